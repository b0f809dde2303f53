"""Scoring code run outside the stage's process: a user's function, or a library whose time
bounds need a process's main thread (math-verify's signal alarms).

A `Scorer` is a host (data/procs/host.py `CallHost`): one child process, the entry
`scorer_host`, which imports the function once and then answers one call at a time over its
channel (data/procs/channel.py), so what the function prints goes to the stage's log, not into
the protocol. Every call is bounded in time by this side: a call that outlives `timeout_s` has
its child killed, with its process group (what the function started), is reported as timed
out, and the next call starts a new child. A child that dies (a crash, `sys.exit`, the
out-of-memory killer) costs only the call it was making. Each call and its answer carry a
number, and a process the function forked that returns from it exits there: no answer ever
goes to a call it was not for.

The function is named by a user's file ('path/to/rewards.py:score', keyed by its digest), an
installed module outside Ratchet ('package.module:score'), or, for Ratchet's own scorers, the
function object itself (`target`): a stage that scores with it then reaches its code, and its
key changes with it (tasks/runner/code_reach.py).

Calls are (completion, answer=, prompt=, **fields) for one row, or, batched, lists under
TRL's names (completions, prompts=, answer=, ...) returning a list. Two other conventions
are taken unchanged, named in config or found from the function's signature (`auto`):
TRL's reward functions (`completions` among its parameters: every list by keyword, as TRL's
trainers call them; with `messages`, each completion and prompt as a list of chat messages, as
TRL passes a conversational dataset) and verl's `compute_score(data_source, solution_str,
ground_truth, extra_info)` (one row; `data_source` from the row's `data_source` column, else "";
the prompt and the other columns in `extra_info`; a scorer of verl's own modules gets the
arguments it names). A function may be `async def`. It returns a float, a bool, None
(unscored) or {"score": x, **metrics}; the child checks the value and says what is wrong with
it, naming what came back.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ratchet.data.procs.channel import Channel, user_traceback
from ratchet.data.procs.entry import LoadError, entry, load_spec, split_spec, target_of
from ratchet.data.procs.host import KEPT, CallHost, HostError, serve_calls


@dataclass(frozen=True)
class Call:
    """One call's outcome: a score (None: the function returned None), its metrics, or a failure."""

    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str | None = None  # what went wrong, for the user: the exception and its traceback, a bad value, a timeout


class ScorerError(Exception):
    """The function cannot be used at all (not importable, not callable, wrong signature)."""


def spec_of(target: str | Callable) -> str:
    """A scoring function as its host loads it: a user's 'file.py:name' or 'module:name' as given
    (keyed by its file's digest), or one of Ratchet's functions by the object (its name found from
    it; a stage that runs it reaches its code)."""
    return target_of(target) if callable(target) else target


