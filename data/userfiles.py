"""Files the user supplies, as one typed kind of config field.

    path: UserPath = Field(...)                                  # a file or directory
    function: Annotated[str, UserFile(spec=True, digest="source")]  # 'path/to/file.py:name'

A field typed `UserPath` (or annotated with `UserFile`) names something on the user's disk:
prompt files, held-out sets' files, a scoring function's file, the policy's or a fixed judge's
model directory. Declaring it is all a config section does; one walker then finds every such
field anywhere in the pipeline config (inside lists and unions too), so

- a deployment makes every one of them absolute (`with_absolute_paths`), and drops the content
  digest a field keeps beside its path (`digest=`), so each scheduled run takes it again;
- `user_files` lists them by dotted field (absolute), for a caller that must name every one.

What a user file's content changes is keyed where it is read: data files by the digests the
prompt stages key on (and the run's name), a function's file by its config's `source` digest,
model directories by the weights' digests of the `base` and `label-model` stages.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel


@dataclass(frozen=True)
class UserFile:
    """The marker. `spec`: the value is 'path:name', or a module 'pkg.mod:name' (not a file);
    `digest`: the sibling field holding the file's content digest, taken again after a move;
    `keep`: values that are names, not paths (the embedded 'default' model)."""

    spec: bool = False
    digest: str | None = None
    keep: tuple[str, ...] = ()

    def path_of(self, value: str) -> Path | None:
        """The local file or directory `value` names, or None (a hub id, a module, a kept name)."""
        if not value or value in self.keep:
            return None
        if self.spec:
            from ratchet.data.checks.scorer import is_file_spec

            where, sep, _ = value.rpartition(":")
            if not sep or not is_file_spec(where):
                return None  # an installed module's function
            value = where
        p = Path(value).expanduser()
        return p if p.exists() else None

    def absolute(self, value: str) -> str:
        p = self.path_of(value)
        if p is None:
            return value
        return f"{p.resolve()}:{value.rpartition(':')[2]}" if self.spec else str(p.resolve())


UserPath = Annotated[str, UserFile()]


def marker(model: type[BaseModel], name: str) -> UserFile | None:
    """The UserFile marker of field `name` (also inside an optional: `UserPath | None`), or None."""
    field = model.model_fields[name]
    found = [m for m in field.metadata if isinstance(m, UserFile)]
    stack = [field.annotation]
    while stack and not found:
        t = stack.pop()
        found = [m for m in getattr(t, "__metadata__", ()) if isinstance(m, UserFile)]
        stack += list(typing.get_args(t))
    return found[0] if found else None


def user_files(model: BaseModel) -> dict[str, Path]:
    """Every user file the config names that exists here, absolute, by dotted field (list items as [i])."""
    return {at: path.resolve() for at, owner, name, value in config_fields(model)
            if isinstance(value, str) and (m := marker(type(owner), name)) is not None
            and (path := m.path_of(value)) is not None}


def with_absolute_paths(model: BaseModel) -> BaseModel:
    """`model` with every user file it names (at any depth) made absolute, and each digest kept
    beside one cleared so the next reader takes it again."""
    update: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        m = marker(type(model), name)
        if m is not None and isinstance(value, str) and m.path_of(value) is not None:
            update[name] = m.absolute(value)
            if m.digest is not None:
                update[m.digest] = None
        elif isinstance(value, BaseModel):
            update[name] = with_absolute_paths(value)
        elif isinstance(value, list) and any(isinstance(v, BaseModel) for v in value):
            update[name] = [with_absolute_paths(v) if isinstance(v, BaseModel) else v for v in value]
    return model.model_copy(update=update) if update else model


def annotated_fields(model: type[BaseModel]) -> dict[str, UserFile]:
    """The fields of a config class that are user files."""
    return {n: m for n in model.model_fields if (m := marker(model, n)) is not None}


def config_fields(model: BaseModel, at: str = ""):
    """(dotted field, the model that holds it, its name, its value) for every field at any depth."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        here = f"{at}.{name}" if at else name
        yield here, model, name, value
        if isinstance(value, BaseModel):
            yield from config_fields(value, here)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, BaseModel):
                    yield from config_fields(v, f"{here}[{i}]")
