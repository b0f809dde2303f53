"""The code check side by side: programs checked per second in the bubblewrap sandbox and
without one, on the same programs in one run; and, with --base-rate, the default model's
pass rate on Ratchet's own code task (greedy, vLLM).

The programs are the task's reference solutions (examples/code_task/solutions.jsonl, every
one passes) and the same number of failing ones (an empty body), so both the passing and the
failing paths are timed. A program here is one run for a problem tested by asserts (two
sandboxes joined by a pipe: the program's side and the tests' side), and one run (one
sandbox) per case for stdin-to-stdout problems.

    python bench/code_bench.py [--repeat 3] [--workers 1 2] [--base-rate]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ratchet.data.checks.base import Item
from ratchet.data.checks.code import CodeCheck, io_cases

ROOT = Path(__file__).parents[1]
TASK = ROOT / "examples" / "code_task"


def _items() -> tuple[list[Item], int]:
    rows = {r["id"]: r for r in map(json.loads, (TASK / "problems.jsonl").read_text().splitlines())}
    sols = [json.loads(x) for x in (TASK / "solutions.jsonl").read_text().splitlines()]
    items = [Item(s["solution"], rows[s["id"]]["answer"]) for s in sols]
    items += [Item("```python\npass\n```", i.answer) for i in items]
    runs = sum(len(io_cases(i.answer) or [None]) for i in items)
    return items, runs


def throughput(repeat: int, workers: list[int]) -> None:
    items, runs = _items()
    print(f"{len(items)} programs ({runs} runs: a run per program, or per stdin case)")
    print(f"{'sandbox':<8} {'workers':>7} {'programs/s':>11} {'runs/s':>8} {'passed':>7}")
    rates = {}
    for w in workers:
        for sandbox in ("bwrap", "none"):
            check = CodeCheck(sandbox=sandbox, workers=w)
            best = float("inf")
            for _ in range(repeat):
                t = time.perf_counter()
                verdicts = check.check_many(items)
                best = min(best, time.perf_counter() - t)
            rates[(sandbox, w)] = len(items) / best
            print(f"{sandbox:<8} {w:>7} {len(items) / best:>11.1f} {runs / best:>8.1f} "
                  f"{sum(bool(v.correct) for v in verdicts):>7}")
        print(f"  sandboxed / unsandboxed at {w} worker(s): {rates[('bwrap', w)] / rates[('none', w)]:.2f}")


def base_rate() -> None:
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler

    rows = [json.loads(x) for x in (TASK / "problems.jsonl").read_text().splitlines()]
    sampler = open_sampler(default_model_dir(), SamplerConfig(backend="vllm", max_model_len=1024, kv_cache_gb=1),
                           seed=0)
    gens = sampler.generate([r["prompt"] for r in rows], SamplingParams(n=1, temperature=0.0, max_tokens=160), seed=0)
    sampler.close()
    for reward in ("pass", "fraction"):
        verdicts = CodeCheck(reward=reward).check_many([Item(g[0].text, r["answer"]) for g, r in zip(gens, rows)])
        right = sum(bool(v.correct) for v in verdicts)
        mean = sum(v.reward for v in verdicts) / len(verdicts)
        print(f"default model, greedy, 160 tokens, reward={reward}: {right}/{len(rows)} problems pass "
              f"({right / len(rows):.0%}); mean reward {mean:.3f}")
    fenced = sum("```" in g[0].text for g in gens)
    print(f"  responses with a fenced block: {fenced}/{len(rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--base-rate", action="store_true")
    args = ap.parse_args()
    throughput(args.repeat, args.workers)
    if args.base_rate:
        base_rate()


if __name__ == "__main__":
    main()
