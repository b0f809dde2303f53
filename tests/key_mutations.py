"""The keys, tested by mutation: edit the code and files each stage kind can reach, one edit at a
time, and see which stages' keys change.

    python tests/key_mutations.py                 # a fixed sample (what CI runs, in a test)
    python tests/key_mutations.py --full          # every definition any stage reaches
    python tests/key_mutations.py --full --json out.json

What it does:

- **A copy.** The package is copied into a scratch folder, beside a user's project: a reward
  function whose file imports a helper (one level), which imports a helper package (two levels,
  with a relative import inside it), and a helper in a sibling folder the reward file puts on
  the import path; an environment class with a helper module; prompt, held-out and
  demonstration files; and a small model directory with its chat template. The real package is
  never touched.
- **The stages.** A worker process, a fresh interpreter that imports the copy as `ratchet`, plans
  every shipped config and the project's configs for two rounds (`ratchet plan`'s own walk,
  flows/plan.py), and notes each stage it keys: its name, round, body and job. A stage's key here
  is the one `run_stage` makes (the code version of what its body and job reach, and its job as
  keyed), less its parents' keys, which a plan does not know yet and which carry an edit
  upstream on their own.
- **The edits.** Each is made to the copy's file on disk, the keys are taken again through the
  real path (code_reach's answers kept in a cache, taken again only while every file they read
  is unchanged), and the file is put back:
  - a behaviour edit to every definition a stage reaches (`--full`; a fixed sample otherwise):
    an AST edit of a constant, a comparison or a returned value, the first of those its syntax
    tree has, in turn. Expected: exactly the stages whose reach holds that definition re-key;
  - a layout edit to each module reached: one function written out again by `ast.unparse`
    (other quotes, other line breaks, its comments gone), a comment added and its docstring
    reworded. Expected: nothing re-keys;
  - the user's files and data files, each edited as a user would (a constant in a helper, a row
    of a data file, a line of the chat template). Expected: exactly the stages whose job names
    that file, or the reward or environment file that imports it, re-key.
- **Oracles.** The expectation for a package edit comes from the reach itself, which would hide a
  reach that misses code a stage runs. So the tool also holds a list written by hand of code that
  runs in a stage's child processes (the scorer host, math-verify's check, reasoning-gym's scorer,
  the environment adapters, a training process of several): each must re-key the stages named; and
  a list of modules a stage kind can never run (a sampling stage and the DPO loss): none may.

The report lists, per stage kind, how many behaviour edits it was expected to see and saw, and
every miss: an edit that did not re-key a stage expected to re-key ("missed"), one that re-keyed
a stage not expected to ("spurious"), and a layout edit that re-keyed anything. The exit code is
1 where there is any miss.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("data", "models", "tasks", "flows")
SKIP_CONFIGS = {"gpu.yaml"}  # its sampler wants CUDA (its stages are those of default.yaml)

# -- the user's project -----------------------------------------------------------------------

REWARD = '''"""The word problems' reward, from helpers beside it and in a sibling folder."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))

from scoring import right_number  # noqa: E402  (one level)
from words import word_count  # noqa: E402  (the sibling folder)


def score(completion, answer=None, **fields):
    return float(right_number(completion, answer) and word_count(completion) <= 30)
'''
SCORING = '''from units.convert import to_number  # two levels: a package of helpers


def right_number(completion, answer):
    found = to_number(completion)
    return found is not None and answer is not None and found == to_number(str(answer))
'''
UNITS_INIT = ''
CONVERT = '''import re

from .digits import SEPARATORS  # a relative import inside the helper package


def to_number(text):
    numbers = re.findall(r"-?[0-9][0-9" + SEPARATORS + r"]*", text)
    return int(numbers[-1].replace(",", "")) if numbers else None
'''
DIGITS = 'SEPARATORS = ","\n'
WORDS = '''def word_count(text):
    return len(text.split())
'''
ENV = '''"""Guess a number from 1 to 8, told higher or lower."""
from hints import hint


class Guess:
    def reset(self, seed, **row):
        self.target = 1 + seed % 8
        self.turns = 0
        return "Guess a number from 1 to 8. Answer with the number."

    def step(self, action):
        self.turns += 1
        said = hint(action, self.target)
        done = said == "right" or self.turns >= 4
        return said, float(said == "right"), done
