import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def ratchet(*args):
    return subprocess.run([sys.executable, "-m", "ratchet.flows.cli", *args], cwd=ROOT, capture_output=True, text=True)


def test_help_lists_commands_and_examples():
    r = ratchet("--help")
    assert r.returncode == 0
    for word in ("run", "config", "model", "ratchet run flows/configs/default.yaml"):
        assert word in r.stdout


def test_config_prints_resolved_yaml():
    r = ratchet("config", "flows/configs/default.yaml", "rounds=4")
    assert r.returncode == 0 and "rounds: 4" in r.stdout and "backend: vllm" in r.stdout


def test_bad_config_exits_2_with_every_problem_and_no_traceback():
    r = ratchet("run", "flows/configs/default.yaml", "rounds=0", "train.lr=1")
    assert r.returncode == 2
    assert "2 problem(s)" in r.stderr and "rounds=0" in r.stderr and "train.lr" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback():
    """`ratchet plan | head`: the reader's end closed before the command writes."""
    p = subprocess.Popen([sys.executable, "-m", "ratchet.flows.cli", "config", "--reference"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait() == 141 and err == "", err  # as a shell reports a command ended by SIGPIPE


def _record(workdir, name, state):
    import json

    (workdir / "runs").mkdir(exist_ok=True)
    ctx = {"run_name": name, "workdir": str(workdir), "parent_run_id": "p", "code_version": "c", "config_hash": "h"}
    (workdir / "runs" / f"{name}.json").write_text(json.dumps({"ctx": ctx, "config": {}, "state": state}))


def test_gc_removes_only_what_no_recorded_run_will_resume(tmp_path):
    import fcntl
    import re

    from ratchet.flows.gc import collect_garbage

    stages = tmp_path / "stages"
    owners = {"sample-aaaa": None, "train-bbbb": "done", "label-cccc": "killed", "sample-dddd": "killed",
              "filter-eeee": "gone"}
    for name, owner in owners.items():
        (stages / name / "shards").mkdir(parents=True)
        (stages / name / "shards" / "00000.jsonl").write_text("x" * 1000)
        if owner:
            (stages / name / "runs.json").write_text(f'["{owner}"]')
    (stages / "sample-aaaa" / "manifest.json").write_text("{}")  # finished: only its leftover scratch goes
    _record(tmp_path, "done", "finished")
    _record(tmp_path, "killed", "running")
    (tmp_path / "locks").mkdir()
    with open(tmp_path / "locks" / "label-cccc.lock", "w") as held:  # a live stage holds this one
        fcntl.flock(held, fcntl.LOCK_EX)
        r = ratchet("gc", "flows/configs/default.yaml", f"workdir={tmp_path}", "--dry-run")
        assert r.returncode == 0, r.stderr
        lines = {re.search(r"/stages/(\S+)", line).group(1).split("/")[-1]: line
                 for line in r.stdout.splitlines() if "MiB):" in line}
        assert "run done started it and finished without it" in lines["train-bbbb"]
        assert "run gone started it and has no record left" in lines["filter-eeee"]
        assert lines["sample-dddd"].lstrip().startswith("kept") and "ratchet resume --run killed" in lines["sample-dddd"]
        assert "a live run is writing it" in lines["label-cccc"]
        assert "scratch a finished stage no longer needs" in lines["shards"]
        assert r.stdout.splitlines()[-1] == "would remove 3 item(s), 0.0 MiB; kept 2"
        assert all((stages / n / "shards").exists() for n in owners)  # a dry run removes nothing
        removed = [x.path.relative_to(stages).as_posix() for x in collect_garbage(tmp_path) if x.remove]
    assert removed == ["filter-eeee", "sample-aaaa/shards", "train-bbbb"]
    assert sorted(p.name for p in stages.iterdir()) == ["label-cccc", "sample-aaaa", "sample-dddd"]
    assert (stages / "sample-aaaa" / "manifest.json").exists()
    # released, label-cccc is resumable like sample-dddd; --all removes both
    kept = [x.path.name for x in collect_garbage(tmp_path) if not x.remove]
    assert kept == ["label-cccc", "sample-dddd"]
    assert [x.path.name for x in collect_garbage(tmp_path, everything=True) if x.remove] == kept


def test_serve_refuses_bad_cron_and_missing_server_before_touching_anything(tmp_path):
    import os

    env = {**os.environ, "PREFECT_API_URL": ""}
    r = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "serve", "flows/configs/default.yaml",
                        f"workdir={tmp_path}", "--cron", "61 * * * *"], cwd=ROOT, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 2 and "--cron '61 * * * *'" in r.stderr and "Traceback" not in r.stderr
    assert "0 3 * * *" in r.stderr  # an example of one that works
    r = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "serve", "flows/configs/default.yaml",
                        f"workdir={tmp_path}", "--cron", "0 3 * * *", "--from", "newest"], cwd=ROOT,
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "--from 'newest'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "serve", "flows/configs/default.yaml",
                        f"workdir={tmp_path}", "--cron", "0 3 * * *"], cwd=ROOT, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 1 and "ephemeral" in r.stderr and "prefect server start" in r.stderr
    assert not (tmp_path / "stages").exists()


