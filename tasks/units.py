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
  (and `threads_per_engine` CPU threads, and on a GPU machine GPUs of its own:
  `gpus_per_engine` of the visible ones, or an even share), take units from one queue as
  they free up, starting together once every engine is open. A
  holder that dies loses only the unit it held: the executor starts another holder for
  whatever is still missing, up to `restarts` times.

    done = run_units(SampleWork(...), stage_dir / "shards")
    rows = [Completion.model_validate_json(x) for x in done.shards.lines()]
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ratchet.data import events, failpoints
from ratchet.data.digest import sha256_json
from ratchet.data.shards import Shards, count

Item = TypeVar("Item")
log = logging.getLogger("ratchet")


class ExecutorConfig(BaseModel):
    """Where a stage's units run. Outputs do not depend on it, so it is not part of any key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["local", "ray"] = Field(default="local", description="local: engine holders on this machine; "
                                          "ray: engine holders placed on a Ray cluster's nodes")
    engines: int = Field(default=1, ge=1, description="engine holders; above 1 each is a process with its own "
                         "engine, taking units as they free up (e.g. one per GPU, or one per few CPU cores)")
    threads_per_engine: int | None = Field(default=None, ge=1, description="CPU threads of each holder, and on "
                                           "Ray the CPUs it reserves (default: local, this machine's cores / "
                                           "engines; ray, 1)")
    restarts: int = Field(default=2, ge=0, description="holders started again for units a dead holder left")
    warm_workers: bool = Field(default=True, description="start each stage's worker process from a fork server "
                               "that imported torch, transformers, TRL and PEFT once for the run, instead of a "
                               "fresh interpreter per stage (tasks/forkserver.py)")
    warm_engine: bool = Field(default=True, description="local, engines=1: one engine process for the whole run, "
                              "lent to every stage that samples, its weights swapped in place between stages "
                              "instead of a new engine per stage; on a GPU it sleeps while training runs "
                              "(models/warm.py). Off: each stage opens and closes its own engine")
    address: str | None = Field(default=None, description="ray: the cluster to join, as `ray start --head` "
                                "prints it (host:port, or 'auto'); unset: a Ray instance on this machine for "
                                "the stage")
    gpus_per_engine: float = Field(default=0.0, ge=0, description="GPUs of each holder. ray: what it reserves "
                                   "(the sampler's tensor_parallel_size on a GPU cluster); local: that many of this "
                                   "machine's visible GPUs, its own (CUDA_VISIBLE_DEVICES), or with 0 the visible "
                                   "GPUs split evenly, at least one each")
    accelerator_type: str | None = Field(default=None, description="ray: place holders only on nodes with this "
                                         "accelerator (Ray's names, e.g. H100, A100-80G)")

    @model_validator(mode="after")
    def _ray_settings_need_ray(self) -> "ExecutorConfig":
        ray_only = [f for f in ("address", "accelerator_type") if getattr(self, f) is not None]
        if self.kind == "local" and self.gpus_per_engine != int(self.gpus_per_engine):
            raise ValueError(f"executor.gpus_per_engine={self.gpus_per_engine:g}: on this machine (kind local) each "
                             "holder gets whole GPUs of its own; give a whole number (fractions share a GPU on "
                             "executor.kind=ray)")
        if self.kind != "ray" and ray_only:
            verb = "applies" if len(ray_only) == 1 else "apply"
            raise ValueError(f"{', '.join('executor.' + f for f in ray_only)} only {verb} to executor.kind=ray "
                             f"(kind is {self.kind!r}); set executor.kind=ray or remove them")
        if self.kind == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("executor.kind=ray needs Ray on this machine and every node: "
                             "pip install 'ratchet[ray]' (or executor.kind=local)")
        return self


def holder_id() -> dict[str, Any]:
    """Which engine holder computed a unit: the machine and the process, and on Ray the node."""
    import socket

    who: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ctx = ray.get_runtime_context()
        who.update(node=ctx.get_node_id(), node_ip=ray.util.get_node_ip_address())
    return who


def unit_seed(seed: int, unit: int) -> int:
    """A unit's seed: a function of the stage seed and the unit's index, nothing else."""
    return int(sha256_json([seed, unit])[:8], 16)


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
    def placement(self) -> list[dict[str, Any]]:
        """Which holder (host, process, and on Ray the node) computed each unit, in unit order:
        kept in the stage's manifest, since the shards themselves are scratch."""
        return self.shards.holders()

    @property
    def holders(self) -> float:
        """How many engine holders computed the stage's units (this attempt's and earlier ones')."""
        return float(len({(h.get("host"), h.get("pid")) for h in self.shards.holders() if h}))


