"""A stage's units of work, and the executor that runs them.

A fan-out stage (sample, the judge and MCTS labels, evaluate) cuts its input into units
of `size` items. A `UnitWork` says how to open the engine a unit needs (a sampler over
the stage's policy) and what one unit computes with it; the executor runs the units that
are missing from the stage's shard folder and writes each one there the moment it is
done (data/shards.py: the cost file, then the shard, both atomic). A resumed stage
therefore runs only the missing units, whichever attempt or engine computed the others.

Each unit is seeded by (stage seed, unit index) alone, so a unit's result does not
depend on which engine ran it, in which order, or how many engines there were.

Executors (`executor:` in the pipeline config; not part of any stage key) run the units:
locally in the stage's process, on a pool of engine holders, or on Ray
(data/procs/executors.py, in the engine room: each holder is a process).

    done = run_units(SampleWork(...), stage_dir / "shards")
    rows = [Completion.model_validate_json(x) for x in done.shards.lines()]
"""

from __future__ import annotations

import importlib.util
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ratchet.data.shards import Shards, count, unit_seed  # noqa: F401 - a unit's seed, for the works

Item = TypeVar("Item")
log = logging.getLogger("ratchet")


class Executor(BaseModel):
    """Where a stage's units run: what every executor kind shares. Outputs do not depend on it, so it
    is not part of any key. The kinds (`executor.kind`) form a family (data/kinds.py): local and ray."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    engines: int = Field(default=1, ge=1, description="engine holders; above 1 each is a process with its own "
                         "engine, taking units as they free up (e.g. one per GPU, or one per few CPU cores)")
    threads_per_engine: int | None = Field(default=None, ge=1, description="CPU threads of each holder, and on "
                                           "Ray the CPUs it reserves (default: local, this machine's cores / "
                                           "engines; ray, 1)")
    restarts: int = Field(default=2, ge=0, description="holders started again for units a dead holder left")
    warm_workers: bool = Field(default=True, description="start each stage's worker process from a fork server "
                               "that imported torch, transformers, TRL and PEFT once for the run, instead of a "
                               "fresh interpreter per stage (data/procs/forkserver.py)")
    warm_engine: bool = Field(default=True, description="local, engines=1: one engine process for the whole run, "
                              "lent to every stage that samples, its weights swapped in place between stages "
                              "instead of a new engine per stage; on a GPU it sleeps while training runs "
                              "(models/warm.py). Off: each stage opens and closes its own engine")
    warm_engine_shapes: int = Field(default=2, ge=1, description="local, with warm_engine, on a CPU: engines of "
                                    "different sampler settings the warm engine holds at once where memory allows "
                                    "(a round that samples in bf16 and evaluates in float32 needs two); 1 closes "
                                    "one to open the other, twice a round. On a GPU it holds one")
    gpus_per_engine: float = Field(default=0.0, ge=0, description="GPUs of each holder. ray: what it reserves "
                                   "(the sampler's tensor_parallel_size on a GPU cluster); local: that many of this "
                                   "machine's visible GPUs, its own (CUDA_VISIBLE_DEVICES), or with 0 the visible "
                                   "GPUs split evenly, at least one each")

    @abstractmethod
    def open(self, engine: str | None = None):
        """The executor (data/procs/executors.py) that runs a stage's units; `engine`: the run's warm
        engine, lent to the units where they run in the stage's own process."""

    def lends_warm_engine(self) -> bool:
        """Whether a run with this executor keeps one engine for all its stages (models/warm.py): its
        units run in the stage's own process on this machine, one engine, and `warm_engine` is on."""
        return False

    def device_problems(self, visible: list[str]) -> list[str]:
        """What this machine's visible GPUs (`visible`, not empty) cannot give its engine holders."""
        return []


RAY_ONLY = ("address", "accelerator_type")


class LocalExecutorConfig(Executor):
    """Units on this machine: in the stage's own process (one engine), or on a pool of engine
    holders, each a process with its own engine (engines above 1)."""

    kind: Literal["local"] = Field(default="local", description="local: engine holders on this machine; "
                                   "ray: engine holders placed on a Ray cluster's nodes")

    @model_validator(mode="before")
    @classmethod
    def _no_ray_settings(cls, data: Any) -> Any:
        ray_only = [f for f in RAY_ONLY if isinstance(data, dict) and data.get(f) is not None]
        if ray_only:
            verb = "applies" if len(ray_only) == 1 else "apply"
            raise ValueError(f"{', '.join('executor.' + f for f in ray_only)} only {verb} to executor.kind=ray "
                             f"(kind is 'local'); set executor.kind=ray or remove them")
        return data

    @model_validator(mode="after")
    def _whole_gpus(self) -> "LocalExecutorConfig":
        if self.gpus_per_engine != int(self.gpus_per_engine):
            raise ValueError(f"executor.gpus_per_engine={self.gpus_per_engine:g}: on this machine (kind local) each "
                             "holder gets whole GPUs of its own; give a whole number (fractions share a GPU on "
                             "executor.kind=ray)")
        return self

    def open(self, engine: str | None = None):
        from ratchet.data.procs.executors import LocalExecutor as InProcess, PoolExecutor
        from ratchet.models.dtype import visible_gpus

        return InProcess(self.threads_per_engine, engine) if self.engines == 1 else PoolExecutor(self, visible_gpus())

    def lends_warm_engine(self) -> bool:
        return self.warm_engine and self.engines == 1

    def device_problems(self, visible: list[str]) -> list[str]:
        """Each holder's own GPUs (data/procs/executors.holder_devices), where there are several holders."""
        from ratchet.data.errors import ConfigError
        from ratchet.data.procs.executors import holder_devices

        if self.engines == 1:
            return []
        try:
            holder_devices(self, visible)
        except ConfigError as e:
            return list(e.problems)
        return []


