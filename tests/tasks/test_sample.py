"""Sharded sampling: shards, per-shard seeds, cost beside each shard, resume of missing shards only."""

import pytest

from ratchet.data.records import Completion, Prompt, read_jsonl
from ratchet.data.shards import Shards
from ratchet.models.sampler import Generation, SamplingParams
from ratchet.tasks.sample import generate_shards, shard_seed

PROMPTS = [Prompt(id=f"p{i}", prompt=f"What is {i} + 1?", answer=str(i + 1)) for i in range(5)]


class RecordingSampler:
    """Records which prompts and seeds each call got (the text is irrelevant here)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, seed):
        self.calls.append((tuple(prompts), seed))
        return [[Generation("x", 3, "stop") for _ in range(params.n)] for _ in prompts]


def test_shards_are_written_seeded_per_shard_with_their_cost(tmp_path):
    s = RecordingSampler()
    shards = Shards(tmp_path / "sh", 3)
    generate_shards(s, PROMPTS, SamplingParams(n=2), seed=7, shards=shards, shard_size=2, progress=False)
    assert sorted(p.name for p in (tmp_path / "sh").iterdir()) == [
        "00000.cost.json", "00000.jsonl", "00001.cost.json", "00001.jsonl", "00002.cost.json", "00002.jsonl"]
    assert [c[1] for c in s.calls] == [shard_seed(7, 0), shard_seed(7, 1), shard_seed(7, 2)]
    rows = read_jsonl(tmp_path / "sh" / "00002.jsonl", Completion)
    assert [(r.prompt_id, r.index) for r in rows] == [("p4", 0), ("p4", 1)]
    assert shards.cost()["gen_tokens"] == 5 * 2 * 3 and shards.missing() == []


@pytest.mark.integration
def test_resume_on_real_generations_writes_the_same_bytes(tiny_model, tmp_path):
    """A real (tiny, random) model sampling at temperature 0.8: a stage that lost shard 1
    regenerates only that shard, and it comes out byte-identical to the uninterrupted one."""
    from ratchet.models.sampler import SamplerConfig, open_sampler

    sampler = open_sampler(tiny_model, SamplerConfig(backend="hf", dtype="float32"), seed=0)
    params = SamplingParams(n=2, temperature=0.8, top_k=50, max_tokens=8)
    full = Shards(tmp_path / "a", 3)
    generate_shards(sampler, PROMPTS, params, seed=7, shards=full, shard_size=2, progress=False)
    texts = [r.text for r in read_jsonl(full.path(1), Completion)]
    assert len(set(texts)) > 1  # real samples, not one repeated string

    killed = Shards(tmp_path / "b", 3)
    generate_shards(sampler, PROMPTS, params, seed=7, shards=killed, shard_size=2, progress=False)
    killed.path(1).unlink()  # as if the process died while writing shard 1
    (tmp_path / "b" / "00001.cost.json").unlink()
    calls = []
    real = sampler.generate
    sampler.generate = lambda prompts, *a, **k: calls.append(prompts) or real(prompts, *a, **k)
    generate_shards(sampler, PROMPTS, params, seed=7, shards=killed, shard_size=2, progress=False)
    assert calls == [[p.prompt for p in PROMPTS[2:4]]]  # only the missing shard
    for i in range(3):
        assert full.path(i).read_bytes() == killed.path(i).read_bytes(), i
