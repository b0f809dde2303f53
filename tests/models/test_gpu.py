"""GPU tier: the same trainer and HF sampler on CUDA. Skipped on machines without a GPU."""

import importlib.util

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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM for CUDA (pip install -e '.[gpu]')")
def test_the_warm_vllm_engine_sleeps_between_stages_and_swaps_weights_after_waking(tiny_model, tmp_path, monkeypatch):
    """vLLM on a GPU: the warm engine sleeps when a stage lets it go (the device's memory falls to
    a fraction of what the engine held), wakes for the next stage, and weights swapped in after
    waking answer as a fresh engine on them does."""
    import shutil
    from multiprocessing.connection import Client

    from safetensors.torch import load_file, save_file

    from ratchet.models import warm
    from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler

    cfg = SamplerConfig(backend="vllm", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=256)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=12)
    prompts = [f"What is {a} + {b}?" for a in range(4) for b in range(4)]
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    (weights,) = other.glob("*.safetensors")
    torch.manual_seed(1)
    save_file({k: (v.float() * 1.5).to(v.dtype).contiguous() for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})

    def stats():
        path, key = warm._ADDRESS
        with Client(path, family="AF_UNIX", authkey=key) as c:
            c.send(("stats",))
            return c.recv()[1]

    def lent(model):
        with warm.lend(None):
            s = warm.WarmSampler(model, cfg, seed=0)
        held = stats()["gpu_used"]
        texts = [[g.text for g in row] for row in s.generate(prompts, greedy, seed=0)]
        how = s.opened["how"]
        s.close()
        return how, texts, held

    monkeypatch.setattr(warm, "_ADDRESS", None)
    with warm.for_run(True, tmp_path / "engine.log", "vllm") as w:
        monkeypatch.setenv(warm.ENV, w.env()[warm.ENV])
        warm.take_address()
        how1, first, held = lent(tiny_model)
        asleep = stats()
        how2, swapped, _ = lent(other)
    cold = open_sampler(other, cfg, seed=0)
    try:
        fresh = [[g.text for g in row] for row in cold.generate(prompts, greedy, seed=0)]
    finally:
        cold.close()
    assert (how1, how2) == ("opened", "swapped weights to")
    assert asleep["asleep"] and asleep["gpu_used"] < 0.25 * held, (asleep, held)
    assert swapped == fresh and swapped != first
