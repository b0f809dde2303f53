"""Warm children: a fork server that has imported the heavy libraries once per run.

A stage worker used to be a fresh interpreter that imported torch, transformers, TRL and
PEFT before its first line of work: about 4-5 s on 2 cores, paid by every train stage (and
by every sampling stage that loaded vLLM in its own process). Here `ratchet run` starts one
process per run (the fork server, the entry `fork_server`) that imports what its creator names
(`preload`), then forks a child per request, which runs the entry the request names
(entry.py): a stage's worker, the run's warm engine, or a call (`call`). A stage's worker is a
process of its own, which exits when its stage ends, so a stage's memory is returned and a
stage's failure or kill leaves the next stage a clean process.

Requests and answers are JSON lines on the server's channel (channel.py). A child's outcome
reaches whoever waits for it as its exit code and what it wrote in files (a stage's manifest or
its error report, a call's result): the child is the server's, not the waiter's, so it holds no
channel to the waiter.

Correct across a fork:
- threads: only the forking thread survives a fork, and a lock another thread held stays
  locked in the child. The server imports with OpenBLAS's thread pool at 1 and Arrow's jemalloc
  without its background thread, which leaves it single-threaded; it checks that before every
  fork (/proc/self/task) and refuses to fork otherwise (the stage then starts cold);
- CUDA: the server never touches a GPU; it checks `torch.cuda.is_initialized()` too;
- environment and directory: the child takes the run's environment and working directory
  as they are when the stage starts, not as they were when the server started;
- lifetime: the server dies with the run (started from a thread that lives as long as the
  run: data/procs/lifetime.Spawner), each child with the server; a server that died is replaced at
  the next stage.

Measured on 2 cores (bench/round_bench.py): a stage's worker starts in about 0.1 s from the
server against 4-5 s cold for a train stage.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ratchet.data.procs import services, spawn
from ratchet.data.procs.channel import Channel
from ratchet.data.procs.entry import Entry, entry, resolve
from ratchet.data.procs.lifetime import Spawner

log = logging.getLogger("ratchet")

QUIET_THREADS = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false", "MPLBACKEND": "Agg"}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _unsafe() -> str | None:
    """Why this process must not fork now, or None."""
    if (n := _threads()) != 1:
        return f"{n} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised"
    return None


def _before_fork() -> None:
    """What a fork of the server's waits for: its output flushed (else a child writes it again),
    and every object it holds moved into the collector's permanent generation (`gc.freeze`), so a
    child's collections scan only what the child made. With a run's libraries imported the server
    holds about 600,000 objects, and one full collection of them took 0.5-0.6 s in a child
    (accelerate's `free_memory`, which transformers' Trainer calls as training starts, runs one:
    every train stage paid it), writing to each page it scanned, which the child then copied from
    the server; frozen, 11 us. What the server made and a child drops stays until the child exits."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()


@contextlib.contextmanager
def imports_frozen() -> Iterator[None]:
    """Python's collector off while the block runs (a process's imports), then what the block made
    frozen (`gc.freeze`: no later collection scans it), and the collector as it was: the pattern
    Python's `gc.freeze` documents for a process that forks. The collector runs a full collection
    each time the heap has grown by a quarter: importing a fork server's libraries (torch,
    transformers, TRL, PEFT, MLflow's flavour) ran 10 of them (1.5 s) and took 7.3 s. A collection
    at the block's end found 17,000 unreachable objects among a fork server's million and did not
    shrink the process (0.65 s, 2 cores), a run's own 6,000 among half a million (0.35 s), and
    that collection sat on the path to a run's first stage; the cycles the imports dropped stay,
    as a child keeps what its server dropped (`_before_fork`). Frozen, the imported modules are
    not scanned again by the collections of a run that lasts hours. A child forked meanwhile turns
    the collector on again (`_child`)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


def _child(req: dict, channel: Channel) -> int:
    """In the forked child: run the entry the request names, with its output in the request's log."""
    from ratchet.data.procs.lifetime import die_with_parent

    die_with_parent()  # the server killed, its children die with it
    gc.enable()  # off in a server that is still importing (imports_frozen)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    os.close(channel.write_fd)  # the server's answers are the server's alone (its requests: stdin, replaced above)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    code = resolve(req["entry"]).main(*req["args"])
    return code if isinstance(code, int) else 0


