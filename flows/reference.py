"""The config reference, generated from the config models themselves.

    ratchet config --reference > docs/reference/config.md    the whole reference, as Markdown
    ratchet config --explain label.mode                      one field's entry

Every field of `PipelineConfig` is walked: its type, default, allowed values and description
come from its pydantic field, and a section that is a union of kinds (data, label, filter,
train, data.check) lists the fields every kind shares, then each kind's own. Nothing here
names a kind: a new kind's fields appear once its module declares them, and a test fails
when the committed reference differs from what the models generate.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ratchet.data.userfiles import UserFile

DOC = "docs/reference/config.md"


@dataclass(frozen=True)
class Entry:
    """One field: `path` is dotted (a list's items as `sets[]`), `kind` the variant it belongs to."""

    path: str
    type: str
    default: str
    allowed: str
    description: str
    kind: str | None = None  # e.g. 'judge' for the fields of label.kind=judge; None: every kind
    see: str | None = None  # the section of kinds this field holds, listed once elsewhere
    owner: str | None = None  # the section whose `kind` is `kind` (label, for label.judge.mode under mcts)


@dataclass
class Section:
    """A top-level section, or a union of kinds met inside one (data.check)."""

    path: str
    about: str
    entries: list[Entry] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)  # kind -> what it is (its class docstring)
    default_kind: str | None = None


# ---------------------------------------------------------------- reading annotations


def _unwrap(ann: Any) -> tuple[Any, list[Any]]:
    """Annotated[X, meta...] -> (X, meta)."""
    meta: list[Any] = []
    while typing.get_origin(ann) is typing.Annotated:
        args = typing.get_args(ann)
        ann, meta = args[0], meta + list(args[1:])
    return ann, meta


def _is_union(ann: Any) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType)


