"""bf16 against fp32 on this machine, side by side in one run: vLLM sampling tok/s and LoRA RFT
training steps/s on the default model, and what `auto` picks here (models/dtype.py) and why: with
the probe's own figures where the CPU's flags leave the choice to it.

    python bench/dtype_bench.py [--prompts 32] [--n 4] [--max-tokens 48] [--steps 6]

Each cell runs in a fresh process of its own, one at a time, so neither dtype inherits the other's
engine, memory or thread pools; the same prompts, seeds and rows in each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def sample_cell(dtype: str, prompts: int, n: int, max_tokens: int) -> dict:
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler

    texts = [f"What is {a} + {b}?" for a in range(10) for b in range(10)][:prompts]
    t = time.time()
    s = open_sampler(default_model_dir(), SamplerConfig(backend="vllm", dtype=dtype), seed=0)
    load = time.time() - t
    s.generate(texts[:2], SamplingParams(n=1, max_tokens=4), seed=0)  # warm-up
    t = time.time()
    out = s.generate(texts, SamplingParams(n=n, temperature=0.8, top_k=50, max_tokens=max_tokens), seed=0)
    gen = time.time() - t
    s.close()
    tokens = sum(g.n_tokens for row in out for g in row)
    return {"load_s": load, "gen_s": gen, "tokens": tokens, "tok_s": tokens / gen}


def train_cell(precision: str, steps: int) -> dict:
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.train_kinds.rft import RFTTrainConfig

    cfg = RFTTrainConfig(precision=precision, epochs=1, batch_size=8)
    rows = [{"prompt": f"What is {a} + {b}?", "completion": f"{a} + {b} = {a + b}."}
            for a in range(20) for b in range(20)][: cfg.batch_size * steps]
    with tempfile.TemporaryDirectory() as out:
        t = time.time()
        metrics = cfg.fit(default_model_dir(), rows, Path(out), seed=0)
        wall = time.time() - t
    done = metrics.get("steps", steps)
    return {"wall_s": wall, "steps": done, "optimizer_s": metrics["steps_s"], "steps_s": done / metrics["steps_s"]}


def _child(cell: str, arg: str, a) -> dict:
    """One cell in a fresh interpreter (this script, --cell)."""
    cmd = [sys.executable, __file__, "--cell", cell, "--arg", arg, "--prompts", str(a.prompts), "--n", str(a.n),
           "--max-tokens", str(a.max_tokens), "--steps", str(a.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{cell} {arg} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cell", choices=["sample", "train"])
    ap.add_argument("--arg")
    a = ap.parse_args()
    if a.cell == "sample":
        print(json.dumps(sample_cell(a.arg, a.prompts, a.n, a.max_tokens)))
        return
    if a.cell == "train":
        print(json.dumps(train_cell(a.arg, a.steps)))
        return

    from ratchet.models import dtype

    choice = dtype.auto()
    rows = {}
    for d, p in (("bfloat16", "bf16"), ("float32", "fp32")):
        rows[d] = {"sample": _child("sample", d, a), "train": _child("train", p, a)}
        print(f"{d}: done", flush=True)
    flags = sorted(f for f in dtype.cpu_flags() if f.startswith(("avx512", "amx")) or f == "avx2")
    print(f"\n{os.cpu_count()} CPUs; flags: {' '.join(flags) or 'none of avx2/avx512/amx'}")
    print(f"auto here: {choice.line()}")
    if not dtype.gpu_capabilities() and any(f in dtype.cpu_flags() for f in dtype.BF16_CPU_FLAGS):
        rec = dtype.probed()  # the flags leave it open here: what the probe measured (models/dtype.py)
        if "error" not in rec:
            print(f"probe: bf16 {rec['bf16_gflops']:.0f} GFLOP/s, fp32 {rec['fp32_gflops']:.0f} "
                  f"(x{rec['bf16_gflops'] / rec['fp32_gflops']:.2f}; {rec['probe']})")
    print(f"sampling: vLLM, {a.prompts} prompts x n={a.n}, max_tokens={a.max_tokens}; training: LoRA RFT, batch 8, "
          f"{a.steps} steps\n")
    print("| dtype | sampling tok/s | engine load s | training steps/s |\n|---|---:|---:|---:|")
    for d, r in rows.items():
        print(f"| {d} | {r['sample']['tok_s']:.0f} | {r['sample']['load_s']:.1f} | {r['train']['steps_s']:.3f} |")
    bf, fp = rows["bfloat16"], rows["float32"]
    print(f"\nbf16 / fp32: sampling x{bf['sample']['tok_s'] / fp['sample']['tok_s']:.2f}, "
          f"training x{bf['train']['steps_s'] / fp['train']['steps_s']:.2f}")


if __name__ == "__main__":
    main()
