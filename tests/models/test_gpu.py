"""GPU tier: the same trainer and HF sampler on CUDA. Skipped on machines without a GPU."""

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ratchet.tasks.sample import SampleWork
from tests.models.test_grpo import wide_tiny  # noqa: F401 - a fixture (a tiny model vLLM and HF both take)

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


def test_grpo_steps_on_cuda_with_the_hf_sampler(tmp_path, request):
    """Three GRPO steps on the GPU, the engine HF generate on the same GPU: the policy's weights
    synced into it from memory before each step's generation after the first, and in float32 the
    engine's log-probabilities within 1e-4 of the trainer's (on CPU: max 2e-6), the weights moved."""
    from safetensors.torch import load_file

    from tests.models.test_grpo import run

    model = request.getfixturevalue("wide_tiny")
    m = run(model, tmp_path / "out", backend="hf", steps=3, precision="fp32")
    assert m["steps"] == 3 and m["syncs"] == 2 and m["gen_tokens"] > 0, m
    assert m["logp_gap_max"] < 1e-4, m
    before = load_file(str(model / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


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
    with warm.for_run(True, tmp_path / "engine.log", "hf") as w:
        monkeypatch.setenv(warm.ENV, w.env()[warm.ENV])
        address = warm.take_address()
        s = warm.WarmSampler(tiny_model, cfg, seed=0, address=address)
        assert s.generate(["What is 2 + 3?"], SamplingParams(max_tokens=4), seed=0)[0][0].n_tokens > 0
        assert s._call("stats")["gpu_allocated"] > 0  # the model is on the GPU while the stage holds it
        s.close()
        path, _, key = address.partition("|")
        with Client(path, family="AF_UNIX", authkey=bytes.fromhex(key)) as c:
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

    held_at = {}

    def stats():
        path, _, key = held_at["address"].partition("|")
        with Client(path, family="AF_UNIX", authkey=bytes.fromhex(key)) as c:
            c.send(("stats",))
            return c.recv()[1]

    def lent(model):
        s = warm.WarmSampler(model, cfg, seed=0, address=held_at["address"])
        held = stats()["gpu_used"]
        texts = [[g.text for g in row] for row in s.generate(prompts, greedy, seed=0)]
        how = s.opened["how"]
        s.close()
        return how, texts, held

    with warm.for_run(True, tmp_path / "engine.log", "vllm") as w:
        monkeypatch.setenv(warm.ENV, w.env()[warm.ENV])
        held_at["address"] = warm.take_address()
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


@dataclass
class WhereSampled(SampleWork):
    """Sampling units whose holders each record, once their engine is open, the devices they were
    started with, what CUDA shows them, and the GPU memory their model takes."""

    seen: str = ""

    def open(self, lent=None):
        engine = super().open()
        where = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": torch.cuda.device_count(),
                 "uuid": str(torch.cuda.get_device_properties(0).uuid), "allocated": torch.cuda.memory_allocated(0)}
        Path(self.seen, str(os.getpid())).write_text(json.dumps(where))
        return engine


def test_each_engine_holder_samples_on_the_gpus_it_is_given(tiny_model, tmp_path):
    """Local engine holders on this machine's GPUs (at least two holders): each is started with
    devices of its own (one GPU each where there are as many as holders, shared in turn where
    there are fewer), sees only those, opens its model on them, and every unit comes out."""
    from ratchet.data.records import Prompt
    from ratchet.models.sampler import SamplerConfig, SamplingParams
    from ratchet.data.procs.executors import holder_devices
    from ratchet.models.dtype import visible_gpus
    from ratchet.tasks.runner.units import LocalExecutorConfig, run_units

    visible = visible_gpus()
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(len(visible))]
    cfg = LocalExecutorConfig(engines=max(2, len(visible)), threads_per_engine=1)
    prompts = [Prompt(id=f"p{i}", prompt=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(2 * cfg.engines)]
    seen = tmp_path / "seen"
    seen.mkdir()
    work = WhereSampled(model=tiny_model, sampler=SamplerConfig(backend="hf", dtype="bfloat16"), seed=5,
                        items=prompts, size=1, params=SamplingParams(n=2, temperature=0.8, max_tokens=8),
                        seen=str(seen))
    done = run_units(work, tmp_path / "shards", cfg)
    assert done.holders == cfg.engines and done.shards.missing() == []
    holders = [json.loads(p.read_text()) for p in seen.iterdir()]
    assert sorted(h["visible"] for h in holders) == sorted(holder_devices(cfg, visible))
    for h in holders:
        mine = h["visible"].split(",")
        assert h["count"] == len(mine)  # a holder sees its own devices only
        assert h["uuid"] == uuids[visible.index(mine[0])]  # the physical GPU it was given
        assert h["allocated"] > 0  # its model is on it
    assert sorted({json.loads(x)["prompt_id"] for x in done.shards.lines()}) == sorted(p.id for p in prompts)


def test_training_processes_past_the_gpus_shown_are_refused_before_the_model_is_read(tiny_model, tmp_path):
    """torchrun gives training process k GPU k: one process more than this machine's GPUs has no
    device (on one GPU its second process failed with an exit code alone, seen here); `ratchet
    check` names the count, the devices and the fix instead."""
    from ratchet.data.errors import ConfigError
    from ratchet.flows.config import config_from_dict
    from ratchet.flows.inputs import check_inputs, devices_line
    from ratchet.models.dtype import visible_gpus

    rows, held = tmp_path / "rows.jsonl", tmp_path / "held.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(16)))
    held.write_text(json.dumps({"prompt": "What is 99 + 1?", "answer": 100}) + "\n")
    n = len(visible_gpus())
    assert n == torch.cuda.device_count() or "CUDA_VISIBLE_DEVICES" in os.environ

    def cfg(processes):
        return config_from_dict({"workdir": str(tmp_path / "w"), "model": {"path": str(tiny_model)},
                                 "data": {"kind": "file", "path": str(rows), "eval_path": str(held)},
                                 "train": {"num_processes": processes}})

    with pytest.raises(ConfigError, match=rf"train.num_processes={n + 1}: training runs one process per GPU, and "
                                          rf"this machine shows {n} "):
        check_inputs(cfg(n + 1))
    assert len(check_inputs(cfg(n)).train) > 0
    assert devices_line(cfg(n)).endswith(f"; training in {n} process{'es' if n > 1 else ''} on "
                                         f"GPU{'s' if n > 1 else ''} {','.join(visible_gpus())}")
