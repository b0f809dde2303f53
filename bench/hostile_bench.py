"""Worst-case time of every function that reads model text, per KB of text, on adversarial
inputs at three sizes: a function whose time grows linearly shows the same microseconds per
KB at every size (the last column, 16 KB / 1 KB time, near 16); one that backtracks shows it
growing with the size.

    python bench/hostile_bench.py [--sizes 1024 4096 16384] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

from ratchet.data.checkers import ExactCheck, MathCheck, NumberCheck, RegexCheck, StepsCheck, check, extract, graded
from ratchet.data.checks.code import program_of
from ratchet.tasks.label_kinds.guard import guard
from ratchet.tasks.label_kinds.judging import copied_mask, parse_verdict
from ratchet.tasks.label_kinds.tree_search import step_text

# (name, a piece that is repeated to the size; the keyword before it is what a pattern keys on)
SHAPES = [("spaces after a keyword", "score", " "), ("newlines", "", "\n"), ("spaces and newlines", "verdict", " \n"),
          ("punctuation", "score", "*_"), ("brackets", "score: ", "("), ("digits", "The answer is ", "9"),
          ("spaced letters", "", "s "), ("look-alike letters", "", "а1"), ("words", "must ", "give "),
          ("verdict lines", "", "Score: 5\n"), ("numbers", "", "1, "), ("equations", "", "1 + 1 = 2. "),
          ("fences", "", "```py\n")]


def functions():
    checks = [NumberCheck(), StepsCheck(), ExactCheck(), RegexCheck(pattern=r"Answer:\s*(\S+)")]
    fns = {"guard.guard": lambda t: guard("What is 2 + 2?", t), "judge.parse_verdict": lambda t: parse_verdict(t, "x"),
           "judge.copied_mask": lambda t: copied_mask(t, t[: len(t) // 2]), "mcts.step_text": lambda t: step_text(t, "\n"),
           "code.program_of": program_of}
    for c in checks:
        fns[f"{c.kind}.check"] = lambda t, c=c: check(c, t, "4")
        fns[f"{c.kind}.extract"] = lambda t, c=c: extract(c, t)
        fns[f"{c.kind}.graded"] = lambda t, c=c: graded(c, t, "4", 0.5)
    fns["math.check"] = lambda t, c=MathCheck(): check(c, t, "4")  # in its own process, bounded by its timeout
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sizes = sorted(args.sizes)
    print(f"{'function':<22} {'worst input':<22}" + "".join(f" {f'us/KB @{s // 1024}K':>12}" for s in sizes)
          + f" {'ratio':>7}")
    for name, fn in functions().items():
        worst = None
        for shape, key, piece in SHAPES:
            times = []
            for size in sizes:
                text = (key + piece * size)[:size]
                best = min(_time(fn, text) for _ in range(args.repeat))
                times.append(best)
            if worst is None or times[-1] > worst[1][-1]:
                worst = (shape, times)
        shape, times = worst
        per_kb = [t / (s / 1024) * 1e6 for t, s in zip(times, sizes)]
        print(f"{name:<22} {shape:<22}" + "".join(f" {x:>12.0f}" for x in per_kb)
              + f" {times[-1] / max(times[0], 1e-9):>7.1f}")
    from ratchet.data.checks.scorer import close_all

    close_all()


def _time(fn, text: str) -> float:
    t = time.perf_counter()
    fn(text)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
