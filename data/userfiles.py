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
prompt stages key on, a function's or an environment's file by its config's `source` digest
(`source_digest`: the file with the modules it imports from its folder), model directories by
the weights' digests of the `base` and `label-model` stages. No digest names the run
(`without_digests`): a user who fixes a file continues the same run, whose stages that read the
file run again.
"""

from __future__ import annotations

import os
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
            from ratchet.data.procs.entry import is_file_spec

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


def without_digests(model: BaseModel) -> BaseModel:
    """`model` with every content digest a user-file field keeps beside it (`digest=`) cleared, at
    any depth: validated again, each is taken from the file as it is now (a resumed run after the
    user fixed a file), and without them the config names a run by its paths alone."""
    update: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        m = marker(type(model), name)
        if m is not None and m.digest is not None and getattr(model, m.digest, None) is not None:
            update[m.digest] = None
        elif isinstance(value, BaseModel):
            if (new := without_digests(value)) is not value:
                update[name] = new
        elif isinstance(value, list) and any(isinstance(v, BaseModel) for v in value):
            new_list = [without_digests(v) if isinstance(v, BaseModel) else v for v in value]
            if any(a is not b for a, b in zip(new_list, value)):
                update[name] = new_list
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


def source_digest(spec: str) -> str:
    """The digest that keys a user's code ('path/to/file.py:name', or an installed module's
    'package.module:name'): its file's bytes, with those of the user's own modules it imports from
    its folder (`helpers`). Raises ValueError for a file or module that is not there."""
    from ratchet.data.procs.entry import is_file_spec, split_spec
    from ratchet.data.digest import sha256_file, sha256_text

    where, _ = split_spec(spec)
    if is_file_spec(where):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ValueError(f"no file {str(path)!r} (from {Path.cwd()}); give the path of a .py file, relative to "
                             "where ratchet runs or absolute, then ':function'")
    else:
        import importlib.util

        try:
            found = importlib.util.find_spec(where)
        except (ImportError, ValueError) as e:
            raise ValueError(f"module {where!r} cannot be found ({type(e).__name__}: {e}); install it, or give a file "
                             "path 'path/to/file.py:function'") from None
        if found is None or found.origin is None or not Path(found.origin).is_file():
            raise ValueError(f"no installed module {where!r}; install it, or give a file path "
                             "'path/to/file.py:function'")
        path = Path(found.origin)
    path = path.resolve()
    found_helpers = helpers(path)
    if not found_helpers:
        return sha256_file(path)
    parts = [f"{os.path.relpath(p, path.parent)}\0{sha256_file(p)}" for p in [path, *found_helpers]]
    return sha256_text("\n".join(parts))


def helpers(path: Path) -> list[Path]:
    """The user's own modules `path` imports, and theirs, transitively, sorted:

    - a module `name` imported (`import name`, `from name import x`, `from name.sub import y`)
      that is a file `name.py` or a package `name/` in that folder (the loader puts the folder
      first on the import path, so those are what it imports);
    - or in a folder one of those files puts on the import path itself, where the folder is
      written from `__file__` (`sys.path.insert(0, str(Path(__file__).parent.parent / "common"))`,
      `sys.path.append(os.path.join(os.path.dirname(__file__), ".."))`);
    - a relative import inside a helper package (`from .digits import SEPARATORS`).

    It stops there: a module found elsewhere (an installed library), a folder put on the path
    some other way, an import made at run time (importlib, __import__), and the data files the
    code reads are not keyed by it."""
    roots = [path.parent.resolve()]
    while True:  # until the files found put no other folder on the path
        found, more = _closure(path.resolve(), roots)
        if not more - set(roots):
            return sorted(found - {path.resolve()})
        roots += sorted(more - set(roots))


def _closure(path: Path, roots: list[Path]) -> tuple[set[Path], set[Path]]:
    """The files `path` imports from `roots` (the first that has a name is the one), transitively,
    and the folders they put on the path."""
    import ast

    seen, folders, todo = {path}, set(), [path]
    while todo:
        p = todo.pop()
        try:
            tree = ast.parse(p.read_text(), str(p))
        except (OSError, SyntaxError, ValueError):
            continue  # its import will say what is wrong with it
        folders.update(_path_entries(tree, p))
        for n in ast.walk(tree):
            found: list[Path] = []
            if isinstance(n, ast.ImportFrom) and n.level:  # relative: from the importing file's package
                here = p.parent
                for _ in range(n.level - 1):
                    here = here.parent
                names = [f"{n.module}.{a.name}" if n.module else a.name for a in n.names]
                found = [f for name in names + ([n.module] if n.module else []) for f in _local_module(here, name)]
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                    [n.module] + [f"{n.module}.{a.name}" for a in n.names] if n.module else []
                for name in names:
                    found += next((fs for root in roots if (fs := _local_module(root, name))), [])
            for f in found:
                if f not in seen:
                    seen.add(f)
                    todo.append(f)
    return seen, folders


def _path_entries(tree, file: Path) -> list[Path]:
    """The folders a module puts on the import path, where they are written from `__file__`
    (`sys.path.insert(i, X)`, `sys.path.append(X)`, `site.addsitedir(X)`), resolved."""
    import ast

    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args):
            continue
        f = n.func
        target = ast.unparse(f.value)
        if (target == "sys.path" and f.attr in ("insert", "append")) or (target == "site" and f.attr == "addsitedir"):
            value = _path_value(n.args[-1], file)
            if value is not None and Path(value).is_dir():
                out.append(Path(value).resolve())
    return out


def _path_value(node, file: Path):
    """The value of a path expression built from `__file__` and strings (Path, its `.parent`,
    `.parents[i]`, `/`, `.resolve()`, `os.path.dirname`, `join`, `abspath`, `realpath`, `str`),
    or None for anything else."""
    import ast
    import os

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            return n.value
        if isinstance(n, ast.Name) and n.id == "__file__":
            return str(file)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            a, b = ev(n.left), ev(n.right)
            return None if a is None or b is None else Path(a) / b
        if isinstance(n, ast.Attribute) and n.attr == "parent":
            a = ev(n.value)
            return None if a is None else Path(a).parent
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "parents" \
                and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, int):
            a = ev(n.value.value)
            return None if a is None else Path(os.path.abspath(a)).parents[n.slice.value]
        if isinstance(n, ast.Call):
            name = ast.unparse(n.func)
            args = [ev(a) for a in n.args]
            if any(a is None for a in args):
                return None
            if name in ("Path", "pathlib.Path", "str", "os.fspath") and len(args) == 1:
                return args[0] if name != "Path" and name != "pathlib.Path" else Path(args[0])
            if name in ("os.path.dirname",) and len(args) == 1:
                return os.path.dirname(args[0])
            if name in ("os.path.abspath", "os.path.realpath", "os.path.normpath") and len(args) == 1:
                return os.path.abspath(args[0])
            if name == "os.path.join" and args:
                return os.path.join(*map(str, args))
            if isinstance(n.func, ast.Attribute) and n.func.attr in ("resolve", "absolute") and not n.args:
                a = ev(n.func.value)
                return None if a is None else Path(os.path.abspath(a))
        return None

    try:
        out = ev(node)
    except (ValueError, IndexError, TypeError):
        return None
    # only a folder found from the file itself: a relative one is relative to where the user runs
    return str(out) if out is not None and os.path.isabs(str(out)) else None


def _local_module(root: Path, name: str) -> list[Path]:
    """The files of `root` that importing `name` (dotted) runs: each package's __init__.py on the
    way, and the module itself."""
    out, here = [], root
    for part in name.split("."):
        if (here / part).is_dir() and (here / part / "__init__.py").is_file():
            here = here / part
            out.append(here / "__init__.py")
        elif (here / f"{part}.py").is_file():
            out.append(here / f"{part}.py")
            break
        else:
            break
    return out