def _models(ann: Any) -> list[type[BaseModel]]:
    """The config models a field holds (itself, in a union, or as a list's items)."""
    ann, _ = _unwrap(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    if _is_union(ann) or typing.get_origin(ann) is list:
        return [m for a in typing.get_args(ann) for m in _models(a)]
    return []


def _not_taken(model: type[BaseModel]) -> dict[str, str]:
    """The fields a kind has (from a base it shares) but refuses where given (`not_taken`): the
    reference lists them under the kinds that take them, not under every kind."""
    return getattr(model, "not_taken", {})


def _kind_of(model: type[BaseModel]) -> str | None:
    f = model.model_fields.get("kind")
    return f.default if f is not None and isinstance(f.default, str) else None


def _type_name(ann: Any) -> tuple[str, list[Any]]:
    """A field's type in words, and the values a Literal allows."""
    ann, meta = _unwrap(ann)
    if any(isinstance(m, UserFile) for m in meta):
        return "path", []
    if ann is type(None):
        return "null", []
    if typing.get_origin(ann) is Literal:
        values = list(typing.get_args(ann))
        return " or ".join(dict.fromkeys(type(v).__name__ for v in values)), values
    if _is_union(ann):
        parts = [_type_name(a) for a in typing.get_args(ann)]
        allowed = [v for _, vs in parts for v in vs]
        return " or ".join(dict.fromkeys(t for t, _ in parts)), allowed
    origin = typing.get_origin(ann)
    if origin in (list, tuple, set):
        inner = [_type_name(a) for a in typing.get_args(ann) if a is not Ellipsis]
        return "list of " + " or ".join(t for t, _ in inner), [v for _, vs in inner for v in vs]
    if origin is dict or ann is dict:
        return "mapping", []
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section", []
    return getattr(ann, "__name__", str(ann)), []


def _value(v: Any) -> str:
    """A value as it is written in a config file (YAML)."""
    import json

    if isinstance(v, BaseModel):
        dump = v.model_dump(mode="json", exclude_defaults=True)
        v = {"kind": v.kind, **dump} if "kind" in type(v).model_fields else dump
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        plain = v and v.strip() == v and not any(c in v for c in ":#{}[],&*!|>'\"%@`\n") and v not in (
            "null", "true", "false", "yes", "no") and not _looks_numeric(v)
        return v if plain else json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _default(f: FieldInfo) -> str:
    if f.default_factory is not None:
        value = _value(f.default_factory())
        return "its fields' defaults" if value == "{}" else value
    if f.default is PydanticUndefined:
        return "required"
    return _value(f.default)


def _bounds(f: FieldInfo) -> list[str]:
    out = []
    for m in f.metadata:
        for attr, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                out.append(f"{word} {_value(getattr(m, attr))}")
        if getattr(m, "min_length", None) is not None:
            out.append(f"at least {m.min_length} item(s)" if "list" in _type_name(f.annotation)[0]
                       else f"at least {m.min_length} character(s)")
        if getattr(m, "max_length", None) is not None:
            out.append(f"at most {m.max_length}")
        if getattr(m, "pattern", None):
            out.append(f"matches `{m.pattern}`")
        if getattr(m, "allow_inf_nan", None) is False:
            out.append("finite")
    return out


def _words(text: str | None) -> str:
    return " ".join((text or "").split())


def _first_paragraph(doc: str | None) -> str:
    return _words((inspect.cleandoc(doc or "").split("\n\n") or [""])[0])


def _entry(path: str, f: FieldInfo, kind: str | None) -> Entry:
    type_name, values = _type_name(f.annotation)
    allowed = [_value(v) for v in values] + _bounds(f)
    desc = _words(f.description)
    extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
    if extra.get("keyed") is False:
        desc += " (not part of the stage's key: changing it resumes the stage instead of redoing it)"
    return Entry(path, type_name, _default(f), ", ".join(allowed), desc, kind)


# ---------------------------------------------------------------- walking the models


class _Walk:
    def __init__(self):
        self.sections: list[Section] = []
        self.unions: dict[frozenset, str] = {}  # the kinds of a union already listed -> its section's path
        self.pending: list[tuple[str, list[type[BaseModel]], str | None]] = []  # unions met, to list next

    def section(self, path: str, about: str, models: list[type[BaseModel]], default_kind: str | None) -> None:
        sec = Section(path, about, default_kind=default_kind)
        self.sections.append(sec)
        kinds = [m for m in models if _kind_of(m)]
        if len(kinds) > 1:
            self.unions[frozenset(kinds)] = path
            sec.kinds = {_kind_of(m): _first_paragraph(m.__doc__) for m in kinds}
            shared = self._shared(path, kinds)
            sec.entries.append(Entry(f"{path}.kind", "str", _value(default_kind) if default_kind else "required",
                                     ", ".join(_value(k) for k in sec.kinds), "which kind this section is; each "
                                     "kind takes the fields every kind shares and its own", None))
            sec.entries += [e for e in shared.values()]
            for m in kinds:
                for name, f in m.model_fields.items():
                    if name != "kind" and f"{path}.{name}" not in shared and name not in _not_taken(m):
                        sec.entries += self.fields(f"{path}.{name}", f, _kind_of(m), owner=path)
        else:
            for name, f in models[0].model_fields.items():
                sec.entries += self.fields(f"{path}.{name}" if path else name, f, None)

    def _shared(self, path: str, kinds: list[type[BaseModel]]) -> dict[str, Entry]:
        """Fields every kind has, alike in type, default, bounds and description."""
        out = {}
        for name, f in kinds[0].model_fields.items():
            if name == "kind" or any(name in _not_taken(m) for m in kinds):
                continue
            first = self.fields(f"{path}.{name}", f, None)
            if all(name in m.model_fields and self.fields(f"{path}.{name}", m.model_fields[name], None) == first
                   for m in kinds[1:]):
                out.update((e.path, e) for e in first)
        return out

    def fields(self, path: str, f: FieldInfo, kind: str | None, owner: str | None = None) -> list[Entry]:
        """A field's entries: its own, and those of the sections it holds."""
        models = _models(f.annotation)
        if not models:
            e = _entry(path, f, kind)
            if path.endswith(".kind") and not e.description:
                e = Entry(e.path, e.type, e.default, e.allowed, f"always {e.default}: the section's only kind", kind)
            return [dataclasses.replace(e, owner=owner)]
        ann, _ = _unwrap(f.annotation)
        is_list = typing.get_origin(ann) is list or (_is_union(ann) and any(
            typing.get_origin(a) is list for a in typing.get_args(ann)))
        tagged = [m for m in models if _kind_of(m)]
        if len(tagged) > 1:  # a union of kinds: a section of its own, listed once
            key = frozenset(tagged)
            where = self.unions.get(key)
            names = ", ".join(_value(_kind_of(m)) for m in tagged)
            if where is None:
                where = path
                self.unions[key] = path
                default = f.default_factory().kind if f.default_factory is not None else None
                self.pending.append((path, tagged, default))
            optional = _is_union(ann) and type(None) in typing.get_args(ann)
            desc = _words(f.description) or f"one of {where}'s kinds"
            return [Entry(path, f"section: one of {where}'s kinds" + (" or null" if optional else ""),
                          _default(f), names, desc, kind, see=where, owner=owner)]
        inner = f"{path}[]" if is_list else path
        own = _entry(path, f, kind)
        out = [Entry(path, "list of sections" if is_list else own.type, own.default, own.allowed,
                     own.description or _first_paragraph(models[0].__doc__), kind, owner=owner)]
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        made = f.default_factory() if f.default_factory is not None and not is_list else None
        for name, sub in models[0].model_fields.items():
            if name in extra.get("without", ()):  # a field of the section that this place refuses
                continue
            entries = self.fields(f"{inner}.{name}", sub, kind, owner)
            if isinstance(made, BaseModel) and not _models(sub.annotation):  # the default this place makes
                entries = [dataclasses.replace(e, default=_value(getattr(made, name))) for e in entries]
            out += entries
        return out


def _anchor(path: str) -> str:
    return "config-" + path.replace(".", "-").replace("[]", "")


def sections() -> list[Section]:
    """The reference: the top level, then each section in the order the config declares them."""
    from ratchet.flows.config import PipelineConfig

    w = _Walk()
    top = Section("", _first_paragraph(PipelineConfig.__doc__))
    for name, f in PipelineConfig.model_fields.items():
        if not _models(f.annotation):
            top.entries.append(_entry(name, f, None))
    w.sections.append(top)
    for name, f in PipelineConfig.model_fields.items():
        models = _models(f.annotation)
        if not models:
            continue
        default = f.default_factory() if f.default_factory is not None else None
        about = _words(f.description) or (_first_paragraph(models[0].__doc__) if len(models) == 1 else "")
        w.section(name, about, models, getattr(default, "kind", None) if len(models) > 1 else None)
        while w.pending:
            path, kinds, dk = w.pending.pop(0)
            w.section(path, f"what `{path}` holds, one of {len(kinds)} kinds", kinds, dk)
    return w.sections


def entries() -> list[Entry]:
    return [e for s in sections() for e in s.entries]


# ---------------------------------------------------------------- output


def _cell(text: str) -> str:
    """A table cell: a pipe outside a code span is escaped (inside one, the table reads it as text)."""
    if not text:
        return "–"
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _code(text: str) -> str:
    return _cell(f"`{text}`") if text and text != "–" else "–"


def markdown() -> str:
    out = [
        "# Config reference",
        "",
        "<!-- Generated from the config models by `ratchet config --reference`; do not edit by hand. "
        "A test fails when this file differs from what the models generate. -->",
        "",
        "Every field a run's YAML config takes, generated from the pydantic models that read it. A field is set",
        "in the YAML file or on the command line as a dotted override (`ratchet run CONFIG sample.n=16`), and",
        "`ratchet config --explain FIELD` prints one field's entry. A section with kinds (`data`, `label`,",
        "`filter`, `train`, `data.check`) takes the fields every kind shares and those of the kind its `kind`",
        "names; a field of another kind is an error. *path* is a local file or directory, read and",
        "digested when the run starts.",
        "",
    ]
    for sec in sections():
        title = sec.path or "Top level"
        out += [f"## {title} {{ #{_anchor(sec.path or 'top')} }}", ""]
        if sec.about:
            out += [sec.about[0].upper() + sec.about[1:] + ("" if sec.about.endswith(".") else "."), ""]
        if sec.kinds:
            default = f" (default `{sec.default_kind}`)" if sec.default_kind else ""
            out += [f"`{sec.path}.kind`{default} is one of:", ""]
            out += [f"- `{k}`: {about or '–'}" for k, about in sec.kinds.items()]
            out.append("")
        groups: dict[str | None, list[Entry]] = {}
        for e in sec.entries:
            groups.setdefault(e.kind, []).append(e)
        for kind in [None, *sec.kinds]:
            rows = groups.get(kind, [])
            if sec.kinds:
                out += ["### every kind" if kind is None else f"### {sec.path}.kind: {kind}", ""]
            if not rows:
                out += ["No settings of its own.", ""]
                continue
            out += ["| field | type | default | allowed | description |", "|---|---|---|---|---|"]
            out += [f"| `{e.path}` | {_cell(e.type)} | {_code(e.default)} | {_cell(e.allowed)} | "
                    f"{_cell(e.description)}{_see(e)} |" for e in rows]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def _see(e: Entry) -> str:
    return f" (see [{e.see}](#{_anchor(e.see)}))" if e.see else ""


def _normal(path: str) -> str:
    import re

    return re.sub(r"\[\d*\]", "", path).strip(".")


def explain(path: str) -> str:
    """One field's entries (one per kind that has it), or a section's summary.
    Raises KeyError with the closest fields when there is none."""
    want = _normal(path)
    secs = sections()
    found = [e for s in secs for e in s.entries if _normal(e.path) == want]
    if not found:
        sec = next((s for s in secs if s.path == want), None)
        if sec is not None:
            lines = [f"{sec.path or 'the top level'}: {sec.about}"]
            if sec.kinds:
                lines += [f"  {sec.path}.kind: one of " + ", ".join(sec.kinds) +
                          (f" (default {sec.default_kind})" if sec.default_kind else "")]
            groups: dict[str | None, list[str]] = {}
            for e in sec.entries:
                groups.setdefault(e.kind, []).append(e.path)
            for kind, names in groups.items():
                head = "every kind: " if kind is None and sec.kinds else "" if kind is None else f"{kind}: "
                lines += textwrap.wrap(head + ", ".join(names), 96, initial_indent="  ", subsequent_indent="    ")
            lines.append(f"one field's entry: ratchet config --explain {sec.path + '.' if sec.path else ''}FIELD")
            return "\n".join(lines)
        known = list(dict.fromkeys(_normal(e.path) for s in secs for e in s.entries)) + [s.path for s in secs]
        raise KeyError(difflib.get_close_matches(want, known, n=5, cutoff=0.5)
                       or [k for k in known if k.startswith(want.split(".")[0])][:5])
    lines, listed = [], False
    for e in found:
        where = "" if e.kind is None else f"   (with {e.owner or e.path.rsplit('.', 1)[0]}.kind: {e.kind})"
        lines += [f"{e.path}{where}", f"  type     {e.type}", f"  default  {e.default}"]
        if e.allowed:
            lines.append(f"  allowed  {e.allowed}")
        if e.description:
            lines += textwrap.wrap(e.description, 96, initial_indent="  ", subsequent_indent="  ")
        if e.see and _normal(e.see) == want and listed:
            lines.append("  its kinds: as above")
        elif e.see and _normal(e.see) == want:  # the section of kinds itself: list them here, not point back here
            listed = True
            sec = next((s for s in secs if s.path == e.see), None)
            for kind, about in (sec.kinds if sec is not None else {}).items():
                lines += textwrap.wrap(f"{kind}: {about}", 96, initial_indent="    ", subsequent_indent="      ")
            lines.append(f"  a kind's fields: ratchet config --explain {e.see}.FIELD")
        elif e.see:
            lines.append(f"  its kinds: ratchet config --explain {e.see}")
        lines.append("")
    section = found[0].path.split(".")[0] if "." in found[0].path else "top"
    lines.append(f"the whole reference: {DOC} (section {section})")
    return "\n".join(lines)
