"""Executors side by side in one run, on the same prompts and the real default model (vLLM):

  1. local, one engine using every core (the default)
  2. local, a pool of engines with one core each (executor.engines=N)
  3. ray, the same pool as Ray actors on a Ray instance started on this machine
  4. Ray's overhead per unit: the same trivial units (no engine) in process and on one Ray
     holder, so the difference is what Ray adds to each unit (a call, a result, a write)

Each configuration runs in a fresh process, so no engine, thread pool or Ray connection
carries over. Throughput counts generated tokens over the stage's wall time, engine start
included, and over its generation time alone.

    python bench/executor_bench.py [--prompts 64] [--n 4] [--max-tokens 48] [--shard 8] [--engines 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Trivial:
    """Units with no engine and no work: what is left is the executor's own cost."""

    stage = "bench"
    items: list
    size: int
    seed: int

    @property
    def n(self):
        return len(self.items) // self.size

    def unit(self, i):
        return self.items[i * self.size:(i + 1) * self.size]

    def open(self):
        return None

    def close(self, engine):
        pass

    def run(self, engine, chunk, seed):
        return [{"x": x} for x in chunk], {"n": float(len(chunk))}


def one(kind: str, engines: int, threads: int, a) -> dict:
    """One configuration, in this (fresh) process."""
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.sampler import SamplerConfig, SamplingParams
    from ratchet.tasks.sample import SampleWork
    from ratchet.data.kinds import member
    from ratchet.tasks.runner.units import ExecutorConfig, run_units

    ex = member(ExecutorConfig, kind, "executor.kind")(engines=engines, threads_per_engine=threads)
    with tempfile.TemporaryDirectory() as tmp:
        if a.trivial:  # 1 unit, then N (after a first run that pays the imports): the difference is N-1 units
            if kind == "ray":
                import ray

                ray.init(include_dashboard=False, configure_logging=False)
            walls = []
            for j, n in enumerate((1, 1, a.trivial)):
                t = time.time()
                run_units(Trivial(items=list(range(n)), size=1, seed=0), Path(tmp) / str(j), ex)
                walls.append(time.time() - t)
            return {"per_unit_s": (walls[2] - walls[1]) / (a.trivial - 1), "first_s": walls[1]}
        work = SampleWork(items=_prompts(a.prompts), size=a.shard, model=default_model_dir(), seed=0,
                          sampler=SamplerConfig(backend="vllm", kv_cache_gb=2),
                          params=SamplingParams(n=a.n, temperature=0.8, top_k=50, max_tokens=a.max_tokens))
        t = time.time()
        done = run_units(work, Path(tmp) / "s", ex)
        wall = time.time() - t
        cost = done.cost
        return {"wall_s": wall, "load_s": done.load_s, "tokens": cost["gen_tokens"], "gen_s_sum": cost["gen_s"],
                "holders": done.holders}


def _prompts(n: int) -> list:
    import random

    from ratchet.data.records import Prompt

    r = random.Random(0)
    out = []
    for i in range(n):
        x, y = r.randint(10, 999), r.randint(10, 999)
        out.append(Prompt(id=f"b{i}", prompt=f"What is {x} + {y}? Answer with the number.", answer=str(x + y)))
    return out


def run_child(kind: str, engines: int, threads: int, a, trivial: int = 0) -> dict:
    args = [sys.executable, __file__, "--one", kind, str(engines), str(threads), "--prompts", str(a.prompts),
            "--n", str(a.n), "--max-tokens", str(a.max_tokens), "--shard", str(a.shard), "--trivial", str(trivial)]
    p = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if p.returncode != 0:
        raise SystemExit(f"{kind} x{engines} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--shard", type=int, default=8)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--trivial", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--one", nargs=3, metavar=("KIND", "ENGINES", "THREADS"))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), int(a.one[2]), a)))
        return

    cores = len(os.sched_getaffinity(0))
    k = a.engines
    print(f"{a.prompts} prompts x n={a.n}, max_tokens={a.max_tokens}, units of {a.shard} prompts; {cores} cores; "
          "vLLM, default model")
    print(f"{'executor':<34}{'wall s':>8}{'load s':>8}{'tokens':>8}{'tok/s wall':>12}{'tok/s gen':>11}")
    base = None
    for label, kind, engines, threads in [(f"local, 1 engine x {cores} threads", "local", 1, cores),
                                          (f"local, {k} engines x {cores // k} thread", "local", k, cores // k),
                                          (f"ray,   {k} engines x {cores // k} CPU", "ray", k, cores // k)]:
        r = run_child(kind, engines, threads, a)
        wall_tps = r["tokens"] / r["wall_s"]
        gen_tps = r["tokens"] / max(r["wall_s"] - r["load_s"], 1e-9)
        base = base or wall_tps
        print(f"{label:<34}{r['wall_s']:>8.1f}{r['load_s']:>8.1f}{r['tokens']:>8.0f}{wall_tps:>12.1f}"
              f"{gen_tps:>11.1f}   x{wall_tps / base:.2f}")
    units = 400
    loc = run_child("local", 1, 1, a, trivial=units)
    ray = run_child("ray", 1, 1, a, trivial=units)
    print(f"\nper trivial unit (one holder, {units} units): local {1e3 * loc['per_unit_s']:.2f} ms, "
          f"ray {1e3 * ray['per_unit_s']:.2f} ms, so Ray adds {1e3 * (ray['per_unit_s'] - loc['per_unit_s']):.2f} ms "
          f"a unit; a stage's first unit on Ray (holder start) {ray['first_s']:.2f} s")


if __name__ == "__main__":
    main()
