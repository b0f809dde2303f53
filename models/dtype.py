"""What `auto` means for a dtype on this machine: bf16 only where the hardware runs it natively.

- An NVIDIA GPU of compute capability 8.0 or higher (A100, L4, H100, ...): bfloat16. Below it
  (T4 7.5, V100 7.0): float16, which those GPUs run natively; bf16 there is emulated.
- A CPU with AMX (`amx_bf16` in its flags): bfloat16. Any other CPU: float32, AVX512-BF16
  (`avx512_bf16`) without AMX included. PyTorch's own test
  (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`) says True on every AVX-512 CPU, also where
  bf16 is emulated. Measured on 2-core VMs: without either flag, vLLM sampled 49 tok/s in bf16
  against 164 in fp32; with `avx512_bf16` and no AMX (oneDNN's ISA: AVX 10.1), a 1024x1024
  matmul ran 166 GFLOP/s in bf16 against 282 in fp32, vLLM sampled 245 tok/s against 310 and LoRA
  training ran 0.46 steps/s against 0.69 (bench/dtype_bench.py); with AMX, bf16 matmuls ran 1,475
  GFLOP/s against 205.

A rule, read from the hardware, not a timing: a timed answer could flip between two runs and with
it every stage's key. It is read without importing torch (the CPU's flags from /proc/cpuinfo, the
GPUs' compute capability from `nvidia-smi`, or from torch where this process has it loaded), so
the run's own process can key its stages by what `auto` resolves to (tasks/stage.py `resolved`).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

NATIVE_CPU_FLAGS = ("amx_bf16",)  # avx512_bf16 alone ran bf16 slower than fp32 (see above)


@dataclass(frozen=True)
class Choice:
    """What `auto` resolved to, and why, in words for `ratchet check` and the run's header."""

    dtype: str  # bfloat16, float16 or float32
    why: str

    def line(self) -> str:
        return f"{self.dtype}: {self.why}"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo (or in the text given)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def on_cpu(flags: set[str]) -> Choice:
    native = [f for f in NATIVE_CPU_FLAGS if f in flags]
    if native:
        return Choice("bfloat16", f"this CPU runs bf16 natively ({', '.join(native)})")
    if "avx512_bf16" in flags:
        return Choice("float32", "this CPU has avx512_bf16 but no AMX (amx_bf16), where bf16 ran slower than fp32")
    return Choice("float32", "this CPU has no native bf16 (no amx_bf16)")


def on_gpu(capabilities: list[tuple[int, int]]) -> Choice:
    """For the visible GPUs' compute capabilities: the lowest decides (a stage may run on any)."""
    low = min(capabilities)
    cc = f"{low[0]}.{low[1]}"
    if low >= (8, 0):
        return Choice("bfloat16", f"this GPU (compute capability {cc}) runs bf16 natively")
    return Choice("float16", f"this GPU (compute capability {cc}) has no native bf16; float16 is native")


def gpu_capabilities() -> list[tuple[int, int]]:
    """The compute capability of each GPU this process may use (CUDA_VISIBLE_DEVICES), or []."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]:
        return []
    torch = sys.modules.get("torch")
    if torch is not None:  # loaded here already: what it sees is what this process runs on
        try:
            if torch.cuda.is_available():
                return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
            return []
        except Exception:  # noqa: BLE001 - a driver torch cannot use: no GPU for it
            return []
    return _smi_capabilities(visible)


@functools.lru_cache(maxsize=8)
def _smi_capabilities(visible: str | None) -> list[tuple[int, int]]:
    from ratchet.data.procs.spawn import run_program

    try:
        out = run_program(["nvidia-smi", "--query-gpu=index,uuid,compute_cap", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=20)
    except (OSError, ValueError):
        return []
    if out.returncode != 0:
        return []
    rows = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and "." in parts[2]:
            major, _, minor = parts[2].partition(".")
            if major.isdigit() and minor.isdigit():
                rows.append((parts[0], parts[1], (int(major), int(minor))))
    if visible is not None:
        wanted = [d.strip() for d in visible.split(",") if d.strip()]
        rows = [r for r in rows if r[0] in wanted or r[1] in wanted]
    return [r[2] for r in rows]


@functools.lru_cache(maxsize=1)
def auto() -> Choice:
    """What `auto` stands for on this machine."""
    caps = gpu_capabilities()
    return on_gpu(caps) if caps else on_cpu(cpu_flags())


def resolve_dtype(choice: str) -> str:
    """A sampler's or model's dtype: `auto` resolved (bfloat16, float16 or float32), else as given."""
    return auto().dtype if choice == "auto" else choice


PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def resolve_precision(choice: str) -> str:
    """A trainer's precision: `auto` resolved (bf16, fp16 or fp32), else as given."""
    return PRECISION[auto().dtype] if choice == "auto" else choice
