"""GPU tier: the same trainer and HF sampler on CUDA. Skipped on machines without a GPU."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_train_rft_on_cuda_uses_bf16_and_changes_weights(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from ratchet.models.train_kinds.rft import RFTTrainConfig, train_rft
    from ratchet.models.trainer import resolve_precision

    rows = [{"prompt": f"What is {a} + 1?", "completion": f"{a + 1}"} for a in range(16)]
    m = train_rft(tiny_model, rows, RFTTrainConfig(epochs=1, batch_size=8, learning_rate=1e-2), tmp_path, seed=0)
    assert m["bf16"] == float(resolve_precision("auto") == "bf16")
    before, after = load_file(str(tiny_model / "model.safetensors")), load_file(str(tmp_path / "model" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)


def test_hf_sampler_on_cuda(tiny_model):
    from ratchet.models.sampler import HFSampler, SamplerConfig, SamplingParams

    s = HFSampler(tiny_model, SamplerConfig(backend="hf", dtype="bfloat16"), seed=0)
    assert s.device == "cuda"
    out = s.generate(["hi", "there"], SamplingParams(n=2, temperature=1.0, max_tokens=4), seed=0)
    assert [len(o) for o in out] == [2, 2]


def test_train_dpo_on_cuda_uses_trl_head_and_changes_weights(tiny_model, tmp_path):
    """On CUDA the DPO trainer keeps TRL's own LM head (the plain head is the CPU path)."""
    from safetensors.torch import load_file

    from ratchet.models.train_kinds.dpo import DPOTrainConfig, train_dpo

    rows = [{"prompt": f"What is {a} + 1?", "chosen": f"{a + 1}", "rejected": f"{a + 2} or so"} for a in range(16)]
    m = train_dpo(tiny_model, rows, DPOTrainConfig(epochs=1, batch_size=8, learning_rate=1e-2), tmp_path, seed=0)
    assert m["plain_lm_head"] == 0.0 and m["steps"] == 2.0
    assert m["last_rewards_margins"] == m["last_rewards_margins"]  # a number, not NaN
    before, after = load_file(str(tiny_model / "model.safetensors")), load_file(str(tmp_path / "model" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)


def test_the_warm_engine_holds_no_gpu_memory_between_stages(tiny_model, tmp_path, monkeypatch):
    """Training runs between sampling stages in another process: the run's warm engine must hand
    the GPU back when a stage lets it go (a transformers model is let go; vLLM sleeps)."""
    from multiprocessing.connection import Client

    from ratchet.models import warm
    from ratchet.models.sampler import SamplerConfig, SamplingParams

    cfg = SamplerConfig(backend="hf", dtype="bfloat16")
    monkeypatch.setattr(warm, "_ADDRESS", None)  # restored after the test: no engine
    with warm.for_run(True, tmp_path / "engine.log", "hf") as w:
        monkeypatch.setenv(warm.ENV, w.env()[warm.ENV])
        warm.take_address()
        with warm.lend(None):
            s = warm.WarmSampler(tiny_model, cfg, seed=0)
        assert s.generate(["What is 2 + 3?"], SamplingParams(max_tokens=4), seed=0)[0][0].n_tokens > 0
        assert s._call("stats")["gpu_allocated"] > 0  # the model is on the GPU while the stage holds it
        s.close()
        path, key = warm._ADDRESS
        with Client(path, family="AF_UNIX", authkey=key) as c:
            c.send(("stats",))
            _, stats = c.recv()
        assert stats["gpu_allocated"] == 0 and stats["model"] is None
