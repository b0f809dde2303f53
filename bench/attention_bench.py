"""Training attention on a CPU: one LoRA step of the default model with eager attention and with
sdpa, with and without gradient checkpointing, at each row length, side by side in one run.

    python bench/attention_bench.py                          # 128, 256, 450 and 900 tokens, batch 8
    python bench/attention_bench.py --lengths 900 --batch 8  # the 16-digit worked sums' rows

`train.attention: auto` is eager on a CPU, measured faster for short rows; eager keeps every
layer's attention weights for the backward pass, a square of the row's length. Each cell runs in a
process of its own (its peak resident memory is its own): the default model in bf16 with LoRA
(r=16 on every linear layer, the trained weights in fp32) under bf16 autocast where the CPU runs
bf16 natively, else fp32, as `train.precision: auto` trains; random rows of the length, loss on every
token, AdamW. A step is forward, backward and the optimiser; the first step is left out of the mean.
Prints seconds a step and peak memory per cell, and sdpa's step time as a share of eager's.

Alone on the machine, as a run trains. Beside another job, set OMP_WAIT_POLICY=PASSIVE (the cells
inherit it): torch's default spinning threads then fight the other job's for the cores, and a step
of 32-token rows took 38 s here instead of 0.5 s. docs/troubleshooting.md's figures were taken so,
beside a grow run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CELL = r"""
import json, resource, sys, time
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from ratchet.models.default_model import default_model_dir
from ratchet.models.dtype import resolve_precision

impl, checkpointing, length, batch, steps = sys.argv[1], sys.argv[2] == "1", *map(int, sys.argv[3:6])
bf16 = resolve_precision("auto") == "bf16"
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.bfloat16 if bf16 else torch.float32,
                                             attn_implementation=impl)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
for p in model.parameters():
    if p.requires_grad:
        p.data = p.data.float()
if checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
model.train()
rows = torch.randint(100, 40000, (batch, length))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
took = []
for _ in range(steps + 1):
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=rows, labels=rows).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    took.append(time.perf_counter() - t)
print(json.dumps({"step_s": sum(took[1:]) / steps, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                  "precision": "bf16" if bf16 else "fp32"}))
"""


def cell(impl: str, checkpointing: bool, length: int, batch: int, steps: int) -> dict | None:
    """One cell in a process of its own; None where it failed (killed for memory, say)."""
    done = subprocess.run([sys.executable, "-c", CELL, impl, str(int(checkpointing)), str(length), str(batch),
                           str(steps)], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 450, 900])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="steps timed after the first")
    ap.add_argument("--no-plain", action="store_true", help="checkpointing only (eager without it at 900 tokens "
                    "needs about 20 GB here)")
    a = ap.parse_args(argv)
    print(f"{'tokens':>6} {'checkpointing':>13} {'eager s':>8} {'GB':>5} {'sdpa s':>8} {'GB':>5} {'sdpa/eager':>10}",
          flush=True)
    for n in a.lengths:
        for checkpointing in ([True] if a.no_plain else [False, True]):
            eager, sdpa = (cell(impl, checkpointing, n, a.batch, a.steps) for impl in ("eager", "sdpa"))
            show = lambda c: f"{c['step_s']:8.2f} {c['peak_gb']:5.1f}" if c else f"{'failed':>8} {'':>5}"
            ratio = f"{sdpa['step_s'] / eager['step_s']:10.2f}" if eager and sdpa else f"{'':>10}"
            print(f"{n:>6} {'yes' if checkpointing else 'no':>13} {show(eager)} {show(sdpa)} {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