RESULT = "result.pkl"


@entry
def call_in_child(spec: str) -> int:
    """In a forked child: make the call `call` asked for; its value, or the ConfigError it raised,
    is pickled beside the request. Any other error ends the child (its traceback in the call's
    log) and the caller makes the call itself."""
    import pickle

    from ratchet.data.errors import ConfigError

    path = Path(spec)
    target, args = pickle.loads(path.read_bytes())
    try:
        out = ("value", resolve(target).main(*args))
    except ConfigError as e:
        out = ("config", (e.problems, e.source))
    tmp = path.with_name(RESULT + ".tmp")
    tmp.write_bytes(pickle.dumps(out))
    tmp.rename(path.with_name(RESULT))
    return 0


CALL_READY_S = 120.0  # how long a call waits for the server's imports before it is made here


def call(target: Entry, *args, after: tuple[str, ...] | None = None):
    """`target(*args)` in a child forked from the run's fork server, which has imported
    what the function needs, so the run's own process does not (mlflow's transformers flavor to
    save the base model for MLflow, matplotlib to draw the report: 4-5 s of round 0 and 3 s of a
    run's end on 2 cores; transformers and torch for the model's checks). The child is forked
    once the server has imported everything it preloads, or only the modules `after` names (the
    rest it imports itself if it needs them). Returns the function's value; a ConfigError it
    raises is raised here. Where there is no server, or the call cannot be made there (the server
    is not ready in CALL_READY_S, refuses to fork or dies, the arguments or the value do not
    pickle, the function fails in any other way), it is made here instead, so its outcome is a
    direct call's. For functions whose outcome depends only on their arguments and the files they
    read, which may run twice (a check, a figure, a model saved to a fresh directory)."""
    import pickle
    import tempfile

    from ratchet.data.errors import ConfigError

    if not isinstance(target, Entry):
        raise TypeError(f"{target!r} is not a declared entry (@entry): a forked child runs nothing else")
    server = current()
    if server is not None and (after is not None or server.wait_ready(CALL_READY_S)):
        with tempfile.TemporaryDirectory(prefix="ratchet-call-") as t:
            spec = Path(t) / "call.pkl"
            try:
                spec.write_bytes(pickle.dumps((target.name, args)))
            except Exception as e:  # noqa: BLE001 - an argument that does not pickle: made here
                log.info("%s: its arguments do not pickle (%s); calling it in this process", target.name, e)
            else:
                code = server.run(call_in_child, [str(spec)], Path(t) / "call.log", {}, after=after or ())
                if code == 0 and (result := Path(t) / RESULT).exists():
                    kind, value = pickle.loads(result.read_bytes())
                    if kind == "config":
                        raise ConfigError(*value)
                    return value
                said = Path(t) / "call.log"
                log.warning("%s did not finish in a child of the fork server (exit code %s); calling it in this "
                            "process. Its output there:\n%s", target.name, code,
                            said.read_text(errors="replace")[-2000:] if said.exists() else "")
    return target.main(*args)


def call_apart(target: Entry, *args):
    """`target(*args)` in a fresh child process, never in this one: for a caller that must not
    import what the function imports (`ratchet plan` reads a tokenizer without importing torch).
    Returns its value; a ConfigError it raises is raised here; any other failure is a RatchetError
    with the child's last output."""
    import pickle
    import tempfile

    from ratchet.data.errors import ConfigError, RatchetError
    from ratchet.data.procs import spawn

    if not isinstance(target, Entry):
        raise TypeError(f"{target!r} is not a declared entry (@entry): a child runs nothing else")
    with tempfile.TemporaryDirectory(prefix="ratchet-call-") as t:
        spec, said = Path(t) / "call.pkl", Path(t) / "call.log"
        spec.write_bytes(pickle.dumps((target.name, args)))
        code = spawn.run_logged(call_in_child, [str(spec)], said)
        if code == 0 and (result := Path(t) / RESULT).exists():
            kind, value = pickle.loads(result.read_bytes())
            if kind == "config":
                raise ConfigError(*value)
            return value
        raise RatchetError(f"{target.name} failed in its own process (exit code {code}): "
                           f"{said.read_text(errors='replace')[-2000:] if said.exists() else 'no output'}")


