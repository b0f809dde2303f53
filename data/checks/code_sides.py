"""The two processes of an assert-form code check, each run in a sandbox of its own.

    python3 code_sides.py program /box/program.py   # the program's side: answers calls
    python3 code_sides.py tests /box/tests.py       # the tests' side: asks, compares, reports

The program's side loads the model's program and then only answers questions about it:
"call `add` with (2, 3)", "the attribute `x` of object 4", "the next item of iterator 5". The
tests' side runs the row's tests in its own interpreter, where every name the program defines
stands for the program's object. A value that comes back is data (None, bools, numbers,
strings, bytes, and lists, tuples, dicts and sets of them), rebuilt from text as Python's own
types, so `==`, `is True`, `sorted` and every comparison a test makes are the tests' side's,
never the program's. Anything else (a function, an instance of the program's class) comes
back as a reference, which a test can call, read attributes of, iterate, index, measure and
print through the program, but never compare: its `==` is identity and its truth value is an
error.

The expected values never reach the program: it sees only the arguments of its calls. The
program's side's own process is the program's to do with as it likes (rewrite this file's
code in memory, print anything, exit); its reach ends at the pipe, whose every line the tests'
side parses as data. So the verdict is the tests' side's, and a program passes a test only by
answering each call the test makes with the value the test wants.

The tests' side writes its report on its stderr, which only the parent reads: `tests N`, then
one `pass I` or `fail I` per test statement as it ends.

Standard library only: this file runs in a sandbox with the system's Python.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import os
import sys

DEPTH = 64  # nesting of a value on the wire
PLAIN_SCALARS = (bool, int, float, complex, str, bytes)


class RemoteError(Exception):
    """The program raised an exception that is not one of Python's own, or the pipe broke."""


# -- the wire: JSON, with tags for what JSON lacks -------------------------------------------


def encode(value, handle, depth: int = 0):
    """A value as JSON data; `handle(obj)` gives the reference for what is not data."""
    if depth > DEPTH:
        raise ValueError("a value nested too deep")
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return {"i": str(int(value))}
    if isinstance(value, float):
        f = float(value)
        return {"x": f.hex()} if math.isfinite(f) else {"x": repr(f)}
    if isinstance(value, complex):
        c = complex(value)
        return {"c": [encode(c.real, handle, depth + 1), encode(c.imag, handle, depth + 1)]}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, list):
        return [encode(v, handle, depth + 1) for v in list(value)]
    if isinstance(value, tuple):
        return {"t": [encode(v, handle, depth + 1) for v in tuple(value)]}
    if isinstance(value, frozenset):
        return {"f": [encode(v, handle, depth + 1) for v in frozenset(value)]}
    if isinstance(value, set):
        return {"s": [encode(v, handle, depth + 1) for v in set(value)]}
    if isinstance(value, dict):
        return {"d": [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in dict(value).items()]}
    return handle(value)


