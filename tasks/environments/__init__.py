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
        imports = ("some_library",)                     # optional: imported once by the host

`reset` gets, by name, whichever of these it names: `seed` (the start's seed: its `seed` column,
else one derived from the prompt's id), `prompt`, `answer` and the row's other columns (a
`**row` parameter gets them all). `step` gets the model's whole turn as text and returns the next
observation (None or "" where the episode is done), the step's reward (a finite number; None is
0) and whether the episode is done; a 4-tuple with an info dict, or a dict with those keys, is
taken too. One object plays one episode.

How it runs: a host (data/procs/host.py `SessionHost`: the entry `env_host`, one per stage
process and environment) imports the class once, checks it (a missing class, a method that is
not there, a signature that cannot take what it will be given are reported before any model
loads), and then forks one process per episode, which makes the object and answers that
episode's calls. At most `workers` calls are
in flight at once (the rest wait their turn, so a unit of hundreds of episodes does not start
hundreds of calls on a few cores), and every call is bounded in time from when it is sent: an episode whose call outlives `step_s` has its process group killed and is
reported as timed out; one whose process dies (a crash, `sys.exit`, a memory limit) costs that
episode alone. A call that raises, or returns a wrong type, NaN or inf, fails its episode with the
environment's own traceback or what came back. An observation longer than `obs_chars` is cut in
the episode's process (its head and tail kept), so a gigabyte of text never crosses a pipe.
Every message carries its episode and call numbers: an answer is never taken for another call.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ratchet.data.procs.channel import Channel, user_traceback
from ratchet.data.records import Prompt
from ratchet.data.procs.entry import LoadError, entry, load_spec, target_of
from ratchet.data.procs.host import KEPT, HostError, SessionHost, serve_session, serve_sessions


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


EPISODE_KEYS = iter(range(1, 1 << 62))  # episode numbers at a host, unique within the process


def seed_of(p: Prompt) -> int:
    """The seed an episode starts from: the row's `seed` column, else one from the prompt's id."""
    s = p.fields.get("seed")
    if isinstance(s, int) and not isinstance(s, bool):
        return s
    return int(hashlib.sha256(p.id.encode()).hexdigest()[:8], 16)


def row_of(p: Prompt) -> dict:
    """What an episode's `reset` may take of its start, besides the seed."""
    return {"prompt": p.prompt, "answer": p.answer, **p.fields}


def spec_of(target: str | type) -> str:
    """An environment as its host imports it: a user's 'file.py:Class' or 'module:Class' as given, or
    one of Ratchet's adapters by the class itself (so a stage that plays it reaches its code)."""
    return target_of(target) if isinstance(target, type) else target


class EnvHost(SessionHost):
    """The host process for one environment class (see the module docstring): episodes by number,
    one call in flight per episode, each answered or failed within `step_s`."""

    def __init__(self, target: str | type, args: dict[str, Any], *, step_s: float, obs_chars: int, memory_mb: int,
                 fields: tuple[str, ...] = (), workers: int = 8, load_s: float = 120.0,
                 before_load: Callable[[], None] | None = None):
        self.spec, self.env_args, self.step_s = spec_of(target), dict(args), step_s
        self.obs_chars, self.memory_mb, self.fields = obs_chars, memory_mb, tuple(fields)
        cfg = {"spec": self.spec, "args": self.env_args, "obs_chars": obs_chars, "memory_mb": memory_mb,
               "fields": list(self.fields)}
        super().__init__(env_host, [cfg], call_s=step_s, workers=workers, load_s=load_s, before_start=before_load,
                         what="the environment's host process", timeout_hint=" (sample.rollout.step_s)")

    def start(self) -> dict[str, Any]:
        try:
            return super().start()
        except HostError as e:
            raise EnvError(str(e) if e.said else f"{self.spec}: {e}") from None

    def collect(self, eps: list[int]) -> dict[int, Reply]:
        """The answers to the calls queued or in flight for `eps`: each one's, or its failure (a
        timeout, a dead process). Answers for other episodes that arrive meanwhile are kept for
        their turn."""
        return {e: Reply(**{k: m[k] for k in ("observation", "reward", "done", "final", "failure") if k in m})
                for e, m in super().collect(eps).items()}


