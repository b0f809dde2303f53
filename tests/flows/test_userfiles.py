"""Files the user supplies are one typed kind of config field: found anywhere in the config,
and made absolute (with any digest beside them taken again) in a deployment."""

import json
import shutil
import typing

from pydantic import BaseModel

from ratchet.data.userfiles import annotated_fields, user_files
from ratchet.flows.config import PipelineConfig, load_config
from ratchet.flows.schedule import absolute_paths


def _models(cls, seen=None):
    """Every config model reachable from `cls`, through unions, lists and optionals."""
    seen = set() if seen is None else seen
    if cls in seen:
        return seen
    seen.add(cls)
    for f in cls.model_fields.values():
        stack = [f.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                _models(t, seen)
            stack += list(typing.get_args(t))
    return seen


def _leaves(t):
    args = typing.get_args(t)
    return {x for a in args for x in _leaves(a)} if args else {t}


def test_every_field_that_names_a_users_file_is_typed_as_one():
    """A new field that takes a path, a model directory or a function's file must say so: the
    deployment and the lineage find user files by that type alone."""
    names = {"path", "eval_path", "model", "function"}
    not_files = {"EndpointConfig.model"}  # the name a server serves a model under
    untyped = [f"{cls.__name__}.{n}" for cls in _models(PipelineConfig) for n, f in cls.model_fields.items()
               if n in names and str in _leaves(f.annotation) and n not in annotated_fields(cls)
               and f"{cls.__name__}.{n}" not in not_files]
    assert not untyped, f"fields that name user files without the UserFile type: {untyped}"
    typed = {f"{cls.__name__}.{n}" for cls in _models(PipelineConfig) for n in annotated_fields(cls)}
    assert {"FileSource.path", "FileSource.eval_path", "PythonCheck.function", "ModelConfig.path",
            "JudgeLabel.model", "RewardModelLabel.model", "ModelOptimiser.path"} <= typed


def test_a_deployment_makes_every_user_file_absolute_wherever_it_is(tmp_path, monkeypatch, tiny_model):
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "regress.jsonl").write_text(json.dumps({"prompt": "What is 40 + 2?", "answer": "42"}) + "\n")
    (tmp_path / "rewards.py").write_text("def score(completion, answer=None, prompt=None, **fields):\n    return 1.0\n")
    shutil.copytree(tiny_model, tmp_path / "policy")
    shutil.copytree(tiny_model, tmp_path / "judge")
    cfg = load_config(None, [
        "model.path=policy", "data={kind: file, path: train.jsonl, eval_size: 2}",
        "evaluate.sets=[{name: own}, {name: regress, data: {kind: file, path: regress.jsonl, "
        "check: {kind: python, function: 'rewards.py:score'}}}]",
        "label.kind=judge", "label.model=judge", "filter.kind=pairs"])
    found = user_files(cfg)
    assert set(found) == {"model.path", "data.path", "evaluate.sets[1].data.path",
                          "evaluate.sets[1].data.check.function", "label.model"}
    assert found["evaluate.sets[1].data.check.function"] == tmp_path / "rewards.py"
    deployed = absolute_paths(cfg)
    assert deployed.model.path == str(tmp_path / "policy") and deployed.label.model == str(tmp_path / "judge")
    assert deployed.data.path == str(tmp_path / "train.jsonl")
    regress = deployed.evaluate.sets[1].data
    assert regress.path == str(tmp_path / "regress.jsonl")
    assert regress.check.function == f"{tmp_path / 'rewards.py'}:score" and regress.check.source is None
    assert deployed.workdir == str(tmp_path / "runs")
    # what is not on this disk stays as written: the embedded model, an installed module's function
    plain = absolute_paths(load_config(None, ["data.check={kind: python, function: 'json:dumps'}"]))
    assert plain.model.path == "default" and plain.data.check.function == "json:dumps"


def test_a_user_function_is_keyed_with_every_helper_it_imports(tmp_path):
    """Its folder's modules, their packages' relative imports, and a folder the file puts on the
    path from `__file__` (two spellings); not a folder named relative to where ratchet runs, and
    not a module a folder earlier on the path shadows (tests/key_mutations.py edits each)."""
    from ratchet.data.userfiles import helpers, source_digest

    files = {
        "task/reward.py": "import os, sys\nfrom pathlib import Path\n"
                          "sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'common'))\n"
                          "sys.path.append(os.path.join(os.path.dirname(__file__), '..', 'more'))\n"
                          "sys.path.append('elsewhere')\n"
                          "from scoring import right\nfrom words import count\nimport extra\nimport shadowed\n",
        "task/scoring.py": "from units.convert import to_number\n",
        "task/units/__init__.py": "",
        "task/units/convert.py": "from .digits import SEPARATORS\nfrom . import signs\n",
        "task/units/digits.py": "SEPARATORS = ','\n",
        "task/units/signs.py": "MINUS = '-'\n",
        "task/shadowed.py": "X = 1\n",
        "common/words.py": "def count(t):\n    return len(t.split())\n",
        "common/shadowed.py": "X = 2\n",
        "more/extra.py": "Y = 1\n",
        "elsewhere/unseen.py": "Z = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = {str(p.relative_to(tmp_path)) for p in helpers(tmp_path / "task" / "reward.py")}
    assert found == {"task/scoring.py", "task/units/__init__.py", "task/units/convert.py", "task/units/digits.py",
                     "task/units/signs.py", "task/shadowed.py", "common/words.py", "more/extra.py"}
    spec = f"{tmp_path / 'task' / 'reward.py'}:score"
    before = source_digest(spec)
    (tmp_path / "common" / "shadowed.py").write_text("X = 3\n")  # not what imports: the task's own does
    assert source_digest(spec) == before
    (tmp_path / "task" / "units" / "signs.py").write_text("MINUS = '+'\n")
    assert source_digest(spec) != before
