"""The unit loop and its executors: one engine in process, or a pool of engine holders.

A unit's output depends on the stage seed and its index only, so 1 or N holders write the
same bytes; a holder that dies loses only its unit, which another holder computes."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchet.data.errors import StageFailedError
from ratchet.data.records import Prompt
from ratchet.models.sampler import SamplerConfig, SamplingParams
from ratchet.tasks.sample import SampleWork
from ratchet.tasks.runner.units import LocalExecutorConfig, UnitWork, run_units, unit_seed

PROMPTS = [Prompt(id=f"p{i}", prompt=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(6)]


class Counter:
    """A stand-in engine whose output is a function of the unit's items and seed."""

    def close(self):
        pass


@dataclass
class Arithmetic(UnitWork):
    """Units that can die on purpose: a holder that reaches unit `die_at` exits, the first
    time only if `marker` is given (the marker file records that it happened)."""

    stage = "sample"
    items: list
    size: int
    seed: int
    die_at: int = -1
    marker: str = ""

    def open(self, lent=None):
        return Counter()

    def run(self, engine, chunk, seed):
        if self.items.index(chunk[0]) // self.size == self.die_at:
            if not self.marker:
                os._exit(137)  # as the kernel's OOM killer would
            if not os.path.exists(self.marker):
                Path(self.marker).write_text(str(os.getpid()))
                os._exit(137)
        return [{"x": x, "seed": seed} for x in chunk], {"n": float(len(chunk))}


def _bytes(folder: Path, n: int) -> list[bytes]:
    return [(folder / f"{i:05d}.jsonl").read_bytes() for i in range(n)]


def test_a_dead_holder_loses_only_its_unit(tmp_path):
    work = Arithmetic(items=list(range(20)), size=2, seed=3, marker=str(tmp_path / "died"), die_at=4)
    done = run_units(work, tmp_path / "pool", LocalExecutorConfig(engines=2, threads_per_engine=1))
    assert (tmp_path / "died").exists()  # a holder did die mid-stage
    assert done.shards.missing() == [] and done.cost["n"] == 20  # every unit once, none lost, none twice
    rows = [json.loads(x) for x in done.shards.lines()]
    assert [r["x"] for r in rows] == list(range(20))
    assert [r["seed"] for r in rows[::2]] == [unit_seed(3, i) for i in range(10)]
    assert done.holders >= 2

    run_units(Arithmetic(items=list(range(20)), size=2, seed=3), tmp_path / "one")
    assert _bytes(tmp_path / "pool", 10) == _bytes(tmp_path / "one", 10)


def test_holders_that_keep_dying_fail_the_stage_and_keep_finished_units(tmp_path):
    work = Arithmetic(items=list(range(8)), size=2, seed=0, die_at=1)
    with pytest.raises(StageFailedError, match=r"1 unit\(s\) unfinished after 1 restart.*re-run the same command"):
        run_units(work, tmp_path / "s", LocalExecutorConfig(engines=2, threads_per_engine=1, restarts=1))
    left = sorted(p.name for p in (tmp_path / "s").glob("*.jsonl"))
    assert left == ["00000.jsonl", "00002.jsonl", "00003.jsonl"]  # the others' work is kept for a resume


@pytest.mark.integration
def test_one_or_two_holders_sample_the_same_bytes(tiny_model, tmp_path):
    """Real seeded sampling (tiny model, T=0.8): in process on one engine, or on two engine
    holders taking units as they free up, every unit comes out byte-identical.

    Guards `executor.engines`: the number of holders changes no byte. Slow: real sampling on one and on two
    holders."""
    import torch

    params = SamplingParams(n=2, temperature=0.8, top_k=50, max_tokens=8)

    def work():
        return SampleWork(model=tiny_model, sampler=SamplerConfig(backend="hf", dtype="float32"), seed=5,
                          items=PROMPTS, size=1, params=params)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the holders below run one thread each: same kernels, same sums
    try:
        one = run_units(work(), tmp_path / "one")
    finally:
        torch.set_num_threads(threads)
    two = run_units(work(), tmp_path / "two", LocalExecutorConfig(engines=2, threads_per_engine=1))
    assert one.holders == 1 and two.holders == 2
    assert _bytes(tmp_path / "one", 6) == _bytes(tmp_path / "two", 6)
    texts = {r for x in _bytes(tmp_path / "one", 6) for r in x.decode().splitlines()}
    assert len(texts) == 12  # real, distinct samples


@dataclass
class Devices(Arithmetic):
    """Each holder writes the CUDA devices it was started with when it opens its engine."""

    seen: str = ""

    def open(self, lent=None):
        Path(self.seen, str(os.getpid())).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
        return Counter()


def test_each_local_holder_is_started_on_gpus_of_its_own(tmp_path, monkeypatch):
    """On a machine with GPUs every holder gets its own (this machine has none: the visible devices
    are given through CUDA_VISIBLE_DEVICES, as a scheduler gives them); on one without, none is set."""
    from ratchet.data.errors import ConfigError
    from ratchet.data.procs.executors import holder_devices
    from ratchet.models.dtype import visible_gpus

    def started(engines, visible, **kw):
        seen = tmp_path / f"seen-{engines}-{visible}-{sorted(kw.items())}"
        seen.mkdir()
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        run_units(Devices(items=list(range(2 * engines)), size=2, seed=0, seen=str(seen)), seen / "shards",
                  LocalExecutorConfig(engines=engines, threads_per_engine=1, **kw))
        return sorted(p.read_text() for p in seen.iterdir() if p.name.isdigit())  # one per holder (its pid)

    assert started(2, "0,1,2,3") == ["0,1", "2,3"]  # the holders' own environments: an even share each
    share = lambda visible, **kw: holder_devices(LocalExecutorConfig(**kw), visible)  # noqa: E731
    assert share(["4", "5", "6", "7"], engines=2, gpus_per_engine=1) == ["4", "5"]
    assert share(["0", "1"], engines=3) == ["0", "1", "0"]  # more holders than GPUs: shared in turn
    assert share([], engines=2) == [None, None]  # no GPU here: nothing is set
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    with pytest.raises(ConfigError, match=r"executor.engines=3 with executor.gpus_per_engine=2 needs 6 GPUs, and "
                                          r"this machine shows 4 \(0,1,2,3\)"):
        holder_devices(LocalExecutorConfig(engines=3, gpus_per_engine=2), ["0", "1", "2", "3"])
    with pytest.raises(ValueError, match="give a whole number"):
        LocalExecutorConfig(engines=2, gpus_per_engine=0.5)
