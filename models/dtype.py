"""What `auto` means for a dtype on this machine: bf16 where the hardware runs it faster than fp32.

- An NVIDIA GPU of compute capability 8.0 or higher (A100, L4, H100, ...): bfloat16. Below it
  (T4 7.5, V100 7.0): float16, which those GPUs run natively; bf16 there is emulated.
- A CPU with AMX (`amx_bf16` in its flags): bfloat16 (bf16 matmuls ran 1,475 GFLOP/s against 205).
- A CPU with no bf16 instructions at all (neither `avx512_bf16` nor, on Arm, `bf16`): float32.
  PyTorch's own test (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`) says True on every AVX-512
  CPU, also where bf16 is emulated: without either flag vLLM sampled 49 tok/s in bf16 against 164.
- A CPU with bf16 instructions but no AMX: measured. Its flags do not decide it: on two 2-core
  VMs with the same flags (`avx512_bf16`, no AMX), bench/dtype_bench.py gave bf16 against fp32
  245 against 310 tok/s sampling on one (an Intel Xeon) and 512 against 294 on the other (an
  AMD EPYC). So the CPU model decides, by a short probe (`_probe`, about 3 s: matmuls at the
  default model's shapes, forward and backward, in a child process), run once per CPU model and
  torch version and kept in the user cache (`~/.cache/ratchet/dtype/`). bf16 is chosen when it
  ran at least `MARGIN` times fp32's rate; a closer race keeps float32, so a probe repeated
  after the cache is cleared cannot flip on noise.

A stage's key holds what `auto` resolved to (tasks/runner/stage.py `resolved`), so the answer must not
change between two runs on one machine: a rule read from the hardware, or a measurement taken once
and then read back. It is read without importing torch (the CPU's flags from /proc/cpuinfo, the
GPUs' compute capability from `nvidia-smi`, or from torch where this process has it loaded).
`RATCHET_AUTO_DTYPE=bfloat16|float16|float32` overrides what `auto` means on any machine.
"""

from __future__ import annotations

import functools
import importlib.metadata as importlib_metadata
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ratchet.data.procs.entry import entry

NATIVE_CPU_FLAGS = ("amx_bf16",)  # bf16 tile matmuls: always faster than fp32
BF16_CPU_FLAGS = ("avx512_bf16", "bf16")  # bf16 instructions (x86, Arm): faster on some CPUs, slower on others
MARGIN = 1.15  # bf16 must run this many times fp32's rate in the probe to be chosen
OVERRIDE = "RATCHET_AUTO_DTYPE"
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Choice:
    """What `auto` resolved to, and why, in words for `ratchet check` and the run's header."""

    dtype: str  # bfloat16, float16 or float32
    why: str

    def line(self) -> str:
        return f"{self.dtype}: {self.why}"


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _first_cpu(cpuinfo: str) -> dict[str, str]:
    """The fields of the first processor in /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo (or in the text given)."""
    fields = _first_cpu(_cpuinfo() if cpuinfo is None else cpuinfo)
    return set((fields.get("flags") or fields.get("Features") or "").split())


def cpu_model(cpuinfo: str | None = None) -> dict[str, str]:
    """What names this CPU model for the probe's cache: vendor, family, model, stepping, its name
    and flags, and the torch version whose kernels ran the probe."""
    fields = _first_cpu(_cpuinfo() if cpuinfo is None else cpuinfo)
    keep = ("vendor_id", "cpu family", "model", "stepping", "model name", "CPU implementer", "CPU part",
            "CPU variant")
    out = {k: fields[k] for k in keep if k in fields}
    out["flags"] = " ".join(sorted(cpu_flags(cpuinfo if cpuinfo is not None else _cpuinfo())))
    try:
        out["torch"] = importlib_metadata.version("torch")
    except importlib_metadata.PackageNotFoundError:
        out["torch"] = "none"
    return out