class Scorer:
    """A child process that runs `target` (see the module docstring); one call at a time."""

    def __init__(self, target: str | Callable, *, batched: bool, timeout_s: float, load_timeout_s: float = 120.0,
                 before_load: Callable[[], None] | None = None, fields: tuple[str, ...] = (),
                 convention: str = "ratchet", messages: bool | str = False):
        self.spec, self.batched, self.timeout_s, self.load_timeout_s = spec_of(target), batched, timeout_s, load_timeout_s
        self.convention = convention  # ratchet, trl, verl, or auto (found from the signature when loaded)
        self.messages = messages  # trl: completions and prompts as chat messages; auto: from the annotation
        self.fields = tuple(fields)  # the rows' other columns, which the signature must take by name
        self.host = CallHost(scorer_host, [self.spec, self.batched, list(self.fields), self.convention, self.messages],
                             load_s=load_timeout_s, before_start=before_load)

    @property
    def proc(self):
        return self.host.proc

    @property
    def calls(self) -> int:
        return self.host.calls

    @property
    def timeouts(self) -> int:
        return self.host.timeouts

    @property
    def restarts(self) -> int:
        return self.host.restarts

    def start(self) -> dict[str, Any]:
        """Start the child and load the function; returns what it found (its signature)."""
        try:
            reply = self.host.start()
        except HostError as e:
            raise ScorerError(str(e) if e.said else f"{self.spec}: {e}") from None
        if reply.get("convention") in CONVENTIONS:  # what `auto` found: the calls take its shape
            self.convention, self.batched = reply["convention"], bool(reply.get("batched"))
            self.messages = bool(reply.get("messages"))
        return reply

    def close(self) -> None:
        self.host.close()

    def call(self, kwargs: dict[str, Any]) -> list[Call] | Call:
        """One call: a Call, or (batched) one Call per row; a timeout or a dead child is a failure
        of this call alone, and the next call starts a new child."""
        try:
            how, reply = self.host.call({"kwargs": kwargs}, self.timeout_s)
        except HostError as e:
            raise ScorerError(str(e) if e.said else f"{self.spec}: {e}") from None
        if how == "died":
            return self._failed(kwargs, f"its process died during the call (exit code {reply})")
        if how == "timeout":
            return self._failed(kwargs, f"timed out after {self.timeout_s:g} s (check.timeout_s)")
        return [Call(**r) for r in reply["results"]] if self.batched else Call(**reply["result"])

    def _failed(self, kwargs: dict, why: str):
        c = Call(failure=why)
        return [c] * _rows(kwargs) if self.batched else c


def shared(target: str | Callable, *, batched: bool, timeout_s: float, tag: str = "",
           before_load: Callable[[], None] | None = None, convention: str = "ratchet",
           messages: bool | str = False, fields: tuple[str, ...] = ()) -> Scorer:
    """This process's scorer for `target` (and `tag`: what else tells two versions apart), started on
    first use and kept for the calls after (a stage's units share it; data/procs/host.py `Kept`).
    `fields`: the rows' other columns, which its signature is checked against when it loads."""
    key = ("scorer", spec_of(target), tag, batched, timeout_s, convention, messages, fields)
    return KEPT.get(key, lambda: Scorer(target, batched=batched, timeout_s=timeout_s, before_load=before_load,
                                        convention=convention, messages=messages, fields=fields))


def close_all() -> None:
    """Close this process's kept scorers (the next call starts its own)."""
    KEPT.close(Scorer)


def _rows(kwargs: dict) -> int:
    return len(kwargs.get("completions") or [])


# the child's side ---------------------------------------------------------------------------

def _load(spec: str):
    try:
        fn = load_spec(spec, "functions")
    except LoadError as e:
        raise ScorerError(str(e)) from None
    if not callable(fn):
        raise ScorerError(f"{spec}: {split_spec(spec)[1]!r} is a {type(fn).__name__}, not a function")
    return fn


CONVENTIONS = ("ratchet", "trl", "verl")
VERL = ("data_source", "solution_str", "ground_truth", "extra_info")


def _parameters(fn) -> list[str] | None:
    import inspect

    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None  # a builtin or C function: its call will tell


def found_convention(fn, asked: str) -> str:
    """`asked`, or for `auto` the convention the signature speaks: verl's names, TRL's
    `completions`, else Ratchet's own."""
    if asked != "auto":
        return asked
    names = set(_parameters(fn) or ())
    if {"solution_str", "ground_truth"} & names:
        return "verl"
    if "completions" in names:
        return "trl"
    return "ratchet"


def found_messages(fn, asked: bool | str, convention: str) -> bool:
    """Whether a TRL function takes its completions and prompts as chat messages: `asked`, or for
    `auto` what its `completions` annotation says (TRL's own reward functions annotate
    `list[list[dict[str, str]]]`). Raises ScorerError for messages asked of another convention."""
    if asked is True and convention != "trl":
        raise ScorerError(f"messages: true gives TRL's reward functions chat messages, but "
                          f"{getattr(fn, '__name__', fn)!r} is called in the {convention} convention; remove messages "
                          "or set the check's convention: trl")
    if asked != "auto" or convention != "trl":
        return asked is True
    import inspect

    try:
        hint = inspect.signature(fn).parameters["completions"].annotation
    except (TypeError, ValueError, KeyError):
        return False
    if hint is inspect.Parameter.empty:
        return False
    text = (hint if isinstance(hint, str) else repr(hint)).replace("typing.", "").lower()  # List[List[Dict]] too
    return re.search(r"list\[\s*list\[\s*dict", text) is not None