def test_start_from_names_the_versions_that_exist(tmp_path):
    import pytest

    from ratchet.data.errors import ConfigError
    from ratchet.flows.runs import start_version
    from ratchet.flows.tracking import Tracker, TrackingConfig

    t = Tracker(TrackingConfig(), tmp_path, "x")
    assert start_version(t, None) is None and start_version(t, "base") is None
    assert start_version(t, "champion") is None  # no champion yet: the base model
    t.client.create_registered_model(t.model_name)
    t.client.create_model_version(t.model_name, source=str(tmp_path), tags={"ratchet.accuracy": "0.5"})
    t.client.set_registered_model_alias(t.model_name, "champion", "1")
    assert start_version(t, "champion") == "1" and start_version(t, "1") == "1"
    with pytest.raises(ConfigError, match=r"start_from='7'.*registered versions: \[1\]"):
        start_version(t, "7")
    with pytest.raises(ConfigError, match="start_from='latest'"):
        start_version(t, "latest")


def test_runs_lists_each_run_with_its_state_rounds_and_how_to_resume(tmp_path):
    import json
    import os
    import socket

    from ratchet.flows.config import load_config
    from ratchet.flows.runs import RunContext, RunRecord, write_record
    from ratchet.flows.tracking import Tracker

    cfg = load_config(ROOT / "flows" / "configs" / "default.yaml", [f"workdir={tmp_path}"])
    t = Tracker(cfg.tracking, tmp_path, cfg.name)
    (tmp_path / "runs").mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    # a live attempt holds its run's liveness lock (whatever its command line says)
    alive = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                              "from ratchet.flows.runs import hold_liveness; "
                              f"hold_liveness(Path({str(tmp_path)!r}), 'd-live'); print('held', flush=True); "
                              "time.sleep(3600)"], stdout=subprocess.PIPE, text=True)
    assert alive.stdout.readline().strip() == "held"
    t.client.create_registered_model(t.model_name)
    try:
        for name, state, pid, rounds in [("a-finished", "finished", gone, [(0, 0.42, 1), (1, 0.8, 1), (2, 0.7, 0)]),
                                         ("b-failed", "failed", gone, [(0, 0.42, 1)]),
                                         ("c-killed", "running", gone, [(0, 0.42, 1), (1, 0.5, 0)]),
                                         ("d-live", "running", alive, [])]:
            parent = t.start_parent(name, {}, {"ratchet.run": name})
            for k, acc, promoted in rounds:
                child = t.child(parent, k, {})
                version = str(len(t.client.search_model_versions(f"name='{t.model_name}'")) + 1)
                t.client.create_model_version(t.model_name, source=str(tmp_path), run_id=child)
                t.log_once(child, "ratchet.model_version", version, {"accuracy": acc, "promoted": float(promoted)},
                           prefix="round.")
            ctx = RunContext(run_name=name, workdir=str(tmp_path), parent_run_id=parent, code_version="c",
                             config_hash="h")
            pid_of = int(gone.stdout) if pid is gone else alive.pid
            write_record(tmp_path, RunRecord(ctx=ctx, config={"rounds": 3}, state=state, host=socket.gethostname(),
                                             pid=pid_of))
        t.client.set_registered_model_alias(t.model_name, "champion", "2")
        r = ratchet("runs", "flows/configs/default.yaml", f"workdir={tmp_path}", "--json")
        text = ratchet("runs", "flows/configs/default.yaml", f"workdir={tmp_path}")
    finally:
        alive.kill()
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["champion"] == "2"
    runs = {x["run"]: x for x in got["runs"]}
    assert {n: (x["state"], x["rounds_done"], x["rounds"]) for n, x in runs.items()} == {
        "a-finished": ("finished", 2, 3), "b-failed": ("failed", 0, 3), "c-killed": ("interrupted", 1, 3),
        "d-live": ("running", 0, 3)}
    assert [(e["version"], e["accuracy"], e["promoted"]) for e in runs["a-finished"]["entries"]] == \
        [("1", 0.42, True), ("2", 0.8, True), ("3", 0.7, False)]
    assert runs["a-finished"]["resume"] is None and runs["d-live"]["resume"] is None
    for n in ("b-failed", "c-killed"):
        assert runs[n]["resume"] == f"ratchet resume --run {n} --workdir {tmp_path}"
        assert f"resume: ratchet resume --run {n} --workdir {tmp_path}" in text.stdout
    assert "v2* 80.0% (champion)" in text.stdout and os.path.basename(str(tmp_path)) in text.stdout


def test_the_suites_cli_template_answers_as_a_fresh_interpreter(tmp_path):
    """Guards the suite's own shortcut (tests/cli_template.py), which most of its `ratchet run`s take:
    forked from the template, a command exits with the code and writes the output a fresh
    interpreter does, refused config and missing run alike; a run arming failpoints is not sent there."""
    import os
    import time

    from tests import cli_template

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    commands = [["run", "flows/configs/default.yaml", "rounds=0", "train.lr=1"],
                ["resume", "flows/configs/default.yaml", f"workdir={tmp_path / 'none'}"]]
    with cli_template.templated(tmp_path / "template.log") as path:
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cli_template.usable(("run",), env) and not cli_template.usable(("plan",), env)
        assert not cli_template.usable(("run",), {**env, "RATCHET_FAILPOINTS": "train:checkpoint"})
        for argv in commands:
            forked = cli_template.run(argv, env, ROOT, timeout=120)
            assert forked is not None, (tmp_path / "template.log").read_text()
            fresh = ratchet(*argv)
            assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
            assert forked.returncode != 0 and forked.stderr.startswith("ratchet: error:"), forked.stderr
