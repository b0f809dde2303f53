"""The code a stage body can run: its code version, by definition rather than by module.

A module-level digest keys a stage by every module its imports touch: the sample stage
imports the sampler, which asks the trainer one question, and the trainer's module imports
the DPO loss, so an edit to the loss re-sampled every round. Here a stage's code is the set of
top-level definitions (functions, classes, assignments) its body reaches:

- from the body function, every name it loads, resolved through its module's definitions
  and imports (imports inside functions included) to the definition it names, transitively;
- a class brings all of it (methods, bases, decorators, field annotations and defaults);
- a module used as a value, or a name a module does not define, brings the whole module;
- every reached module brings its own top-level statements that define nothing, and those of
  the packages above it (they run when it is imported);
- a kind union (`Annotated[A | B, Field(discriminator="kind")]`) brings no kind by itself: the
  job's own values bring the kinds it holds (`instance_classes`), so a stage that checks with
  `regex` is not re-keyed by an edit to the `code` check.

Each definition counts as its syntax tree without docstrings (`syntax_tree`): a
comment or a reflowed line re-keys nothing. Only modules of the body's own top-level package
are followed. A library a reached definition imports (math-verify, reasoning-gym, textarena,
gymnasium, torch, vLLM, TRL, ...) counts as its installed distribution's name and version: an
upgrade re-keys the stages whose code imports it, and no other. Its own dependencies do not
count (a library pins or names what it runs with).

A child process's code is reached the same way: its entry (data/procs/entry.py) and what it is
handed (a function, an adapter class) are objects the stage's code names, never strings.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from ratchet.data.digest import sha256_text

@functools.lru_cache(maxsize=512)
def syntax_tree(text: str, path: str) -> str:
    import ast

    tree = ast.parse(text, path)
    for node in ast.walk(tree):  # docstrings: no stage reads them (the config reference does, outside stages)
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


WHOLE = "*"  # a whole module: every definition in it
INIT = "<module>"  # its top-level statements that define nothing
LIBRARY = "<library>"  # (LIBRARY, top-level import name): an installed library a definition imports


@dataclass
class _Module:
    name: str
    path: Path
    is_pkg: bool
    defs: dict[str, list[ast.AST]] = field(default_factory=dict)
    init: list[ast.AST] = field(default_factory=list)
    aliases: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (module, attribute)
    unions: set[str] = field(default_factory=set)  # names that are kind unions
    # worked out once per text (a `_Module` is `_parse`'s, kept by its text): each definition's
    # code, and the names it loads before they are resolved (`_loads`)
    code: dict[str, str] = field(default_factory=dict)
    loads: dict[str, tuple] = field(default_factory=dict)


class _Read:
    """What one `reach` read: each module name it looked up, with what it found (its file and
    whether it is a package, or None), and the digest of each file's text it parsed. Those are
    all its inputs: an answer is still right while each lookup finds the same and each text is
    the same (`_still`)."""

    def __init__(self) -> None:
        self.specs: dict[str, list | None] = {}
        self.texts: dict[str, str] = {}
        self.libraries: dict[str, str] = {}  # import name -> "distribution==version" (or "" for none)
        self.modules: dict[str, _Module | None] = {}  # each module read once in one answer: a snapshot


_local = threading.local()  # .reading: the `_Read` of the answer this thread's `digest` is working out


def _spec(name: str) -> tuple[Path, bool] | None:
    """(source file, is a package) of a module with a source file, else None."""
    found = _find(name)
    out = None if found is None or found.origin is None or not found.origin.endswith(".py") else \
        (Path(found.origin), found.submodule_search_locations is not None)
    if (read := getattr(_local, "reading", None)) is not None:
        read.specs[name] = None if out is None else [str(out[0]), out[1]]
    return out


@functools.lru_cache(maxsize=None)
def _find(name: str):
    """A module's spec, found without importing it or a package above it that is not imported yet
    (finding `a.b.c` the usual way imports `a.b`, which may import a training library)."""
    parent, _, last = name.rpartition(".")
    try:
        if not parent or parent in sys.modules:
            return importlib.util.find_spec(name)
        above = _find(parent)
        if above is None or above.submodule_search_locations is None:
            return None
        return importlib.machinery.PathFinder.find_spec(last, list(above.submodule_search_locations))
    except (ImportError, ValueError):
        return None


def _import_aliases(node: ast.AST, module: str, is_pkg: bool) -> dict[str, tuple[str, str | None]]:
    """The names an import statement binds, each to (module, attribute or None for the module)."""
    out: dict[str, tuple[str, str | None]] = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                out[a.asname] = (a.name, None)
            else:
                top = a.name.split(".")[0]
                out[top] = (top, None)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            here = module if is_pkg else module.rpartition(".")[0]
            parts = here.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        for a in node.names:
            if a.name != "*":
                out[a.asname or a.name] = (base, a.name)
    return out


def _is_union(value: ast.AST) -> bool:
    """`Annotated[..., Field(discriminator=...)]`: a kind union, resolved by the value it holds."""
    return (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id == "Annotated"
            and any(isinstance(n, ast.Call) and any(k.arg == "discriminator" for k in n.keywords)
                    for n in ast.walk(value)))


def _module(name: str) -> _Module | None:
    """A module's definitions, read from its file now (an edit between two runs of a long-lived
    process counts), parsed once per text."""
    read = getattr(_local, "reading", None)
    if read is not None and name in read.modules:
        return read.modules[name]
    found = _spec(name)
    if found is None:
        return None
    path, is_pkg = found
    text = path.read_text()
    out = _parse(name, path, is_pkg, text)
    if read is not None:
        read.texts[str(path)] = sha256_text(text)
        read.modules[name] = out
    return out


@functools.lru_cache(maxsize=256)
def _parse(name: str, path: Path, is_pkg: bool, text: str) -> _Module:
    m = _Module(name, path, is_pkg)

    def visit(stmts: list[ast.stmt], top: bool) -> None:
        for s in stmts:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                m.aliases.update(_import_aliases(s, name, is_pkg))
            elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                m.defs.setdefault(s.name, []).append(s)
            elif isinstance(s, (ast.Assign, ast.AnnAssign)):
                targets = s.targets if isinstance(s, ast.Assign) else [s.target]
                names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
                for n in names:
                    m.defs.setdefault(n, []).append(s)
                    if s.value is not None and _is_union(s.value):
                        m.unions.add(n)
                if not names:
                    m.init.append(s)
            elif isinstance(s, (ast.If, ast.Try, ast.With)):  # conditional code: its defs, and itself as init
                m.init.append(s)
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(s, block, []) or [], False)
                for h in getattr(s, "handlers", []):
                    visit(h.body, False)
            elif not (top and s is tree.body[0] and isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)):
                m.init.append(s)

    tree = ast.parse(text, str(path))
    visit(tree.body, True)
    return m


def _target(mod: _Module, name: str, local: dict[str, tuple[str, str | None]]) -> tuple[str, str] | None:
    """What `name` names in `mod` (with a function's own imports `local`): (module, definition),
    (module, WHOLE) for a module, or None for a name of no module of ours (a builtin, a local)."""
    if name in local or (name not in mod.defs and name in mod.aliases):
        module, attr = local.get(name) or mod.aliases[name]
        if attr is None:
            return (module, WHOLE)
        if _spec(f"{module}.{attr}") is not None:
            return (f"{module}.{attr}", WHOLE)
        return (module, attr)
    if name in mod.defs:
        return (mod.name, name)
    return None


def _loads(mod: _Module, name: str, nodes: list[ast.AST]) -> tuple:
    """What `nodes` (definition `name` of `mod`) load, before it is resolved: (their own imports,
    [(a name, the attributes read on it, outermost last) ...]). It depends on the text alone, so
    it is worked out once per text; resolving it (`_refs`) looks other modules up every time."""
    if name in mod.loads:
        return mod.loads[name]
    local: dict[str, tuple[str, str | None]] = {}
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                local.update(_import_aliases(n, mod.name, mod.is_pkg))
    loaded: list[tuple[str, tuple[str, ...]]] = []
    chained: set[int] = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and id(n) not in chained:
                chain, base = [], n
                while isinstance(base, ast.Attribute):
                    chained.add(id(base))
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name):
                    chained.add(id(base))
                    loaded.append((base.id, tuple(reversed(chain))))
            elif isinstance(n, ast.Name) and id(n) not in chained:
                loaded.append((n.id, ()))
    mod.loads[name] = out = (local, list(dict.fromkeys(loaded)))
    return out


def _refs(mod: _Module, name: str, nodes: list[ast.AST], top: str) -> set[tuple[str, str]]:
    """The definitions `nodes` load, resolved; attribute chains on modules (`prepare.model_dir`)
    to the definition they end at; a name of another top-level package as (LIBRARY, its name)."""
    local, loaded = _loads(mod, name, nodes)
    out: set[tuple[str, str]] = set()
    for base, chain in loaded:
        t = _target(mod, base, local)
        if not chain:
            if t is not None:
                out.add(t if t[0].split(".")[0] == top else (LIBRARY, t[0].split(".")[0]))
            continue
        if t is not None and t[0].split(".")[0] != top:  # a library: its version, not its code
            out.add((LIBRARY, t[0].split(".")[0]))
            continue
        for attr in chain:
            if t is None or t[1] != WHOLE:
                break
            t = _member(t[0], attr)
        if t is not None:
            out.add(t)
    return {t for t in out if t[0].split(".")[0] == top or (t[0] == LIBRARY and _is_library(t[1]))}


def _is_library(name: str) -> bool:
    """An import name that is not the standard library's (nor a relative, empty or private name)."""
    return bool(name) and not name.startswith("_") and name not in sys.stdlib_module_names


def _member(module: str, attr: str) -> tuple[str, str]:
    """`module.attr`: a submodule, a definition of the module, or one it imports."""
    if _spec(f"{module}.{attr}") is not None:
        return (f"{module}.{attr}", WHOLE)
    m = _module(module)
    if m is None:
        return (module, WHOLE)
    return _target(m, attr, {}) or (module, WHOLE)


def reach(roots: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Every definition the roots (module, name) reach, each with its code: (module, name) ->
    its syntax tree as text; (module, INIT) for a module's other top-level statements."""
    todo = list(roots)
    if not todo:
        return {}
    top = todo[0][0].split(".")[0]
    out: dict[tuple[str, str], str] = {}
    while todo:
        module, name = todo.pop()
        if module == LIBRARY:
            out[(module, name)] = ""
            continue
        if (module, name) in out or module.split(".")[0] != top:
            continue
        m = _module(module)
        if m is None:
            out[(module, name)] = ""
            continue
        if name == WHOLE:
            out[(module, WHOLE)] = ""
            todo.extend((module, n) for n in m.defs)
            todo.append((module, INIT))
            continue
        if name == INIT:
            nodes = m.init
            parts = module.split(".")
            todo.extend((".".join(parts[:i]), INIT) for i in range(1, len(parts)))  # the packages above it
        elif name in m.defs:
            nodes = m.defs[name]
            todo.append((module, INIT))
        else:  # a name the module re-exports from elsewhere, or does not have: follow it, or take it all
            t = _target(m, name, {})
            out[(module, name)] = ""
            todo.append(t if t is not None and t != (module, name) else (module, WHOLE))
            continue
        if name not in m.code:
            m.code[name] = "\n".join(syntax_tree(ast.unparse(n), f"{module}:{name}") for n in nodes)
        out[(module, name)] = m.code[name]
        for ref in _refs(m, name, nodes, top):
            if ref[0] != LIBRARY and ref[1] in _module_unions(ref[0]):
                out.setdefault(ref, "kind union: the job's values bring its kinds")
                continue
            todo.append(ref)
    return out


def digest(roots: list[tuple[str, str]]) -> str:
    """The code version of what `roots` reach (see `opened`)."""
    return opened(roots)["digest"]


def opened(roots: list[tuple[str, str]]) -> dict:
    """The code version of what `roots` reach, opened: {"digest": a digest of every definition's
    syntax tree and every library's version, "definitions": [[module, name, the digest of its
    syntax tree], ...], "libraries": {import name: "distribution==version"}, "texts": {each file
    it parsed: the digest of its text}}.

    Working it out parses every module reached (seconds, at every start of a run). The answer is
    kept in the user's cache with everything it read (`_Read`), and taken again only while every
    module name it looked up finds the same file (or still none) and every file it parsed holds
    the same text: an edit anywhere the roots reach, or a new module where a name was looked up,
    works it out again. The key is the roots alone, so each keeps its latest answer."""
    key = sha256_text(repr(sorted(roots)))
    kept = kept_answer(key)
    if kept is not None and "definitions" in kept and _still(kept):
        return {k: kept[k] for k in ("digest", "definitions", "libraries", "texts")}
    _local.reading = read = _Read()
    try:
        found = reach(roots)
    finally:
        _local.reading = None
    read.libraries = {n: installed(n) for (m, n) in found if m == LIBRARY}
    found = {k: (read.libraries[k[1]] if k[0] == LIBRARY else code) for k, code in found.items()}
    out = sha256_text("\n".join(f"{m}:{n}\0{code}" for (m, n), code in sorted(found.items())))[:16]
    definitions = [[m, n, sha256_text(code)[:16]] for (m, n), code in sorted(found.items()) if m != LIBRARY]
    keep_answer(key, {"digest": out, "specs": read.specs, "texts": read.texts, "libraries": read.libraries,
                      "definitions": definitions})
    return {"digest": out, "definitions": definitions, "libraries": read.libraries, "texts": read.texts}


@functools.lru_cache(maxsize=1)
def source() -> dict:
    """Where this process's Ratchet came from, for the manifests of the stages it runs: the git
    commit of the checkout it runs from (None for an installed wheel), whether the package's files
    differ from that commit (`dirty`), and the installed package's version."""
    from importlib.metadata import PackageNotFoundError, version

    from ratchet.data.procs.spawn import run_program

    root = Path(__file__).resolve().parents[1]
    commit, dirty = None, None
    try:
        head = run_program(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            commit = head.stdout.strip()
            status = run_program(["git", "status", "--porcelain", "--", "data", "models", "tasks", "flows"],
                                 cwd=root, capture_output=True, text=True, timeout=10)
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, ValueError):
        pass
    try:
        ver = version("ratchet")
    except PackageNotFoundError:
        ver = None
    return {"commit": commit, "dirty": dirty, "version": ver}


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    """Each import name's distributions (importlib.metadata.packages_distributions), kept in the user's
    cache while the distributions installed on sys.path (their .dist-info and .egg-info folders, by
    name, which holds the version, in each folder that holds any, by its absolute path) are those it
    was read from: reading every distribution's files took about 1.8 s of each plan and each run on
    2 cores. The last few such sets are kept side by side, so that `python -m`, `-c`, a script and
    pytest (each with its own sys.path[0]) do not read them again in turn."""
    from ratchet.data.digest import sha256_json

    marks = []
    for entry in sys.path:
        try:
            names = sorted(n for n in os.listdir(entry or ".") if n.endswith((".dist-info", ".egg-info")))
        except OSError:
            continue
        if names:
            marks.append([os.path.abspath(entry or "."), names])
    key, path = sha256_json(marks), _memo_file().with_name("distributions.json")
    try:
        kept = json.loads(path.read_text()).get("by_key", {})
        if isinstance(kept.get(key), dict):
            return kept[key]
    except (OSError, ValueError, AttributeError):
        kept = {}
    from importlib.metadata import packages_distributions

    found = packages_distributions()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"distributions.{os.getpid()}.tmp")
        others = [k for k in kept if k != key][-(DISTRIBUTION_SETS - 1):]  # the newest few besides this one
        tmp.write_text(json.dumps({"by_key": {**{k: kept[k] for k in others}, key: found}}))
        tmp.replace(path)
    except OSError:  # unwritable: read again next time
        pass
    return found


DISTRIBUTION_SETS = 4  # sets of installed distributions kept in the cache at once


def installed(name: str) -> str:
    """The distribution(s) and version(s) that provide the import name `name`, as keyed: e.g.
    "math-verify==0.9.0"; "" where none is installed (a module of no distribution)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in sorted(set(_distributions().get(name, ()))):
        try:
            out.append(f"{dist}=={version(dist)}")
        except PackageNotFoundError:
            pass
    return ",".join(out)


def _still(kept: dict) -> bool:
    """Whether every lookup a kept answer made finds the same, and every text it read is unchanged."""
    try:
        for name, was in kept["specs"].items():
            now = _spec(name)
            if (None if now is None else [str(now[0]), now[1]]) != was:
                return False
        if any(installed(n) != v for n, v in kept.get("libraries", {}).items()):
            return False
        return all(sha256_text(Path(path).read_text()) == text for path, text in kept["texts"].items())
    except (OSError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return False


ANSWERS = "code-versions.json"  # the code versions' kept answers; other callers name files of their own


def _memo_file(name: str = ANSWERS) -> Path:
    from ratchet.models.default_model import default_cache_dir

    return default_cache_dir() / name


def kept_answer(key: str, file: str = ANSWERS) -> dict | None:
    """An answer kept in the user's cache (its `file`) under `key`, or None: the caller checks it still holds."""
    found = _kept(file).get(key)
    return found if isinstance(found, dict) else None


_kept_read: dict[str, tuple[tuple, dict]] = {}  # the file's path -> (its stat when read, what it held)


def _kept(file: str = ANSWERS) -> dict:
    """The kept answers, read again only where the file changed since this process last read it
    (it grows with every code version a machine has keyed: parsing it at every stage adds up)."""
    try:
        path = _memo_file(file)
        st = path.stat()
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if (was := _kept_read.get(str(path))) is not None and was[0] == seen:
            return dict(was[1])
        out = json.loads(path.read_text())
        out = out if isinstance(out, dict) else {}
        _kept_read[str(path)] = (seen, out)
        return dict(out)
    except (OSError, ValueError, RuntimeError):  # RuntimeError: no home directory to find the cache in
        return {}


def keep_answer(key: str, entry: dict, file: str = ANSWERS, newest: int | None = None) -> None:
    """Add an answer to the kept ones (best effort: a cache that cannot be written is worked
    around, and two processes writing at once lose at most each other's newest answer); `newest`:
    keep only that many, the latest kept last."""
    try:
        path = _memo_file(file)
        kept = _kept(file)
        kept.pop(key, None)
        kept[key] = entry
        if newest is not None:
            kept = dict(list(kept.items())[-newest:])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, path)
    except (OSError, RuntimeError):
        pass


