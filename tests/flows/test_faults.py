"""Kill the pipeline mid-sampling, stop it as systemd does at a stage boundary (SIGTERM) and as Ctrl-C
does mid-training, resume each time, and end byte-identical to an uninterrupted run.

The kill is `kill -9` of the orchestrator's PID alone, not its group, as a user or a lost
session does it: every process below it (the temporary Prefect server, the stage worker, two
engine holders) must die by itself, and none may write into the workdir afterwards. The
interrupts are a SIGTERM to the orchestrator alone, as systemd, `docker stop` and Kubernetes send
it, and a SIGINT to the run's process group, as a terminal sends it. (The kills of the
whole group, a lost machine, are the other tests' failpoints.)

The run is the self-rewarding path on the tiny model (HF backend, worker processes): the
killed stages have real mid-stage state to lose (sample shards, a trainer checkpoint). The
killed runs' stage workers are forked from the run's own fork server; the reference run's from the
suite's template (tests/conftest.py tiny_reference, which the Ray round compares with too). Only the run
killed mid-sampling holds two engines (the executor is not part of a stage's key, and one or
two holders sample the same bytes: tests/tasks/test_units.py); the others sample on one, so the
resumed sample stage finishes on another executor than the one it was killed on.
"""

import json
import time

import pytest

from ratchet.data.manifest import read_manifest
from tests.flows.tiny import CONFIG, ONE_THREAD, overrides as _overrides, ratchet

pytestmark = pytest.mark.integration

# in stage order, each with how it stops the run: a Ctrl-C at a boundary (right after round 0's
# evaluation wrote its manifest), a kill in a stage that holds several processes at the point that
# leaves it the most to lose and to clean up (two engine holders mid-sampling), and a Ctrl-C once
# training has saved its first checkpoint, which the resumed run trains on from. A stage directory
# without a manifest is resumed by the same code whichever stage and point cut it, so the label and
# evaluation kills this test also made added no path for their cost on a 2-core AVX2 machine (one
# run each). They are made elsewhere: the label stage mid-unit on a Ray cluster (test_ray_round), a
# served judge mid-stage (test_served_round), training in two processes at its checkpoint, by the PID
# of the process that trains alone (test_train_processes).
STOPS = [
    ("evaluate:after-manifest", "terminate"),  # SIGTERM to the orchestrator, as systemd or docker stop sends it
    ("sample:shard", "orchestrator"),  # one shard written, the other holder still sampling
    ("train:checkpoint", "interrupt"),
]


TWO_ENGINES = "executor.engines=2"  # two engine holders in the stage killed mid-sampling


def _run(workdir, tiny_model, api_url, failpoint=None, how="orchestrator"):
    """A run, its stage workers forked from its fork server (data/procs/forkserver.py); the one killed
    mid-sampling holds two engines. At `failpoint`, the orchestrator's PID
    alone is killed (`how`="orchestrator") or the run's process group gets a Ctrl-C's SIGINT
    ("interrupt"); the Prefect server is the run's own temporary one. A killed run starts its own
    fork server (failpoints are armed), so every process below it carries its environment; the
    resumed finish forks its server from the suite's template (tests/conftest.py)."""
    env = None
    if failpoint:
        env = {"RATCHET_FAILPOINTS": failpoint, "RATCHET_FAILPOINTS_KILL": how, MARK: "1"}
        api_url = None
    two = [TWO_ENGINES] if failpoint == "sample:shard" else []
    return ratchet("run", CONFIG, *_overrides(workdir, tiny_model), *ONE_THREAD, *two, api_url=api_url, env=env)


MARK = "RATCHET_TEST_KILLED_RUN"  # every process below a killed run carries it


def _nothing_left_running(workdir, failpoint):
    """No process of the killed run outlives it (each is given 30 s to go), and nothing writes
    into the workdir after it is gone."""
    from tests.procs import carrying, gone_within

    left = carrying(f"{MARK}=1")
    assert all([gone_within(pid, 30) for pid in left]), (failpoint, "outlived the orchestrator")
    files = lambda: {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in (workdir / "stages").rglob("*")
                     if p.is_file()}
    before = files()
    time.sleep(2)
    assert files() == before, (failpoint, "written after the run was killed")


def _finished(workdir):
    return {d.name: m for d in (workdir / "stages").iterdir() if (m := read_manifest(d)) is not None}


def _written(workdir) -> dict[str, tuple[int, int]]:
    """(inode, mtime in ns) of every finished stage's manifest: a manifest written again (the
    stage recomputed, even within the same second) changes both."""
    out = {}
    for d in (workdir / "stages").iterdir():
        if (m := d / "manifest.json").exists():
            st = m.stat()
            out[d.name] = (st.st_ino, st.st_mtime_ns)
    return out


