"""Training in one process vs several (torchrun, DDP), side by side in one run, at the same
global batch on the real default model: RFT (LoRA) on default-task rows.

    python bench/train_processes_bench.py [--rows 64] [--batch 8] [--processes 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--processes", type=int, default=2)
    a = ap.parse_args()

    from ratchet.models.default_model import default_model_dir
    from ratchet.models.train_kinds import RFTTrainConfig
    from ratchet.models.trainer import train

    rows = [{"prompt": f"What is {x} + {x + 7}? Answer with the number.", "completion": f"{x} + {x + 7} = {2 * x + 7}"}
            for x in range(a.rows)]
    model, k = default_model_dir(), a.processes
    cores = len(os.sched_getaffinity(0))
    print(f"RFT, LoRA, default model, {a.rows} rows, global batch {a.batch}, 1 epoch; {cores} cores")
    print(f"{'processes':<30}{'steps':>6}{'wall s':>8}{'s/step':>8}{'last loss':>11}")
    for n in (1, k):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = RFTTrainConfig(epochs=1, batch_size=a.batch // n, num_processes=n, checkpoint_steps=1000)
            t = time.time()
            m = train(model, rows, cfg, Path(tmp), seed=0)
            wall = time.time() - t
        label = f"{n} x {cores // n} thread(s)"
        print(f"{label:<30}{m['steps']:>6.0f}{wall:>8.1f}{wall / m['steps']:>8.2f}{m['last_loss']:>11.4f}")


if __name__ == "__main__":
    main()
