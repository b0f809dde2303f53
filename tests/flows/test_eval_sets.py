"""Several held-out sets per round (evaluate.sets): each set's prompts are checked before any
model loads; through the CLI on the tiny model every set is evaluated each round, logged per
set, shown on the console and in the report, recorded on each model version, and an edit to
one set's file re-runs only that set's stages."""

import json

import pytest

from ratchet.data.errors import ConfigError
from ratchet.data.prompts import load_split
from ratchet.flows.config import load_config
from ratchet.flows.inputs import held_out_sets
from tests.flows.test_user_check import _stages
from tests.flows.tiny import ROOT, ratchet

CONFIG = ROOT / "flows" / "configs" / "default.yaml"


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sets(*sets) -> str:
    return "evaluate.sets=" + json.dumps(list(sets))


def test_a_sets_file_is_read_whole_and_checked_against_the_task(tmp_path):
    reg = _rows(tmp_path / "reg.jsonl", [{"prompt": f"Spell {w}.", "answer": w} for w in ("cat", "dog", "owl")])
    cfg = load_config(CONFIG, [_sets({"name": "task"}, {"name": "reg", "data": {"kind": "file", "path": str(reg)},
                                                         "check": {"kind": "exact"}})])
    split = load_split(cfg.data, cfg.seed)
    sets = held_out_sets(cfg, split)
    assert list(sets) == ["reg"] and [p.answer for p in sets["reg"].eval] == ["cat", "dog", "owl"]  # every row
    assert sets["reg"].digests["path"] and sets["reg"].places["row-1"] == (str(reg), "line 1")

    # a set that repeats train prompts of the task, a row without an answer, a check that cannot load
    train = split.train[0]
    bad = _rows(tmp_path / "bad.jsonl", [{"prompt": train.prompt.upper(), "answer": train.answer},
                                         {"prompt": "What is 40 + 2?", "answer": "42"}])
    blank = _rows(tmp_path / "blank.jsonl", [{"prompt": "Spell emu.", "answer": None}])
    (tmp_path / "other.py").write_text("def other(completion):\n    return 1.0\n")
    cfg = load_config(CONFIG, [_sets(
        {"name": "task"}, {"name": "bad", "data": {"kind": "file", "path": str(bad)}},
        {"name": "scored", "check": {"kind": "python", "function": f"{tmp_path / 'other.py'}:score"}},
        {"name": "blank", "data": {"kind": "file", "path": str(blank)}})])
    with pytest.raises(ConfigError) as e:
        held_out_sets(cfg, split)
    text = str(e.value)
    assert "evaluate.sets[3] (blank).data: " in text and "eval rows without a reference answer" in text
    assert "evaluate.sets[1] (bad): 1 of its prompts are train prompts of the task" in text
    assert "allow_overlap=true" in text and "other.py" in text
    assert "evaluate.sets[2] (scored): evaluate.sets[2].check.function=" in text  # the check names its place
    cfg = load_config(CONFIG, [_sets({"name": "task"}, {"name": "ok", "allow_overlap": True, "data": {
        "kind": "file", "path": str(_rows(tmp_path / "ok.jsonl", [{"prompt": train.prompt, "answer": "1"}]))}})])
    assert len(held_out_sets(cfg, split)["ok"].eval) == 1


