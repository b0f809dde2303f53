"""The curriculum on the default model: from the default task toward 8-digit + 8-digit addition.

    python bench/curriculum_bench.py                         # levels 1-8, RFT, until the run ends
    python bench/curriculum_bench.py --rounds 6 --levels 1 2 3 --workdir /tmp/climb
    python bench/curriculum_bench.py --table-only --workdir /tmp/climb   # the table of a run made before

It runs `ratchet run` on flows/configs/default.yaml with the addition task's levels (digit
counts) and a curriculum, every round keyed and resumable (run the same command again after a
stop: it continues), then prints each level's held-out accuracy per round, the level each round
trained at, its band, and the wall time. The prompt and answer form are the task's own ("What is
a + b?", the last number of the answer is read). Not a test: it takes hours on 2 cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def overrides(a) -> list[str]:
    return [f"workdir={a.workdir}", f"rounds={a.rounds}", f"name=climb-{a.train}",
            f"data={{kind: addition, levels: {list(a.levels)}, eval_size: {a.eval_size}, train_size: {a.train_size}}}",
            f"curriculum={{prompts: {a.prompts}, advance_at: {a.advance_at}, patience: {a.patience}}}",
            *(["train.kind=grpo"] if a.train == "grpo" else []),
            *(["filter.kind=dpo", "train.kind=dpo"] if a.train == "dpo" else [])]


def table(a) -> str:
    from ratchet.flows.config import load_config
    from ratchet.flows.report import gather
    from ratchet.flows.tracking import Tracker

    cfg = load_config(ROOT / "flows" / "configs" / "default.yaml", overrides(a))
    rep = gather(a.workdir, Tracker(cfg.tracking, a.workdir, cfg.name))
    levels = sorted({int(n.removeprefix("level_")) for r in rep.rounds for n in r.sets if n.startswith("level_")})
    head = f"{'round':>5} {'level':>5} {'band':>5} " + " ".join(f"{'L' + str(n):>6}" for n in levels)
    rows = [head]
    for r in rep.rounds:
        cells = " ".join(f"{100 * r.sets[f'level_{n}']:5.1f}%" if f"level_{n}" in r.sets else f"{'':>6}"
                         for n in levels)
        rows.append(f"{r.round:>5} {r.level if r.level is not None else '-':>5} "
                    f"{r.band if r.band is not None else '-':>5} {cells}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ratchet-climb"))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--levels", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--eval-size", type=int, default=50)
    ap.add_argument("--train-size", type=int, default=500)
    ap.add_argument("--prompts", type=int, default=64, help="curriculum.prompts")
    ap.add_argument("--advance-at", type=float, default=0.9, help="curriculum.advance_at")
    ap.add_argument("--patience", type=int, default=4, help="curriculum.patience")
    ap.add_argument("--train", choices=["rft", "dpo", "grpo"], default="rft")
    ap.add_argument("--table-only", action="store_true", help="print the table of the run in --workdir")
    a = ap.parse_args(argv)
    t0 = time.time()
    if not a.table_only:
        cmd = [sys.executable, "-m", "ratchet.flows.cli", "run", str(ROOT / "flows" / "configs" / "default.yaml"),
               *overrides(a)]
        print(" ".join(cmd), flush=True)
        done = subprocess.run(cmd)
        print(f"ratchet run exited {done.returncode} after {time.time() - t0:.0f} s", flush=True)
    print(table(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
