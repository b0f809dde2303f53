"""MCTS vs best-of-N at the same number of generated tokens, side by side in one run.

On a config's task and model (flows/configs/mcts_dpo.yaml unless --config), for the same
prompts and the same sampler settings:

  1. MCTS as the label stage runs it (the config's label section, or overrides): a
     prompt is solved if any trajectory in its tree is correct.
  2. best-of-N: independent samples of each prompt, taken in order while their
     tokens fit that prompt's MCTS spend; solved if any of them is correct.

Both count every generated token (MCTS: all k candidate steps, merged or not, and
every rollout). Printed per seed and pooled, with the standard error of the difference
paired by prompt (the same prompts meet both methods).

    python bench/mcts_bench.py [--config flows/configs/chain_mcts_dpo.yaml] [--prompts 96] \
        [--seeds 0 1 2] [label.simulations=8 ...]
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of mcts_dpo.yaml, e.g. label.k=3")
    a = ap.parse_intermixed_args()

    from ratchet.data.checkers import check
    from ratchet.data.prompts import load_split
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import resolve_model
    from ratchet.models.sampler import SamplingParams, open_sampler
    from ratchet.tasks.mcts import Tree, search

    cfg = load_config(a.config, a.overrides + ([f"sampler.backend={a.backend}"] if a.backend else []))
    mc = cfg.label
    train = load_split(cfg.data, cfg.seed).train
    prompts = train[: a.prompts]
    t0 = time.time()
    sampler = open_sampler(resolve_model(cfg.model.path), cfg.sampler, seed=cfg.seed)
    print(f"model loaded in {time.time() - t0:.1f}s ({cfg.sampler.backend}); {len(prompts)} prompts; MCTS "
          f"{mc.selection} c={mc.c_explore} simulations={mc.simulations} k={mc.k} max_depth={mc.max_depth} "
          f"step={mc.step_delimiter!r}/{mc.step_max_tokens} tok rollout={mc.rollout_tokens} tok; "
          f"T={mc.temperature} top_k={mc.top_k}", flush=True)

    def score(items):
        out = []
        for t, text in items:
            ok = check(cfg.data.check, text, t.answer).correct
            out.append((float(ok), ok))
        return out

    rows, diffs = [], []
    for seed in a.seeds:
        trees = [Tree(prompt_id=p.id, prompt=p.prompt, answer=p.answer) for p in prompts]
        t = time.time()
        search(trees, sampler, mc, seed, score)
        mcts_s = time.time() - t
        budget = [tr.gen_tokens() for tr in trees]
        mcts_solved = [any(x.correct for x in tr.nodes) for tr in trees]

        # best-of-N: draw batches of samples until every prompt's tokens pass its budget
        params = SamplingParams(n=8, temperature=mc.temperature, top_p=mc.top_p, top_k=mc.top_k,
                                max_tokens=mc.max_depth * mc.step_max_tokens + mc.rollout_tokens)
        spent, solved, used = [0] * len(prompts), [False] * len(prompts), [0] * len(prompts)
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
                    used[i] += 1
                    solved[i] |= check(cfg.data.check, g.text, prompts[i].answer).correct
                else:
                    still.append(i)
            open_ = still
        bon_s = time.time() - t
        rows.append((seed, sum(budget), sum(mcts_solved), mcts_s, sum(spent), sum(solved), bon_s,
                     sum(used) / len(used)))
        d = [float(m) - float(b) for m, b in zip(mcts_solved, solved)]
        diffs += d
        print(f"seed {seed}: MCTS - best-of-N {sum(d) / len(d):+.3f} (paired s.e. {paired_se(d):.3f})", flush=True)
        print(f"seed {seed}: MCTS solved {sum(mcts_solved)}/{len(prompts)} with {sum(budget)} tokens "
              f"({mcts_s:.0f}s); best-of-N solved {sum(solved)}/{len(prompts)} with {sum(spent)} tokens, "
              f"N = {sum(used) / len(used):.1f} per prompt ({bon_s:.0f}s)", flush=True)
    sampler.close()

    n = len(prompts) * len(rows)
    m_sol, b_sol = sum(r[2] for r in rows), sum(r[5] for r in rows)
    m_tok, b_tok = sum(r[1] for r in rows), sum(r[4] for r in rows)
    print()
    print(f"{'':24}{'MCTS':>12}{'best-of-N':>12}")
    print(f"{'prompts solved':24}{m_sol / n:>12.3f}{b_sol / n:>12.3f}")
    print(f"{'generated tokens':24}{m_tok:>12}{b_tok:>12}")
    print(f"{'tokens per prompt':24}{m_tok / n:>12.0f}{b_tok / n:>12.0f}")
    print(f"{'wall s':24}{sum(r[3] for r in rows):>12.0f}{sum(r[6] for r in rows):>12.0f}")
    print(f"{'N (best-of-N)':24}{'':>12}{sum(r[7] for r in rows) / len(rows):>12.1f}")
    diff, se = sum(diffs) / len(diffs), paired_se(diffs)
    print(f"MCTS - best-of-N: {diff:+.3f} solved fraction over {n} prompt-seeds, paired s.e. {se:.3f} "
          f"({diff / se if se else float('inf'):+.1f} s.e.)")


def paired_se(d: list[float]) -> float:
    """Standard error of the mean of per-prompt differences."""
    n = len(d)
    if n < 2:
        return 0.0
    mean = sum(d) / n
    return math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)


if __name__ == "__main__":
    main()