def test_kill_in_every_stage_then_resume_to_the_same_bytes(tiny_model, tmp_path, prefect_harness, tiny_reference):
    """Guards the resume promise: a SIGTERM at a stage boundary, a kill -9 of the orchestrator alone
    mid-sampling (two engine holders) and a Ctrl-C after training's first checkpoint, each resumed,
    end at the uninterrupted run's bytes, its MLflow runs and versions; nothing outlives the killed
    orchestrator or writes after it. Slow: four runs of the tiny pipeline (one a resumed finish),
    after the reference run it shares with the Ray round (tiny_reference)."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    ref_dir, ref = tiny_reference  # uninterrupted
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _finished(ref_dir)
    # what a person sees: a line per stage and round, the table; every library's output is in the logs
    lines = ref.stdout.splitlines()
    assert ref.stderr == "" and len(lines) < 40 and max(map(len, lines)) < 200, ref.stdout + ref.stderr
    assert sum(" ✓ " in x for x in lines) == 8 and any("round 1  train    ✓" in x and "steps · loss" in x for x in lines)
    (report,) = (ref_dir / "reports").iterdir()  # every run ends with its report
    assert {p.name for p in report.iterdir()} >= {"index.html", "accuracy.png", "rewards.png", "wall_time.png"}
    assert f"report   {report / 'index.html'}" in ref.stdout
    for name, m in reference.items():
        if m.stage in ("sample", "label", "train", "evaluate"):  # the stages that run in a worker
            assert (ref_dir / "stages" / name / "stage.log").stat().st_size > 0, name

    work = tmp_path / "work"
    # a Ctrl-C reaches the whole process group: the run stops at once and says so, and its Prefect
    # server (in a session of its own) lives to record it, rather than dying of the same signal and
    # leaving the run retrying it for minutes
    for failpoint, how in STOPS:
        before = _finished(work) if (work / "stages").exists() else {}
        written = _written(work) if (work / "stages").exists() else {}
        killed = _run(work, tiny_model, api, failpoint, how=how)
        if how in ("interrupt", "terminate"):
            code, said = (130, "interrupted (Ctrl-C)") if how == "interrupt" else (143, "interrupted (SIGTERM)")
            assert killed.returncode == code, (failpoint, killed.returncode, killed.stderr[-3000:])
            assert said in killed.stderr and "ConnectError" not in killed.stderr, killed.stderr
            assert "to resume: ratchet resume " in killed.stderr
            [record] = (work / "runs").glob("*.json")
            assert json.loads(record.read_text())["state"] == "interrupted"  # `ratchet runs` says so
        else:
            assert killed.returncode == -9, (failpoint, killed.returncode, killed.stderr[-3000:])
        _nothing_left_running(work, failpoint)
        after = _finished(work)
        # nothing finished earlier was recomputed or lost
        assert {n: _written(work)[n] for n in written} == written, failpoint
        stage = failpoint.split(":")[0]
        unfinished = [d.name.split("-")[0] for d in (work / "stages").iterdir() if d.name not in after]
        if failpoint.endswith("after-manifest"):  # a boundary: the stage finished, nothing after it started
            assert unfinished == [] and any(n.startswith(stage) for n in set(after) - set(before)), failpoint
        else:  # the stopped stage left its directory without a manifest
            assert unfinished == [stage], (failpoint, unfinished)

    written = _written(work)
    final = _run(work, tiny_model, api)
    assert final.returncode == 0, final.stderr[-3000:]
    done = _finished(work)
    assert {n: _written(work)[n] for n in written} == written

    # the work of the stages killed before their manifest was resumed whole, not redone
    by_stage = {(m.stage, m.round): m for m in done.values()}
    sample = by_stage[("sample", 1)]
    assert sample.metrics["shards"] == 4 and 1 <= sample.metrics["shards_reused"] < 4
    # and the resumed stages report what the uninterrupted ones did
    ref_sample = next(m for m in reference.values() if (m.stage, m.round) == ("sample", 1))
    assert sample.metrics["gen_tokens"] == ref_sample.metrics["gen_tokens"]
    train = by_stage[("train", 1)]
    assert train.metrics["resumed"] == 1.0 and train.metrics["resumed_from_step"] == 2
    left = [f"{n}/{s}" for n in done for s in ("shards", "checkpoints") if (work / "stages" / n / s).exists()]
    assert left == []  # scratch goes once the manifest is durable

    # and every artifact is byte-identical to the uninterrupted run's
    assert sorted(done) == sorted(reference)
    for name, m in reference.items():
        assert {k: f.sha256 for k, f in done[name].outputs.items()} == {k: f.sha256 for k, f in m.outputs.items()}, name

    # MLflow: one parent run and one child per round, all finished; each stage logged once
    from ratchet.flows.config import load_config
    from ratchet.flows.tracking import Tracker

    cfg = load_config(CONFIG, [*_overrides(work, tiny_model), *ONE_THREAD])
    t = Tracker(cfg.tracking, work, cfg.name)
    runs = t.client.search_runs([t.experiment_id])
    assert sorted(r.info.run_name for r in runs if "mlflow.parentRunId" in r.data.tags) == ["round-0", "round-1"]
    assert len(runs) == 3 and all(r.info.status == "FINISHED" for r in runs)
    child = next(r for r in runs if r.info.run_name == "round-1")
    for key in ("sample.gen_tokens", "label.judge_scored_frac", "filter.pairs", "train.steps", "evaluate.accuracy"):
        assert len(t.client.get_metric_history(child.info.run_id, key)) == 1, key
    assert len(t.client.search_model_versions(f"name='{t.model_name}'")) == 2
    assert {a.path for a in t.client.list_artifacts(child.info.run_id, "logs")} == \
        {f"logs/{s}.log" for s in ("sample", "label", "train", "evaluate")}

