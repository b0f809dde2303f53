"""Sharded sampling with a fake sampler: shards, per-shard seeds, resume of missing shards only."""

from ratchet.models.sampler import Generation, SamplingParams
from ratchet.data.records import Completion, Prompt, read_jsonl
from ratchet.tasks.sample import generate_shards, shard_seed


class FakeSampler:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, seed):
        self.calls.append((tuple(prompts), seed))
        return [[Generation(f"{p} #{i} s{seed}", 3, "stop") for i in range(params.n)] for p in prompts]

    def close(self):
        pass


PROMPTS = [Prompt(id=f"p{i}", prompt=f"q{i}", answer=str(i)) for i in range(5)]


def test_shards_are_written_and_seeded_per_shard(tmp_path):
    s = FakeSampler()
    m = generate_shards(s, PROMPTS, SamplingParams(n=2), seed=7, shard_size=2, shard_dir=tmp_path / "sh",
                        progress=False)
    assert sorted(p.name for p in (tmp_path / "sh").iterdir()) == ["00000.jsonl", "00001.jsonl", "00002.jsonl"]
    assert [c[1] for c in s.calls] == [shard_seed(7, 0), shard_seed(7, 1), shard_seed(7, 2)]
    rows = read_jsonl(tmp_path / "sh" / "00002.jsonl", Completion)
    assert [(r.prompt_id, r.index) for r in rows] == [("p4", 0), ("p4", 1)]
    assert m["gen_tokens"] == 5 * 2 * 3 and m["shards_reused"] == 0


def test_resume_generates_only_missing_shards_with_the_same_result(tmp_path):
    full = FakeSampler()
    generate_shards(full, PROMPTS, SamplingParams(n=2), seed=7, shard_size=2, shard_dir=tmp_path / "a", progress=False)
    generate_shards(FakeSampler(), PROMPTS, SamplingParams(n=2), seed=7, shard_size=2, shard_dir=tmp_path / "b",
                    progress=False)
    (tmp_path / "b" / "00001.jsonl").unlink()  # as if the process died during shard 1
    resumed = FakeSampler()
    m = generate_shards(resumed, PROMPTS, SamplingParams(n=2), seed=7, shard_size=2, shard_dir=tmp_path / "b",
                        progress=False)
    assert [c[0] for c in resumed.calls] == [("q2", "q3")]
    assert m["shards_reused"] == 2
    for name in ("00000.jsonl", "00001.jsonl", "00002.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