def code_digest(root: Path | None = None) -> str:
    """Digest of every module of the installed package (the folders under `root`, this package by
    default): the code a run's results came from. Each module counts as its syntax tree, so an edit
    to a comment, a docstring or the layout leaves the digest as it was."""
    root = root or Path(__file__).parents[2]
    texts = {}
    for pkg in ("data", "models", "tasks", "flows"):
        for p in (root / pkg).rglob("*.py"):
            rel = p.relative_to(root).with_suffix("").parts
            texts[".".join(("ratchet", *(rel[:-1] if rel[-1] == "__init__" else rel)))] = (p, p.read_text())
    # parsing every module takes about a second: the answer is kept for these exact texts
    read = sha256_text("\n".join(f"{name}\0{text}" for name, (_, text) in sorted(texts.items())))
    key = f"code_digest:{root.resolve()}"
    kept = kept_answer(key)
    if kept is not None and kept.get("read") == read:
        return kept["digest"]
    parts = [f"{name}\0{syntax_tree(text, str(p))}" for name, (p, text) in texts.items()]
    out = sha256_text("\n".join(sorted(parts)))[:16]
    keep_answer(key, {"read": read, "digest": out})
    return out


def _module_unions(module: str) -> set[str]:
    m = _module(module)
    return m.unions if m is not None else set()


def instance_classes(value) -> set[type]:
    """The classes of every pydantic model in a job's config tree: the kinds it holds."""
    out: set[type] = set()

    def walk(v) -> None:
        if isinstance(v, BaseModel):
            for cls in type(v).__mro__:
                if issubclass(cls, BaseModel) and cls is not BaseModel and "pydantic" not in cls.__module__:
                    out.add(cls)
            for name in type(v).model_fields:
                walk(getattr(v, name, None))
        elif isinstance(v, (list, tuple, set)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(value)
    return out


def roots_of(body, config: BaseModel | None) -> list[tuple[str, str]]:
    """The body and the classes of its job's values."""
    roots = [(body.__module__, body.__qualname__.split(".")[0])]
    if config is not None:
        roots += sorted((c.__module__, c.__qualname__.split(".")[0]) for c in instance_classes(config))
    return roots
