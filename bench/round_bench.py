"""Where a round's time goes: work, or starting things. Cold and warm side by side in one run.

Runs the default config (or CONFIG) twice from empty workdirs:

  cold  every stage worker a fresh interpreter and every sampling stage its own engine
        (executor.warm_workers=false executor.warm_engine=false: how rounds ran before)
  warm  stage workers forked from the run's fork server, and one engine lent to every
        sampling stage, its weights swapped in place (the default)
  one-shape  warm, but the engine holds one sampler shape at a time (executor.warm_engine_shapes=1):
        where a round samples in bf16 and evaluates in float32, it opens an engine twice a round

and prints, for each round, its wall time (the round's MLflow run, from its first stage to its
registration), its work and their ratio, then where the rest went, stage by stage. Work is
what a faster machine would shorten and nothing else could: the engine's generation seconds
(sample, evaluate, a judge's or a search's), the optimizer's steps (the trainer's own runtime),
and nothing of the starts, loads, saves and bookkeeping around them. The two runs' stage
outputs are compared byte for byte (the same keys: the executor settings are not part of any).

    python bench/round_bench.py                          # default config, 3 rounds, cold then warm
    python bench/round_bench.py --only warm --rounds 1
    python bench/round_bench.py --only one-shape warm   # the warm engine holding one shape, then two
    python bench/round_bench.py --read runs              # a finished run's workdir (e.g. after make demo)
    python bench/round_bench.py -- sample.n=4            # overrides for both runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"cold": ["executor.warm_workers=false", "executor.warm_engine=false"], "warm": [],
         "one-shape": ["executor.warm_engine_shapes=1"]}
DEFAULT_MODES = ["cold", "warm"]
WORK = {  # stage -> the metrics that are work
    "sample": ("gen_s",), "evaluate": ("gen_s",), "train": ("steps_s",),
    "label": ("judge_s", "search_s", "gen_s", "check_s"),
}


def stage_work(stage: str, metrics: dict[str, float]) -> float:
    kind = stage.split(".")[0]
    return sum(metrics.get(k, 0.0) for k in WORK.get(kind, ()))


def read(workdir: Path) -> dict:
    """A workdir's rounds (wall from MLflow, work and stage costs from the manifests): its run's, or
    where it was continued (more rounds, a resume), each round from the run that made it."""
    from mlflow.tracking import MlflowClient

    from ratchet.data.manifest import read_manifest

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if not parents:
        raise SystemExit(f"{workdir}: no pipeline run in its MLflow store")
    # a run continued in the same workdir (more rounds, or a resume) is a second pipeline run that
    # reuses the first one's rounds in seconds: each round's wall is that of the run that made it,
    # the longest of its MLflow runs
    wall_of = lambda r: (r.info.end_time or r.info.start_time) - r.info.start_time
    children: dict = {}
    ids = {p.info.run_id for p in parents}
    for r in runs:
        if r.data.tags.get("mlflow.parentRunId") in ids:
            k = int(r.info.run_name.split("-")[1])
            if k not in children or wall_of(r) > wall_of(children[k]):
                children[k] = r
    stages: dict[int, list] = {}
    for d in (workdir / "stages").iterdir():
        if (m := read_manifest(d)) is not None and m.round in children and m.stage not in ("prompts", "base"):
            stages.setdefault(m.round, []).append(m)
    rounds = {}
    for k, r in sorted(children.items()):
        ms = stages.get(k, [])
        wall = (r.info.end_time - r.info.start_time) / 1000
        work = sum(stage_work(m.stage, m.metrics) for m in ms)
        costs = {"between stages (Prefect, MLflow, registering)": wall - sum(m.wall_s for m in ms)}
        for m in ms:
            kind, x = m.stage.split(".")[0], m.metrics
            if kind in ("sample", "evaluate"):
                costs[f"{kind}: engine load"] = costs.get(f"{kind}: engine load", 0) + x.get("load_s", 0)
                rest = m.wall_s - x.get("load_s", 0) - x.get("gen_s", 0)
                costs[f"{kind}: worker start, reading, writing"] = costs.get(f"{kind}: worker start, reading, writing",
                                                                             0) + rest
            elif kind == "train" and "steps_s" in x:
                costs["train: worker start"] = m.wall_s - x["train_s"]
                costs["train: load policy, data, trainer"] = x["train_s"] - x["steps_s"] - x.get("save_s", 0)
                costs["train: merge and save the model"] = x.get("save_s", 0)
            else:
                costs[kind] = costs.get(kind, 0) + m.wall_s - stage_work(m.stage, x)
        rounds[k] = {"wall": wall, "work": work, "costs": costs}
    whole = sum(wall_of(p) for p in parents) / 1000
    return {"rounds": rounds, "run_wall": whole}


def digests(workdir: Path) -> dict:
    from ratchet.data.manifest import read_manifest

    return {d.name: {k: f.sha256 for k, f in m.outputs.items()}
            for d in (workdir / "stages").iterdir() if (m := read_manifest(d)) is not None}


def run(mode: str, config: str, rounds: int, overrides: list[str], workdir: Path) -> float:
    cmd = [sys.executable, "-m", "ratchet.flows.cli", "run", config, f"workdir={workdir}", f"rounds={rounds}",
           *MODES[mode], *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RATCHET_FAILPOINTS")}
    t = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return time.time() - t


def table(results: dict[str, dict]) -> None:
    modes = list(results)
    head = "round " + " | ".join(f"{m:>4}: wall   work  not work" for m in modes)
    print(head)
    print("-" * len(head))
    for k in sorted(next(iter(results.values()))["rounds"]):
        cells = []
        for m in modes:
            r = results[m]["rounds"][k]
            cells.append(f"{r['wall']:9.1f} {r['work']:6.1f} {1 - r['work'] / r['wall']:9.1%}")
        print(f"{k:>5} " + " | ".join(cells))
    cells = []
    for m in modes:
        rs = [r for k, r in results[m]["rounds"].items() if k > 0]
        wall, work = sum(r["wall"] for r in rs), sum(r["work"] for r in rs)
        cells.append(f"{wall:9.1f} {work:6.1f} {1 - work / wall:9.1%}" if wall else " " * 26)
    print(f"{'1..':>5} " + " | ".join(cells))
    for m in modes:
        x = results[m]
        if "process_wall" in x:
            print(f"{m}: the whole command {x['process_wall']:.1f} s (its MLflow run {x['run_wall']:.1f} s)")
    print("\nnot work, per trained round (mean of rounds 1..), seconds:")
    keys = sorted({c for m in modes for k, r in results[m]["rounds"].items() if k > 0 for c in r["costs"]})
    print(f"{'':52}" + "".join(f"{m:>8}" for m in modes))
    for c in keys:
        vals = []
        for m in modes:
            rs = [r["costs"].get(c, 0.0) for k, r in results[m]["rounds"].items() if k > 0]
            vals.append(sum(rs) / len(rs) if rs else 0.0)
        print(f"{c:52}" + "".join(f"{v:8.1f}" for v in vals))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "flows" / "configs" / "default.yaml"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="+", choices=list(MODES), help=f"these modes, in this order (default: {DEFAULT_MODES})")
    p.add_argument("--read", type=Path, help="report a finished run's workdir instead of running")
    p.add_argument("--keep", type=Path, help="run in this directory (kept) instead of a temporary one")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    if a.read:
        table({"run": read(a.read)})
        return
    base = a.keep or Path(tempfile.mkdtemp(prefix="round-bench-"))
    results = {}
    for mode in a.only or DEFAULT_MODES:
        wd = base / mode
        wall = run(mode, a.config, a.rounds, a.overrides, wd)
        results[mode] = {**read(wd), "process_wall": wall}
        print(f"{mode}: {wall:.1f} s", file=sys.stderr, flush=True)
    table(results)
    first, *others = results
    for other in others:
        same = digests(base / first) == digests(base / other)
        print(f"\nstage outputs, {first} and {other}: {'byte-identical' if same else 'DIFFERENT'} "
              f"({len(digests(base / first))} stages)")
    print(json.dumps({m: {k: {"wall": r["wall"], "work": r["work"]} for k, r in x["rounds"].items()}
                      for m, x in results.items()}))
    if not a.keep:  # two demo runs' models and checkpoints, several GB: kept only where asked (--keep)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
