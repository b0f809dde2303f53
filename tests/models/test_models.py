"""The model layer on the real stack: HF and vLLM samplers, TRL training, the default model."""

import json

import pytest
import torch

from ratchet.models.sampler import HFSampler, SamplerConfig, SamplingParams, chat_token_ids, open_sampler
from ratchet.models.train_kinds.rft import RFTTrainConfig, train_rft

pytestmark = pytest.mark.integration


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_default_model_is_converted_once_with_chat_template(default_model):
    from transformers import AutoTokenizer

    from ratchet.models.default_model import default_model_dir

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
    """vLLM and the HF backend answer alike on the default model, and token ids fed back continue where they left
    off. Guards the two samplers' agreement. Slow: the default model on both."""
    prompts = ["What is 3 + 4?", "Name a color.", "What is 12 + 9?"]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    hf = HFSampler(default_model, SamplerConfig(backend="hf", dtype="float32"), seed=0).generate(prompts, greedy, 0)
    v = open_sampler(default_model, SamplerConfig(backend="vllm", dtype="float32", kv_cache_gb=1), seed=0)
    out = v.generate(prompts, greedy, 0)
    # token in, token out: the ids the engine produced, fed back, continue where they left off
    ctx = chat_token_ids(v.tokenizer, prompts[:1])[0]
    (half,), = v.generate_ids([ctx], greedy.model_copy(update={"max_tokens": 4}), 0)
    (rest,), = v.generate_ids([ctx + list(half.token_ids)], greedy.model_copy(update={"max_tokens": 4}), 0)
    v.close()
    assert len(half.token_ids) == 4 and (half.token_ids + rest.token_ids)[:8] == out[0][0].token_ids[:8]
    # same weights, same token ids in: the first greedy words (and ids) agree
    for h, x in zip(hf, out):
        assert h[0].text.split()[:3] == x[0].text.split()[:3], (h[0].text, x[0].text)
        assert h[0].token_ids[:3] == x[0].token_ids[:3] and len(x[0].token_ids) == x[0].n_tokens


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
    from trl import SFTConfig

    from ratchet.models.train_kinds.trainers import RatchetSFTTrainer
    from ratchet.models.trainer import load_policy

    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                             "completion": [{"role": "assistant", "content": r["completion"]}]} for r in ROWS[:4]])
    losses = []
    for plain in (False, True):
        model, tok, _ = load_policy(tiny_model, RFTTrainConfig(adapter="full"), "fp32")
        args = SFTConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none",
                         per_device_train_batch_size=4, completion_only_loss=True)
        tr = RatchetSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, plain=plain)
        batch = next(iter(tr.get_train_dataloader()))
        with torch.no_grad():
            losses.append(float(tr.compute_loss(tr.model, dict(batch))))
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