def version(package: str) -> str | None:
    """The installed version of a library of environments (textarena, gymnasium), or None."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed(package)
    except PackageNotFoundError:
        return None


def shared(target: str | type, args: dict, *, step_s: float, obs_chars: int, memory_mb: int,
           fields: tuple[str, ...] = (), workers: int = 8, tag: str = "",
           before_load: Callable[[], None] | None = None) -> EnvHost:
    """This process's host for the environment (and `tag`: its source's digest), started on first
    use and kept for the calls after (a stage's units share it; data/procs/host.py `Kept`)."""
    key = ("environment", spec_of(target), json.dumps(args, sort_keys=True), step_s, obs_chars, memory_mb,
           tuple(fields), workers, tag)
    return KEPT.get(key, lambda: EnvHost(target, args, step_s=step_s, obs_chars=obs_chars, memory_mb=memory_mb,
                                         fields=fields, workers=workers, before_load=before_load))


# the host's side -----------------------------------------------------------------------------

def _load(spec: str):
    try:
        return load_spec(spec, "names")
    except LoadError as e:
        raise EnvError(str(e)) from None


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


def _episode(cls, cfg: dict, calls: Channel, answers: Channel) -> None:
    """One episode's process: the object, and the answers to its calls, until finish or EOF."""
    import traceback

    if cfg["memory_mb"]:  # on top of what the host's imports already mapped, which it shares
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = mapped + (cfg["memory_mb"] << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    state: dict[str, Any] = {}

    def handle(req: dict) -> dict:
        op, out = req["op"], {}
        try:
            if op == "open":
                env = state["env"] = cls(**cfg["args"])
                out["observation"] = _observation(env.reset(**reset_kwargs(cls, req["seed"], req["row"])),
                                                  cfg["obs_chars"], "reset's observation") or ""
            elif op == "step":
                out.update(_step_value(state["env"].step(req["action"]), cfg["obs_chars"]))
            elif op == "finish":
                env = state.get("env")
                final = getattr(env, "final_reward", None)
                out["final"] = _number(final(), "final_reward") if callable(final) else None
                if callable(getattr(env, "close", None)):
                    env.close()
                out["closed"] = True
        except ValueError as e:
            if traceback.extract_tb(e.__traceback__)[-1].filename == __file__:  # a wrong value, said plainly
                return {"failure": f"{op}: {e}"}
            return {"failure": f"{op} raised:\n{_user_traceback(e)}"}
        except BaseException as e:  # noqa: BLE001 - the environment's own failure, with its traceback
            return {"failure": f"{op} raised:\n{_user_traceback(e)}"}
        return out

    serve_session(calls, answers, handle)


def _user_traceback(exc: BaseException) -> str:
    """The environment's own frames: the host's and this module's left out."""
    return user_traceback(exc, skip=(__file__,))


@entry
def env_host(channel: Channel, cfg: dict) -> int:
    """An environment's host (see the module docstring): import the class once, check it, say so,
    then fork a process per episode."""
    def hello(**obj) -> int:
        channel.send(obj)
        return 0

    try:
        cls = _load(cfg["spec"])
        for name in getattr(cls, "imports", ()):  # libraries every episode's process forks with, loaded once
            importlib.import_module(name)
    except EnvError as e:
        return hello(ok=False, error=str(e))
    except BaseException as e:  # noqa: BLE001 - the module failed to import: its traceback
        return hello(ok=False, error=f"{cfg['spec']}: importing it failed:\n{_user_traceback(e)}")
    if (problem := interface_problem(cls, cfg["args"], cfg["fields"])) is not None:
        return hello(ok=False, error=f"{cfg['spec']}: {problem}")
    channel.send({"ok": True, "final": callable(getattr(cls, "final_reward", None))})
    return serve_sessions(channel, lambda calls, answers: _episode(cls, cfg, calls, answers))
