"""Starting a process: the one place the package does it.

- `start(entry, *args)`: a child running one of Ratchet's entries (entry.py) in a fresh
  interpreter, optionally with a channel to it (channel.py), in a session of its own (so its
  whole process group can be ended), dying with this process (lifetime.py).
- `launch(launcher, entry, *args)`: the same entry under a launcher that starts the processes
  itself (torchrun: one training process per GPU).
- `run_program(argv)` / `start_program(argv)`: a program that is not Ratchet's code (git, a
  Prefect server, a sandboxed program): no entry, since no key holds its code.

tests/test_engine_room.py scans the package: nothing outside this folder starts a process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ratchet.data.procs.channel import FD, Channel
from ratchet.data.procs.entry import Entry, EntryError, resolve, takes_channel
from ratchet.data.procs.lifetime import child_dies_with_parent, watch_parent

# `python -c` puts the current directory first on sys.path; it is dropped before anything is
# imported, so a `data.py` or a second checkout in the directory the user runs from can never
# stand in for the installed code.
BOOT = "import sys; sys.path.pop(0); from ratchet.data.procs.spawn import boot; sys.exit(boot())"
WATCH = "RATCHET_WATCH_PARENT"  # set: the child ends itself when its parent dies (a watchdog thread)


def command(entry: Entry, *args: Any) -> list[str]:
    """The command line that runs `entry(*args)` in a fresh interpreter; args travel as JSON."""
    if not isinstance(entry, Entry):
        raise EntryError(f"{entry!r} is not a declared entry; a child process runs only a function decorated with "
                         "@entry (ratchet/data/procs/entry.py)")
    return [sys.executable, "-c", BOOT, entry.name, json.dumps(list(args))]


def boot() -> int:
    """A child's main: find the entry it was started for (refusing anything else), then run it."""
    name, args = sys.argv[1], json.loads(sys.argv[2])
    if os.environ.pop(WATCH, ""):
        watch_parent()
    e = resolve(name)
    if takes_channel(e):
        from ratchet.data.procs.channel import to_parent

        code = e.main(to_parent(), *args)
    else:
        code = e.main(*args)
    leave_process_group()
    return code if isinstance(code, int) else 0


