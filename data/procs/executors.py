"""Executors: where a stage's units run (the `executor:` settings; tasks/runner/units.py says what a
unit is).

- `LocalExecutor` (local, engines=1, the default): the missing units one after another on one
  engine in the stage's process, which may be the run's warm engine (`Lent`).
- `PoolExecutor` (local, engines=N): N engine holders, each a process of its own (the entry
  `pool_holder`) with its own engine, `threads_per_engine` CPU threads, and on a GPU machine
  GPUs of its own (`gpus_per_engine` of the visible ones, or an even share). They take units as
  they free up, from a common start once every engine is open, over their channels. A holder
  that dies loses only the unit it held: the executor starts holders again for whatever is
  missing, up to `restarts` times.
- `RayExecutor` (ray): engine holders as Ray actors, placed by Ray on any node with the
  resources they declare.

Every unit is written to the stage's shard folder the moment it is done (data/shards.py), so a
resumed stage runs only the missing units, whichever attempt or holder computed the others.
"""

from __future__ import annotations

import logging
import os
import select
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet.data import events, failpoints
from ratchet.data.procs import spawn
from ratchet.data.procs.channel import Channel
from ratchet.data.procs.entry import entry
from ratchet.data.shards import Shards, unit_seed

log = logging.getLogger("ratchet")


def holder_id() -> dict[str, Any]:
    """Which engine holder computed a unit: the machine and the process, and on Ray the node."""
    import socket

    who: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ctx = ray.get_runtime_context()
        who.update(node=ctx.get_node_id(), node_ip=ray.util.get_node_ip_address())
    return who


def _progress(work, shards: Shards, missing: list[int]) -> events.Progress:
    """The stage's progress file (in the stage's directory, beside the shard folder)."""
    return events.Progress(shards.dir.parent, shards.n, "unit", shards.n - len(missing), shards.cost(), rate=work.rate)


def _advance(work, shards: Shards, progress: events.Progress, done: int) -> None:
    progress.update(done, shards.cost())
    log.info("%s: %d/%d units done", work.stage, done, shards.n)


def _run_one(work, engine: Any, shards: Shards, i: int) -> None:
    """Compute unit i and write it with its holder."""
    rows, cost = work.run(engine, work.unit(i), unit_seed(work.seed, i))
    shards.write(i, rows, cost, holder_id())



@dataclass(frozen=True)
class Lent:
    """The run's warm engine, lent to a stage's units opened in the stage's own process: its
    address, and the CPU threads it runs them with (None: all)."""

    address: str
    threads: int | None = None


class LocalExecutor:
    """Runs a stage's missing units one after another on one engine in this process (with
    `threads` CPU threads, if given, for the stage's duration); the engine may be the run's warm
    engine (`engine`: its address, where the stage's worker was lent it)."""

    def __init__(self, threads: int | None = None, engine: str | None = None):
        self.threads, self.engine = threads, engine

    def run(self, work, shards: Shards, missing: list[int]) -> float:
        before = work.threads(None)
        progress = _progress(work, shards, missing)
        t = time.time()
        engine = work.open(Lent(self.engine, self.threads) if self.engine else None)
        load_s = time.time() - t
        if self.threads:
            work.threads(self.threads)  # after open: an engine may set its own on start
        try:
            for i in missing:
                _run_one(work, engine, shards, i)
                _advance(work, shards, progress, shards.n - len(shards.missing()))
                failpoints.hit(f"{work.stage}:shard")
        finally:
            work.close(engine)
            work.threads(before)
        return load_s


START_WAIT_S = 120.0


@entry
def pool_holder(channel: Channel, work_file: str, folder: str, n: int, threads: int) -> int:
    """An engine holder of the local pool: open the stage's engine, say so, then compute the
    units it is handed (writing each to the shard folder) until its channel closes."""
    import pickle

    path, pickled = pickle.loads(Path(work_file).read_bytes())
    sys.path[:] = path  # the stage's own: the work's classes import as they did there
    work = pickle.loads(pickled)
    work.threads(threads)
    shards = Shards(Path(folder), n)
    t = time.time()
    engine = work.open(None)
    channel.send({"loaded": time.time() - t})
    try:
        while (msg := channel.recv()) != {}:
            if "unit" not in msg:
                continue
            _run_one(work, engine, shards, msg["unit"])
            failpoints.hit(f"{work.stage}:shard")  # kills the stage's process group, as in process
            channel.send({"done": msg["unit"]})
    finally:
        work.close(engine)
    return 0