def decode(data, remote, depth: int = 0):
    """JSON data back to Python's own types (only those: nothing on the wire can choose a class);
    `remote(ref)` makes the stand-in for a reference. Malformed data raises ValueError."""
    if depth > DEPTH:
        raise ValueError("a value nested too deep")
    if data is None or type(data) in (bool, str):
        return data
    if type(data) is list:
        return [decode(v, remote, depth + 1) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError(f"not a value: {str(data)[:80]}")
    ((tag, body),) = data.items()
    items = lambda: [decode(v, remote, depth + 1) for v in _list(body)]  # noqa: E731
    if tag == "i" and type(body) is str:
        return int(body)
    if tag == "x" and type(body) is str:
        return float(body) if body in ("inf", "-inf", "nan") else float.fromhex(body)
    if tag == "c":
        re_, im = items()
        if type(re_) is not float or type(im) is not float:
            raise ValueError("a complex number of non-floats")
        return complex(re_, im)
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "t":
        return tuple(items())
    if tag == "s":
        return set(items())
    if tag == "f":
        return frozenset(items())
    if tag == "d":
        out = {}
        for pair in _list(body):
            k, v = _list(pair)
            out[decode(k, remote, depth + 1)] = decode(v, remote, depth + 1)
        return out
    if tag == "h" and type(body) is int:
        return remote(data)
    raise ValueError(f"not a value: {str(data)[:80]}")


def _no_digit_limit() -> None:
    if hasattr(sys, "set_int_max_str_digits"):  # 3.11+ (and late 3.10s): a value's size is bounded by the pipe's
        sys.set_int_max_str_digits(0)


def _list(x) -> list:
    if type(x) is not list:
        raise ValueError("expected a list")
    return x


# -- the program's side --------------------------------------------------------------------


def serve(path: str) -> None:
    """Load the program, say which names it defines, then answer requests until stdin ends."""
    _no_digit_limit()
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the program's input() ends at once; its prints go nowhere
    os.dup2(null, 1)
    objects: list = []  # every object a test has a reference to, kept alive so that ids stay unique
    seen: dict[int, int] = {}

    def handle(obj):
        if id(obj) not in seen:
            seen[id(obj)] = len(objects)
            objects.append(obj)
        return {"h": seen[id(obj)]}

    def say(message) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    g = {"__name__": "solution"}
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), "program.py", "exec"), g)
    except BaseException as e:  # noqa: BLE001 - the program failed to load: every test fails
        say({"failed": type(e).__name__})
        return
    names = {}
    for name, value in list(g.items()):
        if not name.startswith("__"):
            try:
                names[name] = encode(value, handle)
            except Exception:  # noqa: BLE001 - a value that cannot be sent: left out
                pass
    say({"names": names})
    for line in requests:
        try:
            ask = json.loads(line)
            target = objects[ask["h"]]
            args = [decode(a, lambda ref: objects[ref["h"]]) for a in ask["args"]]
            kwargs = {str(k): decode(v, lambda ref: objects[ref["h"]]) for k, v in ask["kwargs"]}
            value = _do(ask["op"], target, args, kwargs)
            say({"ok": encode(value, handle)})
        except BaseException as e:  # noqa: BLE001 - the program's exception, sent to the test
            say({"raised": type(e).__name__})


def _do(op: str, target, args: list, kwargs: dict):
    if op == "call":
        return target(*args, **kwargs)
    if op == "attr":
        return getattr(target, args[0])
    if op == "item":
        return target[args[0]]
    if op == "iter":
        return iter(target)
    if op == "next":
        return next(target)
    if op == "len":
        return len(target)
    if op == "str":
        return str(target)
    if op == "repr":
        return repr(target)
    if op == "int":
        return int(target)
    if op == "float":
        return float(target)
    raise ValueError(op)


# -- the tests' side -----------------------------------------------------------------------


class Channel:
    """The tests' side of the pipe: one request, one line back, read as data."""

    def __init__(self, cap: int):
        self.replies = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace", newline="\n")
        self.requests = os.fdopen(os.dup(1), "w", encoding="utf-8")
        self.cap = cap
        self.broken = False

    def read(self):
        if self.broken:
            raise RemoteError("the program's side has stopped answering")
        line = self.replies.readline(self.cap)
        if not line.endswith("\n"):  # it ended, or sent a line past the cap: nothing after it is read
            self.broken = True
            raise RemoteError("the program's side ended" if not line else "a reply past the size limit")
        try:
            return json.loads(line)
        except (ValueError, RecursionError) as e:
            self.broken = True
            raise RemoteError("a reply that is not JSON") from e

    def ask(self, op: str, ref: dict, args=(), kwargs=None):
        wire = lambda v: encode(v, _reference)  # noqa: E731
        try:
            message = {"op": op, **ref, "args": [wire(a) for a in args],
                       "kwargs": [[k, wire(v)] for k, v in (kwargs or {}).items()]}
            text = json.dumps(message)
        except (ValueError, TypeError, RecursionError) as e:
            raise TypeError(f"a test can send the program only values and its own objects: {e}") from None
        if self.broken:
            raise RemoteError("the program's side has stopped answering")
        try:
            self.requests.write(text + "\n")
            self.requests.flush()
        except OSError:
            self.broken = True
            raise RemoteError("the program's side has stopped answering") from None
        reply = self.read()
        if type(reply) is not dict or len(reply) != 1:
            raise RemoteError("a reply that is not one")
        if "ok" in reply:
            try:
                return decode(reply["ok"], _remote)
            except (ValueError, TypeError, RecursionError, MemoryError) as e:
                raise RemoteError(f"a reply that is not a value: {e}") from None
        raised = reply.get("raised")
        kind = getattr(builtins, raised, None) if type(raised) is str else None
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                error = kind("raised by the program")
            except Exception:  # noqa: BLE001 - one that takes other arguments
                error = None
            if error is not None:
                raise error
        raise RemoteError(f"the program raised {str(raised)[:80]}")


