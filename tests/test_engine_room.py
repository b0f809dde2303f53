"""The engine room (data/procs/): every process the package starts is started there, for an entry
its code declares; imports point down the layers; a child's failure shows the user's frames."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LAYERS = ("data", "models", "tasks", "flows")  # lowest first: a module imports only from its layer or below
ENGINE_ROOM = ROOT / "data" / "procs"

# calls that start a process, by the module they come from
STARTS = {
    "subprocess": {"Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnl", "spawnle", "spawnlp",
           "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "execv", "execve", "execvp", "execvpe", "execl",
           "execle", "execlp", "execlpe"},
    "multiprocessing": {"Process", "Pool", "get_context"},
    "pty": {"fork", "spawn"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "ray": {"init", "remote"},
}


def process_starts(source: str) -> list[str]:
    """Where `source` starts a process: a call of one of STARTS through its module (under any name
    the module is imported as), or of a name imported from it; and any `.Process(` of a context."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> module
    names: dict[str, str] = {}  # local name -> "module.function"
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                top = a.name.split(".")[0]
                if top in STARTS:
                    modules[a.asname or top] = top
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in STARTS:
            for a in n.names:
                if a.name in STARTS[n.module.split(".")[0]]:
                    names[a.asname or a.name] = f"{n.module}.{a.name}"
    found = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules \
                and f.attr in STARTS[modules[f.value.id]]:
            found.append(f"{n.lineno}: {modules[f.value.id]}.{f.attr}")
        elif isinstance(f, ast.Name) and f.id in names:
            found.append(f"{n.lineno}: {names[f.id]}")
        elif isinstance(f, ast.Attribute) and f.attr == "Process":
            found.append(f"{n.lineno}: .Process")
    return found


def test_the_scan_finds_a_process_start_however_it_is_written():
    src = ("import subprocess\nimport os\nimport multiprocessing as mp\nfrom subprocess import run as r\n"
           "def f():\n    subprocess.Popen(['x'])\n    os.fork()\n    mp.get_context('spawn').Process(target=f)\n"
           "    r(['y'])\n    os.getpid()\n    subprocess.PIPE\n")
    assert sorted(process_starts(src)) == ["6: subprocess.Popen", "7: os.fork", "8: .Process",
                                           "8: multiprocessing.get_context", "9: subprocess.run"]
    assert process_starts("import os\nos.getpid()\n") == []


def test_nothing_outside_the_engine_room_starts_a_process():
    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if ENGINE_ROOM in path.parents:
                continue
            found += [f"{path.relative_to(ROOT)}:{x}" for x in process_starts(path.read_text())]
    assert not found, "processes started outside data/procs/ (start them through the engine room): " + \
        ", ".join(found)


