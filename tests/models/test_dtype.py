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


class Job(BaseModel):
    sampler: SamplerConfig
    seed: int = 0


def sampling_body(req: StageRequest[Job], store):
    return req.finish(store, outputs={})


def test_a_stage_is_keyed_and_recorded_by_the_dtype_auto_resolved_to(tmp_path, monkeypatch):
    """Two machines that resolve `auto` differently never share a key, and the manifest says which
    dtype ran; a dtype set explicitly is keyed as set, whatever the machine."""
    from ratchet.data.store import ArtifactStore
    from ratchet.tasks.runner.stage import run_stage

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


def test_check_and_the_run_header_say_the_dtype_and_why(monkeypatch, tmp_path):
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import dtype_line

    monkeypatch.setattr(dtype, "auto", lambda: dtype.on_cpu(dtype.cpu_flags(CPUINFO.format(flags=AVX512_ONLY))))
    stored = {}
    for name in ("float32", "bfloat16"):  # models as their config.json says they are stored (the default: float32)
        stored[name] = tmp_path / name
        stored[name].mkdir()
        (stored[name] / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": name}))
    fp32, bf16 = f"model.path={stored['float32']}", f"model.path={stored['bfloat16']}"
    assert dtype_line(load_config(None, [fp32])) == (
        "dtype: sampling float32, evaluating float32, training fp32 (float32 for auto: this CPU has no bf16 "
        "instructions (no amx_bf16 or avx512_bf16))")
    assert dtype_line(load_config(None, [fp32, "sampler.dtype=bfloat16", "train.precision=bf16"])) == \
        "dtype: sampling bfloat16, evaluating float32 (as the base model is stored), training bf16 (as set)"
    assert dtype_line(load_config(None, [bf16, "sampler.dtype=bfloat16", "train.precision=bf16"])) == \
        "dtype: sampling bfloat16, evaluating bfloat16, training bf16 (as set)"
    assert dtype_line(load_config(None, [fp32, "sampler.dtype=bfloat16", "train.precision=bf16",
                                         "evaluate.dtype=sampler"])) == \
        "dtype: sampling bfloat16, evaluating bfloat16, training bf16 (as set)"


def test_held_out_answers_are_generated_in_the_dtype_the_base_model_is_stored_in(tmp_path):
    """evaluate.dtype=auto: float32 for a model stored in float32 whatever the sampler runs in for
    speed, so a held-out figure never moves with the machine's choice; a 16-bit model in the
    sampler's; the run's own sampler (and so its warm engine) where that is the same dtype."""
    from ratchet.tasks.evaluate import EvaluateConfig, eval_sampler

    for name in ("float32", "bfloat16"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"torch_dtype": name}))  # as transformers 4 wrote it
    (tmp_path / "unsaid").mkdir()
    bf16, fp32 = SamplerConfig(dtype="bfloat16"), SamplerConfig(dtype="float32")
    auto = EvaluateConfig()
    assert eval_sampler(auto, bf16, str(tmp_path / "float32")) == bf16.model_copy(update={"dtype": "float32"})
    assert eval_sampler(auto, bf16, str(tmp_path / "bfloat16")) is bf16
    assert eval_sampler(auto, bf16, str(tmp_path / "unsaid")) is bf16
    assert eval_sampler(auto, fp32, str(tmp_path / "float32")) is fp32  # the same engine
    assert eval_sampler(EvaluateConfig(dtype="sampler"), bf16, str(tmp_path / "float32")) is bf16
    assert eval_sampler(EvaluateConfig(dtype="float16"), bf16, str(tmp_path / "float32")).dtype == "float16"
    served = SamplerConfig(backend="served", endpoint={"base_url": "http://127.0.0.1:9/v1", "model": "p"})
    assert eval_sampler(auto, served, str(tmp_path / "float32")) is served  # it answers in its own


def test_an_online_kinds_engine_and_trainer_take_auto_for_speed_and_its_held_out_answers_float32(tmp_path,
                                                                                                 monkeypatch):
    """GRPO's engine and trainer take `auto` as every other stage does (for speed: over three seeds
    on the default task a bf16 round gained as much as a float32 one, docs/results.md "Online RL and
    the dtype"); its held-out answers are in the dtype the base model is stored in, and `ratchet
    check`'s line says both."""
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import dtype_line

    monkeypatch.setattr(dtype, "auto", lambda: dtype.Choice("bfloat16", "probed"))
    (tmp_path / "float32").mkdir()
    (tmp_path / "float32" / "config.json").write_text(json.dumps({"dtype": "float32"}))
    grpo = load_config(None, [f"model.path={tmp_path / 'float32'}", "train.kind=grpo", "sample.top_k=0"])
    assert dtype_line(grpo) == ("dtype: sampling bfloat16, evaluating float32 (as the base model is stored), "
                                "training bf16 (bfloat16 for auto: probed)")