def _progress(work: UnitWork, shards: Shards, missing: list[int]) -> events.Progress:
    """The stage's progress file (in the stage's directory, beside the shard folder)."""
    return events.Progress(shards.dir.parent, shards.n, "unit", shards.n - len(missing), shards.cost(), rate=work.rate)


def _advance(work: UnitWork, shards: Shards, progress: events.Progress, done: int) -> None:
    progress.update(done, shards.cost())
    log.info("%s: %d/%d units done", work.stage, done, shards.n)


def _run_one(work: UnitWork, engine: Any, shards: Shards, i: int) -> None:
    """Compute unit i and write it with its holder."""
    rows, cost = work.run(engine, work.unit(i), unit_seed(work.seed, i))
    shards.write(i, rows, cost, holder_id())


class LocalExecutor:
    """Runs a stage's missing units one after another on one engine in this process
    (with `threads` CPU threads, if given, for the stage's duration)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads

    def run(self, work: UnitWork, shards: Shards, missing: list[int]) -> float:
        import torch

        from ratchet.models import warm

        before = torch.get_num_threads()
        progress = _progress(work, shards, missing)
        t = time.time()
        with warm.lend(self.threads):  # a sampler may be the run's warm engine (models/warm.py)
            engine = work.open()
        load_s = time.time() - t
        if self.threads:
            torch.set_num_threads(self.threads)  # after open: an engine may set its own on start
        try:
            for i in missing:
                _run_one(work, engine, shards, i)
                _advance(work, shards, progress, shards.n - len(shards.missing()))
                failpoints.hit(f"{work.stage}:shard")
        finally:
            work.close(engine)
            torch.set_num_threads(before)
        return load_s


START_WAIT_S = 120.0


def _holder(work: UnitWork, folder: str, n: int, todo, events, threads: int, start) -> None:
    """An engine holder's process: open the engine, wait for the other holders to open theirs
    (at most START_WAIT_S), then run units from `todo` until it is empty."""
    import queue
    import threading

    import torch

    from ratchet.data.lifetime import die_with_parent

    die_with_parent()  # its worker killed (and so its orchestrator), a holder stops writing units at once
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
            failpoints.hit(f"{work.stage}:shard")  # kills the stage's process group, as in process
    finally:
        work.close(engine)


class PoolExecutor:
    """`engines` holder processes share one queue of units (see the module docstring)."""

    def __init__(self, cfg: ExecutorConfig):
        self.cfg = cfg

    def run(self, work: UnitWork, shards: Shards, missing: list[int]) -> float:
        import multiprocessing as mp

        from ratchet.data.errors import StageFailedError

        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited engine, lock or thread pool
        threads = self.cfg.threads_per_engine or max(1, (os.cpu_count() or 1) // self.cfg.engines)
        devices = holder_devices(self.cfg, visible_gpus())
        load_s, restarts, progress = 0.0, 0, _progress(work, shards, missing)
        done = progress.base
        while missing:
            todo, events = ctx.Queue(), ctx.Queue()
            for i in missing:
                todo.put(i)
            k = min(self.cfg.engines, len(missing))
            start = ctx.Barrier(k)
            procs = [ctx.Process(target=_holder, args=(work, str(shards.dir), shards.n, todo, events, threads, start),
                                 daemon=True) for _ in range(k)]
            for p, gpus in zip(procs, devices):
                with _environ(CUDA_VISIBLE_DEVICES=gpus):  # a spawned interpreter starts with this environment
                    p.start()
            # Progress is read from the shard folder, not from messages: a holder killed mid-write
            # can leave a pipe with half a message, which must not stall the stage.
            while any(p.is_alive() for p in procs):
                time.sleep(0.25)
                if (now := shards.n - len(shards.missing())) != done:
                    done = now
                    _advance(work, shards, progress, done)
            for p in procs:
                p.join()
            if (now := shards.n - len(shards.missing())) != done:
                done = now
                _advance(work, shards, progress, done)
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
        return load_s


def visible_gpus() -> list[str]:
    """The CUDA devices this process may use: CUDA_VISIBLE_DEVICES where set, else every one torch
    counts (none on a machine without CUDA)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no torch, or no driver: no GPU
        return []