def _preload(name: str) -> None:
    """One of the server's preloads: a module imported, or `module:function` imported and called (a
    cache the function fills is every later child's without its cost), or `module:function:ARGS`
    called with ARGS, a JSON list (`preload_call`)."""
    import importlib
    import json

    module, _, function = name.partition(":")
    function, _, args = function.partition(":")
    loaded = importlib.import_module(module)
    if function:
        getattr(loaded, function)(*(json.loads(args) if args else ()))


def preload_call(function, *args: str) -> str:
    """The preload that calls `function` (a module's, by name) with `args` in the server."""
    import json

    return f"{function.__module__}:{function.__name__}:{json.dumps(list(args))}"


@entry
def fork_server(channel: Channel, preload: list[str]) -> int:
    """The fork server's main: read requests on its channel, fork a child for each, and answer
    with each child's pid and then its exit code. A request that names modules in `after` waits
    until they are imported (a child that will import them anyway gains nothing from an earlier
    fork); `{"signal": id, "sig": n}` signals that request's child, or drops it while it waits;
    `{"stderr": path}` sends the server's own output there."""
    from ratchet.data.procs.lifetime import die_with_parent

    die_with_parent()
    started, pending = time.time(), list(preload)
    children: dict[int, str] = {}
    deferred: list[dict] = []
    importing = contextlib.ExitStack()  # the collector off until they are imported
    if pending:
        importing.enter_context(imports_frozen())

    def fork(req: dict) -> None:
        if (why := _unsafe()) is not None:
            channel.send({"id": req["id"], "refused": why})
            return
        _before_fork()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(req, channel)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - its traceback is in the request's log
                import traceback

                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        children[pid] = req["id"]
        channel.send({"id": req["id"], "pid": pid})

    def signal_child(rid: str, sig: int) -> None:
        for req in [r for r in deferred if r["id"] == rid]:
            deferred.remove(req)
            channel.send({"id": rid, "exit": -sig})
        for pid in [p for p, r in children.items() if r == rid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    while True:
        # Imports go one module at a time between requests: a request that comes before they are
        # all done is forked at once and imports the rest itself, as a cold worker would.
        if not channel.pending():
            ready, _, _ = select.select([channel.read_fd], [], [], 0 if pending else 0.2)
            if not ready and pending:
                _preload(pending.pop(0))
                if not pending:
                    importing.close()
                    print(f"fork server: imported {len(preload)} modules in {time.time() - started:.1f} s",
                          file=sys.stderr, flush=True)
                    channel.send({"ready": _threads()})
        for req in [r for r in deferred if not set(r["after"]) & set(pending)]:
            deferred.remove(req)
            fork(req)
        while (req := channel.recv(time.monotonic())) is not None:
            if req == {}:  # the run closed its end: it is over. Nothing is left to flush or close, and the
                # interpreter's own teardown with torch and the rest loaded took up to 8 s on 2 busy
                # cores, which the run's exit waited for (0.2 s without it)
                sys.stderr.flush()
                os._exit(0)
            if "signal" in req:
                signal_child(req["signal"], req["sig"])
            elif "stderr" in req:
                _output_to(req["stderr"])
            elif "id" not in req:
                continue
            elif set(req.get("after", ())) & set(pending):
                deferred.append(req)
            else:
                fork(req)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            channel.send({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})


TEMPLATE = "RATCHET_FORK_TEMPLATE"  # a template's socket: a run started with it set forks its server from it


@contextlib.contextmanager
def listening(path: str):
    """A Unix socket (SOCK_SEQPACKET) listening at `path` for this user alone (mode 600: what connects
    has its requests forked), there once it listens."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(f"{path}.tmp")
        os.chmod(f"{path}.tmp", 0o600)
        listener.listen(16)
        os.rename(f"{path}.tmp", path)
        yield listener


def received(conn, n_fds: int, who: str) -> tuple[dict, list[int]] | None:
    """A request on `conn`: its JSON object and the `n_fds` descriptors that came with it; None for a
    request that is not that (refused, said on stderr, its descriptors closed)."""
    import json
    import socket

    fds: list[int] = []
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, n_fds)
        req = json.loads(msg)
        if len(fds) != n_fds or not isinstance(req, dict):
            raise ValueError(f"a request with {len(fds)} descriptors")
        return req, fds
    except (OSError, ValueError) as e:
        print(f"{who}: a request refused ({e})", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        return None


@entry
def template(path: str, preload: list[str]) -> int:
    """A template for fork servers, for a process that starts many runs one after another (the
    test suite): it imports `preload` once, then listens on the Unix socket at `path`. A run
    whose environment names that socket (`TEMPLATE`) asks it for its fork server instead of
    starting one cold (TemplatedServer, which `for_run` holds): the template forks a child, which
    serves that run on the pipes the run passed it, its imports made (8-10 s of CPU a run on 2
    cores, `run_preload`).
    The run's server is the template's child, not the run's: it ends when the run closes its end
    or dies (its requests' pipe reads end-of-file), its own children with it, and the run sees it
    through a pidfd the template passes back. It is in a session and process group of its own, not
    the run's: a signal to the run's group does not reach it or its stages (the run ends them).
    Modules the run names that the template did not import, the run's server imports itself."""
    import json
    import socket

    from ratchet.data.procs.lifetime import die_with_parent

    die_with_parent()
    with imports_frozen():
        for name in preload:
            _preload(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its children are reaped by the kernel
    with listening(path) as listener:
        print(f"fork template: imported {len(preload)} modules; listening on {path}", file=sys.stderr, flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                if (got := received(conn, 3, "fork template")) is None:
                    continue
                req, fds = got
                if (why := _unsafe()) is not None:
                    reply, pidfd = {"refused": why}, None
                else:
                    _before_fork()
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        conn.close()
                        os._exit(_serve_run(req, fds, [p for p in req.get("preload", []) if p not in preload]))
                    try:
                        pidfd = os.pidfd_open(pid)
                    except OSError:  # it is gone already
                        reply, pidfd = {"refused": "the server died at once"}, None
                    else:
                        reply = {"pid": pid}
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    socket.send_fds(conn, [json.dumps(reply).encode()], [] if pidfd is None else [pidfd])
                if pidfd is not None:
                    os.close(pidfd)


def _serve_run(req: dict, fds: list[int], pending: list[str]) -> int:
    """In the template's child: become the run's fork server on the descriptors it passed (its
    requests, its answers, the server's log), in its environment and working directory."""
    requests, answers, err = fds
    os.setsid()  # a group of its own: a signal to its stages' group never reaches the template's starter
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this server waits for its own children
    os.dup2(requests, 0)
    os.dup2(err, 1)
    os.dup2(err, 2)
    for fd in (requests, err):
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    print(f"fork server: forked from the template (pid {os.getppid()}), {len(pending)} modules left to import",
          file=sys.stderr, flush=True)
    channel = Channel(0, answers)
    if not pending:  # ready now: the server's loop says so once it has imported what is left
        channel.send({"ready": _threads()})
    try:
        return fork_server.main(channel, pending)
    except BaseException:  # noqa: BLE001 - its traceback is in the server's log
        import traceback

        traceback.print_exc()
        return 1


class Adopted:
    """A run's fork server forked from a template, seen from the run: as much of spawn.Child as
    ForkServer uses. It is not this process's child: its end is seen through the pidfd the template
    passed, and its exit code is not known here (`returncode` -1 once it is gone). `stdin` is
    the run's end of its requests: closed, the server exits."""

    def __init__(self, pid: int, pidfd: int, requests: int, answers: int):
        self.pid, self.pidfd, self.returncode = pid, pidfd, None
        self.stdin = os.fdopen(requests, "wb", buffering=0)
        self.channel = Channel(answers, requests, owns_write=False)

    @property
    def proc(self) -> Adopted:
        return self

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self.pidfd], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            os.close(self.pidfd)
            self.returncode = -1
        return self.returncode

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def from_template(preload: list[str], env: dict[str, str], log_fd: int) -> Adopted | None:
    """The run's fork server forked from the template its environment names (`TEMPLATE`), its
    output into `log_fd`; None where there is none, or it does not answer (the caller starts one)."""
    import json
    import socket

    path = os.environ.get(TEMPLATE)
    if not path:
        return None
    req_r, req_w = os.pipe()
    ans_r, ans_w = os.pipe()
    got: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(10)
            s.connect(path)
            msg = {"preload": preload, "env": env, "cwd": os.getcwd()}
            socket.send_fds(s, [json.dumps(msg).encode()], [req_r, ans_w, log_fd])
            data, got, _, _ = socket.recv_fds(s, 1 << 16, 1)
            reply = json.loads(data)
        if "pid" not in reply or len(got) != 1:
            raise ValueError(reply.get("refused", "no pid"))
    except (OSError, ValueError) as e:
        log.info("the fork template at %s did not fork this run's server (%s); starting one", path, e)
        for fd in (req_w, ans_r, *got):
            os.close(fd)
        return None
    finally:
        os.close(req_r)
        os.close(ans_w)
    return Adopted(reply["pid"], got[0], req_w, ans_r)


@contextlib.contextmanager
def templated(preload: tuple[str, ...], log_path: Path):
    """A fork template (`template`) while the block runs, named in this process's environment, so
    that each run started in the block, here or in a child process (which inherits the
    environment), forks its fork server from it. A run started before it listens starts its own."""
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix="ratchet-template-")  # a socket's path has at most 107 bytes
    path = os.path.join(where, "socket")
    with open(log_path, "ab") as err:
        child = spawn.start(template, path, list(preload), env={**os.environ, **QUIET_THREADS}, stderr=err)
    before = os.environ.get(TEMPLATE)
    os.environ[TEMPLATE] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(TEMPLATE, None)
        else:
            os.environ[TEMPLATE] = before
        child.close()
        shutil.rmtree(where, ignore_errors=True)


def _output_to(path: str) -> None:
    """In the server: its output (stdout and stderr) from now on into the file at `path`, after
    what it wrote so far into the file without a name it started with."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with contextlib.suppress(OSError):  # a log that is not readable has nothing to carry over
        if size := os.fstat(2).st_size:
            os.write(fd, os.pread(2, size, 0))
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


FINAL = {"exit", "refused", "lost"}  # what ends a request: its child's exit, a refusal, the server's death


class ForkServer:
    """The run's fork server, seen from the run: `run(entry, args, log)` forks a child running
    the entry and waits for its exit code; None if the server cannot give one (the caller starts
    the process cold). `preload`: what it imports before it is ready, in order."""

    def __init__(self, log_path: Path | None, preload: tuple[str, ...] = ()):
        self.log_path = None if log_path is None else Path(log_path)
        self.preload = tuple(preload)
        self.child: spawn.Child | None = None
        self.lock = threading.Lock()
        self.waiting: dict[str, dict] = {}
        self.cond = threading.Condition()
        self.n = 0
        self.ready: int | None = None
        self.spawner = Spawner()
        self.log_fd: int | None = None  # the log named after the server started (rename_log)

    @property
    def proc(self):
        return None if self.child is None else self.child.proc

    def start(self) -> None:
        """The server's process. Without a log path yet (a run whose inputs are still being checked,
        which writes nothing before they pass) its output goes to a file without a name, which it
        copies into the log once `rename_log` names one."""
        import tempfile

        env = {**os.environ, **QUIET_THREADS}
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with (open(self.log_path, "ab") if self.log_path is not None else tempfile.TemporaryFile()) as err:
            self.child = spawn.start(fork_server, list(self.preload), channel=True, env=env, stderr=err,
                                     popen=self.spawner.popen)
        threading.Thread(target=self._read, args=(self.child.channel,), daemon=True,
                         name="ratchet-forkserver").start()

    def _read(self, channel: Channel) -> None:
        while (msg := channel.recv()) != {}:
            with self.cond:
                if "id" in msg:
                    self.waiting.setdefault(msg["id"], {}).update(msg)
                elif "ready" in msg:  # the server's threads once its imports were done (1: it may fork)
                    self.ready = msg["ready"]
                self.cond.notify_all()
        channel.close()
        with self.cond:  # the server is gone: nobody waiting will hear more from it
            for m in self.waiting.values():
                m.setdefault("lost", True)
            self.cond.notify_all()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the server has imported everything it preloads; False if it has not by `timeout`."""
        with self.cond:
            return self.cond.wait_for(lambda: self.ready is not None, timeout)

    def alive(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def _request(self, target: Entry, args: list, log_path: Path, extra_env: dict[str, str],
                 after: tuple[str, ...]) -> str | None:
        """Send a request for a child; its id, or None if the server cannot be asked."""
        if not isinstance(target, Entry):
            raise TypeError(f"{target!r} is not a declared entry (@entry): a forked child runs nothing else")
        with self.lock:
            if not self.alive():
                if self.child is not None:
                    log.warning("the fork server (pid %s) exited with code %s; starting another", self.child.pid,
                                self.child.returncode)
                self.start()
            self.n += 1
            rid = str(self.n)
            with self.cond:
                self.waiting[rid] = {}
            req = {"id": rid, "log": str(log_path), "cwd": os.getcwd(), "env": {**os.environ, **extra_env},
                   "entry": target.name, "args": list(args), "after": list(after)}
            if not self._send(req):
                with self.cond:
                    self.waiting.pop(rid, None)
                return None
            return rid

    def _send(self, msg: dict) -> bool:
        return self.child is not None and self.child.channel.send(msg)

    def spawn(self, target: Entry, args: list, log_path: Path, after: tuple[str, ...] = ()) -> Forked | None:
        """A long-lived child running `target(*args)` (the run's warm engine), forked once the
        server has imported `after`; returned at once, as a handle. None if the server cannot be
        asked (the caller starts the process itself)."""
        rid = self._request(target, args, log_path, {}, after)
        return None if rid is None else Forked(self, rid)

    def run(self, target: Entry, args: list, log_path: Path, extra_env: dict[str, str],
            after: tuple[str, ...] = ()) -> int | None:
        """Fork a child running `target(*args)`, its output appended to `log_path`, and wait for
        its exit code; None where the server did not fork it (the caller starts it itself)."""
        rid = self._request(target, args, log_path, extra_env, after)
        if rid is None:
            return None
        with self.cond:
            self.cond.wait_for(lambda: FINAL & self.waiting[rid].keys())
            msg = self.waiting.pop(rid)
        if "refused" in msg:
            log.warning("the fork server refused to fork (%s); the child starts cold", msg["refused"])
            return None
        if "exit" not in msg:  # the server died: its children died with it
            return -signal.SIGKILL if "pid" in msg else None
        return msg["exit"]

    def rename_log(self, path: Path) -> None:
        """Its log renamed to `path` (kept where it is if `path` exists), or, while it has none, made
        there, with what the server wrote so far; a restart opens the new name."""
        from ratchet.data.procs.lifetime import move_log

        with self.lock:
            if self.log_path is None:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self.log_path = Path(path)
                if self.alive():  # held open here, so a rename before the server opens it moves it with it
                    self.log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    self._send({"stderr": f"/proc/{os.getpid()}/fd/{self.log_fd}"})
                return
            self.log_path = move_log(self.log_path, Path(path))

    def stop(self) -> None:
        from ratchet.data.procs.lifetime import end

        with self.lock:
            if self.child is not None:  # its input closed, the server returns (and the reader closes its end)
                end(self.child.proc, ask=lambda p: p.stdin.close())
            self.child = None
            if self.log_fd is not None:
                os.close(self.log_fd)
                self.log_fd = None
        self.spawner.close()


class TemplatedServer(ForkServer):
    """The run's fork server, forked from the template its environment names (`TEMPLATE`) where
    one answers, else started as ForkServer starts it (a restart too: `start` is asked again). A run
    with failpoints armed (data/failpoints.py) starts its own: a failpoint that kills its process's
    group must take the run with it, and a server forked from the template is in a group of its own.
    A subclass, not a branch in ForkServer.start: the sample and evaluate stages' code reaches
    ForkServer (a stage's warm engine is forked from it), so an edit there re-keys those stages in
    every workdir; nothing a stage runs reaches this class."""

    def start(self) -> None:
        import tempfile

        from ratchet.data import failpoints

        if not os.environ.get(TEMPLATE) or os.environ.get(failpoints.ENV):
            return super().start()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with (open(self.log_path, "ab") if self.log_path is not None else tempfile.TemporaryFile()) as err:
            child = from_template(list(self.preload), {**os.environ, **QUIET_THREADS}, err.fileno())
        if child is None:
            return super().start()
        self.child = child
        threading.Thread(target=self._read, args=(child.channel,), daemon=True, name="ratchet-forkserver").start()


class Forked:
    """A long-lived child of the fork server, with as much of `subprocess.Popen` as the run's
    services use (`pid`, `poll`, `wait`, `terminate`, `kill`). `refused` says why the server did
    not fork it (its threads, a lost server): the caller then starts the process itself. Signals
    go through the server, which reaps the child, so a pid is never signalled after its reuse."""

    def __init__(self, server: ForkServer, rid: str):
        self.server, self.rid = server, rid
        self.returncode: int | None = None
        self.refused: str | None = None
        self._pid: int | None = None

    def _msg(self) -> dict:
        with self.server.cond:
            m = dict(self.server.waiting.get(self.rid, {}))
        self._pid = m.get("pid", self._pid)
        return m

    @property
    def pid(self) -> int | None:
        """The child's pid once forked (kept after it exits), else None."""
        self._msg()
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None:
            m = self._msg()
            if "refused" in m:
                self.refused, self.returncode = m["refused"], -1
            elif "exit" in m:
                self.returncode = m["exit"]
            elif "lost" in m:  # the server died, and its children with it
                self.refused = None if "pid" in m else "the fork server died first"
                self.returncode = -signal.SIGKILL
            if self.returncode is not None:
                with self.server.cond:
                    self.server.waiting.pop(self.rid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.cond:
            if not self.server.cond.wait_for(lambda: self.returncode is not None
                                             or FINAL & self.server.waiting.get(self.rid, {}).keys(), timeout):
                raise subprocess.TimeoutExpired(f"fork server child {self.rid}", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        with self.server.lock:  # one writer at a time on the server's input
            sent = self.server.alive() and self.server._send({"signal": self.rid, "sig": int(sig)})
        if not sent:
            self.returncode = -signal.SIGKILL  # no server: its children died with it

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def current() -> ForkServer | None:
    """The fork server of the run this code runs in (data/procs/services.py), or None."""
    return services.of_run().server


@contextlib.contextmanager
def for_run(enabled: bool, log_path: Path | None, preload: tuple[str, ...] = ()):
    """The run's fork server while the run lasts (none if not `enabled`); its own output (not
    its workers') goes to `log_path` (None: kept until `rename_log` names a file). A server that
    this run has running already is kept, and given `log_path` if it has no log yet. It is the
    run's (services.py): code in the block, and Prefect tasks submitted from it, find it with
    `current()`; nothing outside the block does."""
    running = current()
    if not enabled or running is not None:
        if running is not None and running.log_path is None and log_path is not None:
            running.rename_log(log_path)
        yield None
        return
    f = TemplatedServer(log_path, preload)
    try:
        f.start()  # its imports overlap with the run's first stages
        with services.held(server=f):
            yield f
    finally:
        f.stop()
