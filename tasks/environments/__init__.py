"""Environments: the user's (or a library's) code that a model plays episodes against, run where it
cannot take the run down with it.

The interface an environment class implements (learning from TRL's `environment_factory`, SkyRL's
`BaseTextEnv` and verifiers' `MultiTurnEnv`; docs/guides/environments.md):

    class Env:
        def __init__(self, **args): ...                 # sample.rollout.args, by name
        def reset(self, seed, **row) -> str: ...        # the first observation
        def step(self, action: str) -> tuple[str | None, float, bool]: ...   # observation, reward, done
        def final_reward(self) -> float | None: ...     # optional: added to the return at the end
        def close(self) -> None: ...                    # optional

`reset` gets, by name, whichever of these it names: `seed` (the start's seed: its `seed` column,
else one derived from the prompt's id), `prompt`, `answer` and the row's other columns (a
`**row` parameter gets them all). `step` gets the model's whole turn as text and returns the next
observation (None or "" where the episode is done), the step's reward (a finite number; None is
0) and whether the episode is done; a 4-tuple with an info dict, or a dict with those keys, is
taken too. One object plays one episode.

How it runs: a host process (`python -c ...`, one per stage process and environment) imports the
class once, checks it (a missing class, a method that is not there, a signature that cannot take
what it will be given are reported before any model loads), and then forks one process per
episode, which makes the object and answers that episode's calls. At most `workers` calls are
in flight at once (the rest wait their turn, so a unit of hundreds of episodes does not start
hundreds of calls on a few cores), and every call is bounded in time from when it is sent: an episode whose call outlives `step_s` has its process group killed and is
reported as timed out; one whose process dies (a crash, `sys.exit`, a memory limit) costs that
episode alone. A call that raises, or returns a wrong type, NaN or inf, fails its episode with the
environment's own traceback or what came back. An observation longer than `obs_chars` is cut in
the episode's process (its head and tail kept), so a gigabyte of text never crosses a pipe.
Every message carries its episode and call numbers: an answer is never taken for another call.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CHILD = "import sys; from ratchet.tasks.environments import host_main; sys.exit(host_main())"
LINE_LIMIT = 1 << 24  # bytes one message may take (an observation is cut before it); past it the process is killed


class EnvError(Exception):
    """The environment cannot be used at all (not importable, no such class, wrong signatures)."""


@dataclass
class Reply:
    """One call's answer: the observation, reward and done flag (or final reward), or a failure."""

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    final: float | None = None
    failure: str | None = None