def _module_names() -> dict[str, tuple[Path, bool]]:
    out = {}
    for layer in LAYERS:
        for p in (ROOT / layer).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(["ratchet", *(parts[:-1] if is_pkg else parts)])] = (p, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, counting imports inside functions and leaving out
    those under `if TYPE_CHECKING:`."""
    mods = _module_names()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for m, (p, is_pkg) in mods.items():
        tree = ast.parse(p.read_text())
        typing_only = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                       for x in ast.walk(n)}
        out = set()
        for n in ast.walk(tree):
            if id(n) in typing_only:
                continue
            if isinstance(n, ast.Import):
                out |= {o for a in n.names if (o := owner(a.name))}
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    here = (m if is_pkg else m.rpartition(".")[0]).split(".")
                    base = ".".join(here[: len(here) - n.level + 1] + ([base] if base else []))
                out |= {o for a in n.names if (o := owner(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base))}
        graph[m] = out - {m}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_reading_finds_upward_imports_and_circles():
    graph = {"ratchet.data.a": {"ratchet.tasks.b"}, "ratchet.tasks.b": {"ratchet.data.a"}, "ratchet.data.c": set()}
    assert circles(graph) == [{"ratchet.data.a", "ratchet.tasks.b"}]
    assert _upward(graph) == ["ratchet.data.a -> ratchet.tasks.b"]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    layer = {name: i for i, name in enumerate(LAYERS)}
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                  if layer[b.split(".")[1]] > layer[a.split(".")[1]])


def test_no_import_runs_back_up_the_layers_and_at_most_one_circle_remains():
    """The one left: the trainer and its train kinds (each kind uses the trainer's helpers, the
    trainer finds a row's kind). The flows have none: the flow's tasks drop weights through
    flows/gc.py, not the scheduler that deploys the flow."""
    graph = import_graph()
    assert _upward(graph) == [], "imports that run up the layers (data < models < tasks < flows)"
    found = circles(graph)
    assert len(found) <= 1, f"import circles: {[sorted(c) for c in found]}"
    assert all(not any(m.startswith("ratchet.flows.") for m in c) for c in found), \
        f"a circle among the flows: {[sorted(c) for c in found]}"
    engine_room = {m for m in graph if m.startswith("ratchet.data.procs")}
    assert all(not (c & engine_room) for c in found), "the engine room is in an import circle"
    assert all(b.startswith("ratchet.data.") for m in engine_room for b in graph[m]), \
        "the engine room imports from above the data layer"


def test_nothing_in_data_imports_torch_prefect_or_mlflow():
    """data/'s promise (data/__init__.py), inside functions too: the engine room asks a stage's work
    to set its engine's threads and is handed the visible GPUs, rather than asking torch."""
    heavy = ("torch", "prefect", "mlflow", "transformers", "vllm")
    found = []
    for path in sorted((ROOT / "data").rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
            found += [f"{path.relative_to(ROOT)}:{n.lineno}: {x}" for x in names if x.split(".")[0] in heavy]
    assert found == []


def test_no_module_of_the_package_is_named_by_a_string():
    """A child's code is handed over as an object (an entry, a function, a class), which a stage's
    key reaches; a string naming a module of ours would be code no key sees. The engine room's own
    bootstrap is the one string."""
    import re

    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            tree = ast.parse(path.read_text())
            docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(getattr(n, "body", None), list)
                    and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            for n in ast.walk(tree):
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs \
                        and re.search(r"\bratchet\.(data|models|tasks|flows)\.\w", n.value):
                    found.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    assert found == ["data/procs/spawn.py:" + str(_boot_line())], found


def _boot_line() -> int:
    from ratchet.data.procs import spawn

    tree = ast.parse(Path(spawn.__file__).read_text())
    return next(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "BOOT" for t in n.targets))


def not_an_entry(x):
    return x


def test_a_child_runs_only_a_declared_entry(tmp_path):
    import subprocess

    from ratchet.data.procs import spawn
    from ratchet.data.procs.entry import EntryError, resolve

    with pytest.raises(EntryError, match="not a declared entry"):
        spawn.command(not_an_entry, 1)
    with pytest.raises(EntryError, match="not a declared entry"):
        resolve("tests.test_engine_room:not_an_entry")
    with pytest.raises(EntryError, match="not a module-level function"):
        from ratchet.data.procs.entry import entry

        entry(lambda: 0)
    # a child asked by name for something that is not an entry refuses to run it
    boot = [sys.executable, "-c", spawn.BOOT, "tests.test_engine_room:not_an_entry", "[1]"]
    done = subprocess.run(boot, capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert done.returncode != 0 and "is not a declared entry" in done.stderr


ENV = '''
class Boom:
    def reset(self, seed):
        return "start"

    def step(self, action):
        return helper(action)


def helper(action):
    raise RuntimeError("the environment's own failure: " + action)
'''

SCORE = '''
def score(completion, answer=None, **fields):
    return helper(completion)


def helper(text):
    raise RuntimeError("the reward's own failure: " + text)
'''


def test_a_child_s_failure_reaches_the_user_as_the_user_s_own_frames(tmp_path):
    """The same for every host: the traceback starts at the user's code, with no frame of the engine
    room or of the host (the environment's host used to show host_main and _episode first)."""
    from ratchet.data.checks.scorer import Scorer
    from ratchet.tasks.environments import EnvHost

    (tmp_path / "env.py").write_text(ENV)
    (tmp_path / "reward.py").write_text(SCORE)
    host = EnvHost(f"{tmp_path / 'env.py'}:Boom", {}, step_s=30, obs_chars=1000, memory_mb=0)
    try:
        host.send(1, "open", seed=0, row={})
        assert host.collect([1])[1].failure is None
        host.send(1, "step", action="left")
        env_failure = host.collect([1])[1].failure
    finally:
        host.close()
    scorer = Scorer(f"{tmp_path / 'reward.py'}:score", batched=False, timeout_s=30)
    try:
        reward_failure = scorer.call({"completion": "x", "answer": "1"}).failure
    finally:
        scorer.close()
    for failure, file, last in ((env_failure, "env.py", "the environment's own failure: left"),
                                (reward_failure, "reward.py", "the reward's own failure: x")):
        frames = [line for line in failure.splitlines() if line.strip().startswith("File ")]
        assert frames and all(file in f for f in frames), failure  # the user's frames, and only theirs
        assert f"RuntimeError: {last}" in failure
        for own in ("host_main", "_episode", "serve_session", "serve_calls", "scorer_host", "env_host", "procs"):
            assert own not in failure, failure


def test_a_kept_host_is_started_once_per_key_and_a_failed_start_keeps_nothing():
    """`Kept` (data/procs/host.py): threads that want one host at once start it once; hosts for
    other keys start beside it, not after it; a start that raises is not kept, and the next asks
    again; `close` ends the hosts of one kind and forgets them."""
    import threading

    from ratchet.data.procs.host import Kept

    started, closed = [], []
    both = threading.Barrier(2, timeout=30)  # a's start and b's: it breaks unless they run at once

    class Slow:
        def __init__(self, key, fail=False):
            self.key, self.fail = key, fail

        def start(self):
            started.append(self.key)
            if self.key in (("a",), ("b",)):
                both.wait()
            if self.fail:
                raise RuntimeError("cannot load")

        def close(self):
            closed.append(self.key)

    class Other(Slow):
        pass

    kept = Kept()
    got: dict[int, object] = {}

    def want(i, key, kind=Slow):
        got[i] = kept.get(key, lambda: kind(key))

    threads = [threading.Thread(target=want, args=(i, ("a",))) for i in range(4)]
    threads.append(threading.Thread(target=want, args=(4, ("b",), Other)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(started) == [("a",), ("b",)] and not both.broken  # each once, side by side
    assert len({id(got[i]) for i in range(4)}) == 1 and got[4] is not got[0]
    with pytest.raises(RuntimeError, match="cannot load"):
        kept.get(("c",), lambda: Slow(("c",), fail=True))
    assert kept.get(("c",), lambda: Slow(("c",))).key == ("c",) and started.count(("c",)) == 2
    kept.close(Other)
    assert closed == [("b",)] and kept.of(Other) == [] and len(kept.of(Slow)) == 2
    kept.close()
    assert sorted(closed) == [("a",), ("b",), ("c",)] and kept.of(Slow) == []