@pytest.mark.integration
def test_every_set_is_evaluated_logged_and_keyed_on_its_own(tiny_model, tmp_path, prefect_harness, capsys):
    """Guards several held-out sets a round (the module's promise, end to end): each set evaluated
    each round, logged per set in MLflow, shown on the console, in the report and on every model
    version, and an edit to one set's file re-runs only that set's stages; `ratchet evaluate` reads
    a version's sets from its round and evaluates a set added later. Slow: a CLI run, then the
    edited run in this process."""
    from mlflow.tracking import MlflowClient
    from prefect.settings import PREFECT_API_URL

    api, work = PREFECT_API_URL.value(), tmp_path / "runs"
    reg = _rows(tmp_path / "reg.jsonl", [{"prompt": f"What is {a} times 2?", "answer": str(2 * a)} for a in range(3)])
    args = [CONFIG, f"workdir={work}", f"model.path={tiny_model}", "rounds=1", "sampler.backend=hf",
            "sampler.dtype=float32", "data.a_max=6", "data.b_max=4", "data.eval_size=4", "sample.n=3",
            "sample.max_tokens=6", "filter.min_rows=1", "filter.min_reward=0", "train.epochs=1", "train.batch_size=4",
            "evaluate.max_tokens=6", "evaluate.max_drop=0.5", "evaluate.gate=task",
            _sets({"name": "task"}, {"name": "reg", "data": {"kind": "file", "path": str(reg)}})]
    first = ratchet("run", *args, api_url=api)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    one = _stages(work)
    kinds = sorted(s for s, *_ in one.values())
    assert kinds.count("evaluate") == 2 and kinds.count("evaluate.reg") == 2 and kinds.count("prompts.reg") == 1
    assert "evaluate.reg" in first.stdout and " · reg " in first.stdout  # a stage line and the round line

    c = MlflowClient(db := f"sqlite:///{work / 'mlflow.db'}", db)
    [exp] = [e for e in c.search_experiments() if e.name == "ratchet-default"]
    runs = c.search_runs([exp.experiment_id])
    [r1] = [r for r in runs if r.data.tags.get("ratchet.round") == "1"]
    [parent] = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    m = r1.data.metrics
    assert {"evaluate.accuracy", "evaluate.reg.accuracy", "round.accuracy.task", "round.accuracy.reg"} <= set(m)
    assert m["round.accuracy"] == m["round.accuracy.task"] == m["evaluate.accuracy"]
    assert {"eval.accuracy", "eval.reg.accuracy"} <= set(parent.data.metrics)
    versions = c.search_model_versions("name='ratchet-default'")
    for v in versions:
        named = dict(x.split("=") for x in v.tags["ratchet.eval_sets"].split(", "))
        assert set(named) == {"task", "reg"} and v.tags["ratchet.gate_set"] == "task"
        assert all(f"ratchet.accuracy.{e}" in v.tags for e in named.values())
    [report] = (work / "reports").iterdir()
    page = (report / "index.html").read_text()
    assert "<th>held-out accuracy (task, in float32)</th><th>reg</th>" in page

    # an edited regression file: a new run that re-runs only that set's stages
    _rows(reg, [{"prompt": f"What is {a} times 3?", "answer": str(3 * a)} for a in range(3)])
    from ratchet.flows import api as python_api

    python_api.run(python_api.load(CONFIG, args[1:]))  # as `ratchet run` runs it, in this process
    two = _stages(work)
    new = sorted(two[n][0] for n in two if n not in one)
    # the two rounds' models on the new set, and the champion (first run's) again before the gate compares
    assert new == ["evaluate.reg", "evaluate.reg", "prompts.reg"], new

    # `ratchet evaluate`: a version on the run's sets reads what its round made; a set added by an
    # override is evaluated once and kept; a set the config lacks is refused before any model loads
    from ratchet.data.errors import RatchetError
    from ratchet.flows.cli import main

    more = _rows(tmp_path / "more.jsonl", [{"prompt": f"What is {a} times 4?", "answer": str(4 * a)} for a in range(5)])
    plus = [*args[1:-1], _sets({"name": "task"}, {"name": "reg", "data": {"kind": "file", "path": str(reg)}},
                                {"name": "more", "data": {"kind": "file", "path": str(more)}})]
    done = python_api.evaluate(CONFIG, "2", overrides=plus)
    by = {s.name: s for s in done.sets}
    assert list(by) == ["task", "reg", "more"] and done.made_by.endswith("round 1")
    assert by["task"].reused and by["reg"].reused and not by["more"].reused
    assert by["task"].accuracy == m["evaluate.accuracy"] and by["more"].prompts == 5
    assert _stages(work)[by["task"].stage_dir.split("/")[1]][2:4] == two[by["task"].stage_dir.split("/")[1]][2:4]
    assert main(["evaluate", str(CONFIG), "2", "--set", "more", *plus]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  more ")]
    assert f"{by['more'].accuracy:.1%} of 5 " in line and line.endswith(f"{by['more'].stage_dir} (read: evaluated before)")
    with pytest.raises(RatchetError, match="--set gone: not a held-out set of this config, which has task, reg, more"):
        python_api.evaluate(CONFIG, "2", ["gone"], overrides=plus)


@pytest.mark.integration
def test_the_guides_example_checks_clean_as_the_guide_shows(default_model):
    """docs/guides/own-task.md's worked example passes `ratchet check`, and the guide prints what it prints."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "check", "examples/own_task/own_task.yaml"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    import re

    guide = (ROOT / "docs" / "guides" / "own-task.md").read_text()
    dtype_line = re.compile(r"^dtype: sampling \w+, evaluating \w+( \(as the base model is stored\))?, training \w+ "
                            r"\(.+\)$", re.M)  # the machine's own
    assert len(dtype_line.findall(r.stdout)) == 1 and len(dtype_line.findall(guide)) == 1
    # the guide shows a first check; one of the same inputs again adds that its model's checks passed before
    first = "".join(x for x in r.stdout.splitlines(keepends=True) if not x.startswith("model checks: passed before"))
    shown = dtype_line.sub(dtype_line.search(guide).group(0), first)
    assert r.stdout.startswith("data: file, 120 train prompts") and shown in guide


def test_the_guides_reward_function_scores_as_it_says():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rewards", ROOT / "examples" / "own_task" / "rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    assert rewards.score("Fay has 15 coins now.", answer=15)["score"] == 1.0
    assert rewards.score("Fay has 14, so 15", answer="15")["score"] == 1.0
    assert rewards.score("15 or maybe 16", answer=15)["score"] == 0.0
    long = " ".join(["word"] * 40) + " 15"
    assert rewards.score(long, answer=15) == {"score": pytest.approx(1.0 - 0.02 * 11), "words": 41.0}
