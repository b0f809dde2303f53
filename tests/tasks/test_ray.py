"""The Ray executor on a real two-node cluster (loopback): units spread over both nodes, each
recorded with its node; a holder killed mid-stage loses nothing; a unit that raises fails the
stage with its error; an engine that cannot open is not retried; the bytes are the local
executor's."""

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchet.data.errors import StageFailedError
from ratchet.tasks.runner.units import RayExecutorConfig, run_units, unit_seed
from tests.tasks.test_units import PROMPTS, Arithmetic, _bytes

pytestmark = pytest.mark.integration


def _ray(address, **kw) -> RayExecutorConfig:
    return RayExecutorConfig(address=address, engines=2, threads_per_engine=1, **kw)


@dataclass
class Killed(Arithmetic):
    """A holder that reaches unit `die_at` is SIGKILLed (the first time: `marker` records it),
    as the kernel's OOM killer or a lost node would end it."""

    def run(self, engine, chunk, seed):
        if self.items.index(chunk[0]) // self.size == self.die_at and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return [{"x": x, "seed": seed} for x in chunk], {"n": float(len(chunk))}


@dataclass
class Raises(Arithmetic):
    def run(self, engine, chunk, seed):
        raise ValueError(f"bad unit {chunk}")


@dataclass
class WontOpen(Arithmetic):
    def open(self, lent=None):
        raise FileNotFoundError("no model at /nowhere")


def test_units_spread_over_both_nodes_and_a_killed_holder_loses_nothing(ray_cluster, tmp_path):
    work = Killed(items=list(range(20)), size=2, seed=3, marker=str(tmp_path / "died"), die_at=3)
    done = run_units(work, tmp_path / "ray", _ray(ray_cluster))
    assert (tmp_path / "died").exists()  # a holder really was killed mid-stage
    assert done.shards.missing() == [] and done.cost["n"] == 20  # every unit once: none lost, none twice
    rows = [json.loads(x) for x in done.shards.lines()]
    assert [r["x"] for r in rows] == list(range(20))
    assert [r["seed"] for r in rows[::2]] == [unit_seed(3, i) for i in range(10)]
    placement = done.placement
    assert len({p["node"] for p in placement}) == 2  # both nodes computed units
    assert all(p["node_ip"] == "127.0.0.1" for p in placement)
    assert placement[3]["pid"] != int((tmp_path / "died").read_text())  # its unit was redone by another

    run_units(Arithmetic(items=list(range(20)), size=2, seed=3), tmp_path / "local")
    assert _bytes(tmp_path / "ray", 10) == _bytes(tmp_path / "local", 10)


def test_a_resumed_stage_runs_only_missing_units(ray_cluster, tmp_path):
    first = run_units(Arithmetic(items=list(range(8)), size=2, seed=1), tmp_path / "s")
    for i in (1, 3):
        first.shards.path(i).unlink()
    done = run_units(Arithmetic(items=list(range(8)), size=2, seed=1), tmp_path / "s", _ray(ray_cluster))
    assert done.reused == 2 and done.shards.missing() == []
    assert [bool(p.get("node")) for p in done.placement] == [False, True, False, True]


def test_a_unit_that_raises_fails_the_stage_with_its_error(ray_cluster, tmp_path):
    with pytest.raises(ValueError, match="bad unit"):
        run_units(Raises(items=list(range(4)), size=2, seed=0), tmp_path / "s", _ray(ray_cluster))


def test_an_engine_that_cannot_open_is_not_retried(ray_cluster, tmp_path):
    with pytest.raises(StageFailedError, match="could not open its engine.*no model at /nowhere"):
        run_units(WontOpen(items=list(range(4)), size=2, seed=0), tmp_path / "s", _ray(ray_cluster, restarts=5))


def test_real_sampling_and_tree_search_units_match_the_local_executor(ray_cluster, tiny_model, tmp_path):
    """Seeded sampling and MCTS on the tiny model: Ray holders on two nodes (one thread each)
    write the bytes the local executor writes with one thread.

    Guards `executor.kind=ray` for the two kinds of units that generate: the cluster changes no byte. Slow:
    sampling and tree search on both executors."""
    import torch

    from ratchet.data.checkers import NumberCheck
    from ratchet.models.sampler import SamplerConfig, SamplingParams
    from ratchet.tasks.label_kinds.mcts import MctsWork
    from ratchet.tasks.label_kinds.mcts import MctsLabel
    from ratchet.tasks.sample import SampleWork

    policy = dict(model=tiny_model, sampler=SamplerConfig(backend="hf", dtype="float32"), seed=5)
    works = {
        "sample": lambda: SampleWork(items=PROMPTS, size=1, **policy,
                                     params=SamplingParams(n=2, temperature=0.8, top_k=50, max_tokens=8)),
        "mcts": lambda: MctsWork(items=PROMPTS[:4], size=1, **policy, check=NumberCheck(),
                                 cfg=MctsLabel(simulations=2, k=2, max_depth=2, step_max_tokens=3,
                                               rollout_tokens=4)),
    }
    threads = torch.get_num_threads()
    for name, work in works.items():
        torch.set_num_threads(1)
        try:
            local = run_units(work(), tmp_path / name / "local")
        finally:
            torch.set_num_threads(threads)
        ray = run_units(work(), tmp_path / name / "ray", _ray(ray_cluster))
        assert len({p["node"] for p in ray.placement}) == 2, name
        assert _bytes(tmp_path / name / "ray", local.shards.n) == _bytes(tmp_path / name / "local", local.shards.n)
