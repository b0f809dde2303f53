"""`auto` dtype and precision: bf16 only where the hardware runs it natively (models/dtype.py)."""

import pytest
from pydantic import BaseModel

from ratchet.models.sampler import SamplerConfig
from ratchet.tasks.stage import StageRequest

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


@pytest.mark.parametrize("line, want, why", [
    (WITH_AMX, "bfloat16", "this CPU runs bf16 natively (amx_bf16)"),
    # bench/dtype_bench.py on this machine: bf16 sampled and trained slower than fp32 (x0.79, x0.67)
    (THIS_MACHINE, "float32", "this CPU has avx512_bf16 but no AMX (amx_bf16), where bf16 ran slower than fp32"),
    (AVX512_ONLY, "float32", "this CPU has no native bf16 (no amx_bf16)"),
    (AVX2_ONLY, "float32", "this CPU has no native bf16 (no amx_bf16)")])
def test_a_cpu_gets_bf16_only_with_amx(line, want, why):
    flags = dtype.cpu_flags(CPUINFO.format(flags=line))
    assert "avx2" in flags and ("avx512f" in flags) == (line is not AVX2_ONLY)
    assert dtype.on_cpu(flags).line() == f"{want}: {why}"


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


class Job(BaseModel):
    sampler: SamplerConfig
    seed: int = 0


def sampling_body(req: StageRequest[Job], store):
    return req.finish(store, outputs={})


def test_a_stage_is_keyed_and_recorded_by_the_dtype_auto_resolved_to(tmp_path, monkeypatch):
    """Two machines that resolve `auto` differently never share a key, and the manifest says which
    dtype ran; a dtype set explicitly is keyed as set, whatever the machine."""
    from ratchet.data.store import ArtifactStore
    from ratchet.tasks.stage import run_stage

    store = ArtifactStore(tmp_path)

    def run(choice: str, dtype_set: str = "auto"):
        monkeypatch.setattr(dtype, "auto", lambda: dtype.Choice(choice, "for the test"))
        return run_stage(store, stage="sample", round=1, body=sampling_body, code="c",
                         config=Job(sampler=SamplerConfig(dtype=dtype_set)), parents=[])

    bf16, reused = run("bfloat16")
    assert not reused and bf16.config["sampler"]["dtype"] == "bfloat16"
    fp32, reused = run("float32")
    assert not reused and fp32.key != bf16.key and fp32.config["sampler"]["dtype"] == "float32"
    again, reused = run("bfloat16")
    assert reused and again.key == bf16.key
    set_a, _ = run("bfloat16", "float32")
    set_b, reused = run("float32", "float32")
    assert reused and set_a.key == set_b.key == fp32.key  # float32 set, or auto resolved to it: the same work


def test_check_and_the_run_header_say_the_dtype_and_why(monkeypatch):
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import dtype_line

    monkeypatch.setattr(dtype, "auto", lambda: dtype.on_cpu(dtype.cpu_flags(CPUINFO.format(flags=AVX512_ONLY))))
    assert dtype_line(load_config(None, [])) == ("dtype: sampling float32, training fp32 (float32 for auto: this CPU "
                                                 "has no native bf16 (no amx_bf16))")
    assert dtype_line(load_config(None, ["sampler.dtype=bfloat16", "train.precision=bf16"])) == \
        "dtype: sampling bfloat16, training bf16 (as set)"