def probe_path(model: dict[str, str]) -> Path:
    import hashlib

    from ratchet.models.default_model import default_cache_dir

    digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:12]
    return default_cache_dir() / "dtype" / f"cpu-{digest}.json"


def _name(model: dict[str, str]) -> str:
    """The CPU's name as /proc/cpuinfo gives it, e.g. AMD EPYC (Arm gives none: its implementer)."""
    return model.get("model name") or model.get("vendor_id") or model.get("CPU implementer") or "this CPU"


def on_cpu(flags: set[str], measured=None) -> Choice:
    """`auto` on a CPU with these flags; `measured()` gives the probe's record where the flags
    leave it open (see the module docstring)."""
    native = [f for f in NATIVE_CPU_FLAGS if f in flags]
    if native:
        return Choice("bfloat16", f"this CPU runs bf16 natively ({', '.join(native)})")
    if not any(f in flags for f in BF16_CPU_FLAGS):
        return Choice("float32", "this CPU has no bf16 instructions (no amx_bf16 or avx512_bf16)")
    if measured is None:
        measured = probed
    rec = measured()
    if "error" in rec:
        return Choice("float32", f"this CPU has bf16 instructions but no AMX, and the probe that measures it "
                                 f"failed ({rec['error']}); the next run tries it again")
    ratio = rec["bf16_gflops"] / rec["fp32_gflops"]
    said = f"{_name(rec['cpu'])} ran bf16 x{ratio:.2f} fp32 in its probe ({_home(rec['path'])})"
    if ratio >= MARGIN:
        return Choice("bfloat16", said)
    return Choice("float32", f"{said}; bf16 from x{MARGIN:.2f}")


def _home(path: str) -> str:
    home = str(Path.home())
    return "~" + path[len(home):] if path.startswith(home + os.sep) else path


def probed(cpuinfo: str | None = None) -> dict:
    """The probe's record for this CPU model: read from the user cache, else measured now (in a
    child process) and kept there. Two processes that measure at once keep the first one's."""
    model = cpu_model(cpuinfo)
    path = probe_path(model)
    rec = _read(path, model)
    if rec is None:
        rec = _measure()
        if "error" in rec:
            return rec
        rec = _keep(path, {"cpu": model, "measured": time.strftime("%Y-%m-%d"), **rec}, model)
    return {**rec, "path": str(path)}


def _read(path: Path, model: dict[str, str]) -> dict | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(rec, dict) and rec.get("cpu") == model and all(
        isinstance(rec.get(k), (int, float)) and rec[k] > 0 for k in ("bf16_gflops", "fp32_gflops"))
    return rec if ok else None