def leave_process_group() -> None:
    """A child that worked in a torch process group (one of torchrun's training processes) waits
    for the others there, then leaves it before it exits. A process that exited with its group
    open while another still worked (the main one merging and saving the model) aborted now and
    then at its exit ("terminate called without an active exception"), and torchrun failed the
    whole training with it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class Child:
    """A started child: as much of `subprocess.Popen` as callers use, its channel (or None), and
    `close`, which ends it with everything it started."""

    def __init__(self, proc: subprocess.Popen, channel: Channel | None, session: bool):
        self.proc, self.channel, self.session = proc, channel, session

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()

    def exit_code(self, wait_s: float = 5.0) -> int | None:
        """The exit code of a child that closed its end (it may take a moment to be reaped)."""
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """End the child (with its process group, when it has one of its own) and its channel."""
        try:
            if self.session:
                os.killpg(self.proc.pid, signal.SIGKILL)
            elif self.proc.poll() is None:
                self.proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        if self.channel is not None:
            self.channel.close()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


def start(entry: Entry, *args: Any, channel: bool = False, session: bool = False, lifetime: str = "parent",
          env: dict[str, str] | None = None, popen: Callable[..., subprocess.Popen] | None = None,
          **kwargs) -> Child:
    """Start `entry(*args)` in a fresh interpreter.

    channel: the child's standard input carries calls and a descriptor of its own its answers
    (channel.py); the parent's end is `Child.channel`. session: a session (and process group) of
    its own, so `close` ends whatever it started too. lifetime: "parent" (the kernel ends it when
    the thread that started it ends: start long-lived services from a thread that lives as long as
    the run, lifetime.Spawner), "watch" (a thread in the child ends it when its parent process
    dies: for children started from threads that may end first), or "none". `popen`: how the
    process is made (a Spawner's). Other keyword arguments go to `subprocess.Popen`."""
    env = dict(os.environ if env is None else env)
    pass_fds = tuple(kwargs.pop("pass_fds", ()))
    read_fd = write_fd = None
    if channel:
        read_fd, write_fd = os.pipe()
        env[FD] = str(write_fd)
        pass_fds += (write_fd,)
        kwargs["stdin"] = subprocess.PIPE
    if lifetime == "watch":
        env[WATCH] = "1"
    elif lifetime == "parent":
        kwargs["preexec_fn"] = child_dies_with_parent()
    try:
        proc = (popen or subprocess.Popen)(command(entry, *args), env=env, pass_fds=pass_fds,
                                           start_new_session=session, **kwargs)
    finally:
        if write_fd is not None:
            os.close(write_fd)
    ch = None
    if channel:
        ch = Channel(read_fd, proc.stdin.fileno(), owns_write=False)
    return Child(proc, ch, session)


def launch(launcher: list[str], entry: Entry, *args: Any, **kwargs) -> subprocess.CompletedProcess:
    """Run `entry(*args)` under a launcher that starts the entry's processes itself, and wait for
    it: `launcher` is its command up to the program it runs (torchrun's `... --no-python`)."""
    return subprocess.run([*launcher, *command(entry, *args)], **kwargs)


def run_program(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a program that is not Ratchet's code and wait for it (`subprocess.run`)."""
    return subprocess.run(argv, **kwargs)


def start_program(argv: list[str], **kwargs) -> subprocess.Popen:
    """Start a program that is not Ratchet's code (`subprocess.Popen`)."""
    return subprocess.Popen(argv, **kwargs)


def program_starter(dies_with: int | None = None, session: bool = False) -> Callable[..., subprocess.Popen]:
    """A `subprocess.Popen` for a library that starts a program itself (Prefect's temporary
    server): the program asks for signal `dies_with` when this process dies, and with `session`
    runs in a session of its own."""
    import functools

    kw: dict[str, Any] = {"start_new_session": session}
    if dies_with is not None:
        kw["preexec_fn"] = child_dies_with_parent(dies_with)
    return functools.partial(subprocess.Popen, **kw)


def run_logged(target: Entry, args: list, log_path, extra_env: dict[str, str] | None = None,
               follow: bool = False) -> int:
    """Run `target(*args)` in a fresh interpreter and wait for it, its output (every library's)
    appended to the file at `log_path`; with `follow` also copied to this process's standard
    output as it comes. Returns its exit code."""
    import threading

    env = {**os.environ, **(extra_env or {})}
    with open(log_path, "ab") as f:
        if not follow:
            return start(target, *args, env=env, stdout=f, stderr=subprocess.STDOUT).wait()
        child = start(target, *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        def copy() -> None:
            for line in iter(child.proc.stdout.readline, b""):
                f.write(line)
                f.flush()
                sys.stdout.buffer.write(line)
                sys.stdout.flush()

        t = threading.Thread(target=copy, daemon=True)
        t.start()
        code = child.wait()
        t.join(timeout=5)  # a holder the child started may keep the pipe open; never wait on it
        return code


class following:
    """While in the block, with `on`, copy what is appended to the file at `path` to this process's
    standard output (a child forked elsewhere writes there)."""

    def __init__(self, path, on: bool):
        self.path, self.on = path, on

    def __enter__(self):
        import threading
        from pathlib import Path

        if not self.on:
            return self
        self.stop = threading.Event()
        path = Path(self.path)
        path.touch()

        def copy(start: int) -> None:
            import time

            with open(path, "rb") as f:
                f.seek(start)
                while True:
                    line = f.readline()
                    if line:
                        sys.stdout.buffer.write(line)
                        sys.stdout.flush()
                    elif self.stop.is_set():
                        return
                    else:
                        time.sleep(0.1)

        self.thread = threading.Thread(target=copy, args=(path.stat().st_size,), daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.on:
            self.stop.set()
            self.thread.join(timeout=5)
        return False