class EnvHost:
    """The host process for one environment class (see the module docstring): episodes by number,
    one call in flight per episode, each answered or failed within `step_s`."""

    def __init__(self, spec: str, args: dict[str, Any], *, step_s: float, obs_chars: int, memory_mb: int,
                 fields: tuple[str, ...] = (), workers: int = 8, load_s: float = 120.0,
                 before_load: Callable[[], None] | None = None):
        self.spec, self.args, self.step_s, self.load_s, self.workers = spec, dict(args), step_s, load_s, workers
        self.queue: deque[tuple[int, str, dict]] = deque()  # calls not yet sent (`workers` are in flight)
        self.obs_chars, self.memory_mb, self.fields = obs_chars, memory_mb, tuple(fields)
        self.before_load = before_load  # runs before every (re)start, which imports the file anew
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.calls = 0
        self.pending: dict[int, tuple[int, float]] = {}  # episode -> (call number, deadline)
        self.answered: dict[int, Reply] = {}  # answers read while waiting for others
        self.lost: set[int] = set()  # episodes whose process went with a host that died
        self.live: set[int] = set()  # episodes opened on the current host

    # the host's life -------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        if self.before_load is not None:
            self.before_load()
        read_fd, write_fd = os.pipe()
        env = dict(os.environ, RATCHET_ENV_FD=str(write_fd))
        cfg = json.dumps({"spec": self.spec, "args": self.args, "obs_chars": self.obs_chars,
                          "memory_mb": self.memory_mb, "fields": list(self.fields)})
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, cfg], stdin=subprocess.PIPE, pass_fds=(write_fd,),
                                     env=env, start_new_session=True)
        os.close(write_fd)
        self._out, self._buf = os.fdopen(read_fd, "rb", buffering=0), b""
        reply = self._read(time.monotonic() + self.load_s)
        if not reply or not reply.get("ok"):
            code = self._wait() if reply == {} else None
            self.close()
            if reply is None:
                raise EnvError(f"{self.spec}: importing it took over {self.load_s:.0f} s")
            raise EnvError(reply.get("error") if reply else f"{self.spec}: its process exited while importing it "
                           f"(exit code {code})")
        self.info = reply
        return reply

    def close(self) -> None:
        if self.proc is not None:
            import signal

            try:  # the host's group; each episode's process has a group of its own and dies with the host
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for f in (self.proc.stdin, getattr(self, "_out", None)):
                try:
                    f is not None and f.close()
                except OSError:
                    pass
        self.proc = None
        self.lost |= self.live | set(self.pending)
        self.live.clear()
        self.pending.clear()

    def _wait(self):
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def _read(self, end: float) -> dict | None:
        """The host's next message; None past `end`; {} when the host is gone."""
        from ratchet.data.checks.scorer import read_message

        return read_message(self._out, self, end)

    # calls -----------------------------------------------------------------------------------
    def send(self, ep: int, op: str, **payload) -> None:
        """Queue a call for episode `ep` (`open` with its seed and row, `step` with an action, or
        `finish`); at most `workers` calls are in flight at once, and a call's time bound starts
        when it is sent. Its answer is read by `collect`."""
        self.queue.append((ep, op, payload))
        self._pump()

    def _pump(self) -> None:
        while self.queue and len(self.pending) < self.workers:
            self._write(*self.queue.popleft())

    def _write(self, ep: int, op: str, payload: dict) -> None:
        if op != "open" and ep not in self.live:
            self.answered[ep] = Reply(failure="its process was lost with the environment's host process"
                                      if ep in self.lost else "no such episode")
            return
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self.close()
            self.start()
        self.calls += 1
        try:
            self.proc.stdin.write((json.dumps({"#": self.calls, "ep": ep, "op": op, **payload}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.close()
            self.answered[ep] = Reply(failure="the environment's host process died")
            return
        self.pending[ep] = (self.calls, time.monotonic() + self.step_s)
        if op == "open":
            self.live.add(ep)

    def collect(self, eps: list[int]) -> dict[int, Reply]:
        """The answers to the calls queued or in flight for `eps`: each one's, or its failure (a
        timeout, a dead process). Answers for other episodes that arrive meanwhile are kept for
        their turn."""
        want = set(eps)
        while not want <= set(self.answered):
            self._pump()
            queued = {q[0] for q in self.queue}
            if not [e for e in want - set(self.answered) if e in self.pending or e in queued]:
                for e in want - set(self.answered):  # never sent (or lost): nothing will come
                    self.answered[e] = Reply(failure="no call was made")
                break
            msg = self._read(min(d for _, d in self.pending.values()))
            if msg is None:  # a deadline passed: those episodes' processes are ended
                now = time.monotonic()
                for e in [e for e, (_, d) in self.pending.items() if d <= now]:
                    self._kill(e)
                    self.answered[e] = Reply(failure=f"timed out after {self.step_s:g} s (sample.rollout.step_s)")
                continue
            if msg == {}:
                code = self._wait()
                lost = set(self.pending)
                self.close()
                for e in lost:
                    self.answered[e] = Reply(failure=f"the environment's host process died (exit code {code})")
                continue
            e = msg.get("ep")
            if e not in self.pending or msg.get("#") != self.pending[e][0]:
                continue  # not the answer to a call in flight: never taken for one
            del self.pending[e]
            reply = Reply(**{k: msg[k] for k in ("observation", "reward", "done", "final", "failure") if k in msg})
            if reply.failure is not None or msg.get("closed"):
                self.live.discard(e)
            self.answered[e] = reply
        return {e: self.answered.pop(e) for e in eps}

    def _kill(self, ep: int) -> None:
        self.pending.pop(ep, None)
        self.live.discard(ep)
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.write((json.dumps({"#": 0, "ep": ep, "op": "kill"}) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def drop(self, eps: list[int]) -> None:
        """Forget these episodes: their queued calls, calls in flight and unread answers, and end
        their processes (a unit that finished, or stopped half way)."""
        gone = set(eps)
        self.queue = deque(q for q in self.queue if q[0] not in gone)
        for e in gone:
            if e in self.live or e in self.pending:
                self._kill(e)
            self.answered.pop(e, None)
        self.lost -= gone


def version(package: str) -> str | None:
    """The installed version of a library of environments (textarena, gymnasium), or None."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed(package)
    except PackageNotFoundError:
        return None


_SHARED: dict[tuple, EnvHost] = {}


def shared(spec: str, args: dict, *, step_s: float, obs_chars: int, memory_mb: int, fields: tuple[str, ...] = (),
           workers: int = 8, tag: str = "", before_load: Callable[[], None] | None = None) -> EnvHost:
    """This process's host for the environment (and `tag`: its source's digest), started on first
    use and kept for the calls after (a stage's units share it; it ends with the process)."""
    key = (spec, json.dumps(args, sort_keys=True), step_s, obs_chars, memory_mb, tuple(fields), workers, tag)
    if key not in _SHARED:
        h = EnvHost(spec, args, step_s=step_s, obs_chars=obs_chars, memory_mb=memory_mb, fields=fields,
                    workers=workers, before_load=before_load)
        h.start()  # raises EnvError, and then nothing is kept
        _SHARED[key] = h
    return _SHARED[key]


@atexit.register
def close_all() -> None:
    for h in _SHARED.values():
        h.close()
    _SHARED.clear()


# the host's side -----------------------------------------------------------------------------

def _load(spec: str):
    from ratchet.data.checks.scorer import ScorerError, _load as load_attr

    try:
        return load_attr(spec)
    except ScorerError as e:
        raise EnvError(str(e).replace("functions", "names")) from None


def interface_problem(cls, args: dict, fields: list[str]) -> str | None:
    """Why `cls` cannot play episodes as the rollout will drive it, or None."""
    import inspect

    if not isinstance(cls, type):
        return f"{getattr(cls, '__name__', cls)!r} is a {type(cls).__name__}, not a class"
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        return (f"class {cls.__name__} has no {' or '.join(missing)} method; an environment defines reset(self, "
                "seed, **row) -> str and step(self, action) -> (observation, reward, done)")
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        return f"{cls.__name__}{inspect.signature(cls)} cannot take sample.rollout.args {sorted(args)} ({e})"
    except ValueError:
        pass
    offered = {"seed", "prompt", "answer", *fields}
    try:
        reset = inspect.signature(cls.reset)
        params = list(reset.parameters.values())[1:]  # after self
        need = [p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in offered]
        if need or any(p.kind == p.POSITIONAL_ONLY and p.default is p.empty for p in params):
            return (f"{cls.__name__}.reset{reset} needs {need or 'positional arguments'}, which no start gives; it gets "
                    f"by name any of {sorted(offered)} (a **row parameter: all of them)")
    except (TypeError, ValueError):
        pass
    try:
        inspect.signature(cls.step).bind(None, "action")
    except TypeError as e:
        return f"{cls.__name__}.step{inspect.signature(cls.step)} cannot take the model's action ({e}); define " \
               "step(self, action) -> (observation, reward, done)"
    except ValueError:
        pass
    return None


def reset_kwargs(cls, seed: int, row: dict) -> dict:
    """What `reset` is given: the names it takes, of the seed and the row."""
    import inspect

    offered = {"seed": seed, **row}
    try:
        params = list(inspect.signature(cls.reset).parameters.values())[1:]
    except (TypeError, ValueError):
        return offered
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return offered
    return {p.name: offered[p.name] for p in params if p.name in offered}


def cut(text: str, limit: int) -> str:
    """`text` within `limit` characters, its head and tail kept, valid UTF-8."""
    if len(text) > limit:
        half = limit // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return text.encode("utf-8", "replace").decode("utf-8")


def _number(v, what: str) -> float | None:
    """A reward as a float, or raise with what came back."""
    import math

    if v is None:
        return None
    if isinstance(v, bool):
        return float(v)
    try:
        x = float(v if isinstance(v, (int, float)) else v.item())
    except Exception:  # noqa: BLE001 - said below
        raise ValueError(f"{what} is {type(v).__name__} {v!r:.80}; return a finite number") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} is {x!r}; return a finite number")
    return x


def _observation(v, limit: int, what: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValueError(f"{what} is {type(v).__name__} {v!r:.80}; return the observation as text (a str)")
    return cut(v, limit)


def _step_value(out, limit: int) -> dict:
    if isinstance(out, dict):
        if "observation" not in out and "done" not in out:
            raise ValueError(f"step returned a dict without 'observation' and 'done' ({sorted(out)[:8]})")
        obs, reward, done = out.get("observation"), out.get("reward"), out.get("done", False)
    elif isinstance(out, tuple) and len(out) in (3, 4):
        obs, reward, done = out[:3]
    else:
        raise ValueError(f"step returned {type(out).__name__} {out!r:.80}; return (observation, reward, done)")
    if not isinstance(done, bool) and done not in (0, 1):
        raise ValueError(f"step's done is {type(done).__name__} {done!r:.80}; return True or False")
    return {"observation": _observation(obs, limit, "step's observation"),
            "reward": _number(reward, "step's reward") or 0.0, "done": bool(done)}


def _episode(cls, cfg: dict, inbox, outbox) -> None:
    """One episode's process: the object, and the answers to its calls, until finish or EOF."""
    import traceback

    from ratchet.data.checks.scorer import _die_with_parent, _user_traceback

    _die_with_parent()
    if cfg["memory_mb"]:  # on top of what the host's imports already mapped, which it shares
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = mapped + (cfg["memory_mb"] << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    env = None
    for line in inbox:
        req = json.loads(line)
        out: dict[str, Any] = {"#": req["#"], "ep": req["ep"]}
        op = req["op"]
        try:
            if op == "open":
                env = cls(**cfg["args"])
                out["observation"] = _observation(env.reset(**reset_kwargs(cls, req["seed"], req["row"])),
                                                  cfg["obs_chars"], "reset's observation") or ""
            elif op == "step":
                out.update(_step_value(env.step(req["action"]), cfg["obs_chars"]))
            elif op == "finish":
                final = getattr(env, "final_reward", None)
                out["final"] = _number(final(), "final_reward") if callable(final) else None
                if callable(getattr(env, "close", None)):
                    env.close()
                out["closed"] = True
        except ValueError as e:
            if traceback.extract_tb(e.__traceback__)[-1].filename == __file__:  # a wrong value, said plainly
                out = {**out, "failure": f"{op}: {e}"}
            else:
                out = {**out, "failure": f"{op} raised:\n{_user_traceback(e)}"}
        except BaseException as e:  # noqa: BLE001 - the environment's own failure, with its traceback
            out = {**out, "failure": f"{op} raised:\n{_user_traceback(e)}"}
        outbox.write(json.dumps(out) + "\n")
        outbox.flush()
        if "failure" in out or out.get("closed"):
            break


def host_main() -> int:
    import signal

    from ratchet.data.checks.scorer import _die_with_parent, _user_traceback

    _die_with_parent()
    proto = os.fdopen(int(os.environ.pop("RATCHET_ENV_FD")), "w")
    os.dup2(2, 1)  # the environment's prints go to the log
    cfg = json.loads(sys.argv[1])

    def say(obj) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        cls = _load(cfg["spec"])
    except EnvError as e:
        say({"ok": False, "error": str(e)})
        return 0
    except BaseException as e:  # noqa: BLE001 - the module failed to import: its traceback
        say({"ok": False, "error": f"{cfg['spec']}: importing it failed:\n{_user_traceback(e)}"})
        return 0
    if (problem := interface_problem(cls, cfg["args"], cfg["fields"])) is not None:
        say({"ok": False, "error": f"{cfg['spec']}: {problem}"})
        return 0
    say({"ok": True, "final": callable(getattr(cls, "final_reward", None))})

    @dataclass
    class Child:
        pid: int
        to: Any  # its request pipe
        fd: int  # its answer pipe
        buf: bytes = b""
        said: int = field(default=0)

    children: dict[int, Child] = {}
    stdin = sys.stdin.buffer.fileno()
    inbuf = b""

    def end(ep: int, failure: str | None = None, call: int = 0) -> None:
        c = children.pop(ep, None)
        if c is None:
            return
        try:
            os.killpg(c.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for f in (c.to,):
            try:
                f.close()
            except OSError:
                pass
        os.close(c.fd)
        _, status = os.waitpid(c.pid, 0)
        if failure is not None:
            code = os.waitstatus_to_exitcode(status)
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            say({"#": call, "ep": ep, "failure": failure.format(how=how)})

    inflight: dict[int, int] = {}  # episode -> the call it answers next
    while True:
        ready, _, _ = select.select([stdin] + [c.fd for c in children.values()], [], [])
        if stdin in ready:
            chunk = os.read(stdin, 1 << 20)
            if not chunk:
                for ep in list(children):
                    end(ep)
                return 0
            inbuf += chunk
            while b"\n" in inbuf:
                line, inbuf = inbuf.split(b"\n", 1)
                req = json.loads(line)
                ep, op = req["ep"], req["op"]
                if op == "kill":
                    end(ep)
                    inflight.pop(ep, None)
                    continue
                if op == "open":
                    r1, w1 = os.pipe()
                    r2, w2 = os.pipe()
                    pid = os.fork()
                    if pid == 0:  # the episode's process
                        try:
                            os.setpgid(0, 0)  # its group: what the environment starts ends with it
                            os.close(w1)
                            os.close(r2)
                            os.close(proto.fileno())
                            for c in children.values():
                                os.close(c.fd)
                                os.close(c.to.fileno())
                            null = os.open(os.devnull, os.O_RDONLY)
                            os.dup2(null, 0)
                            _episode(cls, cfg, os.fdopen(r1, "r"), os.fdopen(w2, "w"))
                        finally:
                            os._exit(0)
                    os.close(r1)
                    os.close(w2)
                    children[ep] = Child(pid, os.fdopen(w1, "w"), r2)
                c = children.get(ep)
                if c is None:
                    say({"#": req["#"], "ep": ep, "failure": "its process is gone"})
                    continue
                inflight[ep] = req["#"]
                try:
                    c.to.write(line.decode() + "\n")
                    c.to.flush()
                except (BrokenPipeError, OSError):
                    end(ep, "its process died ({how})", req["#"])
        for ep, c in list(children.items()):
            if c.fd not in ready:
                continue
            chunk = os.read(c.fd, 1 << 20)
            if not chunk:
                end(ep, "its process died ({how})", inflight.pop(ep, 0))
                continue
            c.buf += chunk
            while b"\n" in c.buf:
                line, c.buf = c.buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    end(ep, "it wrote outside the protocol ({how})", inflight.pop(ep, 0))
                    break
                proto.write(line.decode("utf-8", "replace") + "\n")
                proto.flush()
                if "failure" in msg or msg.get("closed"):
                    inflight.pop(ep, None)
                    end(ep)
                    break
            if ep in children and len(c.buf) > LINE_LIMIT:
                end(ep, f"it answered past {LINE_LIMIT >> 20} MiB in one message ({{how}})", inflight.pop(ep, 0))
