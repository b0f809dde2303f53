"""A stage's units of work, and the executor that runs them.

A fan-out stage (sample, the judge and MCTS labels, evaluate) cuts its input into units
of `size` items. A `UnitWork` says how to open the engine a unit needs (a sampler over
the stage's policy) and what one unit computes with it; the executor runs the units that
are missing from the stage's shard folder and writes each one there the moment it is
done (data/shards.py: the cost file, then the shard, both atomic). A resumed stage
therefore runs only the missing units, whichever attempt or engine computed the others.

Each unit is seeded by (stage seed, unit index) alone, so a unit's result does not
depend on which engine ran it, in which order, or how many engines there were.

    done = run_units(SampleWork(...), stage_dir / "shards")
    rows = [Completion.model_validate_json(x) for x in done.shards.lines()]
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from ratchet.data import failpoints
from ratchet.data.digest import sha256_json
from ratchet.data.shards import Shards, count

Item = TypeVar("Item")


def unit_seed(seed: int, unit: int) -> int:
    """A unit's seed: a function of the stage seed and the unit's index, nothing else."""
    return int(sha256_json([seed, unit])[:8], 16)


class UnitWork(ABC, Generic[Item]):
    """What one fan-out stage computes per unit. Subclasses are small and picklable: they
    hold the stage's items and settings, never an open engine."""

    stage: str  # the stage's name, for progress and failpoints ("<stage>:shard")
    items: list[Item]
    size: int  # items per unit
    seed: int

    @property
    def n(self) -> int:
        return count(len(self.items), self.size)

    def unit(self, i: int) -> list[Item]:
        return self.items[i * self.size : (i + 1) * self.size]

    @abstractmethod
    def open(self) -> Any:
        """The engine every unit of this stage runs on (for example a sampler)."""

    def close(self, engine: Any) -> None:
        engine.close()

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


class LocalExecutor:
    """Runs a stage's missing units one after another on one engine in this process."""

    kind = "local"

    def run(self, work: UnitWork, shards: Shards, missing: list[int]) -> float:
        from tqdm import tqdm

        t = time.time()
        engine = work.open()
        load_s = time.time() - t
        try:
            for i in tqdm(missing, desc=work.stage, unit="unit"):
                rows, cost = work.run(engine, work.unit(i), unit_seed(work.seed, i))
                shards.write(i, rows, cost)
                failpoints.hit(f"{work.stage}:shard")
        finally:
            work.close(engine)
        return load_s


def run_units(work: UnitWork, folder: Path, executor: LocalExecutor | None = None) -> UnitsDone:
    """Run every unit of `work` not yet in `folder`; the engine is opened only if one is missing."""
    shards = Shards(folder, work.n)
    missing = shards.missing()
    load_s = (executor or LocalExecutor()).run(work, shards, missing) if missing else 0.0
    return UnitsDone(shards=shards, reused=work.n - len(missing), load_s=load_s)
