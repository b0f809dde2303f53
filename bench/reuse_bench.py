"""Nothing changed, nothing paid: what each command costs on a finished run, measured side by side in
one go, as wall time, peak memory and the ratio to `ratchet --help` (so the table holds on any
machine).

    python bench/reuse_bench.py                        # a finished one-round run on the tiny model, made here
    python bench/reuse_bench.py --config C --workdir W # a finished run of yours (C's run in W)
    python bench/reuse_bench.py --repeat 5
    python bench/reuse_bench.py --rounds 6             # the tiny run made with 6 rounds

Each command runs in a fresh interpreter, as a user types it: `ratchet --help`, `ratchet run` with
every stage reused (a read: it prints the run's lines and starts nothing), `ratchet plan`, `ratchet
runs`, `ratchet lineage` (the newest version) and `ratchet check`. The median of --repeat runs. On
the tiny run it makes, two runs that reuse part of it, each to its first new stage's `started` line:
one whose train stage is new (its epochs changed), and one a round longer (every round of it reused).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATCHET = [sys.executable, "-m", "ratchet.flows.cli"]


def tiny_run(work: Path, rounds: int = 1) -> list[str]:
    """A finished run of `rounds` rounds on a tiny random model (the tests' own), made in `work`: the
    words that name its config."""
    sys.path.insert(0, str(ROOT))
    from ratchet.models.default_model import default_model_dir
    from tests.flows.tiny import tiny_causal_lm

    model = tiny_causal_lm(work / "tiny", default_model_dir(), seed=0)
    (work / "reward.py").write_text("import re\n\ndef score(completion, answer=None, prompt=None, **fields):\n"
                                    "    return float(int(re.findall(r'\\d+', prompt)[0]) % 2 == 1)\n")
    words = [str(ROOT / "flows" / "configs" / "default.yaml"), f"workdir={work / 'runs'}", f"model.path={model}",
             f"rounds={rounds}", "sampler.backend=hf", "sampler.dtype=float32", "data.a_max=6", "data.b_max=4",
             "data.train_size=12", "data.eval_size=4", "sample.n=2", "sample.max_tokens=6", "evaluate.max_tokens=6",
             "train.epochs=1", "filter.min_rows=1", f"data.check={{kind: python, function: '{work / 'reward.py'}:score'}}"]
    done = subprocess.run([*RATCHET, "run", *words], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the tiny run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return words


def timed(argv: list[str], cwd: Path) -> tuple[float, float, int]:
    """Wall seconds, peak resident MiB (GNU time's, of the command and what it waited for) and exit code
    of one command in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    t = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "PEAK %M", *argv], capture_output=True, text=True, cwd=cwd, env=env)
    wall = time.perf_counter() - t
    peak = next((int(x.split()[1]) for x in reversed(done.stderr.splitlines()) if x.startswith("PEAK ")), 0)
    return wall, peak / 1024, done.returncode


def to_first_new_stage(argv: list[str], cwd: Path, stage: str = "train") -> tuple[float, float, int]:
    """Wall seconds from the command to its `stage started` line, the first stage the plan does not
    reuse; then the run is stopped (SIGTERM), so the next repeat starts that stage again."""
    import signal

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    wall = float("nan")
    for line in proc.stdout:
        if f"{stage}" in line and "started" in line.split(f"{stage}", 1)[1]:
            wall = time.perf_counter() - t
            break
    proc.send_signal(signal.SIGTERM)
    proc.stdout.read()
    return wall, 0.0, proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="a finished run's config (with --workdir); default: a tiny run made here")
    ap.add_argument("--workdir", help="where --config's run is")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="the rounds of the tiny run made here")
    a = ap.parse_args(argv)
    if a.config and not a.workdir:
        ap.error("--config needs --workdir: where its finished run is")
    work = Path(tempfile.mkdtemp(prefix="ratchet-reuse-"))
    # each command runs in `work`, so the paths given here are made absolute first
    words = [str(Path(a.config).resolve()), f"workdir={Path(a.workdir).resolve()}"] if a.config \
        else tiny_run(work, a.rounds)
    commands = {"ratchet --help": ["--help"], "ratchet run (every stage reused)": ["run", *words],
                "ratchet plan": ["plan", *words], "ratchet runs": ["runs", *words],
                "ratchet lineage": ["lineage", *words], "ratchet check": ["check", *words]}
    rows = {}
    for name, args in commands.items():  # one at a time, each alone: the peak is then its own
        runs = [timed([*RATCHET, *args], work) for _ in range(a.repeat)]
        rows[name] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2])
    if not a.config:  # a run whose train stage is new (its epochs changed): up to that stage's start, the
        # checks, the plan, MLflow and Prefect started, the reused stages read (exit: 143, stopped there)
        runs = [to_first_new_stage([*RATCHET, "run", *words, "train.epochs=2"], work) for _ in range(a.repeat)]
        rows["ratchet run (train new): to its start"] = (statistics.median(r[0] for r in runs), 0.0, runs[-1][2])
        # a round longer: every round of the finished run reused (their Prefect flows and tasks, their
        # MLflow records in the new run), up to the new round's sample stage
        longer = [w if not w.startswith("rounds=") else f"rounds={a.rounds + 1}" for w in words]
        runs = [to_first_new_stage([*RATCHET, "run", *longer], work, "sample") for _ in range(a.repeat)]
        rows[f"ratchet run (round {a.rounds + 1} new): to its start"] = (statistics.median(r[0] for r in runs), 0.0,
                                                                        runs[-1][2])
    base = rows["ratchet --help"][0]
    print(f"{'command':<42} {'wall s':>7} {'x --help':>8} {'peak MiB':>9} {'exit':>4}")
    for name, (wall, peak, code) in rows.items():
        print(f"{name:<42} {wall:7.2f} {wall / base:8.1f} {peak:9.0f} {code:>4}")
    print(f"\n(median of {a.repeat} runs; peak: the command's own process; 0: not measured)")
    shutil.rmtree(work, ignore_errors=True)  # the tiny run made here, or the commands' own scratch
    return 0


if __name__ == "__main__":
    sys.exit(main())