def as_messages(kwargs: dict) -> dict:
    """A TRL call's completions and prompts as a conversational dataset gives them: each a list
    of one message (TRL's `completion[0]["content"]`)."""
    out = dict(kwargs)
    out["completions"] = [[{"role": "assistant", "content": c}] for c in kwargs["completions"]]
    if "prompts" in kwargs:
        out["prompts"] = [None if p is None else [{"role": "user", "content": p}] for p in kwargs["prompts"]]
    return out


def _signature_problem(fn, batched: bool, fields: list[str] = (), convention: str = "ratchet") -> str | None:
    """Why fn cannot take a row's fields (and its other columns, `fields`) by name, or None."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C function: its call will tell
    if convention == "verl":
        row = {"data_source": "", "solution_str": "", "ground_truth": "", "extra_info": {}}
        probe = ((), {k: x for k, x in row.items() if k in verl_names(fn)})
        want = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
    elif convention == "trl":
        probe = ((), {"completions": [""], "prompts": [""], "answer": [""], **{f: [""] for f in fields}})
        want = "reward(completions, prompts=None, answer=None, **kwargs) returning a list, as TRL calls it"
    elif batched:
        probe = (([""], ), {"prompts": [""], "answer": [""], **{f: [""] for f in fields}})
        want = "score(completions, prompts=None, answer=None, **fields) returning a list"
    else:
        probe = (("",), {"prompt": "", "answer": "", **{f: "" for f in fields}})
        want = "score(completion, answer=None, prompt=None, **fields)"
    try:
        sig.bind(*probe[0], **probe[1])
    except TypeError as e:
        cols = f"; the rows' other columns {sorted(fields)} come by name too" if fields and convention != "verl" else ""
        return f"{fn.__name__}{sig} cannot take a row's fields by name ({e}{cols}); define it as {want}"
    return None


def verl_names(fn) -> tuple[str, ...]:
    """Of verl's four arguments, those `fn` is called with: the ones it names (all, where it takes
    **kwargs), and always the completion and the reference. A scorer of verl's own modules
    (`gsm8k.compute_score(solution_str, ground_truth)`) is called as verl's dispatcher calls it, a
    custom reward function with all four."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return VERL
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return VERL
    return tuple(k for k in VERL if k in params or k in ("solution_str", "ground_truth"))


def _verl_kwargs(row: dict) -> dict:
    """A row's fields as verl's compute_score takes them."""
    rest = dict(row)
    solution, truth, prompt = rest.pop("completion"), rest.pop("answer", None), rest.pop("prompt", None)
    source = rest.pop("data_source", None)
    return {"data_source": source if isinstance(source, str) else "", "solution_str": solution,
            "ground_truth": truth, "extra_info": {"prompt": prompt, **rest}}


# the names a metric may have: a subset of what MLflow logs (it also takes spaces, slashes and
# colons, but refuses '@', '%' and others), checked at the call, before the stage writes its manifest
METRIC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def _value(v) -> dict:
    """A returned value as a Call's fields, or its failure naming what came back."""
    import math

    if isinstance(v, dict):
        if "score" not in v:
            return {"failure": f"returned a dict without 'score' ({sorted(v)[:8]}); return {{'score': x, ...}}"}
        metrics = {}
        for k, x in v.items():
            if k == "score":
                continue
            if not isinstance(k, str) or not METRIC_NAME.fullmatch(k):
                return {"failure": f"returned metric name {k!r:.80}, which MLflow cannot log; name metrics with "
                                   "letters, digits and _ - . (at most 100), e.g. 'pass_at_1'"}
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                return {"failure": f"returned metric {k!r} = {x!r:.80}; metrics must be finite numbers"}
            metrics[str(k)] = float(x)
        out = _value(v["score"])
        return {**out, "metrics": metrics} if "failure" not in out else out
    if v is None:
        return {"score": None}
    if isinstance(v, bool):
        return {"score": float(v)}
    if isinstance(v, (int, float)) and not isinstance(v, complex):
        try:
            x = float(v)
        except OverflowError:
            return {"failure": f"returned {str(v)[:40]}..., too large for a float; return a finite number"}
        if not math.isfinite(x):
            return {"failure": f"returned {x!r}; a score must be a finite number (or None: unscored)"}
        return {"score": x}
    try:  # numpy and torch scalars
        return _value(v.item())
    except Exception:  # noqa: BLE001 - anything else is the wrong type, said below
        pass
    return {"failure": f"returned {type(v).__name__} {v!r:.80}; return a float, a bool, None or {{'score': x, ...}}"}


