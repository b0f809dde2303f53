"""Base rates of a task for the starting model: what a round has to work with.

For each variant of the config (--vary), on the same engine:

  greedy    held-out accuracy, greedy (what round 0 of a run reports)
  pass@1    share of correct samples at the config's sampling settings (train prompts)
  pass@k    share of train prompts with at least one correct sample among k
            (unbiased estimate from n >= k samples per prompt)
  tokens    mean tokens of a sample; truncated: share that hit sample.max_tokens

    python bench/task_bench.py flows/configs/chain_rft.yaml --prompts 96 --n 8 \\
        --vary data.steps=2,3,4
    python bench/task_bench.py flows/configs/reasoning_gym.yaml --prompts 50 \
        --set 'data.dataset=leg_counting|data.config={max_animals: 2}' --set 'data.dataset=gcd|data.config={}'

--vary takes comma-separated values of one key (several --vary: every combination); --set is
one variant of several overrides separated by '|' (for values that hold commas).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is among the c correct)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--prompts", type=int, default=96, help="train prompts sampled (and at most this many held out)")
    ap.add_argument("--n", type=int, default=8, help="samples per train prompt")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--vary", action="append", default=[], metavar="key=v1,v2",
                    help="run once per value (several --vary: every combination)")
    ap.add_argument("--set", action="append", default=[], metavar="'k=v|k2=v2'", dest="sets",
                    help="one variant: overrides separated by '|' (repeat for more)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    a = ap.parse_intermixed_args()

    from ratchet.data.checkers import Item, check_many
    from ratchet.data.errors import ConfigError
    from ratchet.data.prompts import load_split
    from ratchet.flows.config import load_config
    from ratchet.models.locate import find_model
    from ratchet.models.sampler import SamplingParams, open_sampler, resolve_dtype

    axes = [[f"{k}={v}" for v in vals.split(",")] for k, _, vals in (x.partition("=") for x in a.vary)]
    variants = [list(c) for c in itertools.product(*axes)] if axes else []
    variants += [x.split("|") for x in a.sets]
    variants = variants or [[]]
    base = load_config(a.config, a.overrides)
    t0 = time.time()
    sampler = open_sampler(find_model(base.model.path), base.sampler, seed=base.seed)
    print(f"{base.model.path} on {base.sampler.backend} ({resolve_dtype(base.sampler.dtype)}), loaded in "
          f"{time.time() - t0:.0f}s; {a.prompts} train prompts x {a.n} samples at T={base.sample.temperature}, "
          f"max_tokens={base.sample.max_tokens}", flush=True)
    ks = [k for k in a.k if k <= a.n]
    width = max(28, *(len(" ".join(v)) + 2 for v in variants))
    head = f"{'variant':{width}}{'greedy':>8}" + "".join(f"{'pass@' + str(k):>8}" for k in ks) + f"{'tokens':>8}" \
        f"{'trunc':>7}{'s':>6}"
    lines = []
    for v in variants:
        try:
            cfg = load_config(a.config, a.overrides + v)
            split = load_split(cfg.data, cfg.seed)
        except ConfigError as e:  # one bad variant is reported, the others still run
            print(f"{' '.join(v)}: {e}", flush=True)
            continue
        train, ev = split.train[: a.prompts], split.eval[: a.prompts]
        t = time.time()
        greedy = sampler.generate([p.prompt for p in ev], SamplingParams(max_tokens=cfg.evaluate.max_tokens), seed=0)
        verdicts = check_many(cfg.data.check, [Item(g.text, p.answer, p.prompt, p.id) for p, (g,) in zip(ev, greedy)])
        acc = sum(bool(v.correct) for v in verdicts) / len(ev)
        gens = sampler.generate([p.prompt for p in train], cfg.sample.params().model_copy(update={"n": a.n}),
                                seed=cfg.seed)
        right = [sum(bool(v.correct) for v in check_many(cfg.data.check, [Item(g.text, p.answer, p.prompt, f"{p.id}#{i}")
                                                                        for i, g in enumerate(gs)]))
                 for p, gs in zip(train, gens)]
        flat = [g for gs in gens for g in gs]
        row = f"{' '.join(v) or 'as configured':{width}}{acc:>8.3f}"
        row += "".join(f"{sum(pass_at_k(a.n, c, k) for c in right) / len(right):>8.3f}" for k in ks)
        row += f"{sum(g.n_tokens for g in flat) / len(flat):>8.0f}"
        row += f"{sum(g.finish_reason == 'length' for g in flat) / len(flat):>7.2f}{time.time() - t:>6.0f}"
        lines.append(row)
        print(row, f"  e.g. {train[0].prompt!r} -> {gens[0][0].text[:120]!r}", flush=True)
    sampler.close()
    print(f"\n{len(ev)} held-out prompts (greedy), {len(train)} train prompts x {a.n} samples\n{head}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
