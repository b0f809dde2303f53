"""`auto` dtype and precision: bf16 where the hardware runs it faster than fp32 (models/dtype.py)."""

import json

import pytest
from pydantic import BaseModel

from ratchet.models.sampler import SamplerConfig
from ratchet.tasks.runner.stage import StageRequest

from ratchet.models import dtype

# This machine's flags line (2-core AVX-512 VM, 2026-11-27: avx512_bf16, AMX not exposed).
THIS_MACHINE = (
    "flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss "
    "ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni "
    "pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand "
    "hypervisor lahf_lm abm 3dnowprefetch cpuid_fault fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm "
    "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec "
    "xgetbv1 xsaves avx_vnni avx512_bf16 arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni "
    "avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b fsrm serialize tsxldtrk avx512_fp16 "
    "arch_capabilities")
# The same line with AMX's flags (as a Sapphire Rapids host without a VM's masking prints them).
WITH_AMX = THIS_MACHINE + " amx_bf16 amx_tile amx_int8"
# The kind the slow demo was measured on: AVX-512 with VNNI but neither amx_bf16 nor avx512_bf16.
AVX512_ONLY = " ".join(f for f in WITH_AMX.split(" ") if f not in ("avx512_bf16", "avx512_fp16", "amx_bf16",
                                                                      "amx_tile", "amx_int8"))
AVX2_ONLY = " ".join(f for f in AVX512_ONLY.split(" ") if not f.startswith("avx512"))
CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n{flags}\nbogomips\t: 4000\n"


def measured(ratio: float):
    def probe():
        return {"bf16_gflops": 100.0 * ratio, "fp32_gflops": 100.0, "measured": "2026-11-29", "path": "/c/x.json",
                "cpu": {"model name": "AMD EPYC"}}
    return probe


def never():
    raise AssertionError("the flags decide here: no probe")


@pytest.mark.parametrize("line, probe, want, why", [
    (WITH_AMX, never, "bfloat16", "this CPU runs bf16 natively (amx_bf16)"),
    # the same flags, two CPUs: bench/dtype_bench.py gave bf16 x1.75 fp32 on an AMD EPYC, x0.79 on an Intel Xeon
    (THIS_MACHINE, measured(1.75), "bfloat16", "AMD EPYC ran bf16 x1.75 fp32 in its probe (/c/x.json)"),
    (THIS_MACHINE, measured(0.79), "float32", "AMD EPYC ran bf16 x0.79 fp32 in its probe (/c/x.json); bf16 from "
     "x1.15"),
    (THIS_MACHINE, measured(1.10), "float32", None),  # a near tie keeps float32: a re-probe cannot flip on noise
    (THIS_MACHINE, lambda: {"error": "exit 1: no torch"}, "float32", "this CPU has bf16 instructions but no AMX, and "
     "the probe that measures it failed (exit 1: no torch); the next run tries it again"),
    (AVX512_ONLY, never, "float32", "this CPU has no bf16 instructions (no amx_bf16 or avx512_bf16)"),
    (AVX2_ONLY, never, "float32", "this CPU has no bf16 instructions (no amx_bf16 or avx512_bf16)")])
def test_a_cpu_gets_bf16_by_its_flags_or_where_they_leave_it_open_by_the_probe(line, probe, want, why):
    flags = dtype.cpu_flags(CPUINFO.format(flags=line))
    assert "avx2" in flags and ("avx512f" in flags) == (line is not AVX2_ONLY)
    choice = dtype.on_cpu(flags, probe)
    assert choice.dtype == want and (why is None or choice.why == why)


OTHER_CPU = CPUINFO.replace("Intel(R) Xeon(R) Processor", "AMD EPYC").replace("GenuineIntel", "AuthenticAMD")


