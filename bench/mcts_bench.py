"""MCTS vs best-of-N at the same number of generated tokens, side by side in one run.

On a config's task and model (flows/configs/mcts_dpo.yaml unless --config), for the same
prompts and the same sampler settings:

  1. MCTS as the label stage runs it (the config's label section, or overrides): a
     prompt is solved if any trajectory in its tree is correct.
  2. best-of-N: independent samples of each prompt, taken in order while their
     tokens fit that prompt's MCTS spend; solved if any of them is correct.

Both count every generated token (MCTS: all k candidate steps, merged or not, and
every rollout). Printed per seed and pooled, with the standard error of the difference
paired by prompt (the same prompts meet both methods), and the solved fraction after each
wave. Each --variant (other search settings) meets the same prompts and the same best-of-N
samples, drawn once per seed to the largest spend of any variant; a variant may also change
the answer check (data.check), and best-of-N's samples are then judged by it too. On the chain task it
also counts the correct answers that state every running value in order ("derived"),
apart from those whose last number is right by luck.

    python bench/mcts_bench.py [--config flows/configs/chain_mcts_dpo.yaml] [--prompts 96] \
        [--seeds 0 1 2] [--variant label.value=graded ...] [--dump trees.json] [-- label.simulations=8 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "flows" / "configs" / "mcts_dpo.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--backend", default=None, help="vllm (config default) or hf")
    ap.add_argument("--variant", action="append", default=[], metavar="key=value[,key=value]",
                    help="an MCTS setting (label.*) or answer check (data.check.*) to compare on the same prompts "
                    "and best-of-N samples, e.g. label.c_explore=2 (repeatable; the config's own settings always "
                    "run first)")
    ap.add_argument("--dump", default=None, help="write each seed's trees and best-of-N samples to this JSON file")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the config, e.g. label.k=3")
    a = ap.parse_intermixed_args()

    from ratchet.data.checkers import NumberCheck, check, worked
    from ratchet.data.prompts import chain_values, load_split
    from ratchet.flows.config import load_config
    from ratchet.models.locate import find_model
    from ratchet.models.sampler import SamplingParams, open_sampler
    from ratchet.tasks.label_kinds.mcts import reference_values
    from ratchet.tasks.label_kinds.tree_search import Tree, wave
    from ratchet.tasks.runner.units import unit_seed

    base = a.overrides + ([f"sampler.backend={a.backend}"] if a.backend else [])
    cfg = load_config(a.config, base)
    confs = {"config": cfg}
    for v in a.variant:
        confs[v] = load_config(a.config, base + v.split(","))
    variants = {name: c.label for name, c in confs.items()}
    # each variant's prompts: the same problems; a variant's answer check (data.check) may change the references
    asked = {name: load_split(c.data, c.seed).train[: a.prompts] for name, c in confs.items()}
    prompts = asked["config"]
    if any([p.prompt for p in ps] != [p.prompt for p in prompts] for ps in asked.values()):
        raise SystemExit("--variant: every variant must ask the same prompts (vary label.* or data.check only)")
    t0 = time.time()
    sampler = open_sampler(find_model(cfg.model.path), cfg.sampler, seed=cfg.seed)
    mc = cfg.label
    print(f"model loaded in {time.time() - t0:.1f}s ({cfg.sampler.backend}); {len(prompts)} prompts; MCTS "
          f"{mc.selection} c={mc.c_explore} simulations={mc.simulations} k={mc.k} max_depth={mc.max_depth} "
          f"step={mc.step_delimiter!r}/{mc.step_max_tokens} tok rollout={mc.rollout_tokens} tok; "
          f"T={mc.temperature} top_k={mc.top_k}; variants: {', '.join(list(variants)[1:]) or 'none'}", flush=True)

    values = {p.id: chain_values(p.id) for p in prompts} if cfg.data.kind == "chain" else {}
    room = NumberCheck(max_numbers=2 * len(next(iter(values.values()))) + 3) if values else None

    def derived(p_id: str, text: str) -> bool:  # a right answer that states every running value (the steps check)
        return bool(values) and worked(room, text, values[p_id]).correct

    def judged(check_cfg, p, tokens: int, text: str) -> tuple[int, bool, bool]:  # a best-of-N sample, scored
        ok = check(check_cfg, text, p.answer).correct
        return tokens, ok, derived(p.id, text)

    def scorer(name):  # what the label stage scores with (the judge value is not benchmarked here)
        return lambda items: reference_values(variants[name], confs[name].data.check, items)

    # per variant, over all seeds: per prompt-seed (MCTS solved, best-of-N solved, MCTS tokens, best-of-N tokens,
    # best-of-N samples), MCTS wall s, and per wave the (MCTS, best-of-N) solved lists
    res = {name: {"pairs": [], "wall": 0.0, "waves": [([], []) for _ in range(v.simulations)]}
           for name, v in variants.items()}
    bon_wall, dumps = 0.0, []
    shown = {name: ([], []) for name in variants}  # per prompt-seed (correct, derived, all) of MCTS, of best-of-N
    for seed in a.seeds:
        runs = {}
        for name, v in variants.items():
            trees = [Tree(prompt_id=p.id, prompt=p.prompt, answer=p.answer) for p in asked[name]]
            t = time.time()
            by_wave = []  # after each wave: every tree's tokens so far and whether it is solved
            for w in range(v.simulations):  # what search() does, wave by wave
                wave(trees, sampler, v, unit_seed(seed, w), scorer(name))
                by_wave.append([(tr.gen_tokens(), any(x.correct for x in tr.nodes)) for tr in trees])
            res[name]["wall"] += time.time() - t
            runs[name] = (trees, by_wave)

        # best-of-N: independent samples in order, drawn in batches until every prompt's tokens pass the
        # largest spend of any variant on it; each variant meets the samples that fit its own spend
        budget = [max(runs[name][1][-1][i][0] for name in runs) for i in range(len(prompts))]
        params = SamplingParams(n=8, temperature=mc.temperature, top_p=mc.top_p, top_k=mc.top_k,
                                max_tokens=mc.max_depth * mc.step_max_tokens + mc.rollout_tokens)
        spent = [0] * len(prompts)
        drawn = [[] for _ in prompts]  # every prompt's samples in order: (tokens, text)
        open_ = list(range(len(prompts)))
        t = time.time()
        draw = 0
        while open_:
            outs = sampler.generate([prompts[i].prompt for i in open_], params, seed=seed * 1000 + draw)
            draw += 1
            still = []
            for i, gens in zip(open_, outs):
                for g in gens:
                    if spent[i] + max(g.n_tokens, 1) > budget[i]:
                        break
                    spent[i] += max(g.n_tokens, 1)
                    drawn[i].append((max(g.n_tokens, 1), g.text))
                else:
                    still.append(i)
            open_ = still
        bon_wall += time.time() - t

        for name, (trees, by_wave) in runs.items():
            scored = [[judged(confs[name].data.check, p, tok, text) for tok, text in samples]
                      for p, samples in zip(asked[name], drawn)]
            pairs = []
            for i, tr in enumerate(trees):
                used = within(scored[i], tr.gen_tokens())
                pairs.append((any(x.correct for x in tr.nodes), any(ok for _, ok, _ in used), tr.gen_tokens(),
                              sum(tok for tok, *_ in used), len(used)))
                done = [x for x in tr.nodes if x.value is not None]
                shown[name][0].append((sum(bool(x.correct) for x in done),
                                       sum(derived(tr.prompt_id, tr.trajectory(x)) for x in done),
                                       len(done)))
                shown[name][1].append((sum(ok for _, ok, _ in used), sum(d for *_, d in used), len(used)))
            res[name]["pairs"] += pairs
            d = [float(m) - float(b) for m, b, *_ in pairs]
            print(f"seed {seed} {name}: MCTS solved {sum(p[0] for p in pairs)}/{len(prompts)} with "
                  f"{sum(p[2] for p in pairs)} tokens; best-of-N solved {sum(p[1] for p in pairs)}/{len(prompts)} "
                  f"with {sum(p[3] for p in pairs)} tokens, N = {sum(p[4] for p in pairs) / len(pairs):.1f}; "
                  f"MCTS - best-of-N {sum(d) / len(d):+.3f} (paired s.e. {paired_se(d):.3f})", flush=True)
            for w, state in enumerate(by_wave):
                res[name]["waves"][w][0].extend(ok for _, ok in state)
                res[name]["waves"][w][1].extend(any(ok for _, ok, _ in within(scored[i], tok))
                                                for i, (tok, _) in enumerate(state))
        if a.dump:
            dumps.append({"seed": seed, "best_of_n": drawn,
                          "variants": {name: {"trees": [tr.to_json() for tr in trees], "by_wave": by_wave}
                                       for name, (trees, by_wave) in runs.items()}})
            Path(a.dump).write_text(json.dumps(dumps))
    sampler.close()

    n = len(prompts) * len(a.seeds)
    w = max(34, max(len(name) for name in variants) + 2)
    print()
    print(f"pooled over {n} prompt-seeds; best-of-N meets each variant at that variant's tokens per prompt")
    print(f"{'variant':{w}}{'MCTS':>7}{'BoN':>7}{'diff':>8}{'s.e.':>7}{'z':>6}{'tok/prompt':>11}{'N':>6}{'MCTS s':>8}")
    for name, r in res.items():
        p = r["pairs"]
        d = [float(m) - float(b) for m, b, *_ in p]
        diff, se = sum(d) / n, paired_se(d)
        print(f"{name:{w}}{sum(x[0] for x in p) / n:>7.3f}{sum(x[1] for x in p) / n:>7.3f}{diff:>+8.3f}{se:>7.3f}"
              f"{diff / se if se else float('inf'):>+6.1f}{sum(x[2] for x in p) / n:>11.0f}"
              f"{sum(x[4] for x in p) / n:>6.1f}{r['wall']:>8.0f}")
    print(f"best-of-N wall s (drawn to the largest spend of any variant): {bon_wall:.0f}")
    print()
    print("solved after each wave (MCTS / best-of-N at the same tokens per prompt)")
    for name, r in res.items():
        print(f"{name:{w}}" + "  ".join(f"{sum(m) / n:.3f}/{sum(b) / n:.3f}" for m, b in r["waves"]))
    if values:
        print()
        print("correct answers that state every running value in order (derived), not a lucky last number")
        print(f"{'variant':{w}}{'method':>12}{'answers':>9}{'correct':>9}{'derived':>9}{'share':>7}{'solved':>8}"
              f"{'derived-solved':>16}")
        for name in variants:
            for method, rows in zip(("MCTS", "best-of-N"), shown[name]):
                c, dv, tot = (sum(r[i] for r in rows) for i in range(3))
                print(f"{name:{w}}{method:>12}{tot:>9}{c:>9}{dv:>9}{dv / max(c, 1):>7.1%}"
                      f"{sum(r[0] > 0 for r in rows) / n:>8.3f}{sum(r[1] > 0 for r in rows) / n:>16.3f}")


def within(samples: list[tuple[int, bool, bool]], budget: int) -> list[tuple[int, bool, bool]]:
    """Best-of-N's samples, in order, whose tokens together fit `budget`."""
    out, spent = [], 0
    for sample in samples:
        spent += sample[0]
        if spent > budget:
            break
        out.append(sample)
    return out


def paired_se(d: list[float]) -> float:
    """Standard error of the mean of per-prompt differences."""
    n = len(d)
    if n < 2:
        return 0.0
    mean = sum(d) / n
    return math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)


if __name__ == "__main__":
    main()
