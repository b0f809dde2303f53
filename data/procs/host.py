"""Hosts: a child process that imported some code once and answers calls on it, each bounded in
time from this side, over a channel (channel.py).

- `CallHost`: one child answering one call at a time (a scoring function's host). A call that
  outlives its bound has the child killed, with its process group (whatever the code started),
  and fails; a child that dies costs the call it was making; the next call starts a new child.
- `SessionHost`: one child that forks a process per session (an environment's episode), which
  answers that session's calls. At most `workers` calls are in flight at once; each is bounded
  from when it is sent; a session whose call outlives its bound has its process group killed,
  one whose process dies costs that session alone.

`KEPT` keeps a process's hosts for the calls after their first (`Kept`).

The child's side: `serve_calls` and `serve_sessions`, called by the host's entry (entry.py) with
what it loaded. A function the code runs that forks, and returns or raises in the forked
process, ends that process there: only the host answers, and only the calls it was sent.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ratchet.data.procs import spawn
from ratchet.data.procs.channel import Channel
from ratchet.data.procs.entry import Entry

LINE_LIMIT = 1 << 24  # bytes one answer may take; past it the session's process is killed


class HostError(Exception):
    """The host's child could not load what it hosts: `said` where its first message says why (the
    message is then the child's own), else it died, hung or answered outside the protocol."""

    def __init__(self, message: str, said: bool = False):
        super().__init__(message)
        self.said = said


def _hello(child: spawn.Child, load_s: float, what: str, verb: str) -> dict:
    """The child's first message once it says it is ready; HostError otherwise."""
    hello = child.channel.recv(time.monotonic() + load_s)
    if hello and hello.get("ok"):
        return hello
    code = child.exit_code() if hello == {} else None
    child.close()
    if hello is None:
        raise HostError(f"{verb} it took over {load_s:.0f} s")
    if hello == {}:
        raise HostError(f"{what} exited while {verb} it (exit code {code})")
    if isinstance(hello.get("error"), str):
        raise HostError(hello["error"], said=True)
    raise HostError(f"{what} answered outside the protocol")


class Kept:
    """The hosts a process keeps for the calls after their first: a stage's units share one scorer
    and one environment host, started on first use (data/checks/scorer.py `shared`,
    tasks/environments `shared`). Each is kept under a key of everything that makes it what it is
    (what it loads, the digest of the user's file it loads, its bounds, its convention), so taking
    a kept host or starting a new one gives a call the same outcome: keeping decides how many
    processes start, never what a call returns. That is why they are the process's and not the
    run's (data/procs/services.py holds what decides how a run's stages run): a check's worker
    threads share them without a run's context, and two runs in one process that load the same
    code share a host as they would share a module. They end with the process, or at `close`.

    A host is started under its key's own lock: two threads that want one host start it once,
    and hosts for different keys start side by side. A host whose start fails is not kept."""

    def __init__(self):
        self.hosts: dict[tuple, Any] = {}
        self.lock = threading.Lock()  # the two tables
        self.starting: dict[tuple, threading.Lock] = {}

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The host kept under `key`, else `make()`'s, started (its `start` may raise: nothing kept)."""
        with self.lock:
            if key in self.hosts:
                return self.hosts[key]
            mine = self.starting.setdefault(key, threading.Lock())
        with mine:
            with self.lock:
                if key in self.hosts:
                    return self.hosts[key]
            h = make()
            h.start()
            with self.lock:
                self.hosts[key] = h
            return h

    def of(self, kind: type) -> list:
        """The kept hosts of one kind (a scorer, an environment's host)."""
        with self.lock:
            return [h for h in self.hosts.values() if isinstance(h, kind)]

    def close(self, kind: type = object) -> None:
        """Close the kept hosts of `kind` (all of them by default) and forget them."""
        with self.lock:
            gone = [k for k, h in self.hosts.items() if isinstance(h, kind)]
            hosts = [self.hosts.pop(k) for k in gone]
        for h in hosts:
            h.close()


KEPT = Kept()
atexit.register(KEPT.close)