CHANNEL: Channel | None = None


REMOTES: dict[int, Remote] = {}


def _remote(ref: dict) -> Remote:
    """One stand-in per object of the program's, so that `is` and `==` between them are its identity."""
    if ref["h"] not in REMOTES:
        REMOTES[ref["h"]] = Remote(ref)
    return REMOTES[ref["h"]]


def _reference(obj):
    if type(obj) is Remote:
        return dict(object.__getattribute__(obj, "_ref"))
    raise TypeError(f"{type(obj).__name__} is neither a value nor one of the program's objects")


class Remote:
    """One of the program's objects, as a test sees it: asked through the pipe, never compared."""

    __slots__ = ("_ref",)

    def __init__(self, ref: dict):
        object.__setattr__(self, "_ref", ref)

    def _ask(self, op: str, *args, **kwargs):
        return CHANNEL.ask(op, object.__getattribute__(self, "_ref"), args, kwargs)

    def __call__(self, *args, **kwargs):
        return self._ask("call", *args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask("attr", name)

    def __getitem__(self, key):
        return self._ask("item", key)

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __len__(self) -> int:
        return _typed(self._ask("len"), int)

    def __str__(self) -> str:
        return _typed(self._ask("str"), str)

    def __repr__(self) -> str:
        return _typed(self._ask("repr"), str)

    def __int__(self) -> int:
        return _typed(self._ask("int"), int)

    def __float__(self) -> float:
        return _typed(self._ask("float"), float)

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    __hash__ = object.__hash__

    def __bool__(self):
        raise TypeError("a test reads values from the program, not the truth of its objects")


def _typed(value, kind):
    if type(value) is not kind:
        raise TypeError(f"the program gave a {type(value).__name__} where Python needs a {kind.__name__}")
    return value


def run_tests(path: str, cap: int) -> None:
    """Run each top-level statement of the tests on its own; report each as it ends."""
    global CHANNEL
    _no_digit_limit()
    report = os.fdopen(os.dup(2), "w", encoding="utf-8")
    CHANNEL = Channel(cap)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the tests' own prints and input() touch neither the pipe nor the report
        os.dup2(null, fd)
    try:
        with open(path, encoding="utf-8") as f:
            tests = ast.parse(f.read()).body
    except (SyntaxError, ValueError):
        tests = []
    report.write(f"tests {len(tests)}\n")
    report.flush()
    names: dict = {}
    try:
        hello = CHANNEL.read()
        if type(hello) is dict and type(hello.get("names")) is dict:
            for name, data in hello["names"].items():
                if type(name) is str and name.isidentifier() and not name.startswith("__") \
                        and not hasattr(builtins, name):
                    try:  # a program's name that shadows a builtin is not the tests': `len` stays Python's
                        names[name] = decode(data, _remote)
                    except (ValueError, TypeError, RecursionError, MemoryError):
                        pass
        else:
            CHANNEL.broken = True  # it failed to load: every test fails
    except RemoteError:
        pass
    g = {"__name__": "tests", "__builtins__": builtins, **names}
    for i, t in enumerate(tests):
        ok = False
        if not CHANNEL.broken:  # once the program's side has failed, nothing more passes
            try:
                exec(compile(ast.Module([t], []), "tests.py", "exec"), g)
                ok = True
            except BaseException:  # noqa: BLE001 - a failed test, whatever it raised
                pass
        report.write(f"{'pass' if ok else 'fail'} {i}\n")
        report.flush()
    report.write("done\n")
    report.flush()


if __name__ == "__main__":
    if sys.argv[1] == "program":
        serve(sys.argv[2])
    else:
        run_tests(sys.argv[2], int(sys.argv[3]))