class PoolExecutor:
    """`engines` holder processes (the entry `pool_holder`), each with an engine of its own, take
    a stage's missing units one at a time as they free up, from a common start once every engine
    is open (at most START_WAIT_S after the first). A holder that dies loses the unit it held;
    once the holders are done, new ones are started for whatever is missing, up to `restarts`
    times."""

    def __init__(self, cfg, visible: list[str]):
        self.cfg, self.visible = cfg, visible  # the GPUs this machine shows (none: a CPU machine)

    def run(self, work, shards: Shards, missing: list[int]) -> float:
        import pickle
        import tempfile

        from ratchet.data.errors import StageFailedError

        threads = self.cfg.threads_per_engine or max(1, (os.cpu_count() or 1) // self.cfg.engines)
        devices = holder_devices(self.cfg, self.visible)
        load_s, restarts, progress = 0.0, 0, _progress(work, shards, missing)
        with tempfile.TemporaryDirectory(prefix="ratchet-pool-") as t:
            work_file = Path(t) / "work.pkl"
            work_file.write_bytes(pickle.dumps((list(sys.path), pickle.dumps(work))))
            while missing:
                k = min(self.cfg.engines, len(missing))
                holders = [spawn.start(pool_holder, str(work_file), str(shards.dir), shards.n, threads, channel=True,
                                       env=_with(CUDA_VISIBLE_DEVICES=gpus)) for gpus in devices[:k]]
                try:
                    load_s = max(load_s, self._round(work, shards, progress, holders, list(missing)))
                finally:
                    for h in holders:
                        h.proc.stdin.close()  # no more units: each holder returns
                    dead = [h.exit_code(wait_s=30) if h.poll() is None else h.returncode for h in holders]
                    for h in holders:
                        h.close()
                dead = [c for c in dead if c != 0]
                _advance(work, shards, progress, shards.n - len(shards.missing()))
                missing = shards.missing()
                if missing and (not dead or restarts >= self.cfg.restarts):
                    raise StageFailedError(
                        f"{work.stage}: {len(missing)} unit(s) unfinished after {restarts} restart(s) of its engine "
                        f"holders (exit codes {dead or 'all 0'}); the finished units are kept in {shards.dir}, "
                        "re-run the same command to resume")
                if missing:
                    restarts += 1
                    log.warning("%s: %d engine holder(s) died (exit codes %s); %d unit(s) left, starting holders "
                                "again", work.stage, len(dead), dead, len(missing))
        return load_s

    def _round(self, work, shards: Shards, progress, holders: list, todo: list[int]) -> float:
        """Hand `todo` out to `holders` until each is done or dead; the longest engine load."""
        live = {h.channel.read_fd: h for h in holders}
        ready: list = []
        held: dict[int, int] = {}  # a holder's descriptor -> the unit it computes
        load_s, first, shared, done = 0.0, None, False, progress.base
        while live and (todo or held or not shared):
            if not shared and ready and (len(ready) == len(live) or time.time() - first > START_WAIT_S):
                shared = True
            while shared and ready and todo:
                h = ready.pop(0)
                held[h.channel.read_fd] = todo.pop(0)
                h.channel.send({"unit": held[h.channel.read_fd]})
            if shared and not todo and not held:
                break
            # Progress is read from the shard folder, not from messages: a holder killed mid-write
            # can leave half a message, which must not stall the stage.
            r, _, _ = select.select(list(live), [], [], 0.25)
            for fd in r:
                h = live[fd]
                msg = h.channel.recv(time.monotonic())
                if msg == {}:  # it died: the unit it held is left for the next holders
                    del live[fd]
                    held.pop(fd, None)
                    if h in ready:
                        ready.remove(h)
                elif msg is not None and "loaded" in msg:
                    load_s, first = max(load_s, float(msg["loaded"])), first or time.time()
                    ready.append(h)
                elif msg is not None and "done" in msg:
                    held.pop(fd, None)
                    ready.append(h)
            if (now := shards.n - len(shards.missing())) != done:
                done = now
                _advance(work, shards, progress, done)
        return load_s


def holder_devices(cfg, visible: list[str]) -> list[str | None]:
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


def _with(**values: str | None) -> dict[str, str]:
    """This process's environment with `values` set (None: left as it is)."""
    return {**os.environ, **{k: v for k, v in values.items() if v is not None}}


class _RayHolder:
    """An engine holder as a Ray actor: opens the stage's engine once, then computes the units
    it is handed, writing each to the stage's shard folder (storage every node mounts)."""

    def __init__(self, work, folder: str, n: int, threads: int):
        work.threads(threads)
        self.work, self.shards, self.threads = work, Shards(Path(folder), n), threads
        t = time.time()
        self.engine = work.open(None)
        work.threads(threads)
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

    def __init__(self, cfg):
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

    def run(self, work, shards: Shards, missing: list[int]) -> float:
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
