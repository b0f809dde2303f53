"""Each stage on the tiny random model (HF backend, in process): the exact files it leaves."""

import pytest

from data.prompts import AdditionSource
from data.records import SFTRow, write_jsonl
from data.store import ArtifactStore
from models.sampler import SamplerConfig
from models.trainer import RFTTrainConfig
from tasks import evaluate, filter as filt, label, prepare, sample, train
from tasks.evaluate import EvaluateConfig
from tasks.filter import RFTFilter
from tasks.label import VerifierLabel
from tasks.sample import SampleConfig

pytestmark = pytest.mark.integration
HF = SamplerConfig(backend="hf", dtype="float32")


def files(store, m):
    d = store.dir_of(m)
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


def test_stages_write_exactly_their_files(tiny_model, tmp_path):
    store = ArtifactStore(tmp_path)
    src = AdditionSource(a_max=4, b_max=3, eval_size=4)
    pm, _ = prepare.prompts(store, src.model_dump(), seed=0, source_digest=None)
    assert files(store, pm) == ["eval.jsonl", "manifest.json", "train.jsonl"]
    assert pm.metrics == {"train_prompts": 8.0, "eval_prompts": 4.0, "train_with_answer": 8.0}

    base, _ = prepare.base_model(store, "tiny", tiny_model)
    assert [f for f in files(store, base) if f != "manifest.json"] == sorted(
        f"model/{p.name}" for p in tiny_model.iterdir() if p.is_file())

    s, reused = sample.sample(store, base, pm, SampleConfig(n=3, max_tokens=5, shard_size=3), HF, seed=1, round=1,
                              isolate=False)
    assert not reused and files(store, s) == ["manifest.json", "samples.jsonl"]  # shards folded in and removed
    assert s.outputs["samples.jsonl"].rows == 24 and s.metrics["shards"] == 3
    assert [p.stage for p in s.parents] == ["base", "prompts"]

    lab, _ = label.label(store, s, VerifierLabel(), src.model_dump(), round=1)
    assert files(store, lab) == ["labels.jsonl", "manifest.json"] and lab.outputs["labels.jsonl"].rows == 24

    # a random 2-layer model answers nothing right: a hand-made accepted set stands in for the filter
    fkey = "f" * 64
    d = store.prepare("filter", fkey)
    write_jsonl(d / "train_set.jsonl", [SFTRow(prompt_id=f"p{i}", prompt=f"What is {i} + 1?",
                                               completion=f"{i + 1}", reward=1.0) for i in range(8)])
    fm = store.finish(stage="filter", round=1, key=fkey, code_version="test", config={}, parents=[lab],
                      outputs={"train_set.jsonl": 8})
    tm, _ = train.train(store, base, fm, RFTTrainConfig(epochs=1, batch_size=4, checkpoint_steps=1), seed=1,
                        round=1, isolate=False)
    got = files(store, tm)
    assert "model/model.safetensors" in got and "adapter/adapter_model.safetensors" in got
    assert "train_log.jsonl" in got and not any(f.startswith("checkpoints/") for f in got)
    assert set(got) - {"manifest.json"} == set(tm.outputs)

    ev, _ = evaluate.evaluate(store, tm, pm, EvaluateConfig(max_tokens=5), HF, src.model_dump(), seed=0, round=1,
                              isolate=False)
    assert files(store, ev) == ["eval.jsonl", "manifest.json"] and ev.metrics["eval_prompts"] == 4.0
    assert 0.0 <= ev.metrics["accuracy"] <= 1.0


def test_empty_accepted_set_stops_before_training(tiny_model, tmp_path):
    store = ArtifactStore(tmp_path)
    src = AdditionSource(a_max=4, b_max=3, eval_size=4)
    pm, _ = prepare.prompts(store, src.model_dump(), seed=0, source_digest=None)
    base, _ = prepare.base_model(store, "tiny", tiny_model)
    s, _ = sample.sample(store, base, pm, SampleConfig(n=2, max_tokens=4), HF, seed=1, round=1, isolate=False)
    lab, _ = label.label(store, s, VerifierLabel(), src.model_dump(), round=1)
    from data.errors import EmptyStageError

    with pytest.raises(EmptyStageError, match="filter.min_rows"):
        filt.filter_rows(store, lab, RFTFilter(min_rows=1), seed=0, round=1)