'''
HINTS = '''def hint(action, target):
    digits = [c for c in action if c.isdigit()]
    if not digits:
        return "say a number"
    guess = int(digits[0])
    return "right" if guess == target else ("higher" if guess < target else "lower")
'''
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")

OWN = '''name: mutated-own
workdir: {ws}/runs
seed: 0
rounds: 2
model: {{path: {ws}/model}}
data:
  kind: file
  path: {ws}/project/data/word_problems.jsonl
  prompt_field: question
  answer_field: answer
  eval_size: 8
  train_size: 24
  check: {{kind: python, function: "{ws}/project/rewards/reward.py:score", threshold: 1.0}}
sampler: {{backend: hf, dtype: float32}}
sample: {{n: 2, max_tokens: 16}}
label: {{kind: verifier}}
filter: {{kind: rft, min_rows: 1}}
train: {{kind: rft, epochs: 1, batch_size: 2}}
evaluate:
  max_tokens: 16
  sets:
    - name: words
    - name: fractions
      data: {{kind: file, path: {ws}/project/data/fractions.jsonl, prompt_field: problem, answer_field: solution}}
      check: {{kind: math}}
'''
ENV_CONFIG = '''name: mutated-env
workdir: {ws}/runs
seed: 0
rounds: 2
model: {{path: {ws}/model}}
data: {{kind: episodes, train_size: 4, eval_size: 2, check: {{kind: return, success: 0.5}}}}
sampler: {{backend: hf, dtype: float32}}
sample: {{n: 2, max_tokens: 8, rollout: {{kind: environment, env: "{ws}/project/envs/guess.py:Guess", max_turns: 4,
                                               episode_tokens: 128}}}}
label: {{kind: verifier}}
filter: {{kind: rft, min_rows: 1}}
train: {{kind: rft, epochs: 1, batch_size: 2}}
evaluate: {{max_tokens: 8}}
'''


def project(ws: Path) -> list[Path]:
    """The user's project and its configs, written under `ws`; the configs' paths."""
    p = ws / "project"
    files = {
        "rewards/reward.py": REWARD, "rewards/scoring.py": SCORING, "rewards/units/__init__.py": UNITS_INIT,
        "rewards/units/convert.py": CONVERT, "rewards/units/digits.py": DIGITS, "common/words.py": WORDS,
        "envs/guess.py": ENV, "envs/hints.py": HINTS,
    }
    for rel, text in files.items():
        (p / rel).parent.mkdir(parents=True, exist_ok=True)
        (p / rel).write_text(text)
    (p / "data").mkdir()
    for name in ("word_problems.jsonl", "fractions.jsonl"):
        shutil.copy(ROOT / "examples" / "own_task" / name, p / "data" / name)
    (ws / "own.yaml").write_text(OWN.format(ws=ws))
    (ws / "env.yaml").write_text(ENV_CONFIG.format(ws=ws))
    return [ws / "own.yaml", ws / "env.yaml"]


def model(ws: Path) -> None:
    """A small model directory with a chat template file (the base stage keys every file in it)."""
    sys.path.insert(0, str(ROOT))  # the tests' tiny model (tests/flows/tiny.py)
    from ratchet.models.default_model import default_model_dir
    from tests.flows.tiny import tiny_causal_lm

    out = ws / "model"
    tiny_causal_lm(out, default_model_dir())
    (out / "chat_template.jinja").write_text(TEMPLATE)


# -- the worker: keys, in a fresh interpreter that imports the copy ------------------------------

WORKER = r'''
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in type(f).__name__]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_importer_cache.clear()
sys.path.insert(0, sys.argv[1])
import ratchet.tasks.runner.stage as stage
assert stage.__file__.startswith(sys.argv[1]), stage.__file__
from ratchet.data.store import stage_key
from ratchet.flows import plan as plans
from ratchet.flows.config import load_config
from ratchet.tasks.runner import code_reach
from ratchet.tasks.runner.plan import Planner

noted = []
real = Planner.stage

def note(self, name, round, body, config, keyed, code, parents, role=None):
    noted.append((name, round, body, config, keyed))
    return real(self, name, round, body, config, keyed, code, parents, role)

