"""Sampling in units: shards, per-unit seeds, cost beside each shard, resume of missing units only."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchet.data.records import Completion, Prompt, read_jsonl
from ratchet.models.sampler import Generation, SamplerConfig, SamplingParams
from ratchet.tasks.sample import SampleWork
from ratchet.tasks.runner.units import run_units, unit_seed

PROMPTS = [Prompt(id=f"p{i}", prompt=f"What is {i} + 1?", answer=str(i + 1)) for i in range(5)]


class RecordingSampler:
    """Records which prompts and seeds each call got (the text is irrelevant here)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, seed):
        self.calls.append((tuple(prompts), seed))
        return [[Generation("x", 3, "stop") for _ in range(params.n)] for _ in prompts]

    def close(self):
        pass


@dataclass
class Given(SampleWork):
    """SampleWork on an engine the test holds."""

    engine: object = None

    def open(self, lent=None):
        return self.engine

    def close(self, engine):
        pass


def work(engine, params, seed=7) -> Given:
    return Given(model=Path("unused"), sampler=SamplerConfig(backend="hf"), seed=seed, items=PROMPTS, size=2,
                 params=params, engine=engine)


def test_shards_are_written_seeded_per_shard_with_their_cost(tmp_path):
    s = RecordingSampler()
    done = run_units(work(s, SamplingParams(n=2)), tmp_path / "sh")
    shards = done.shards
    assert done.reused == 0 and shards.n == 3
    assert sorted(p.name for p in (tmp_path / "sh").iterdir()) == [
        f"{i:05d}.{ext}" for i in range(3) for ext in ("cost.json", "holder.json", "jsonl")]
    assert shards.holders() == [{"host": __import__("socket").gethostname(), "pid": os.getpid()}] * 3
    assert [c[1] for c in s.calls] == [unit_seed(7, 0), unit_seed(7, 1), unit_seed(7, 2)]
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
    full = run_units(work(sampler, params), tmp_path / "a").shards
    texts = [r.text for r in read_jsonl(full.path(1), Completion)]
    assert len(set(texts)) > 1  # real samples, not one repeated string

    killed = run_units(work(sampler, params), tmp_path / "b").shards
    killed.path(1).unlink()  # as if the process died while writing shard 1
    (tmp_path / "b" / "00001.cost.json").unlink()
    calls = []
    real = sampler.generate
    sampler.generate = lambda prompts, *a, **k: calls.append(prompts) or real(prompts, *a, **k)
    assert run_units(work(sampler, params), tmp_path / "b").reused == 2
    assert calls == [[p.prompt for p in PROMPTS[2:4]]]  # only the missing shard
    for i in range(3):
        assert full.path(i).read_bytes() == killed.path(i).read_bytes(), i
