"""What a run tells the person watching it: stage events in the orchestrator, progress from workers.

Two channels, both small and safe to ignore:

- Stage events. `run_stage` (tasks/runner/stage.py) and the flow emit an `Event` when a stage
  starts, is reused, finishes or fails, and when a round is decided. Listeners (the
  console, flows/console.py) subscribe in the orchestrator's process. A listener that
  raises is logged and dropped from nothing else: a display bug never fails a run.
- Progress. A stage that runs in a worker process (units of a fan-out stage, trainer
  steps) rewrites `<stage dir>/progress.json` as it goes: what is done of how many, and
  counters (tokens, loss). The console polls the running stage's file. Writes are atomic
  renames, and at most a few per second.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("ratchet")
PROGRESS = "progress.json"
STAGE_LOG = "stage.log"


@dataclass(frozen=True)
class Figure:
    """A figure of a kind's own in the run's report: `bars` (metric key, name) per round, and an
    optional `line` (metric key, name, axis label), a fraction drawn as a percentage on a second axis."""

    title: str
    file: str
    ylabel: str
    bars: tuple[str, str]
    line: tuple[str, str, str] | None = None


@dataclass(frozen=True)
class Shows:
    """The metrics a kind emits that the report draws, keys within its stage's metrics: `rows`
    (key, what they are) counts the training rows it built; `agreement` (key, name) are fractions
    in [0, 1] drawn beside the label's agreement with the verifier; `throughput` is its tokens/s;
    `figures` are its own. The report asks the registered kinds; it names no metric of one."""

    rows: tuple[str, str] | None = None
    agreement: tuple[tuple[str, str], ...] = ()
    throughput: str | None = None
    figures: tuple[Figure, ...] = ()


@dataclass(frozen=True)
class Event:
    """kind: start | reused | done | failed (a stage), note (a check's finding, data["text"]),
    round (a round decided), report (the run's report written). `summary`: a finished stage's
    key result in a few words, as its job (and so its kind) words it (`summary_of`)."""

    kind: str
    stage: str = ""
    round: int = 0
    dir: Path | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    summary: str = ""


def count(x: float) -> str:
    """A count for a person: 1,200."""
    return f"{int(round(x)):,}"


def summary_of(job: Any, metrics: dict[str, float]) -> str:
    """A finished stage's key result: its job's `summary(metrics)` (each job asks its kind), or ""
    for a job that says nothing. A summary that fails is logged and left out: a display bug
    never fails a run."""
    fn = getattr(job, "summary", None)
    if fn is None:
        return ""
    try:
        return " · ".join(fn(metrics))
    except Exception:
        log.exception("the summary of %s failed", type(job).__name__)
        return ""


_listeners: list[Callable[[Event], None]] = []
_lock = threading.Lock()


def subscribe(fn: Callable[[Event], None]) -> Callable[[], None]:
    """Call `fn` on every event in this process; returns the function that unsubscribes it."""
    with _lock:
        _listeners.append(fn)

    def unsubscribe() -> None:
        with _lock:
            if fn in _listeners:
                _listeners.remove(fn)

    return unsubscribe


def emit(event: Event) -> None:
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn(event)
        except Exception:  # the display is never a reason for a run to fail
            log.exception("event listener %r failed on %s", fn, event.kind)


class Progress:
    """Writes a stage's progress file: `done` of `total` `unit`s plus counters, since `started`;
    `rate` (count counter, seconds counter, unit): which counters give the stage's rate, as the
    stage's work declares it (tasks/runner/units.py UnitWork.rate)."""

    def __init__(self, stage_dir: Path, total: int, unit: str, done: int = 0,
                 counters: dict[str, float] | None = None, every_s: float = 0.5,
                 rate: tuple[str, str, str] | None = None):
        self.path, self.total, self.unit, self.every_s = Path(stage_dir) / PROGRESS, total, unit, every_s
        self.rate = rate
        self.started, self.base, self.base_counters, self._last = time.time(), done, dict(counters or {}), 0.0
        self.update(done, self.base_counters, force=True)

    def update(self, done: int, counters: dict[str, float] | None = None, force: bool = False) -> None:
        """`counters` are totals so far (reused work included); the console takes rates from
        what this attempt added since it started."""
        now = time.time()
        if not force and now - self._last < self.every_s and done < self.total:
            return
        self._last = now
        body = {"done": done, "total": self.total, "unit": self.unit, "started": self.started, "at": now,
                "done_at_start": self.base, "counters": counters or {}, "counters_at_start": self.base_counters,
                "rate": self.rate}
        tmp = self.path.with_name(f"{PROGRESS}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(body))
            tmp.replace(self.path)
        except OSError:  # the stage dir went away (a finished stage's cleanup): nothing to report to
            pass


def read_progress(stage_dir: Path | None) -> dict[str, Any] | None:
    if stage_dir is None:
        return None
    try:
        return json.loads((Path(stage_dir) / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