Planner.stage = note
# nothing is installed while the edits run: each distribution's version is read once, not at every
# kept answer's check (thousands of them)
import functools
code_reach.installed = functools.lru_cache(maxsize=None)(code_reach.installed)
records = {}  # (config, stage, round) -> (body, job, keyed)

def collect(path):
    noted.clear()
    cfg = load_config(path, ["rounds=2", f"workdir={sys.argv[2]}"])
    plans.plan(cfg)
    for name, round, body, config, keyed in noted:
        records[(path, name, round)] = (body, config, keyed)

def keys():
    opened, out = {}, []
    for (path, name, round), (body, config, keyed) in records.items():
        roots = tuple(code_reach.roots_of(body, config))
        if roots not in opened:
            opened[roots] = code_reach.opened(list(roots))
        out.append([path, name, round, stage_key(name, opened[roots]["digest"], keyed, []),
                    "\n".join(f"{m}:{n}" for m, n, _ in opened[roots]["definitions"]), json.dumps(keyed)])
    return out

for line in sys.stdin:
    ask = json.loads(line)
    try:
        for path in ask.get("collect", []):
            collect(path)
        reply = {"keys": keys()}
    except Exception as e:
        import traceback
        reply = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    print(json.dumps(reply), flush=True)
'''


class Worker:
    def __init__(self, ws: Path):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(ws), "RATCHET_CACHE": str(ws / "cache"),
               "MLFLOW_TRACKING_URI": f"file://{ws}/mlruns", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
        # a cache of its own: code_reach's kept answers are made and taken again there; the shipped
        # configs' embedded model is not converted in it, so their base stage is planned unkeyed
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(ws / "pkg"), str(ws / "runs")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ws, env=env)

    def keys(self, collect: list[str] = ()) -> dict[tuple, "Keyed"]:
        self.proc.stdin.write(json.dumps({"collect": [str(c) for c in collect]}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the worker ended (its output is above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the worker failed: {reply['error']}\n{reply['trace']}")
        return {(Path(p).name, s, r): Keyed(k, frozenset(d.split("\n")) if d else frozenset(), j)
                for p, s, r, k, d, j in reply["keys"]}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@dataclass(frozen=True)
class Keyed:
    key: str
    reach: frozenset  # "module:name" of every definition the stage's code reaches
    job: str  # its job as keyed, JSON


# -- the edits --------------------------------------------------------------------------------

SWAP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
        ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
KINDS = ("constant", "comparison", "return")


def _docstring(node) -> ast.AST | None:
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].value
    return None


def _mutate(node: ast.AST, kind: str) -> str | None:
    """Make edit `kind` in `node` (in place); what it did, or None where it has nothing to edit."""
    docs = {id(d) for n in ast.walk(node) if (d := _docstring(n)) is not None}
    formatted = {id(v) for n in ast.walk(node) if isinstance(n, ast.JoinedStr) for v in n.values}
    for n in ast.walk(node):
        if kind == "constant" and isinstance(n, ast.Constant) and id(n) not in docs and id(n) not in formatted:
            v = n.value
            if isinstance(v, bool):
                n.value = not v
            elif isinstance(v, (int, float)):
                n.value = v + 1
            elif isinstance(v, str):
                n.value = v + "~"
            elif v is None:
                n.value = 0
            else:
                continue
            return f"constant {v!r:.40} -> {n.value!r:.40} (line {n.lineno})"
        if kind == "comparison" and isinstance(n, ast.Compare) and type(n.ops[0]) in SWAP:
            was = type(n.ops[0])
            n.ops[0] = SWAP[was]()
            return f"comparison {was.__name__} -> {SWAP[was].__name__} (line {n.lineno})"
        if kind == "return" and isinstance(n, ast.Return):
            was = "None" if n.value is None else ast.unparse(n.value)
            n.value = ast.Constant(0) if n.value is None or (isinstance(n.value, ast.Constant) and n.value.value is None) \
                else ast.Constant(None)
            return f"return {was:.40} -> return {ast.unparse(n.value)} (line {n.lineno})"
    return None


def _span(node: ast.AST) -> tuple[int, int]:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


def _rewrite(path: Path, node: ast.AST, text: str) -> None:
    """Put `node` (unparsed) where it stands in `path`, at its indentation; the rest byte for byte."""
    lines = text.splitlines(keepends=True)
    first, last = _span(node)
    indent = " " * node.col_offset
    new = "".join(indent + line + "\n" if line else "\n" for line in ast.unparse(node).split("\n"))
    path.write_text("".join(lines[:first - 1]) + new + "".join(lines[last:]))


def _definition(tree: ast.Module, name: str) -> ast.AST | None:
    for s in ast.walk(tree):
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.name == name \
                and s in getattr(tree, "body", []) + [x for b in tree.body if isinstance(b, (ast.If, ast.Try))
                                                       for x in ast.walk(b)]:
            return s
        if isinstance(s, (ast.Assign, ast.AnnAssign)) and s in tree.body:
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            if name in {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}:
                return s
    return None


@dataclass
class Edit:
    """One edit of one file: `expect` the stages (config file, stage name) that must re-key."""

    what: str
    path: Path
    apply: object  # () -> description, or None where there is nothing to edit
    expect: set = field(default_factory=set)
    layout: bool = False
    definition: str | None = None  # "module:name" of a package edit
    oracle: set | None = None  # stages named by hand that must re-key (CHILD_CODE)
    # a kind union: by design no stage is keyed by the union itself, only by the kinds its job holds
    # (adding a kind, or editing one a stage does not hold, re-keys none); an edit that changes how a
    # value parses changes the classes it holds, which are keyed, or fails to parse, loudly
    union: bool = False
    done: str | None = None


def module_file(pkg: Path, module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    for p in (pkg / "ratchet" / rel.with_suffix(".py"), pkg / "ratchet" / rel / "__init__.py"):
        if p.is_file():
            return p
    return None


def behaviour_edit(pkg: Path, definition: str, turn: int) -> Edit | None:
    module, name = definition.split(":")
    path = module_file(pkg, module)
    if path is None or name.startswith("<") or name == "*":
        return None

    def apply() -> str | None:
        text = path.read_text()
        tree = ast.parse(text)
        node = _definition(tree, name)
        if node is None:
            return None
        for kind in KINDS[turn % 3:] + KINDS[:turn % 3]:
            done = _mutate(node, kind)
            if done is not None:
                _rewrite(path, node, text)
                return done
        return None

    from ratchet.tasks.runner.code_reach import _is_union  # a kind union, as the reach reads one

    node = _definition(ast.parse(path.read_text()), name)
    union = isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_union(node.value)
    return Edit(f"{definition}", path, apply, definition=definition, union=union)


def layout_edit(pkg: Path, module: str) -> Edit | None:
    path = module_file(pkg, module)
    if path is None:
        return None

    def apply() -> str | None:
        text = path.read_text()
        tree = ast.parse(text)
        node = next((s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
        if node is None:
            node = next((s for s in tree.body if isinstance(s, ast.ClassDef)), None)
        if node is None:
            lines = text.splitlines(keepends=True)
            path.write_text("# a note for the reader\n" + "".join(lines))
            return "a comment at the top"
        doc = _docstring(node)
        if doc is not None:
            doc.value = "Reworded: " + doc.value
        _rewrite(path, node, text)  # written out again: other quotes and line breaks, comments gone
        lines = path.read_text().splitlines(keepends=True)
        first, _ = _span(node)
        lines.insert(first - 1, " " * node.col_offset + "# a note for the reader, and nothing else\n")
        path.write_text("".join(lines))
        return f"{node.name} written out again, a comment added" + (", its docstring reworded" if doc else "")

    return Edit(f"layout of {module}", path, apply, layout=True)


def file_edit(path: Path, what: str, old: str, new: str) -> Edit:
    def apply() -> str:
        text = path.read_text()
        assert old in text, f"{path}: {old!r} is not in it"
        path.write_text(text.replace(old, new, 1))
        return f"{old!r:.40} -> {new!r:.40}"

    return Edit(what, path, apply)


# Code that runs in a stage's child processes, named by hand (not found by the reach): each must
# re-key the stages named. (module, definition, what, [(config, stage, text its keyed job holds or None)])
CHILD_CODE = [
    ("ratchet.data.checks.math_answer", "verify_answer", "math-verify's check, in the scorer host",
     [("own.yaml", "evaluate.fractions", None)]),
    ("ratchet.data.sources.reasoning_gym", "score_entry", "reasoning-gym's scorer, in the scorer host",
     [("reasoning_gym.yaml", "label", None), ("tool_rft.yaml", "label", None)]),
    ("ratchet.data.checks.scorer", "_value", "the scorer host's reading of a score",
     [("own.yaml", "label", None), ("reasoning_gym.yaml", "label", None)]),
    ("ratchet.tasks.environments.textarena_game", "_echoes", "the TextArena adapter, in the environment host",
     [("guess_number_rft.yaml", "sample", None)]),
    ("ratchet.tasks.environments", "_step_value", "the environment host's reading of a step",
     [("guess_number_rft.yaml", "sample", None), ("env.yaml", "sample", None)]),
    ("ratchet.data.procs.host", "serve_calls", "the engine room's host loop",
     [("own.yaml", "label", None), ("reasoning_gym.yaml", "label", None)]),
    ("ratchet.tasks.train", "online_process", "an online training process of several", [("grpo.yaml", "train", None)]),
    ("ratchet.models.trainer", "fit_in_process", "a training process",
     [("grpo.yaml", "train", None), ("default.yaml", "train", None)]),
]
# Modules a stage kind can never run: an edit there must not re-key it. (module prefix, stages)
NEVER = [
    ("ratchet.models.train_kinds.dpo", {"prompts", "base", "sample", "label", "filter", "evaluate", "held-out"}),
    ("ratchet.models.train_kinds.grpo", {"prompts", "base", "sample", "label", "filter", "evaluate", "held-out"}),
    ("ratchet.tasks.label_kinds.judge", {"prompts", "base", "sample", "filter", "evaluate", "held-out"}),
    ("ratchet.tasks.filter_kinds", {"prompts", "base", "sample", "label", "evaluate", "held-out"}),
    ("ratchet.flows.report", {"prompts", "base", "sample", "label", "filter", "train", "evaluate", "held-out"}),
    ("ratchet.flows.cli", {"prompts", "base", "sample", "label", "filter", "train", "evaluate", "held-out"}),
]


# the stages that read a data file themselves (the others have its rows from them, by their digest)
READERS = {"prompts", "prompts.fractions", "base", "demonstrations"}


def user_edits(ws: Path) -> list[tuple[Edit, str, list[Path]]]:
    """The user's files and data files, each with the file whose naming in a job makes a stage
    expect it, and the configs planned again after it (a file's digest is taken as a config is read)."""
    p = ws / "project"
    reward, env = p / "rewards" / "reward.py", p / "envs" / "guess.py"
    own = [ws / "own.yaml", ws / "env.yaml"]
    demos = "examples/cold_start/demos.jsonl"
    return [(e, names, own) for e, names in [
        (file_edit(reward, "the reward file", "<= 30", "<= 29"), str(reward)),
        (file_edit(p / "rewards" / "scoring.py", "its helper, one level", "found == ", "found != "), str(reward)),
        (file_edit(p / "rewards" / "units" / "convert.py", "its helper package, two levels", "[-1]", "[0]"),
         str(reward)),
        (file_edit(p / "rewards" / "units" / "digits.py", "a module the helper package imports relatively",
                   '","', '",."'), str(reward)),
        (file_edit(p / "common" / "words.py", "a helper in a sibling folder", "split()", "split(' ')"), str(reward)),
        (file_edit(env, "an environment's file", "seed % 8", "seed % 7"), str(env)),
        (file_edit(p / "envs" / "hints.py", "the environment's helper module", '"higher"', '"up"'), str(env)),
        (file_edit(p / "data" / "word_problems.jsonl", "a row of the prompt file", '"answer": 15}', '"answer": 16}'),
         str(p / "data" / "word_problems.jsonl")),
        (file_edit(p / "data" / "fractions.jsonl", "a row of a held-out set's file", "one half", "one third"),
         str(p / "data" / "fractions.jsonl")),
        (file_edit(ws / "model" / "chat_template.jinja", "the model's chat template", "assistant: ", "assistant:\n"),
         str(ws / "model")),
    ]] + [(file_edit(ws / demos, "a demonstration of the cold start", "The remainder is 351", "It is 351"), demos,
           [ROOT / "flows" / "configs" / "cold_start_tool.yaml"])]


# -- the run ----------------------------------------------------------------------------------

def workspace(ws: Path) -> list[Path]:
    for layer in LAYERS:  # with their compiled modules (`make test` compiles them): each copy keeps its
        # source's mtime, so a module's bytecode holds until an edit, which Python then compiles afresh
        shutil.copytree(ROOT / layer, ws / "pkg" / "ratchet" / layer)
    # the shipped configs name the examples by paths from the repository's root, where the worker runs
    shutil.copytree(ROOT / "examples", ws / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    model(ws)
    return project(ws)


def configs(own: list[Path], names: list[str] | None) -> list[Path]:
    """The shipped configs (those `names` names, or all), then the project's."""
    shipped = sorted(p for p in (ROOT / "flows" / "configs").glob("*.yaml") if p.name not in SKIP_CONFIGS
                     and (names is None or p.name in names))
    return shipped + own


def changed(before: dict, after: dict) -> set:
    return {k for k in before if k in after and after[k].key != before[k].key}


def run(full: bool = False, sample: int = 24, seed: int = 0, out: Path | None = None, keep: Path | None = None,
        shipped: list[str] | None = None, only: list[str] | None = None) -> dict:
    """Make the copy, plan its configs (`shipped`: those of flows/configs to plan, or all), make
    the edits and report; the report as a dict ("misses": each edit with a miss)."""
    t0 = time.time()
    ws = Path(keep or tempfile.mkdtemp(prefix="key-mutations-"))
    ws.mkdir(parents=True, exist_ok=True)
    try:
        own = workspace(ws)
        paths = configs(own, shipped)
        worker = Worker(ws)
        try:
            return _run(ws, worker, paths, full, sample, seed, out, t0, only)
        finally:
            worker.close()
    finally:
        if keep is None:
            shutil.rmtree(ws, ignore_errors=True)


def _run(ws, worker, paths, full, sample, seed, out, t0, only=None) -> dict:
    base = worker.keys(collect=paths)
    print(f"{len(paths)} configs planned, {len(base)} stages keyed in {time.time() - t0:.0f} s", flush=True)
    # the stages' kinds: one per (stage, reach), named by the first config that has it
    kinds: dict[tuple, list] = {}
    for k, v in base.items():
        kinds.setdefault((k[1], v.reach), []).append(k)
    reached: dict[str, set] = {}
    for k, v in base.items():
        for d in v.reach:
            reached.setdefault(d, set()).add(k)
    pkg = ws / "pkg"
    definitions = sorted(d for d in reached if not d.split(":")[1].startswith("<") and d.split(":")[1] != "*")
    modules = sorted({d.split(":")[0] for d in definitions})
    rng = random.Random(seed)
    if only:
        chosen, layouts = [d for d in definitions if any(o in d for o in only)], []
    elif full:
        chosen, layouts = definitions, modules
    else:
        chosen = sorted(rng.sample(definitions, min(sample, len(definitions))))
        layouts = sorted(rng.sample(modules, min(max(3, sample // 4), len(modules))))
    edits: list[Edit] = []
    for i, d in enumerate(chosen):
        if (e := behaviour_edit(pkg, d, i)) is not None:
            e.expect = reached[d]
            edits.append(e)
    for module, name, what, where in CHILD_CODE:
        e = behaviour_edit(pkg, f"{module}:{name}", 0)
        e.what = f"{module}:{name} ({what})"
        e.expect = reached.get(f"{module}:{name}", set())
        e.oracle = {k for k, v in base.items() for c, stage, holds in where
                    if k[0] == c and k[1] == stage and (holds is None or holds in v.job)}
        if e.oracle:  # where a config that runs it is planned
            edits.append(e)
    for m in layouts:
        if (e := layout_edit(pkg, m)) is not None:
            edits.append(e)
    user, replan = [], {}
    for e, names, again in user_edits(ws):
        if not set(again) <= set(paths):
            continue
        e.expect = {k for k, v in base.items() if names in v.job and (e.path.suffix == ".py" or k[1] in READERS)}
        user.append(e)
        replan[id(e)] = again
    never = {(prefix, s) for prefix, stages in NEVER for s in stages}
    users = {id(e) for e in user}

    results = []
    for i, e in enumerate(edits + user):
        if i and i % 50 == 0:
            print(f"{i} of {len(edits) + len(user)} edits, {time.time() - t0:.0f} s", flush=True)
        original = e.path.read_text()
        try:
            e.done = e.apply()
            if e.done is None:
                results.append({"edit": e.what, "skipped": "nothing to edit"})
                continue
            t = time.time()
            after = worker.keys(collect=replan.get(id(e), []))
            took = time.time() - t
        finally:
            e.path.write_text(original)
            if replan.get(id(e)):
                worker.keys(collect=replan[id(e)])  # its configs planned again as they were
        got = changed(base, after)
        expect = set() if e.layout or e.union else e.expect
        missed, spurious = expect - got, got - expect
        if e.oracle is not None:
            missed |= e.oracle - got
        if e.definition is not None:
            spurious |= {k for k in got if any(e.definition.startswith(p + ":") or e.definition.startswith(p + ".")
                                                for p, s in never if s == k[1])}
        results.append({"edit": e.what, "file": str(e.path.relative_to(ws)), "how": e.done,
                        "kind": "layout" if e.layout else "user" if id(e) in users else "union" if e.union
                        else "behaviour",
                        "expected": len(expect), "rekeyed": len(got), "seconds": round(took, 2),
                        "missed": sorted(map(list, missed)), "spurious": sorted(map(list, spurious))})
    if worker.keys(collect=sorted({p for again in replan.values() for p in again})) != base:  # all put back
        results.append({"edit": "all put back", "kind": "check", "missed": [["the keys did not come back"]],
                        "spurious": []})
    return report(results, kinds, base, time.time() - t0, out)


def report(results: list[dict], kinds: dict, base: dict, seconds: float, out: Path | None) -> dict:
    misses = [r for r in results if r.get("missed") or r.get("spurious")]
    counts: dict[str, int] = {}
    for r in results:
        counts[r.get("kind", "skipped")] = counts.get(r.get("kind", "skipped"), 0) + 1
    print(f"\n{len(kinds)} stage kinds across {len({k[0] for k in base})} configs; edits: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"; {seconds:.0f} s")
    print(f"{'kind':<46} {'definitions':>11} {'edits seen':>10}")
    coverage = {}
    for (stage, reach), members in sorted(kinds.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        name = f"{stage} ({', '.join(sorted({m[0] for m in members}))[:36]})"
        edits = [r for r in results if r.get("kind") == "behaviour" and r.get("edit", "").split(" ")[0] in reach]
        seen = sum(1 for r in edits if not any(tuple(m) in members for m in map(tuple, r["missed"])))
        coverage[name] = {"definitions": len(reach), "edits": len(edits), "rekeyed": seen}
        print(f"{name:<46} {len(reach):>11} {seen:>4}/{len(edits):<5}")
    print(f"\nmisses: {len(misses)}")
    for r in misses:
        print(f"  {r['edit']} [{r.get('how')}]")
        for k in r["missed"]:
            print(f"    missed: {k}")
        for k in r["spurious"]:
            print(f"    spurious: {k}")
    for r in results:
        if r.get("kind") == "user":
            print(f"user edit: {r['edit']}: {r['rekeyed']} stage(s) re-keyed, {r['expected']} expected")
    done = {"seconds": round(seconds, 1), "coverage": coverage, "misses": misses, "results": results,
            "stages": sorted(map(list, base))}
    if out is not None:
        out.write_text(json.dumps(done, indent=1))
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="every definition any stage reaches")
    ap.add_argument("--sample", type=int, default=24, help="without --full: how many definitions (a fixed sample)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep", type=Path, help="make the copy here and keep it")
    ap.add_argument("--configs", nargs="+", metavar="NAME", help="plan only these of flows/configs (default: all)")
    ap.add_argument("--only", nargs="+", metavar="TEXT", help="edit only the definitions whose module:name holds "
                    "one of these (and the hand-named and user edits)")
    a = ap.parse_args(argv)
    return 1 if run(a.full, a.sample, a.seed, a.json, a.keep, a.configs, a.only)["misses"] else 0


if __name__ == "__main__":
    sys.exit(main())
