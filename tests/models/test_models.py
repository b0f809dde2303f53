"""The model layer on the real stack: HF and vLLM samplers, TRL training, the default model."""

import json

import pytest
import torch

from models.sampler import HFSampler, SamplerConfig, SamplingParams, chat_token_ids, open_sampler
from models.trainer import RFTTrainConfig, train_rft

pytestmark = pytest.mark.integration


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_default_model_is_converted_once_with_chat_template(default_model):
    from transformers import AutoTokenizer

    from models.default_model import default_model_dir

    assert default_model_dir() == default_model  # cached: second call finds the same directory
    tok = AutoTokenizer.from_pretrained(default_model)
    ids = chat_token_ids(tok, ["What is 2 + 2?"])[0]
    assert "What is 2 + 2?" in tok.decode(ids) and tok.decode(ids).rstrip().endswith("assistant")
    cfg = json.loads((default_model / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576


def test_hf_sampler_shapes_and_seeding(tiny_model):
    s = HFSampler(tiny_model, SamplerConfig(backend="hf", dtype="float32", hf_batch_size=2), seed=0)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6)
    a = s.generate(["hi", "what is 1 + 1?", "x"], params, seed=5)
    b = s.generate(["hi", "what is 1 + 1?", "x"], params, seed=5)
    assert [len(g) for g in a] == [3, 3, 3]
    assert all(0 < x.n_tokens <= 6 for g in a for x in g)
    assert a == b  # same seed, same text
    assert a != s.generate(["hi", "what is 1 + 1?", "x"], params, seed=6)


def test_vllm_and_hf_greedy_agree_on_the_default_model(default_model):
    prompts = ["What is 3 + 4?", "Name a color.", "What is 12 + 9?"]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    hf = HFSampler(default_model, SamplerConfig(backend="hf", dtype="float32"), seed=0).generate(prompts, greedy, 0)
    v = open_sampler(default_model, SamplerConfig(backend="vllm", dtype="float32", kv_cache_gb=1), seed=0)
    out = v.generate(prompts, greedy, 0)
    v.close()
    # same weights, same token ids in: the first greedy words agree
    for h, x in zip(hf, out):
        assert h[0].text.split()[:3] == x[0].text.split()[:3], (h[0].text, x[0].text)


ROWS = [{"prompt": f"What is {a} + {b}?", "completion": f"{a} + {b} = {a + b}."} for a in range(4) for b in range(3)]


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_train_rft_changes_the_weights(tiny_model, tmp_path, adapter):
    cfg = RFTTrainConfig(adapter=adapter, epochs=1, batch_size=4, learning_rate=1e-2, logging_steps=1)
    m = train_rft(tiny_model, ROWS, cfg, tmp_path, seed=0)
    assert m["steps"] == 3 and m["rows"] == 12
    before, after = _weights(tiny_model), _weights(tmp_path / "model")
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "training left every weight unchanged"
    assert all(after[k].dtype == torch.float32 for k in after)  # merged in full precision
    assert (tmp_path / "adapter").is_dir() == (adapter == "lora")
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all("loss" in r for r in log)
    assert not any((tmp_path / "model").glob("adapter_*"))  # a plain model directory, not an adapter


def test_plain_loss_matches_trl_loss(tiny_model):
    """The CPU loss override must compute the same completion-only loss as TRL's fused head."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from models.trainer import load_policy, plain_loss

    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                             "completion": [{"role": "assistant", "content": r["completion"]}]} for r in ROWS[:4]])
    losses = []
    for cls in (SFTTrainer, plain_loss(SFTTrainer)):
        model, tok, _ = load_policy(tiny_model, RFTTrainConfig(adapter="full"), "fp32")
        args = SFTConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none",
                         per_device_train_batch_size=4, completion_only_loss=True)
        tr = cls(model=model, args=args, train_dataset=ds, processing_class=tok)
        batch = next(iter(tr.get_train_dataloader()))
        with torch.no_grad():
            losses.append(float(tr.compute_loss(tr.model, dict(batch))))
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
