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
from pathlib import Path


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


def watch_parent() -> None:
    """End this process when the one that started it dies, so a killed stage never leaves a call
    running. A watchdog thread, not PR_SET_PDEATHSIG: that signal follows the *thread* that
    started the child, and the thread that started a shared host may have finished."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.2)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def end(proc, ask=None, wait_s: float = 30.0) -> None:
    """Stop a helper process the run started: `ask(proc)` (default: SIGTERM) lets it end cleanly;
    one still running `wait_s` later is killed."""
    import subprocess

    if proc is None or proc.poll() is not None:
        return
    (ask or (lambda p: p.terminate()))(proc)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Spawner:
    """Starts the run's long-lived services (the fork server, the warm engine) from one thread of
    its own, which lives until `close`. Linux ties PR_SET_PDEATHSIG to the thread that forked,
    not the process: a helper restarted from a short-lived thread (a Prefect task's) would die
    when that thread ended."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ratchet-spawner")

    def popen(self, cmd: list[str], **kwargs):
        """`subprocess.Popen(cmd, **kwargs)` from the spawner's thread (spawn.start makes the child
        die with it: `lifetime="parent"`)."""
        import subprocess

        return self._pool.submit(subprocess.Popen, cmd, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def move_log(old: Path, new: Path) -> Path:
    """Rename the log a running process appends to (its descriptor follows the file); where `new`
    exists already, the log stays at `old`. Returns where the log is."""
    if old == new or new.exists():
        return old
    try:
        old.rename(new)
    except FileNotFoundError:  # nothing written yet: the process opens `new` when it next opens its log
        pass
    return new