class CallHost:
    """A child running `entry(*args)` that answers one call at a time (see the module docstring)."""

    def __init__(self, entry: Entry, args: list, *, load_s: float = 120.0,
                 before_start: Callable[[], None] | None = None, what: str = "its process"):
        self.entry, self.args, self.load_s, self.before_start, self.what = entry, list(args), load_s, before_start, what
        self.child: spawn.Child | None = None
        self.calls = self.timeouts = self.restarts = 0

    @property
    def proc(self):
        return None if self.child is None else self.child.proc

    def start(self) -> dict[str, Any]:
        """Start the child; its first message (what it loaded), once it says it is ready. Raises
        HostError when it says it cannot (`{"ok": false, "error": ...}`), dies or hangs first."""
        if self.before_start is not None:
            self.before_start()
        self.child = spawn.start(self.entry, *self.args, channel=True, session=True, lifetime="watch")
        try:
            return _hello(self.child, self.load_s, self.what, "loading")
        except HostError:
            self.child = None  # closed by _hello
            raise

    def alive(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def call(self, payload: dict, timeout_s: float) -> tuple[str, Any]:
        """One call: ("ok", the answer), ("died", exit code) or ("timeout", None). A dead child is
        replaced first; after a failure the next call starts a new child."""
        if not self.alive():
            if self.child is not None:
                self.restarts += 1
                self.close()
            self.start()
        self.calls += 1
        ch = self.child.channel
        if not ch.send({"#": self.calls, **payload}):
            code = self.child.exit_code()
            self.close()
            return "died", code
        end = time.monotonic() + timeout_s
        while (reply := ch.recv(end)) and reply.get("#") != self.calls:
            pass  # not this call's answer: never taken for it
        if reply == {}:
            code = self.child.exit_code()
            self.close()
            return "died", code
        if reply is None:
            self.close()
            self.timeouts += 1
            return "timeout", None
        return "ok", reply

    def close(self) -> None:
        if self.child is not None:
            self.child.close()
        self.child = None


def serve_calls(channel: Channel, handle: Callable[[dict], dict],
                failed: Callable[[dict, BaseException], dict]) -> int:
    """A CallHost child's loop: each call's answer is `handle(call)`, or `failed(call, exception)`
    where the hosted code raised; until the parent closes its end."""
    me = os.getpid()
    while (call := channel.recv()) != {}:
        if call.get("#") is None:
            continue
        try:
            reply = handle(call)
        except BaseException as e:  # noqa: BLE001 - the hosted code's own failure, answered
            if os.getpid() != me:  # a process the code forked, raising out of it: never answers
                os._exit(1)
            reply = failed(call, e)
        if os.getpid() != me:  # a process the code forked, returning from it: it answers nothing, and reads no
            os._exit(0)  # call (its parent answers this one)
        channel.send({"#": call["#"], **reply})
    return 0


@dataclass
class _Session:
    pid: int
    to: Channel  # its calls
    answers: Channel  # its answers


class SessionHost:
    """A child running `entry(*args)` that forks a process per session (see the module
    docstring). `send` queues a call; `collect` gathers answers, or each session's failure."""

    def __init__(self, entry: Entry, args: list, *, call_s: float, workers: int = 8, load_s: float = 120.0,
                 before_start: Callable[[], None] | None = None, what: str = "the host process",
                 timeout_hint: str = ""):
        self.entry, self.args, self.call_s, self.load_s, self.workers = entry, list(args), call_s, load_s, workers
        self.before_start, self.what, self.timeout_hint = before_start, what, timeout_hint
        self.queue: deque[tuple[int, str, dict]] = deque()  # calls not yet sent (`workers` are in flight)
        self.child: spawn.Child | None = None
        self.info: dict[str, Any] = {}
        self.calls = 0
        self.pending: dict[int, tuple[int, float]] = {}  # session -> (call number, deadline)
        self.answered: dict[int, dict] = {}  # answers read while waiting for others
        self.lost: set[int] = set()  # sessions whose process went with a host that died
        self.live: set[int] = set()  # sessions opened on the current host

    @property
    def proc(self):
        return None if self.child is None else self.child.proc

    def start(self) -> dict[str, Any]:
        if self.before_start is not None:
            self.before_start()
        self.child = spawn.start(self.entry, *self.args, channel=True, session=True, lifetime="watch")
        try:
            self.info = _hello(self.child, self.load_s, self.what, "importing")
        except HostError:
            self.close()
            raise
        return self.info

    def close(self) -> None:
        if self.child is not None:
            self.child.close()  # the host's group; each session's process has a group of its own and dies with it
        self.child = None
        self.lost |= self.live | set(self.pending)
        self.live.clear()
        self.pending.clear()

    def send(self, s: int, op: str, **payload) -> None:
        """Queue a call for session `s` (`open` starts its process); at most `workers` calls are in
        flight at once, and a call's time bound starts when it is sent."""
        self.queue.append((s, op, payload))
        self._pump()

    def _pump(self) -> None:
        while self.queue and len(self.pending) < self.workers:
            self._write(*self.queue.popleft())

    def _write(self, s: int, op: str, payload: dict) -> None:
        if op != "open" and s not in self.live:
            self.answered[s] = {"failure": f"its process was lost with {self.what}" if s in self.lost
                                else "no such session"}
            return
        if self.child is None or self.child.poll() is not None:
            if self.child is not None:
                self.close()
            self.start()
        self.calls += 1
        if not self.child.channel.send({"#": self.calls, "s": s, "op": op, **payload}):
            self.close()
            self.answered[s] = {"failure": f"{self.what} died"}
            return
        self.pending[s] = (self.calls, time.monotonic() + self.call_s)
        if op == "open":
            self.live.add(s)

    def collect(self, sessions: list[int]) -> dict[int, dict]:
        """The answers to the calls queued or in flight for `sessions`: each one's, or its failure (a
        timeout, a dead process). Answers for other sessions that arrive meanwhile are kept."""
        want = set(sessions)
        while not want <= set(self.answered):
            self._pump()
            queued = {q[0] for q in self.queue}
            if not [s for s in want - set(self.answered) if s in self.pending or s in queued]:
                for s in want - set(self.answered):  # never sent (or lost): nothing will come
                    self.answered[s] = {"failure": "no call was made"}
                break
            msg = self.child.channel.recv(min(d for _, d in self.pending.values()))
            if msg is None:  # a deadline passed: those sessions' processes are ended
                now = time.monotonic()
                for s in [s for s, (_, d) in self.pending.items() if d <= now]:
                    self._kill(s)
                    self.answered[s] = {"failure": f"timed out after {self.call_s:g} s{self.timeout_hint}"}
                continue
            if msg == {}:
                code = self.child.exit_code()
                lost = set(self.pending)
                self.close()
                for s in lost:
                    self.answered[s] = {"failure": f"{self.what} died (exit code {code})"}
                continue
            s = msg.get("s")
            if s not in self.pending or msg.get("#") != self.pending[s][0]:
                continue  # not the answer to a call in flight: never taken for one
            del self.pending[s]
            if "failure" in msg or msg.get("closed"):
                self.live.discard(s)
            self.answered[s] = msg
        return {s: self.answered.pop(s) for s in sessions}

    def _kill(self, s: int) -> None:
        self.pending.pop(s, None)
        self.live.discard(s)
        if self.child is not None and self.child.poll() is None:
            self.child.channel.send({"#": 0, "s": s, "op": "kill"})

    def drop(self, sessions: list[int]) -> None:
        """Forget these sessions: their queued calls, calls in flight and unread answers, and end
        their processes."""
        gone = set(sessions)
        self.queue = deque(q for q in self.queue if q[0] not in gone)
        for s in gone:
            if s in self.live or s in self.pending:
                self._kill(s)
            self.answered.pop(s, None)
        self.lost -= gone


def serve_sessions(channel: Channel, session: Callable[[Channel, Channel], None]) -> int:
    """A SessionHost child's loop: on `open`, fork a process that runs `session(calls, answers)`
    (its calls relayed to it, its answers relayed back); `kill` ends one; until the parent closes
    its end. A session's process has a process group of its own, ended with it."""
    sessions: dict[int, _Session] = {}
    inflight: dict[int, int] = {}  # session -> the call it answers next

    def end(s: int, failure: str | None = None, call: int = 0) -> None:
        c = sessions.pop(s, None)
        if c is None:
            return
        try:
            os.killpg(c.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        c.to.close()
        c.answers.close()
        _, status = os.waitpid(c.pid, 0)
        if failure is not None:
            code = os.waitstatus_to_exitcode(status)
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            channel.send({"#": call, "s": s, "failure": failure.format(how=how)})

    def fork(s: int) -> None:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        pid = os.fork()
        if pid == 0:  # the session's process
            try:
                os.setpgid(0, 0)  # its group: what the hosted code starts ends with it
                os.close(w1)
                os.close(r2)
                os.close(channel.write_fd)
                for c in sessions.values():
                    c.to.close()
                    c.answers.close()
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                session(Channel(r1, None), Channel(None, w2))
            finally:
                os._exit(0)
        os.close(r1)
        os.close(w2)
        sessions[s] = _Session(pid, Channel(None, w1), Channel(r2, None))

    while True:
        ready, _, _ = select.select([channel.read_fd] + [c.answers.read_fd for c in sessions.values()], [], [])
        if channel.read_fd in ready:
            while True:
                req = channel.recv(time.monotonic())
                if req == {}:
                    for s in list(sessions):
                        end(s)
                    return 0
                if req is None:
                    break
                s, op = req.get("s"), req.get("op")
                if op == "kill":
                    end(s)
                    inflight.pop(s, None)
                    continue
                if op == "open":
                    fork(s)
                c = sessions.get(s)
                if c is None:
                    channel.send({"#": req.get("#"), "s": s, "failure": "its process is gone"})
                    continue
                inflight[s] = req["#"]
                if not c.to.send(req):
                    end(s, "its process died ({how})", req["#"])
                if not channel.pending():
                    break
        for s, c in list(sessions.items()):
            if c.answers.read_fd not in ready:
                continue
            while s in sessions:
                msg = c.answers.recv(time.monotonic(), limit=LINE_LIMIT)
                if msg is None:
                    break
                if msg == {}:
                    end(s, "its process died ({how})", inflight.pop(s, 0))
                    break
                if msg.get("#") is None:
                    end(s, f"it answered past {LINE_LIMIT >> 20} MiB in one message ({{how}})" if msg.get("!") else
                        "it wrote outside the protocol ({how})", inflight.pop(s, 0))
                    break
                channel.send(msg)
                if "failure" in msg or msg.get("closed"):
                    inflight.pop(s, None)
                    end(s)
                    break
                if not c.answers.pending():
                    break


def serve_session(calls: Channel, answers: Channel, handle: Callable[[dict], dict]) -> None:
    """A session's process: each call's answer is `handle(call)`, until it says it is done
    (`failure` or `closed` in its answer) or its calls end."""
    while (call := calls.recv()) != {}:
        if call.get("#") is None:
            continue
        out = {"#": call["#"], "s": call.get("s"), **handle(call)}
        answers.send(out)
        if "failure" in out or out.get("closed"):
            return
