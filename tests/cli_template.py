"""`ratchet run` and `ratchet resume` for the tests, forked from a process that made their imports once.

Each `ratchet run` a test starts as a command imports MLflow with its SQL stores and Ratchet's
command-line modules before its first stage: about 2.7 s of CPU of the 5 s its own process spends
in a tiny run (a busy 2-core machine), paid again by each of the suite's twenty-odd such runs (most
others run in the test's own process, flows/pipeline.py `execute`, which imports them once). A
template (`serve`, one per test process, tests/conftest.py) imports them once and, per request,
forks a waiter that forks the command: the command's process is then what `python -m
ratchet.flows.cli ARGS` would be at its first line, with the request's arguments, environment,
directory and output pipes, in a session of its own (as `start_new_session=True` makes it), SIGINT
at its default. The waiter passes back
its pid, then its exit code as `subprocess` reports it (a signal's: its negative). The template
imports with OpenBLAS's and Arrow's threads off, as the fork server does (data/procs/forkserver.py:
a process with threads must not fork), so the command's NumPy computes on one thread.

What the template does not import, the command imports itself as it would anyway: Prefect
(which reads its settings once, on import, and whose temporary server a run starts only where
Prefect is not imported: flows/launch.py) and the flow's module, and no model library (a run's
checks go to its fork server only where this process has not imported transformers:
flows/inputs.py). `ratchet(...)` in tests/flows/tiny.py sends a run here when the template is
there and the run arms no failpoints (the kill tests find and kill a run's processes as a user
would: a fresh interpreter); a template that is not there or does not answer: a fresh one.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

ENV = "RATCHET_TEST_CLI_TEMPLATE"  # the template's socket, in the test process's environment
PRELOAD = ("mlflow", "mlflow.tracking", "mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store",
           "mlflow.store.model_registry.sqlalchemy_store", "ratchet.flows.cli", "ratchet.flows.launch",
           "ratchet.flows.inputs", "ratchet.flows.plan", "ratchet.flows.runs", "ratchet.flows.tracking",
           "ratchet.flows.console")
COMMANDS = {"run", "resume"}  # the commands that pay those imports (the ones that read a run import none)
NOT_IMPORTED = ("prefect", "torch", "transformers")  # what the command must import itself (see above)


def serve(path: str) -> None:
    """The template: PRELOAD imported, then a waiter forked per request on the socket at `path`."""
    from ratchet.data.procs import forkserver
    from ratchet.data.procs.lifetime import die_with_parent

    die_with_parent()
    with forkserver.imports_frozen():  # as a run freezes its own imports (flows/launch.py)
        for name in PRELOAD:
            importlib.import_module(name)
    if loaded := [n for n in NOT_IMPORTED if n in sys.modules]:
        raise SystemExit(f"cli template: its preload imported {loaded}; a command forked from it would not be "
                         "what a fresh `ratchet` is")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    with forkserver.listening(path) as listener:
        while True:
            conn, _ = listener.accept()
            if (got := forkserver.received(conn, 2, "cli template")) is not None:
                req, fds = got
                if (why := forkserver._unsafe()) is not None:  # a thread would be lost in the fork
                    print(f"cli template: a request refused ({why})", file=sys.stderr, flush=True)
                else:
                    sys.stderr.flush()
                    if os.fork() == 0:
                        listener.close()
                        _wait_for_command(conn, req, fds)
                for fd in fds:
                    os.close(fd)
            conn.close()


def _wait_for_command(conn: socket.socket, req: dict, fds: list[int]) -> None:
    """In the waiter: fork the command, send its pid, wait for it, send its exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _command(req, fds)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
    os._exit(0)


def _command(req: dict, fds: list[int]) -> None:
    """In the command's process: `ratchet ARGV` as a fresh `python -m ratchet.flows.cli` would run it."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as a fresh interpreter sets it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    from ratchet.flows import cli

    sys.argv = [cli.__file__, *req["argv"]]
    try:
        cli.entry()  # ends the process (os._exit) once its exit handlers ran
    finally:
        os._exit(1)


def usable(args, env: dict[str, str]) -> bool:
    """A run or resume arming no failpoints, where the template listens."""
    return bool(args) and args[0] in COMMANDS and os.path.exists(os.environ.get(ENV, "")) \
        and not env.get("RATCHET_FAILPOINTS")


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess | None:
    """`ratchet ARGV` forked from the template, as `subprocess.run(..., capture_output=True, text=True)`
    returns it; None where the template does not answer (the caller starts a fresh interpreter)."""
    cmd = [sys.executable, "-m", "ratchet.flows.cli", *argv]  # what it stands for
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(10)
        s.connect(os.environ[ENV])
        socket.send_fds(s, [json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()], [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        out_w = err_w = -1
        pid = json.loads(s.recv(1 << 16))["pid"]
    except (OSError, ValueError, KeyError):
        s.close()
        for fd in (out_r, out_w, err_r, err_w):
            if fd >= 0:
                os.close(fd)
        return None
    read: dict[int, bytes] = {}

    def drain(fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            read[fd] = f.read()

    readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in (out_r, err_r)]
    for t in readers:
        t.start()
    with s:
        s.settimeout(timeout)
        try:
            code = json.loads(s.recv(1 << 16))["exit"]
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # unreaped until the waiter hears of it: still the command's pid
            raise subprocess.TimeoutExpired(cmd, timeout) from None
    for t in readers:
        t.join()
    text = lambda b: b.decode().replace("\r\n", "\n").replace("\r", "\n")  # as subprocess's text mode reads it
    return subprocess.CompletedProcess(cmd, code, text(read[out_r]), text(read[err_r]))


@contextlib.contextmanager
def templated(log_path: Path):
    """The template while the block runs, named in this process's environment (ENV). Runs started
    before it listens (its imports take a few seconds) start fresh."""
    import shutil
    import tempfile

    from ratchet.data.procs.forkserver import QUIET_THREADS
    from ratchet.data.procs.lifetime import child_dies_with_parent

    where = tempfile.mkdtemp(prefix="ratchet-cli-template-")
    path = os.path.join(where, "socket")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", f"from tests.cli_template import serve; serve({path!r})"],
                                cwd=Path(__file__).parents[1], env={**os.environ, **QUIET_THREADS},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=child_dies_with_parent())
    os.environ[ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(ENV, None)
        proc.kill()
        proc.wait()
        shutil.rmtree(where, ignore_errors=True)
