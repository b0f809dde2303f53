"""Keys over all the code a stage runs, in its own process and in its children: a copy of the
package is keyed, edited, and keyed again (the real package is never touched).

For each piece of child-process code a stage runs (math-verify's check, reasoning-gym's scorer,
the TextArena adapter, the scorer host, an environment's helper module, a training process of
several), a behaviour edit
re-keys the stage that runs it, and a comment or docstring edit does not."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

# Run in a fresh interpreter with the copy as the `ratchet` package: the editable install's finder
# is dropped first, so every module (and what code_reach reads) comes from the copy.
PROBE = r'''
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in type(f).__name__]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_importer_cache.clear()
sys.path.insert(0, sys.argv[1])
import ratchet.tasks.stage as stage
assert stage.__file__.startswith(sys.argv[1]), stage.__file__
from ratchet.data.store import stage_key
from ratchet.data.checks.math_answer import MathCheck
from ratchet.data.prompts import AdditionSource
from ratchet.data.sources.reasoning_gym import ReasoningGymSource
from ratchet.models.sampler import SamplerConfig
from ratchet.models.train_kinds import GRPOTrainConfig
from ratchet.tasks import label, sample, train
from ratchet.tasks.rollouts.environment import EnvironmentRollout

def key(name, body, job):
    return stage_key(name, stage.body_code(body, config=job), stage.keyed(job), [])

jobs = {
    "math": ("label", label.label_body, label.LabelJob(label=label.VerifierLabel(),
                                                        data=AdditionSource(check=MathCheck()))),
    "reasoning_gym": ("label", label.label_body, label.LabelJob(label=label.VerifierLabel(),
                                                                 data=ReasoningGymSource(dataset="chain_sum"))),
    "textarena": ("sample", sample.sample_body, sample.SampleJob(
        sample=sample.SampleConfig(rollout=EnvironmentRollout(env={"kind": "textarena", "game": "GuessTheNumber-v0"})),
        sampler=SamplerConfig(), seed=0)),
    "gymnasium": ("sample", sample.sample_body, sample.SampleJob(
        sample=sample.SampleConfig(rollout=EnvironmentRollout(env={"kind": "gymnasium", "game": "FrozenLake-v1"})),
        sampler=SamplerConfig(), seed=0)),
    "user_env": ("sample", sample.sample_body, sample.SampleJob(
        sample=sample.SampleConfig(rollout=EnvironmentRollout(env=sys.argv[2])), sampler=SamplerConfig(), seed=0)),
    "grpo": ("train", train.online_body, train.OnlineJob(
        train=GRPOTrainConfig(), seed=0, sample=sample.SampleConfig(top_k=0), sampler=SamplerConfig(),
        label=label.VerifierLabel(), data=AdditionSource())),
}
print(json.dumps({k: key(*v) for k, v in jobs.items()}))
'''

ENV = '''from moves import parse


class Walk:
    """A one-dimensional walk."""

    def reset(self, seed):
        return "start at 0"

    def step(self, action):
        return "moved", float(parse(action)), True
'''
MOVES = '''def parse(action):
    return action.count("right")
'''


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """The package copied (data, models, tasks, flows under ratchet/), and a user's environment
    whose class imports a helper module beside it."""
    base = tmp_path_factory.mktemp("keyed")
    for layer in ("data", "models", "tasks", "flows"):
        shutil.copytree(ROOT / layer, base / "pkg" / "ratchet" / layer, ignore=shutil.ignore_patterns("__pycache__"))
    (base / "env").mkdir()
    (base / "env" / "walk.py").write_text(ENV)
    (base / "env" / "moves.py").write_text(MOVES)
    return base


def keys(base: Path) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(base / "pkg"), f"{base / 'env' / 'walk.py'}:Walk"],
                         capture_output=True, text=True, cwd=base,
                         env={"PATH": "/usr/bin:/bin", "RATCHET_CACHE": str(base / "cache"), "HOME": str(base)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _function(path: Path, qualname: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    parts = qualname.split(".")
    scope = tree.body
    for part in parts:
        node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        scope = node.body
    return node


def edit(path: Path, qualname: str, how: str) -> None:
    """An edit inside a function: `behaviour` adds a statement that changes nothing it returns but
    is code (so a key must see it); `comment` adds a comment and rewords its docstring."""
    node = _function(path, qualname)
    lines = path.read_text().splitlines(keepends=True)
    first = node.body[0]
    indent = " " * first.col_offset
    has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    if how == "behaviour":
        at = (first.end_lineno if has_doc else first.lineno - 1)
        lines.insert(at, f"{indent}_edited = {len(lines)}\n")
    else:
        lines.insert(first.lineno - 1, f"{indent}# a note for the reader, and nothing else\n")
        if has_doc:
            i = first.lineno  # the docstring's first line, now one down
            lines[i] = lines[i].replace('"""', '"""Reworded: ', 1)
    path.write_text("".join(lines))


# (what, the copy's file, the function edited, the stages that run it, the stages that do not). What an
# environment rollout plays is a kind (tasks/environments/kinds.py): a stage is keyed by the adapter
# it plays, not by its siblings (a user's class is not re-keyed by an edit to the TextArena adapter).
CASES = [
    ("math verify", "data/checks/math_answer.py", "verify_answer", {"math"},
     {"reasoning_gym", "textarena", "gymnasium", "user_env"}),
    ("reasoning-gym scoring", "data/sources/reasoning_gym.py", "score_entry", {"reasoning_gym"},
     {"math", "textarena", "gymnasium", "user_env"}),
    ("the TextArena adapter", "tasks/environments/textarena_game.py", "_echoes", {"textarena"},
     {"math", "reasoning_gym", "gymnasium", "user_env"}),
    ("the gymnasium adapter", "tasks/environments/gymnasium_game.py", "_FrozenLake.render", {"gymnasium"},
     {"math", "reasoning_gym", "textarena", "user_env"}),
    ("the scorer host", "data/checks/scorer.py", "_value", {"math", "reasoning_gym"},
     {"textarena", "gymnasium", "user_env"}),
    ("the environment host", "tasks/environments/__init__.py", "_step_value", {"textarena", "gymnasium", "user_env"},
     {"math", "reasoning_gym"}),
    ("the engine room's host", "data/procs/host.py", "serve_calls", {"math", "reasoning_gym"}, set()),
    # what each training process of several runs (torchrun's children): the stage's Online made
    # again, and the trainer's own entry into the kind
    ("an online training process", "tasks/train.py", "online_process", {"grpo"},
     {"math", "reasoning_gym", "textarena", "gymnasium", "user_env"}),
    ("a training process", "models/trainer.py", "fit_in_process", {"grpo"},
     {"math", "reasoning_gym", "textarena", "gymnasium", "user_env"}),
]


@pytest.mark.parametrize("what, file, function, runs, not_runs", CASES, ids=[c[0] for c in CASES])
def test_an_edit_to_code_a_child_runs_rekeys_the_stage_that_runs_it(copy, what, file, function, runs, not_runs):
    path = copy / "pkg" / "ratchet" / file
    original = path.read_text()
    try:
        before = keys(copy)
        edit(path, function, "comment")
        assert keys(copy) == before, f"a comment in {what} re-keyed a stage"
        edit(path, function, "behaviour")
        after = keys(copy)
        assert {j for j in runs if after[j] == before[j]} == set(), \
            f"a behaviour edit in {what} ({file}:{function}) did not re-key a stage that runs it"
        assert {j for j in not_runs if after[j] != before[j]} == set(), f"{what}: re-keyed a stage that does not run it"
    finally:
        path.write_text(original)


def test_an_edit_to_an_environment_s_helper_module_rekeys_the_stage_that_plays_it(copy):
    """A user's file is keyed by its bytes and those of the modules it imports from its folder (a
    comment there is an edit of the user's file: it re-keys too); nothing else re-keys."""
    helper = copy / "env" / "moves.py"
    before = keys(copy)
    try:
        helper.write_text(MOVES.replace('"right"', '"left"'))
        after = keys(copy)
        assert after["user_env"] != before["user_env"]
        assert {k: v for k, v in after.items() if k != "user_env"} == \
            {k: v for k, v in before.items() if k != "user_env"}
    finally:
        helper.write_text(MOVES)
    assert keys(copy) == before


def test_a_library_upgrade_rekeys_the_stages_whose_code_imports_it(monkeypatch):
    """math-verify's version is in the key of a stage that checks with it, not of one that does not."""
    from ratchet.data.checks.math_answer import MathCheck
    from ratchet.data.checks.number import NumberCheck
    from ratchet.data.prompts import AdditionSource
    from ratchet.tasks import code_reach, label
    from ratchet.tasks.stage import body_code

    def version(check):
        return body_code(label.label_body, config=label.LabelJob(label=label.VerifierLabel(),
                                                                 data=AdditionSource(check=check)))

    math, number = version(MathCheck()), version(NumberCheck())
    real = code_reach.installed
    monkeypatch.setattr(code_reach, "installed", lambda n: "math-verify==99.0" if n == "math_verify" else real(n))
    assert version(MathCheck()) != math and version(NumberCheck()) == number
