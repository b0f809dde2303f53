"""A stage's units of work, and the executor that runs them.

A fan-out stage (sample, the judge and MCTS labels, evaluate) cuts its input into units
of `size` items. A `UnitWork` says how to open the engine a unit needs (a sampler over
the stage's policy) and what one unit computes with it; the executor runs the units that
are missing from the stage's shard folder and writes each one there the moment it is
done (data/shards.py: the cost file, then the shard, both atomic). A resumed stage
therefore runs only the missing units, whichever attempt or engine computed the others.

Each unit is seeded by (stage seed, unit index) alone, so a unit's result does not
depend on which engine ran it, in which order, or how many engines there were.

Executors (`executor:` in the pipeline config; not part of any stage key):
- `local`, engines=1 (the default): the missing units one after another on one engine
  in the stage's process.
- `local`, engines=N: N engine holders, each a process of its own with its own engine
  (and `threads_per_engine` CPU threads), take units from one queue as they free up,
  starting together once every engine is open. A
  holder that dies loses only the unit it held: the executor starts another holder for
  whatever is still missing, up to `restarts` times.

    done = run_units(SampleWork(...), stage_dir / "shards")
    rows = [Completion.model_validate_json(x) for x in done.shards.lines()]
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import failpoints
from ratchet.data.digest import sha256_json
from ratchet.data.shards import Shards, count

Item = TypeVar("Item")
log = logging.getLogger("ratchet")


class ExecutorConfig(BaseModel):
    """Where a stage's units run. Outputs do not depend on it, so it is not part of any key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["local"] = Field(default="local", description="local: engine holders on this machine")
    engines: int = Field(default=1, ge=1, description="engine holders; above 1 each is a process with its own "
                         "engine, taking units as they free up (e.g. one per GPU, or one per few CPU cores)")
    threads_per_engine: int | None = Field(default=None, ge=1, description="CPU threads of each holder "
                                           "(default: this machine's cores / engines)")
    restarts: int = Field(default=2, ge=0, description="holders started again for units a dead holder left")


def holder_id() -> dict[str, Any]:
    """Which engine holder computed a unit: the machine and the process."""
    import socket

    return {"host": socket.gethostname(), "pid": os.getpid()}


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

    @property
    def holders(self) -> float:
        """How many engine holders computed the stage's units (this attempt's and earlier ones')."""
        return float(len({(h.get("host"), h.get("pid")) for h in self.shards.holders() if h}))


def _run_one(work: UnitWork, engine: Any, shards: Shards, i: int) -> None:
    """Compute unit i, write it with its holder, then pass the stage's shard failpoint."""
    rows, cost = work.run(engine, work.unit(i), unit_seed(work.seed, i))
    shards.write(i, rows, cost, holder_id())
    failpoints.hit(f"{work.stage}:shard")


class LocalExecutor:
    """Runs a stage's missing units one after another on one engine in this process."""

    def run(self, work: UnitWork, shards: Shards, missing: list[int]) -> float:
        from tqdm import tqdm

        t = time.time()
        engine = work.open()
        load_s = time.time() - t
        try:
            for i in tqdm(missing, desc=work.stage, unit="unit"):
                _run_one(work, engine, shards, i)
        finally:
            work.close(engine)
        return load_s


START_WAIT_S = 120.0


def _holder(work: UnitWork, folder: str, n: int, todo, events, threads: int, start) -> None:
    """An engine holder's process: open the engine, wait for the other holders to open theirs
    (at most START_WAIT_S), then run units from `todo` until it is empty."""
    import queue
    import threading

    import torch

    torch.set_num_threads(threads)
    shards = Shards(Path(folder), n)
    t = time.time()
    engine = work.open()
    events.put(("loaded", os.getpid(), time.time() - t))
    try:
        start.wait(timeout=START_WAIT_S)  # engines load at different speeds; units are shared from a common start
    except threading.BrokenBarrierError:
        pass  # a holder died or is slow to load: go on without it
    try:
        while True:
            try:
                i = todo.get(timeout=0.2)
            except queue.Empty:
                return
            _run_one(work, engine, shards, i)
    finally:
        work.close(engine)


class PoolExecutor:
    """`engines` holder processes share one queue of units (see the module docstring)."""

    def __init__(self, cfg: ExecutorConfig):
        self.cfg = cfg

    def run(self, work: UnitWork, shards: Shards, missing: list[int]) -> float:
        import multiprocessing as mp

        from tqdm import tqdm

        from ratchet.data.errors import StageFailedError

        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited engine, lock or thread pool
        threads = self.cfg.threads_per_engine or max(1, (os.cpu_count() or 1) // self.cfg.engines)
        load_s, restarts, bar = 0.0, 0, tqdm(total=len(missing), desc=work.stage, unit="unit")
        while missing:
            todo, events = ctx.Queue(), ctx.Queue()
            for i in missing:
                todo.put(i)
            k = min(self.cfg.engines, len(missing))
            start = ctx.Barrier(k)
            procs = [ctx.Process(target=_holder, args=(work, str(shards.dir), shards.n, todo, events, threads, start),
                                 daemon=True) for _ in range(k)]
            for p in procs:
                p.start()
            # Progress is read from the shard folder, not from messages: a holder killed mid-write
            # can leave a pipe with half a message, which must not stall the stage.
            while any(p.is_alive() for p in procs):
                time.sleep(0.25)
                bar.n = bar.total - len(shards.missing())
                bar.refresh()
            for p in procs:
                p.join()
            for _ in procs:  # each holder that opened its engine said how long that took
                try:
                    kind, _, value = events.get(timeout=0.05)
                except Exception:  # empty, or a message cut short by a dead holder
                    break
                load_s = max(load_s, value)
            dead = [p.exitcode for p in procs if p.exitcode != 0]
            missing = shards.missing()
            if missing and (not dead or restarts >= self.cfg.restarts):
                raise StageFailedError(
                    f"{work.stage}: {len(missing)} unit(s) unfinished after {restarts} restart(s) of its engine "
                    f"holders (exit codes {dead or 'all 0'}); the finished units are kept in {shards.dir}, "
                    "re-run the same command to resume")
            if missing:
                restarts += 1
                log.warning("%s: %d engine holder(s) died (exit codes %s); %d unit(s) left, starting holders again",
                            work.stage, len(dead), dead, len(missing))
        bar.close()
        return load_s


def executor_for(cfg: ExecutorConfig | None):
    if cfg is None or cfg.engines == 1:
        return LocalExecutor()
    return PoolExecutor(cfg)


def run_units(work: UnitWork, folder: Path, executor: ExecutorConfig | None = None) -> UnitsDone:
    """Run every unit of `work` not yet in `folder`; engines are opened only if one is missing."""
    shards = Shards(folder, work.n)
    missing = shards.missing()
    load_s = executor_for(executor).run(work, shards, missing) if missing else 0.0
    return UnitsDone(shards=shards, reused=work.n - len(missing), load_s=load_s)
