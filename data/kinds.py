"""Kind families: the one way a configurable family registers its kinds.

A family is a config field that takes one of several kinds, each a config model with a `kind`
literal: the answer checks, the prompt sources, the rollouts, the labels, the filters, the train
kinds and the executors. Each family is written in its own module, once, as

    FamilyConfig = Annotated[AKind | BKind | CKind, Field(discriminator="kind")]

which is the whole of its registration: the config field's type, the dispatch (a config holds
an instance of its kind's class, which does the work), and, read back by `members`, every table
of kinds a check or a message needs. The form is also what tasks/runner/code_reach.py recognises as a
family: a stage that holds one kind is keyed by that kind's code alone, never by its siblings'.
"""

from __future__ import annotations

import typing
from typing import Any


def kind_of(cls: type) -> str:
    """The kind a member of a family names itself (its `kind` field's default)."""
    return cls.model_fields["kind"].default


def members(family: Any) -> dict[str, type]:
    """kind -> config class of a family (`Annotated[A | B, Field(discriminator="kind")]`), in the
    order the family lists them; a lone class is a family of one."""
    inner = typing.get_args(family)[0] if typing.get_origin(family) is typing.Annotated else family
    found = {}
    for cls in typing.get_args(inner) or (inner,):
        kind = kind_of(cls)
        if kind in found:
            raise TypeError(f"two kinds of one family are named {kind!r}: {found[kind].__name__} and {cls.__name__}")
        found[kind] = cls
    return found


def member(family: Any, kind: str, field: str) -> type:
    """The config class of `kind` in `family`; a ValueError naming the field and the kinds there are."""
    known = members(family)
    if kind not in known:
        raise ValueError(f"{field}={kind!r} is not a known kind; use one of {list(known)}")
    return known[kind]