def _user_traceback(exc: BaseException) -> str:
    """The traceback from the user's function down, without this module's frames."""
    return user_traceback(exc, skip=(__file__,))


@entry
def scorer_host(channel: Channel, spec: str, batched: bool, fields: list[str], asked: str = "ratchet",
                asked_messages: bool | str = False) -> int:
    """A scorer's child (see the module docstring): load the function, say what was found, then
    answer calls until the stage's side closes the channel."""
    import asyncio
    import inspect

    def hello(**obj) -> int:
        channel.send(obj)
        return 0

    try:
        fn = _load(spec)
    except ScorerError as e:
        return hello(ok=False, error=str(e))
    except BaseException as e:  # noqa: BLE001 - the user's module failed to import: its traceback
        return hello(ok=False, error=f"{spec}: importing it failed:\n{_user_traceback(e)}")
    convention = found_convention(fn, asked)
    batched = convention == "trl" or (convention == "ratchet" and batched)
    if (problem := _signature_problem(fn, batched, fields, convention)) is not None:
        return hello(ok=False, error=f"{spec}: {problem}")
    try:
        chat = found_messages(fn, asked_messages, convention)
    except ScorerError as e:
        return hello(ok=False, error=f"{spec}: {e}")
    channel.send({"ok": True, "async": inspect.iscoroutinefunction(fn), "convention": convention,
                  "batched": batched, "messages": chat})
    verl = verl_names(fn) if convention == "verl" else VERL

    def first(kwargs: dict) -> list:
        return kwargs["completions"] if batched else kwargs["completion"]

    def handle(call: dict) -> dict:
        kwargs = dict(call["kwargs"])
        n = len(first(kwargs)) if batched else 1
        if convention == "trl":  # every list by keyword, as TRL's trainers call a reward function
            v = fn(**(as_messages(kwargs) if chat else kwargs))
        elif convention == "verl":
            v = fn(**{k: x for k, x in _verl_kwargs(kwargs).items() if k in verl})
        else:
            v = fn(kwargs.pop("completions" if batched else "completion"), **kwargs)
        if inspect.isawaitable(v):
            v = asyncio.run(_await(v))
        if not batched:
            return {"result": _value(v)}
        if not isinstance(v, (list, tuple)) or len(v) != n:
            what = f"{type(v).__name__} of {len(v)}" if isinstance(v, (list, tuple)) else type(v).__name__
            failure = f"returned a {what} for {n} rows; a batched function returns one value per row"
            return {"results": [{"failure": failure}] * n}
        return {"results": [_value(x) for x in v]}

    def failed(call: dict, e: BaseException) -> dict:
        hint = ("\n(a TRL reward function written for a conversational dataset reads completion[0]['content']: "
                "set the check's messages: true to pass each completion as a list of chat messages)"
                if convention == "trl" and not chat and isinstance(e, TypeError) and "string indices" in str(e)
                else "")
        failure = {"failure": f"raised {type(e).__name__}: {e}\n{_user_traceback(e)}{hint}"}
        kwargs = call["kwargs"]
        return {"results": [failure] * len(kwargs.get("completions") or [])} if batched else {"result": failure}

    return serve_calls(channel, handle, failed)


async def _await(v):
    return await v
