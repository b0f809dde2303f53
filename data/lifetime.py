"""A process Ratchet starts never outlives the one that started it.

Kill the orchestrator (`kill -9` of its PID alone, not its group) and each process below it
dies too: a stage worker, the engine holders of a pool, a training run under torchrun and
its training processes. Otherwise one of them would go on writing into a stage directory
that a resumed run is about to use. Linux delivers a signal to a process whose parent dies
(PR_SET_PDEATHSIG); each process asks for it first thing, or is started with it.
"""

from __future__ import annotations

import os
import signal
import sys


def _prctl():
    import ctypes

    return ctypes.CDLL("libc.so.6", use_errno=True).prctl


def die_with_parent(sig: int = signal.SIGKILL, prctl=None) -> None:
    """Ask Linux to send `sig` to this process when its parent dies; exit now if it already has.
    (It follows the parent *thread*: call it in a process started from a thread that lives as
    long as its parent does.)"""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    (prctl or _prctl())(1, int(sig))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died while the request was being made
        os._exit(1)


def child_dies_with_parent(sig: int = signal.SIGKILL):
    """A subprocess `preexec_fn`: the child asks for `sig` when this process dies. libc is
    opened here, in the parent: between fork and exec the child calls prctl alone."""
    prctl = _prctl() if sys.platform.startswith("linux") else None
    return lambda: die_with_parent(sig, prctl)