PAIRS = [{"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}.", "rejected": f"It is {a + b + 3}, I think."}
         for a in range(4) for b in range(2)]


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_one_dpo_step_moves_the_policy_toward_chosen(tiny_model, tmp_path, adapter):
    """A real TRL DPOTrainer step: the weights change, the implicit reward margin is logged,
    and the trained policy prefers chosen over rejected more than its reference did."""
    from ratchet.models.train_kinds.dpo import DPOTrainConfig, train_dpo

    cfg = DPOTrainConfig(adapter=adapter, epochs=1, batch_size=8, learning_rate=5e-2 if adapter == "lora" else 5e-3,
                         logging_steps=1, beta=0.1)
    m = train_dpo(tiny_model, PAIRS, cfg, tmp_path, seed=0)
    assert m["steps"] == 1 and m["rows"] == 8
    before, after = _weights(tiny_model), _weights(tmp_path / "model")
    assert [k for k in before if not torch.equal(before[k], after[k])], "the DPO step changed no weight"
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert {"rewards/margins", "rewards/chosen", "logps/rejected"} <= log[0].keys()

    def margin(model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ratchet.models.sampler import chat_token_ids

        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        total = 0.0
        for r in PAIRS:
            for side, sign in (("chosen", 1), ("rejected", -1)):
                prompt = chat_token_ids(tok, [r["prompt"]])[0]
                full = tok.apply_chat_template([{"role": "user", "content": r["prompt"]},
                                                {"role": "assistant", "content": r[side]}], tokenize=True)
                full = list(full["input_ids"] if hasattr(full, "keys") else full)
                ids = torch.tensor([full])
                with torch.no_grad():
                    lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                tgt = ids[0, 1:]
                total += sign * lp[len(prompt) - 1:].gather(1, tgt[len(prompt) - 1:, None]).sum().item()
        return total

    assert margin(tmp_path / "model") > margin(tiny_model)


def test_dpo_config_errors_name_the_fix():
    from ratchet.models.train_kinds.dpo import DPOTrainConfig

    with pytest.raises(ValueError, match="one weight per loss"):
        DPOTrainConfig(loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="label_smoothing > 0"):
        DPOTrainConfig(loss_type=["exo_pair"])
    assert DPOTrainConfig(loss_type=["ipo"]).loss_type == ["ipo"]


def test_plain_lm_head_matches_trl_fused_head(tiny_model):
    """The CPU DPO head must give TRL's per-token log-probabilities, loss and gradients (fp32)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from ratchet.models.train_kinds.dpo import DPOTrainConfig
    from ratchet.models.train_kinds.trainers import plain_lm_head
    from ratchet.models.trainer import load_policy

    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                             "chosen": [{"role": "assistant", "content": r["chosen"]}],
                             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in PAIRS[:4]])
    model, tok, peft = load_policy(tiny_model, DPOTrainConfig(), "fp32")
    args = DPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none",
                     per_device_train_batch_size=4)
    tr = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft)
    torch.manual_seed(1)
    for n, p in tr.model.named_parameters():
        if "lora_B" in n:  # a non-zero adapter, so policy and reference differ and every LoRA weight gets a gradient
            p.data.normal_(0, 0.05)
    batch = dict(next(iter(tr.get_train_dataloader())))
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    got = []
    for plain in (False, True):
        if plain:
            assert plain_lm_head(tr.model.get_base_model())
        tr.model.zero_grad()
        loss = tr.compute_loss(tr.model, dict(batch))
        loss.backward()
        out = tr.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                       fused_lm_head=True)
        grads = torch.cat([p.grad.flatten() for p in tr.model.parameters() if p.requires_grad])
        got.append((float(loss.detach()), out.log_probs.detach(), out.is_top1, grads))
    (l0, lp0, top0, g0), (l1, lp1, top1, g1) = got
    assert l1 == pytest.approx(l0, rel=1e-5) and torch.allclose(lp0, lp1, atol=1e-4)
    assert torch.equal(top0, top1)
    assert float((g0 - g1).norm() / g0.norm()) < 1e-4


def test_a_run_shorter_than_its_logging_cadence_still_reports_its_loss(tmp_path):
    """One step with logging_steps=2 logs no step loss: the run's mean loss stands for the first
    and last, and the stage manifest (JSON, where NaN does not survive) still reads back."""
    from types import SimpleNamespace

    from ratchet.models.trainer import write_log

    trainer = SimpleNamespace(state=SimpleNamespace(global_step=1, log_history=[{"train_loss": 0.69, "step": 1}]),
                              args=SimpleNamespace(num_train_epochs=1))
    m = write_log(trainer, tmp_path, started=0.0, n_tokens=10)
    assert (m["first_loss"], m["last_loss"], m["train_loss"], m["steps"]) == (0.69, 0.69, 0.69, 1.0)
    assert (tmp_path / "train_log.jsonl").read_text() == ""
    assert json.loads(json.dumps(m, allow_nan=False))  # every metric is a number JSON can carry


def test_a_train_kind_that_does_not_say_how_it_trains_is_an_error_not_sft():
    """A train kind is one module: a config model that says what it consumes and how it trains
    (fit, rows_of). One without them cannot even be made, and an unregistered kind is named."""
    from typing import ClassVar, Literal

    import pytest

    from ratchet.models.train_kinds import TrainConfig, config_class
    from ratchet.models.trainer import OptimSettings

    class PPOTrainConfig(OptimSettings):
        consumes: ClassVar[str] = "rollouts"
        kind: Literal["ppo"] = "ppo"

    with pytest.raises(TypeError, match="abstract"):
        PPOTrainConfig()
    with pytest.raises(ValueError, match="'ppo' is not a known kind"):
        config_class("ppo")
    assert config_class("rft") is RFTTrainConfig
    from pydantic import TypeAdapter, ValidationError

    with pytest.raises(ValidationError, match="ppo"):
        TypeAdapter(TrainConfig).validate_python({"kind": "ppo"})


def test_every_schedule_the_config_allows_builds_in_transformers():
    """train.lr_scheduler is checked when the config is read, not when the trainer is built; each
    value it allows must build as it is."""
    import typing

    import torch
    from transformers.optimization import get_scheduler
    from transformers.trainer_utils import SchedulerType

    from ratchet.models.trainer import Scheduler

    for name in typing.get_args(Scheduler):
        assert name in {s.value for s in SchedulerType}
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        get_scheduler(name, opt, num_warmup_steps=1, num_training_steps=10).step()