def test_the_probe_runs_once_per_cpu_model_and_is_read_back_after(tmp_path, monkeypatch):
    """Measured once, kept in the user cache, read back by every later call (the key never flips
    on one machine); another CPU model, or another torch, is measured anew; a record another
    process kept first stands; an unreadable one is replaced."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runs = []

    def fake():
        runs.append(1)
        return {"bf16_gflops": 200.0 + len(runs), "fp32_gflops": 100.0, "threads": 2}

    monkeypatch.setattr(dtype, "_measure", fake)
    info = CPUINFO.format(flags=THIS_MACHINE)
    first = dtype.probed(info)
    assert len(runs) == 1 and first["bf16_gflops"] == 201.0 and first["cpu"]["model name"] == "Intel(R) Xeon(R) Processor"
    assert dtype.probed(info) == first and len(runs) == 1
    assert dtype.probed(OTHER_CPU.format(flags=THIS_MACHINE))["bf16_gflops"] == 202.0 and len(runs) == 2
    model = dtype.cpu_model(info)
    path = dtype.probe_path(model)
    assert path.parent == tmp_path / "ratchet" / "dtype" and first["path"] == str(path)
    kept = dtype._keep(path, {**first, "bf16_gflops": 999.0}, model)  # a second writer: the first record stands
    assert kept["bf16_gflops"] == 201.0
    path.write_text("{half a record")
    assert dtype.probed(info)["bf16_gflops"] == 203.0 and len(runs) == 3
    assert json.loads(path.read_text())["bf16_gflops"] == 203.0
    monkeypatch.setattr(dtype.importlib_metadata, "version", lambda name: "9.9.9")
    assert dtype.cpu_model(info)["torch"] == "9.9.9" and dtype.probe_path(dtype.cpu_model(info)) != path


def test_the_probe_measures_both_dtypes_in_a_child(tmp_path):
    """The real probe (about 5 s, torch in its own process): both rates measured and positive."""
    rec = dtype._measure()
    assert "error" not in rec, rec
    assert rec["bf16_gflops"] > 0 and rec["fp32_gflops"] > 0 and rec["threads"] >= 1 and "576" in rec["probe"]


@pytest.mark.parametrize("code, out, err, said", [
    (0, "loading...\n{not json", "", "exit 0: no output"),
    (0, '["a", "list"]', "", "exit 0: no output"),
    (1, "", "Traceback...\nImportError: no torch", "exit 1: ImportError: no torch"),
])
def test_a_probe_that_prints_no_record_is_an_error_not_a_choice(monkeypatch, code, out, err, said):
    """The child's output is read as untrusted: anything but one JSON object on its last line is
    an error (float32 for this run, measured again by the next), never a record kept."""
    import subprocess

    from ratchet.data.procs import spawn

    monkeypatch.setattr(spawn, "run_program", lambda *a, **k: subprocess.CompletedProcess(a, code, out, err))
    assert dtype._measure() == {"error": said}

    def timeout(*a, **k):
        raise subprocess.TimeoutExpired("probe", 300)

    monkeypatch.setattr(spawn, "run_program", timeout)
    assert dtype._measure()["error"].startswith("TimeoutExpired:")


def test_an_override_sets_what_auto_means_and_a_wrong_one_is_named(monkeypatch):
    from ratchet.data.errors import ConfigError

    dtype.auto.cache_clear()
    try:
        monkeypatch.setenv("RATCHET_AUTO_DTYPE", "float32")
        assert dtype.auto().line() == "float32: set by RATCHET_AUTO_DTYPE"
        dtype.auto.cache_clear()
        monkeypatch.setenv("RATCHET_AUTO_DTYPE", "bf16")
        with pytest.raises(ConfigError, match="RATCHET_AUTO_DTYPE='bf16': not a dtype; give one of bfloat16, float16, "
                                              "float32, or unset it"):
            dtype.auto()
    finally:
        dtype.auto.cache_clear()


@pytest.mark.parametrize("caps, want", [([(7, 0)], "float16"), ([(7, 5)], "float16"), ([(8, 0)], "bfloat16"),
                                        ([(9, 0), (7, 5)], "float16")])
def test_a_gpu_gets_bf16_from_compute_capability_8_0(caps, want):
    choice = dtype.on_gpu(caps)
    assert choice.dtype == want
    assert f"compute capability {min(caps)[0]}.{min(caps)[1]}" in choice.why


def test_auto_resolves_the_same_for_sampling_and_training(monkeypatch):
    monkeypatch.setattr(dtype, "auto", lambda: dtype.Choice("float16", "a T4"))
    assert dtype.resolve_dtype("auto") == "float16" and dtype.resolve_precision("auto") == "fp16"
    monkeypatch.setattr(dtype, "auto", lambda: dtype.Choice("float32", "no native bf16"))
    assert dtype.resolve_dtype("auto") == "float32" and dtype.resolve_precision("auto") == "fp32"
    assert dtype.resolve_dtype("bfloat16") == "bfloat16" and dtype.resolve_precision("bf16") == "bf16"


def test_visible_gpus_are_read_without_torch(monkeypatch):
    """The run's own process never imports torch: nvidia-smi's answer, for the visible devices."""
    import subprocess
    import sys

    from ratchet.data.procs import spawn

    out = "0, GPU-aaa, 7.5\n1, GPU-bbb, 8.0\n"
    monkeypatch.setattr(spawn, "run_program", lambda *a, **k: subprocess.CompletedProcess(a, 0, out, ""))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    dtype._smi_capabilities.cache_clear()
    try:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        assert dtype.gpu_capabilities() == [(8, 0)]
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        assert dtype.gpu_capabilities() == [(7, 5), (8, 0)]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        assert dtype.gpu_capabilities() == []
    finally:
        dtype._smi_capabilities.cache_clear()


def test_no_gpu_driver_no_torch(monkeypatch):
    """On a machine without a GPU driver the visible GPUs are none, said without importing torch
    (`ratchet check` prints them); torch, where loaded, says the same of this machine."""
    import sys

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert dtype.visible_gpus() == []  # torch is loaded in this process: it counts no CUDA device here
    asked = []

    class Refuse:  # first on the import path: records an import of torch and refuses it
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                asked.append(name)
                raise ImportError("torch refused by the test")

    monkeypatch.delitem(sys.modules, "torch", raising=False)  # put back as it was after the test
    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
    monkeypatch.setattr(dtype, "GPU_DRIVER_NODES", ("/nonexistent/nvidia",), raising=False)
    assert dtype.visible_gpus() == [] and asked == []
    monkeypatch.setattr(dtype, "GPU_DRIVER_NODES", (__file__,), raising=False)  # a driver's node: torch is asked
    assert dtype.visible_gpus() == [] and asked == ["torch"]