class RayExecutorConfig(Executor):
    """Units on a Ray cluster: one engine holder per `gpus_per_engine` GPUs (or CPUs), placed on its
    nodes."""

    kind: Literal["ray"] = "ray"
    address: str | None = Field(default=None, description="the cluster to join, as `ray start --head` "
                                "prints it (host:port, or 'auto'); unset: a Ray instance on this machine for "
                                "the stage")
    accelerator_type: str | None = Field(default=None, description="place holders only on nodes with this "
                                         "accelerator (Ray's names, e.g. H100, A100-80G)")

    @model_validator(mode="after")
    def _ray_is_here(self) -> "RayExecutorConfig":
        if importlib.util.find_spec("ray") is None:
            raise ValueError("executor.kind=ray needs Ray on this machine and every node: "
                             "pip install 'ratchet[ray]' (or executor.kind=local)")
        return self

    def open(self, engine: str | None = None):
        from ratchet.data.procs.executors import RayExecutor as OnRay

        return OnRay(self)


# The registration of every executor kind (data/kinds.py): one member each.
ExecutorConfig = Annotated[LocalExecutorConfig | RayExecutorConfig, Field(discriminator="kind")]


class UnitWork(ABC, Generic[Item]):
    """What one fan-out stage computes per unit. Subclasses are small and picklable: they
    hold the stage's items and settings, never an open engine."""

    stage: str  # the stage's name, for progress and failpoints ("<stage>:shard")
    rate: ClassVar[tuple[str, str, str] | None] = None  # (count, seconds, unit): its rate on the console
    items: list[Item]
    size: int  # items per unit
    seed: int

    @property
    def n(self) -> int:
        return count(len(self.items), self.size)

    def unit(self, i: int) -> list[Item]:
        return self.items[i * self.size : (i + 1) * self.size]

    @abstractmethod
    def open(self, lent: Any = None) -> Any:
        """The engine every unit of this stage runs on (for example a sampler); `lent`
        (data/procs/executors.Lent): the run's warm engine, where the units may use it."""

    def close(self, engine: Any) -> None:
        engine.close()

    def threads(self, n: int | None) -> int:
        """Set the CPU threads this process's engine computes with (None: leave them); returns how
        many it had. The executors (data/procs/) ask the work, so the engine room imports no torch."""
        import torch

        before = torch.get_num_threads()
        if n is not None:
            torch.set_num_threads(n)
        return before

    @abstractmethod
    def run(self, engine: Any, items: list[Item], seed: int) -> tuple[list[BaseModel | dict], dict[str, float]]:
        """One unit: its output rows and what it cost (summed over units into stage metrics)."""


@dataclass(frozen=True)
class UnitsDone:
    shards: Shards
    reused: int  # units found finished on disk
    load_s: float  # seconds spent opening engines (0 when every unit was reused)

    @property
    def cost(self) -> dict[str, float]:
        return self.shards.cost()

    @property
    def placement(self) -> list[dict[str, Any]]:
        """Which holder (host, process, and on Ray the node) computed each unit, in unit order:
        kept in the stage's manifest, since the shards themselves are scratch."""
        return self.shards.holders()

    @property
    def holders(self) -> float:
        """How many engine holders computed the stage's units (this attempt's and earlier ones')."""
        return float(len({(h.get("host"), h.get("pid")) for h in self.shards.holders() if h}))


def run_units(work: UnitWork, folder: Path, executor: ExecutorConfig | None = None,
              engine: str | None = None) -> UnitsDone:
    """Run every unit of `work` not yet in `folder`; engines are opened only if one is missing.
    `engine`: the run's warm engine, where the stage's worker was lent it (StageRequest.engine)."""

    shards = Shards(folder, work.n)
    missing = shards.missing()
    load_s = (executor or LocalExecutorConfig()).open(engine).run(work, shards, missing) if missing else 0.0
    return UnitsDone(shards=shards, reused=work.n - len(missing), load_s=load_s)
