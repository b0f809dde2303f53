"""What Python's collector costs a process's imports: a run's fork server's (torch, transformers,
TRL, PEFT, MLflow's flavour: flows/inputs.py `run_preload`) and a run's own (MLflow's store,
Prefect, the flow's module: flows/launch.py), each imported in a fresh interpreter with the
collector as Python leaves it, off with one collection at the end and the heap then frozen (as the
product did before 2026-12-07's second change), and inside `imports_frozen` (data/procs/forkserver.py:
off, then the heap frozen with no collection), side by side, alternating.

    python bench/collector_bench.py             # 3 of each, the median
    python bench/collector_bench.py --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import gc, importlib, json, sys, time
names, way = json.loads(sys.argv[1]), sys.argv[2]
full = [0, 0.0]
def seen(phase, info, t=[0.0]):
    if phase == "start":
        t[0] = time.perf_counter()
    elif info["generation"] == 2:
        full[0] += 1
        full[1] += time.perf_counter() - t[0]
gc.callbacks.append(seen)
t = time.perf_counter()
if way == "imports_frozen":
    from ratchet.data.procs.forkserver import imports_frozen
    with imports_frozen():
        for n in names:
            importlib.import_module(n)
elif way == "collected once":
    gc.disable()
    for n in names:
        importlib.import_module(n)
    gc.collect()
    gc.freeze()
    gc.enable()
else:
    for n in names:
        importlib.import_module(n)
print(json.dumps({"s": time.perf_counter() - t, "full": full[0], "full_s": full[1], "objects": len(gc.get_objects()) + gc.get_freeze_count()}))
sys.stdout.flush()
import os; os._exit(0)
"""


def imports() -> dict[str, list[str]]:
    from ratchet.flows.inputs import run_preload
    from ratchet.flows.launch import PREFECT_IMPORTS, TRACKING_IMPORTS

    server = [n for n in run_preload() if ":" not in n]
    return {"a fork server's": server, "a run's own": [*TRACKING_IMPORTS, *PREFECT_IMPORTS, "ratchet.flows.pipeline"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    rows = []
    for what, names in imports().items():
        got = {"as Python leaves it": [], "collected once": [], "imports_frozen": []}
        for _ in range(a.repeat):
            for way in got:
                out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(names), way], capture_output=True,
                                     text=True, check=True).stdout
                got[way].append(json.loads(out.strip().splitlines()[-1]))
        for way, runs in got.items():
            med = {k: statistics.median(r[k] for r in runs) for k in ("s", "full", "full_s", "objects")}
            rows.append((what, way, med["s"], med["full"], med["full_s"], med["objects"]))
    print(f"{'imports':16} {'collector':20} {'seconds':>8} {'full collections':>17} {'their s':>8} {'objects':>14}")
    for what, way, s, n, ns, objs in rows:
        print(f"{what:16} {way:20} {s:8.2f} {n:17.0f} {ns:8.2f} {objs:14,.0f}")
    for what in dict.fromkeys(r[0] for r in rows):
        before, once, frozen = (r[2] for r in rows if r[0] == what)
        print(f"{what} imports: {once / before:.2f}x the time collected once, {frozen / before:.2f}x frozen")


if __name__ == "__main__":
    main()
