"""A user's reward file as the check of a round, through the CLI on the tiny model: its scores
label and evaluate; a function that raises stops the run naming the row with the user's
traceback; once fixed, the command the failure printed continues the same run (its name, its
MLflow parent), re-runs what reads the file and reuses the samples, and the lineage says which
version of the file each stage read."""

import textwrap

import pytest

from ratchet.data.manifest import read_manifest
from tests.flows.tiny import ROOT, ratchet

pytestmark = pytest.mark.integration

V1 = """
    def score(completion, answer=None, prompt=None, **fields):
        return {"score": float(len(completion) > 3), "length": float(len(completion))}
"""
RAISES = """
    def score(completion, answer=None, prompt=None, **fields):
        return {"score": rule(completion), "length": float(len(completion))}

    def rule(text):
        if len(text) > 3:
            raise ValueError("no rule for " + repr(text[:10]))
        return 0.0
"""
FIXED = """
    def score(completion, answer=None, prompt=None, **fields):
        return {"score": float(len(completion) > 3 and prompt is not None), "length": float(len(completion))}
"""


def _args(workdir, tiny_model, rewards):
    return [ROOT / "flows" / "configs" / "default.yaml", f"workdir={workdir}", f"model.path={tiny_model}", "rounds=1",
            "sampler.backend=hf", "sampler.dtype=float32", "data.a_max=6", "data.b_max=4", "data.eval_size=4",
            "sample.n=3", "sample.max_tokens=6", "sample.shard_size=6", "label.shard_size=8", "filter.min_rows=1",
            "train.epochs=1", "train.batch_size=4", "evaluate.max_tokens=6",
            f"data.check={{kind: python, function: '{rewards}:score', threshold: 1.0}}"]


def _stages(workdir) -> dict[str, tuple]:
    """stage directory -> (stage, round, manifest inode and mtime): a stage run again changes the last."""
    out = {}
    for d in (workdir / "stages").iterdir():
        if (m := read_manifest(d)) is not None:
            st = (d / "manifest.json").stat()
            out[d.name] = (m.stage, m.round, st.st_ino, st.st_mtime_ns, m)
    return out


def test_a_reward_file_scores_a_round_and_its_edits_rerun_only_what_reads_it(tiny_model, tmp_path, prefect_harness,
                                                                             capsys):
    """Guards a user's reward file as a round's check: its scores label and evaluate; a raising
    function stops the run naming the row and the user's traceback; fixed, the printed command
    continues the same run and re-runs only what reads the file; lineage names each file version.
    Slow: three CLI runs of the tiny pipeline."""
    from prefect.settings import PREFECT_API_URL

    api, work = PREFECT_API_URL.value(), tmp_path / "runs"
    rewards = tmp_path / "user" / "rewards.py"
    rewards.parent.mkdir()
    rewards.write_text(textwrap.dedent(V1))
    first = ratchet("run", *_args(work, tiny_model, rewards), api_url=api)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    one = _stages(work)
    [label] = [m for s, r, *_, m in one.values() if s == "label"]
    assert label.metrics["score_mean"] == pytest.approx(label.metrics["reward_mean"])  # the reward is the score
    assert label.metrics["score_length_mean"] > 0  # the function's own metric, per round
    evals = [m for s, r, *_, m in one.values() if s == "evaluate"]
    assert len(evals) == 2 and all("score_mean" in m.metrics for m in evals)
    assert all(len(m.config["data"]["check"]["source"]) == 64 for m in (label, *evals))  # the digest keys them

    # a function that raises: the run stops in label, naming the row and the user's own traceback
    rewards.write_text(textwrap.dedent(RAISES))
    failed = ratchet("run", *_args(work, tiny_model, rewards), api_url=api)
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert "failed on row '" in out and "raised ValueError: no rule for" in out, out[-3000:]
    assert f'File "{rewards}", line 7, in rule' in out, out[-3000:]
    assert {s for s, *_ in _stages(work).values()} == {s for s, *_ in one.values()}  # nothing new finished

    # fixed: the command the failure printed continues the same run, re-runs label and what follows
    # from it, and reuses the samples
    import json
    import re

    name = re.search(r"ratchet run (\S+):", first.stdout).group(1)
    printed = re.search(r"to resume: ratchet resume --run (\S+) --workdir (\S+)", out)
    assert printed and printed.group(1) == name, out[-3000:]  # an edited file names no new run
    parent = json.loads((work / "runs" / f"{name}.json").read_text())["ctx"]["parent_run_id"]
    rewards.write_text(textwrap.dedent(FIXED))
    # before it resumes, `ratchet plan` says what it will reuse and what the fix re-runs, and why
    from ratchet.flows.cli import main  # the command itself, in this process: it starts no server and no model

    capsys.readouterr()
    assert main(["plan", *map(str, _args(work, tiny_model, rewards)), "--json"]) == 0, capsys.readouterr().err
    steps = {(x["stage"], x["round"]): x for x in json.loads(capsys.readouterr().out)["stages"]}
    assert steps[("base", 0)]["state"] == "reused"
    for k in ("prompts", 0), ("label", 1), ("evaluate", 0):  # the check's file keys the stages that read it
        if steps[k]["state"] != "waits":
            assert steps[k]["state"] == "stale" and steps[k]["why"] == \
                f"file {rewards}:score (data.check.function) changed", steps[k]
    assert steps[("prompts", 0)]["state"] == "stale"
    assert steps[("sample", 1)]["state"] == "waits" and steps[("sample", 1)]["why"].startswith("on prompts (round 0)")
    fixed = ratchet("resume", "--run", printed.group(1), "--workdir", printed.group(2), api_url=api)
    assert fixed.returncode == 0, fixed.stdout[-3000:] + fixed.stderr[-3000:]
    assert f"ratchet run {name}:" in fixed.stdout
    record = json.loads((work / "runs" / f"{name}.json").read_text())
    assert record["ctx"]["parent_run_id"] == parent and record["state"] == "finished"
    two = _stages(work)
    again = {n for n in one if two[n][2:4] == one[n][2:4]}
    new = {two[n][0] for n in two if n not in one}
    assert {one[n][0] for n in again} >= {"sample", "base"} and "sample" not in new
    # the plan and the run keyed every stage alike: what it said would be reused was, and what it said
    # was stale ran again (a stage that waited on one is reused where that one's output came out the same)
    assert {k for k, x in steps.items() if x["state"] == "reused"} <= {(one[n][0], one[n][1]) for n in again}
    assert {k for k, x in steps.items() if x["state"] == "stale"} <= {(two[n][0], two[n][1]) for n in two if n not in one}
    assert {"label", "evaluate"} <= new
    # the lineage: each label stage names the version of the file it read
    from ratchet.data.digest import sha256_file

    read = {m.config["data"]["check"]["source"] for s, *_, m in two.values() if s == "label"}
    assert sha256_file(rewards) in read and label.config["data"]["check"]["source"] in read and len(read) == 2