def holder_devices(cfg: ExecutorConfig, visible: list[str]) -> list[str | None]:
    """Each local holder's CUDA_VISIBLE_DEVICES, from the `visible` devices: `gpus_per_engine` of
    them each, distinct (0: the visible ones split evenly, at least one each, shared in turn when
    there are more holders than GPUs); None for every holder on a machine without GPUs."""
    from ratchet.data.errors import ConfigError

    if not visible:
        return [None] * cfg.engines
    each = int(cfg.gpus_per_engine) or max(1, len(visible) // cfg.engines)
    if cfg.gpus_per_engine and each * cfg.engines > len(visible):
        raise ConfigError([f"executor.engines={cfg.engines} with executor.gpus_per_engine={each} needs "
                           f"{each * cfg.engines} GPUs, and this machine shows {len(visible)} "
                           f"({','.join(visible)}); lower executor.engines or gpus_per_engine"])
    return [",".join(visible[(k * each + j) % len(visible)] for j in range(each)) for k in range(cfg.engines)]


@contextlib.contextmanager
def _environ(**values: str | None):
    """Set (or, for None, leave alone) environment variables for the duration of the block."""
    before = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is not None:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _RayHolder:
    """An engine holder as a Ray actor: opens the stage's engine once, then computes the units
    it is handed, writing each to the stage's shard folder (storage every node mounts)."""

    def __init__(self, work: UnitWork, folder: str, n: int, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.work, self.shards, self.threads = work, Shards(Path(folder), n), threads
        t = time.time()
        self.engine = work.open()
        torch.set_num_threads(threads)
        self.load_s = time.time() - t

    def ready(self) -> float:
        return self.load_s

    def unit(self, i: int) -> int:
        _run_one(self.work, self.engine, self.shards, i)
        return i


NO_HOLDER_WARN_S = 60.0


class RayExecutor:
    """Engine holders as Ray actors, placed by Ray on any node with the resources they declare.

    The driver (the stage's process) hands each holder one unit at a time, the next as soon as
    it returns, so fast holders take more units. A holder writes its unit to the shard folder
    itself; the driver only learns its index. A holder that dies (its process or node lost)
    gives its unit back to the queue, unless its write had landed, and a new holder is started
    for the rest, up to `restarts` times. A unit that raises fails the stage with that error:
    a bug or bad input is not retried. Holders never outlive the stage; with no `address`,
    neither does the Ray instance started for it."""

    def __init__(self, cfg: ExecutorConfig):
        self.cfg = cfg

    def _connect(self) -> bool:
        """Join the cluster (or start one here); True if this call did, so the stage leaves it after."""
        import ray

        if ray.is_initialized():
            return False
        ray.init(address=self.cfg.address, include_dashboard=False, configure_logging=False,
                 log_to_driver=True) if self.cfg.address else \
            ray.init(include_dashboard=False, configure_logging=False, log_to_driver=True)
        return True

    def run(self, work: UnitWork, shards: Shards, missing: list[int]) -> float:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from ratchet.data.errors import StageFailedError

        joined = self._connect()
        threads = self.cfg.threads_per_engine or 1
        opts: dict[str, Any] = dict(num_cpus=threads, num_gpus=self.cfg.gpus_per_engine, max_restarts=0,
                                    max_task_retries=0)
        if self.cfg.accelerator_type:
            opts["accelerator_type"] = self.cfg.accelerator_type
        holder_cls = ray.remote(_RayHolder).options(**opts)
        todo, restarts, load_s = list(missing), 0, 0.0
        progress = _progress(work, shards, missing)
        holders: dict[Any, Any] = {}  # pending call -> (holder, unit index or None for its start)
        started: list[Any] = []

        def start_holder() -> None:
            h = holder_cls.remote(work, str(shards.dir), shards.n, threads)
            started.append(h)
            holders[h.ready.remote()] = (h, None)

        def give(h) -> None:
            if todo:
                i = todo.pop(0)
                holders[h.unit.remote(i)] = (h, i)

        idle: list[Any] = []  # holders with their engine open, waiting for the common start
        try:
            for _ in range(min(self.cfg.engines, len(missing))):
                start_holder()
            # Units are shared from a common start, as in the local pool: the first engine to load
            # would otherwise take every unit of a small stage. At most START_WAIT_S for the slow.
            starting, first_ready, shared = len(holders), 0.0, False
            waited, warned = time.time(), False
            while todo or any(i is not None for _, i in holders.values()):
                if not shared and idle and (starting == 0 or time.time() - first_ready > START_WAIT_S):
                    shared = True
                    for h in idle:
                        give(h)
                    idle.clear()
                if not holders:
                    raise StageFailedError(
                        f"{work.stage}: {len(todo)} unit(s) unfinished after {restarts} restart(s) of its engine "
                        f"holders on Ray; the finished units are kept in {shards.dir}, re-run the same command "
                        "to resume")
                ready, _ = ray.wait(list(holders), num_returns=1, timeout=5.0)
                if not ready:
                    if not warned and load_s == 0 and time.time() - waited > NO_HOLDER_WARN_S:
                        warned = True
                        log.warning("%s: no engine holder has started after %.0f s; each asks for %s, the "
                                    "cluster has %s free", work.stage, NO_HOLDER_WARN_S, opts,
                                    ray.available_resources())
                    continue
                h, i = holders.pop(ready[0])
                if i is None and not shared:
                    starting -= 1
                try:
                    value = ray.get(ready[0])
                except RayTaskError as e:  # the work itself failed: a real error, not a lost holder
                    raise e.as_instanceof_cause() from None
                except RayActorError as e:  # the holder's process or node is gone
                    if e.actor_init_failed:  # its engine would not open: the same on any node
                        log.error("%s: %s", work.stage, e.error_msg)
                        last = e.error_msg.strip().splitlines()[-1]
                        raise StageFailedError(f"{work.stage}: an engine holder could not open its engine: {last} "
                                               "(its traceback is in the stage's log above)") from None
                    if i is not None and not shards.has(i):
                        todo.insert(0, i)
                    if todo and restarts < self.cfg.restarts:
                        restarts += 1
                        log.warning("%s: an engine holder was lost (%s); %d unit(s) left, starting another",
                                    work.stage, type(e).__name__, len(todo))
                        start_holder()
                    continue
                if i is None:
                    load_s = max(load_s, value)
                    if not shared:
                        first_ready = first_ready or time.time()
                        idle.append(h)
                        continue
                else:
                    _advance(work, shards, progress, shards.n - len(shards.missing()))
                    failpoints.hit(f"{work.stage}:shard")
                give(h)
        finally:
            for h in started:
                ray.kill(h)  # holders idle, still starting, or never placed: none outlives the stage
            if joined:
                ray.shutdown()
        return load_s


def executor_for(cfg: ExecutorConfig | None):
    if cfg is not None and cfg.kind == "ray":
        return RayExecutor(cfg)
    if cfg is None or cfg.engines == 1:
        return LocalExecutor(cfg.threads_per_engine if cfg else None)
    return PoolExecutor(cfg)


def run_units(work: UnitWork, folder: Path, executor: ExecutorConfig | None = None) -> UnitsDone:
    """Run every unit of `work` not yet in `folder`; engines are opened only if one is missing."""
    shards = Shards(folder, work.n)
    missing = shards.missing()
    load_s = executor_for(executor).run(work, shards, missing) if missing else 0.0
    return UnitsDone(shards=shards, reused=work.n - len(missing), load_s=load_s)
