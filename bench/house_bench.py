"""The house in figures: the places a stage is written in, the stage-name tests left, the longest
functions, and the calls from a round's walk to a stage's body.

    python bench/house_bench.py            # the figures, printed
    python bench/house_bench.py --json     # the same as JSON
    python bench/house_bench.py --hops     # also walk one round's sample stage through the flow (Prefect's
                                           # temporary server starts: about 20 s)

Everything but `--hops` is read from the source (ast): nothing runs, no model loads. A stage-name
test is a comparison of a manifest's `stage` (or a variable `stage`) with a string, an f-string
or a hand-kept tuple of names; a lookup of a parent a stage was given by its name
(`req.parent("prompts")`, `req.find(...)`) names an input, and is not counted.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("data", "models", "tasks", "flows")


def _files(*folders: str):
    for f in folders:
        yield from sorted((ROOT / f).rglob("*.py"))


def _is_stage_ref(node: ast.AST) -> bool:
    """`x.stage`, `stage`, or `x.stage` behind a call such as `getattr(x, "stage", None)`."""
    if isinstance(node, ast.Attribute) and node.attr == "stage":
        return True
    if isinstance(node, ast.Name) and node.id == "stage":
        return True
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "stage")


def _kept_lists() -> set[str]:
    """Module-level names bound to a tuple or list of strings alone: hand-kept lists."""
    out = set()
    for path in _files(*LAYERS):
        for n in ast.parse(path.read_text()).body:
            if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Tuple, ast.List)) and n.value.elts and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.value.elts):
                out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return out


def _is_name_list(node: ast.AST, kept: set[str]) -> bool:
    """A string, a tuple/list/set of strings, an f-string, a name of a hand-kept list, or a call that
    makes a stage's name (`level_stage(n)`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return True
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name_list(e, kept) for e in node.elts) or any(
            isinstance(e, ast.Starred) and _is_name_list(e.value, kept) for e in node.elts)
    if isinstance(node, ast.Name) and node.id in kept:
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "level_stage":
        return True
    return False


def name_tests() -> list[str]:
    """Where a stage's manifest is told apart by its name: `m.stage == "train"`, `p.stage in
    ("label", "train")`, `stage in MODEL_STAGES`, and the like, in the package."""
    out, kept = [], _kept_lists()
    for path in _files(*LAYERS):
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if not isinstance(n, ast.Compare):
                continue
            sides = [n.left, *n.comparators]
            if any(_is_stage_ref(s) for s in sides) and any(_is_name_list(s, kept) for s in sides):
                out.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    return out


def stage_lists() -> list[str]:
    """Hand-kept lists of stage names: module-level tuples or lists of strings bound to a name that
    says stages (`*STAGES`)."""
    out = []
    for path in _files(*LAYERS):
        for n in ast.parse(path.read_text()).body:
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("STAGES") for t in n.targets) \
                    and isinstance(n.value, (ast.Tuple, ast.List)) and all(
                        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.value.elts):
                out.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    return out


def longest(folders: tuple[str, ...], n: int = 6) -> list[tuple[str, int]]:
    found = []
    for path in _files(*folders):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{path.relative_to(ROOT)}:{node.name}", node.end_lineno - node.lineno + 1))
    return sorted(found, key=lambda t: -t[1])[:n]


def per_stage_methods() -> dict[str, list[str]]:
    """In flows/: each method of a class that is defined in two or more of its classes under one
    name (the per-stage adapters: Calls.sample, FlowRound.sample, PlanRound.sample, ...), and each
    Prefect task function per stage (`*_task`)."""
    by_name: dict[str, list[str]] = {}
    tasks = []
    for path in _files("flows"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and not f.name.startswith("_"):
                        by_name.setdefault(f.name, []).append(f"{path.name}:{node.name}")
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and getattr(d.func, "id", "") == "task" for d in node.decorator_list):
                tasks.append(f"{path.name}:{node.name}")
    return {"tasks": tasks, "methods": {k: v for k, v in sorted(by_name.items()) if len(v) >= 3}}


def hops() -> list[str]:
    """The package's functions between a round's walk (`round_shape`) and the sample stage's body, as
    the flow calls them: the round's walk runs in a real Prefect flow, and `run_stage` is stopped
    where it would run the body (in this process, `isolate=false`: a worker adds its own two,
    `_run_in_worker` and `worker`)."""
    import os
    import sys
    import tempfile

    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="house-prefect-"))
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.pop("PREFECT_API_URL", None)
    from prefect import flow

    from ratchet.data.manifest import StageManifest
    from ratchet.flows.config import load_config
    from ratchet.flows.pipeline import FlowSteps
    from ratchet.flows.runs import RunContext
    from ratchet.flows.shape import round_shape
    from ratchet.tasks.runner import stage as runner

    seen: list[str] = []

    class Reached(Exception):
        pass

    def stop(*a, **k):
        frames, f = [], sys._getframe(0)
        while f is not None and f.f_code.co_name != "round_shape":
            f = f.f_back
            if f is not None and any(Path(f.f_code.co_filename).is_relative_to(ROOT / x) for x in LAYERS):
                frames.append(f.f_code.co_qualname)  # the package's own frames, not Prefect's
        seen.extend(reversed(frames))
        raise Reached

    work = Path(tempfile.mkdtemp(prefix="house-"))
    cfg = load_config(ROOT / "flows" / "configs" / "default.yaml", [f"workdir={work}", "isolate=false"])
    ctx = RunContext(run_name="house", workdir=str(work), parent_run_id="-", config_hash="-", code_version="-")
    m = StageManifest(stage="prompts", role="data", round=0, key="k", dir="stages/prompts-0123456789abcdef",
                      code_version="c")

    @flow(name="house")
    def walk():
        round_shape(cfg, FlowSteps(cfg, ctx, child="-"), 1, m, m, 0)

    runner_run = runner.run_stage
    runner.run_stage = stop
    try:
        walk()
    except Reached:
        pass
    finally:
        runner.run_stage = runner_run
    return seen + ["run_stage", "sample_body"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hops", action="store_true", help="walk one round's sample stage through the flow")
    args = ap.parse_args(argv)
    figures = {"hops": hops()} if args.hops else {}
    figures |= {"name_tests": name_tests(), "stage_lists": stage_lists(), "per_stage": per_stage_methods(),
               "longest_package": longest(LAYERS), "longest_bench": longest(("bench",), 3)}
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"stage-name tests in the package: {len(figures['name_tests'])}")
    for x in figures["name_tests"]:
        print(f"  {x}")
    print(f"hand-kept stage lists: {len(figures['stage_lists'])} {figures['stage_lists']}")
    per = figures["per_stage"]
    print(f"Prefect task functions in flows/: {len(per['tasks'])}")
    print(f"methods written once per stage in flows/ (one name in 3+ classes): {len(per['methods'])}")
    for k, v in per["methods"].items():
        print(f"  {k}: {', '.join(v)}")
    print("longest functions (package):")
    for name, lines in figures["longest_package"]:
        print(f"  {lines:4d}  {name}")
    if "hops" in figures:
        print(f"calls from round_shape to the sample stage's body (in this process): {len(figures['hops'])}")
        print("  " + " -> ".join(figures["hops"]))
    print("longest functions (bench):")
    for name, lines in figures["longest_bench"]:
        print(f"  {lines:4d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
