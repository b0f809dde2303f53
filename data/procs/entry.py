"""Entries: what a child process Ratchet starts runs as its main, declared where it is defined.

    @entry
    def scorer_host(channel: Channel, spec: str) -> int:
        ...

An entry is a module-level function, wrapped in an `Entry` by the decorator. The engine room starts a child only for an `Entry` object (spawn.start, the fork
server, the pool's holders, a launcher such as torchrun); the child finds it again by the name
the object gives (`module:qualname`), and refuses a name that is not an entry. A caller hands the
object itself, a name its own code loads, so a stage's code version (tasks/runner/code_reach.py)
reaches the entry and, through it, every definition the child runs: no string names a child's
code where a key cannot see it.

What an entry's child runs that its main reaches only at run time (the function a scorer host
loads, the environment class an episode plays) is handed over the same way: as the object
(`target_of`), or as a user's file, whose digest keys the stage (data/userfiles.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

class EntryError(Exception):
    """A child was asked to run something that is not a declared entry."""


class Entry:
    """A child process's main: a module-level function (its code root). Calling
    the entry calls the function, so it stays usable in-process (tests, a direct call)."""

    def __init__(self, main: Callable[..., Any]):
        module, qualname = getattr(main, "__module__", None), getattr(main, "__qualname__", "")
        if not module or "<" in qualname or "." in qualname:
            raise EntryError(f"{main!r} is not a module-level function: a child process can only import one by name")
        self.main, self.name = main, f"{module}:{qualname}"
        functools.update_wrapper(self, main)

    def __call__(self, *args, **kwargs):
        return self.main(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Entry({self.name})"

    def __reduce__(self):  # pickled by name, as the child finds it: the same object there
        return (resolve, (self.name,))


def entry(main: Callable[..., Any]) -> Entry:
    """Declare `main` as the main of a child process (see the module docstring)."""
    return Entry(main)


def target_of(obj: Any) -> str:
    """`module:qualname` of a module-level function or class, checked to find the object again:
    how a child imports what it was handed. A nested or local definition cannot be found by a
    child, and is refused here, before any process starts."""
    if isinstance(obj, Entry):
        return obj.name
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise EntryError(f"{obj!r} is not a module-level function or class; a child process can only import one of "
                         "those by name")
    name = f"{module}:{qualname}"
    try:
        found = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError) as e:
        raise EntryError(f"{name} cannot be found by its name ({type(e).__name__}: {e})") from None
    if found is not obj and getattr(found, "main", None) is not obj:
        raise EntryError(f"{name} names another object than the one given; a child would run that one")
    return name


def resolve(name: str) -> Entry:
    """The entry `name` ("module:qualname") names, imported; EntryError for anything else."""
    module, sep, qualname = name.partition(":")
    if not sep or not module:
        raise EntryError(f"{name!r} is not the name of an entry ('module:function')")
    found = getattr(importlib.import_module(module), qualname, None)
    if not isinstance(found, Entry):
        raise EntryError(f"{name} is not a declared entry (a function decorated with @entry); a child runs nothing "
                         "else")
    return found


def load_target(name: str) -> Any:
    """What `target_of` named: a module-level function or class of an installed module."""
    module, _, qualname = name.partition(":")
    obj = getattr(importlib.import_module(module), qualname)
    return obj.main if isinstance(obj, Entry) else obj


def takes_channel(e: Entry) -> bool:
    """Whether the entry's main takes the channel to its parent as its first argument."""
    params = list(inspect.signature(e.main).parameters)
    return bool(params) and params[0] == "channel"


class LoadError(Exception):
    """A user's code named by a spec cannot be loaded (no such file, module or name)."""


def split_spec(spec: str) -> tuple[str, str]:
    """'path/to/file.py:score' or 'package.module:score' -> (module or file, name)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{spec!r} is not 'path/to/file.py:function' or 'package.module:function'")
    return where, name


def is_file_spec(where: str) -> bool:
    return where.endswith(".py") or "/" in where or (os.sep in where)


def load_spec(spec: str, listing: str = "names"):
    """What a host loads for the user: the name `spec` gives, from a file ('path/to/file.py:name',
    imported as a module of its own, its folder first on the import path so the helpers beside it
    import as they would for the user) or an installed module ('package.module:name', also from
    the directory ratchet runs from). LoadError, naming the module's `listing`, where it is not
    there; the user's own exception where importing it fails."""
    import importlib.util
    import sys
    from pathlib import Path

    where, name = split_spec(spec)
    if is_file_spec(where):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise LoadError(f"{spec}: no file {path}")
        mod_name = f"ratchet_user_{path.stem}"
        mod_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.parent))
        mod_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(where)
    found = getattr(module, name, None)
    if found is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise LoadError(f"{spec}: {where} defines no {name!r} (its {listing}: {names or 'none'})")
    return found