def _keep(path: Path, rec: dict, model: dict[str, str]) -> dict:
    """Write `rec` at `path` unless a readable record is there already (then that one stands)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    try:
        for _ in range(2):
            try:
                os.link(tmp, path)
                return rec
            except FileExistsError:
                there = _read(path, model)
                if there is not None:
                    return there
                path.unlink(missing_ok=True)  # unreadable or another CPU's: replaced
        return rec
    finally:
        tmp.unlink(missing_ok=True)


def _measure() -> dict:
    """Run the probe in a fresh interpreter (this process may not import torch); its record, or
    {"error": ...}."""
    from ratchet.data.procs import spawn

    try:
        out = spawn.run_program(spawn.command(dtype_probe), capture_output=True, text=True, timeout=300,
                                env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    except Exception as e:  # noqa: BLE001 - no interpreter, a timeout: float32, said, tried again next run
        return {"error": f"{type(e).__name__}: {e}"}
    lines = out.stdout.strip().splitlines()
    try:
        rec = json.loads(lines[-1]) if out.returncode == 0 and lines else None
    except ValueError:
        rec = None
    if not isinstance(rec, dict):
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {out.returncode}: {tail[-200:]}"}
    return rec


PROBE = "y = x @ w.T at the default model's MLP shapes: [64, 576] x [576, 1536] forward, [256, 576] forward and " \
        "backward; best of 3 interleaved runs of 0.2 s per dtype"


@entry
def dtype_probe() -> int:
    """Measure bf16 against fp32 matmul throughput on this CPU; print one JSON line."""
    import torch

    torch.manual_seed(0)

    def rate(dt, m: int, backward: bool) -> float:
        x = torch.randn(m, 576, dtype=dt, requires_grad=backward)
        w = torch.randn(1536, 576, dtype=dt, requires_grad=backward)

        def once():
            y = torch.nn.functional.linear(x, w)
            if backward:
                y.sum().backward()

        for _ in range(3):
            once()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.2:
            once()
            n += 1
        return n * m * 576 * 1536 * 2 * (3 if backward else 1) / (time.perf_counter() - start) / 1e9

    best = {"bf16": [0.0, 0.0], "fp32": [0.0, 0.0]}
    for _ in range(3):
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for i, (m, backward) in enumerate(((64, False), (256, True))):
                best[name][i] = max(best[name][i], rate(dt, m, backward))
    # one figure per dtype: the geometric mean of the two shapes' rates
    print(json.dumps({f"{k}_gflops": round((v[0] * v[1]) ** 0.5, 1) for k, v in best.items()}
                     | {"threads": torch.get_num_threads(), "probe": PROBE}))
    return 0


def on_gpu(capabilities: list[tuple[int, int]]) -> Choice:
    """For the visible GPUs' compute capabilities: the lowest decides (a stage may run on any)."""
    low = min(capabilities)
    cc = f"{low[0]}.{low[1]}"
    if low >= (8, 0):
        return Choice("bfloat16", f"this GPU (compute capability {cc}) runs bf16 natively")
    return Choice("float16", f"this GPU (compute capability {cc}) has no native bf16; float16 is native")


# what a GPU driver leaves on a machine: NVIDIA's kernel driver (also inside a container given GPUs),
# ROCm's, WSL2's; where none is there, torch counts no device, so it is not imported to say so (1.1 s)
GPU_DRIVER_NODES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use: CUDA_VISIBLE_DEVICES where set, else every one torch
    counts (none on a machine without a GPU driver, where torch is not imported to say so)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip() and d.strip() != "-1"]
    if "torch" not in sys.modules and not any(os.path.exists(p) for p in GPU_DRIVER_NODES):
        return []
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no torch, or no driver: no GPU
        return []


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
    """What `auto` stands for on this machine (`RATCHET_AUTO_DTYPE` overrides it)."""
    said = os.environ.get(OVERRIDE, "").strip()
    if said:
        if said not in DTYPES:
            from ratchet.data.errors import ConfigError

            raise ConfigError([f"{OVERRIDE}={said!r}: not a dtype; give one of {', '.join(DTYPES)}, or unset it to let "
                               "auto follow the machine"])
        return Choice(said, f"set by {OVERRIDE}")
    caps = gpu_capabilities()
    return on_gpu(caps) if caps else on_cpu(cpu_flags())


def resolve_dtype(choice: str) -> str:
    """A sampler's or model's dtype: `auto` resolved (bfloat16, float16 or float32), else as given."""
    return auto().dtype if choice == "auto" else choice


PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def resolve_precision(choice: str) -> str:
    """A trainer's precision: `auto` resolved (bf16, fp16 or fp32), else as given."""
    return PRECISION[auto().dtype] if choice == "auto" else choice


def stored_dtype(model_dir: Path | str | None) -> str | None:
    """The dtype a model directory's weights are stored in, as its config.json says (`dtype`, or
    transformers 4's `torch_dtype`); None where it says none or cannot be read."""
    try:
        conf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return None
    said = (conf.get("dtype") or conf.get("torch_dtype")) if isinstance(conf, dict) else None
    return said if isinstance(said, str) else None


def stored_in_float32(model_path: str) -> bool:
    """Whether the model a config names (model.path: 'default', a directory, a hub id already
    here) is stored in float32."""
    from ratchet.models.locate import find_model

    return stored_dtype(find_model(model_path, fetch=False)) == "float32"
