"""A run's helper processes, held by the run that started them rather than by the process.

A run keeps up to two services while it lasts: its fork server (forkserver.py), which its stage
workers and calls are forked from, and its warm engine (models/warm.py), which its sampling
stages borrow. Both decide how a stage runs (forked or cold; on the run's engine or its own), so
they are the run's state, not the process's: they live in a context variable that the run's
`with` blocks set (`forkserver.for_run`, `warm.for_run`) and reset when they end. A Prefect task
runs in a copy of the context it was submitted from (Prefect's thread-pool runner copies it for
each task), so the run's stages see the run's services, and nothing else does:

- two runs in one process (two threads calling flows/api.py) each have their own fork server
  and engine: one never samples on the other's engine (loaded for the other's backend), nor loses
  it when the other ends;
- a run that ends leaves no helper behind for whatever runs next in the process (a test, a
  second `run` call);
- a thread started without the run's context (a plain `threading.Thread`) sees no services and
  starts what it needs cold: slower, never wrong.

What holds a helper's address where a context cannot go is an argument: the warm engine keeps
the server it is forked from (`WarmEngine(server=...)`), and a stage's worker gets the engine's
address in its environment (`warm.take_address`).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ratchet.data.procs.forkserver import ForkServer


@dataclass(frozen=True)
class Services:
    """The services of the run this context belongs to (None: the run has none of that kind)."""

    server: ForkServer | None = None
    engine: Any = None  # a models.warm.WarmEngine (models/ is above this layer)


_RUN: ContextVar[Services] = ContextVar("ratchet.run_services", default=Services())


def of_run() -> Services:
    """The services of the run this code runs in (all None outside a run's `with` blocks)."""
    return _RUN.get()


@contextlib.contextmanager
def held(**services: Any):
    """`services` (server=, engine=) are this context's run's until the block ends."""
    token = _RUN.set(replace(_RUN.get(), **services))
    try:
        yield
    finally:
        _RUN.reset(token)
