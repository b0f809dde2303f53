"""Two attempts of one pipeline run started at once on one workdir and one MLflow tracking
server, from a directory full of modules named like Ratchet's own; then a run on another split that must
re-evaluate the champion before comparing with it. The tracking URI carries credentials,
which must end up nowhere."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.flows.tiny import CONFIG, free_port, overrides

pytestmark = pytest.mark.integration
SECRET = "s3cret-pw"


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on loopback, stopped after the test. Without MLflow's job runners (its
    GenAI jobs, which Ratchet never submits): six consumer processes that poll all test long."""
    port = free_port()
    root = tmp_path / "mlflow-server"
    root.mkdir()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art"),
         "--workers", "1"],
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        cwd=root, stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise AssertionError((root / "server.log").read_text()[-3000:])
    yield url, root
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


def _hostile_cwd(tmp_path) -> Path:
    """Modules a user might have lying around, each named like part of Ratchet."""
    d = tmp_path / "elsewhere"
    (d / "models").mkdir(parents=True)
    boom = "raise ImportError('imported from the current directory: {}')\n"
    for name in ("data.py", "tasks.py", "flows.py", "ratchet.py", "models/__init__.py"):
        (d / name).write_text(boom.format(name))
    return d


def _start(cwd, workdir, tiny_model, config, api_url, *extra):
    env = {**os.environ, "PREFECT_API_URL": api_url}
    for k in ("RATCHET_FAILPOINTS", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "PYTHONPATH"):
        env.pop(k, None)
    cmd = [str(Path(sys.executable).parent / "ratchet"), "run", str(config), *overrides(workdir, tiny_model), *extra]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_racing_runs_share_one_store_and_a_new_split_reevaluates_the_champion(tmp_path, tiny_model, mlflow_server,
                                                                             prefect_harness):
    """Guards one store shared by racing runs: the same command twice at once on one workdir and a
    real `mlflow server` (credentials in the config's URI), from a directory of modules named like
    Ratchet's: one waits for the other and reuses its work under one MLflow parent run; a run on
    another split evaluates the champion again before comparing; the secret is written nowhere.
    Slow: three runs of the tiny pipeline against an MLflow server started here."""
    from mlflow.tracking import MlflowClient
    from prefect.settings import PREFECT_API_URL

    from ratchet.data.manifest import read_manifest

    url, server_root = mlflow_server
    # the credentials come in the config file (never on the command line, where ps shows them)
    import yaml

    config = tmp_path / "shared.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load(Path(CONFIG).read_text()),
                                      "tracking": {"uri": url.replace("http://", f"http://alice:{SECRET}@")}}))
    api, cwd, work = PREFECT_API_URL.value(), _hostile_cwd(tmp_path), tmp_path / "work"

    # the same command twice at once, as a cron tick that overlaps a manual run would: the second
    # names the first, waits for it, then finishes by reusing what it made
    procs = [_start(cwd, work, tiny_model, config, api) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
        assert "imported from the current directory" not in err
    assert sum("is already running in" in out and "waiting for it to end" in out for out, _ in outs) == 1

    c = MlflowClient(url, url)  # the registry named too, never another test's
    (exp,) = [e for e in c.search_experiments() if e.name == "ratchet-self-reward-dpo"]
    runs = c.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and sorted(r.info.run_name for r in children) == ["round-0", "round-1"]
    assert all(r.info.status == "FINISHED" for r in runs)
    round1 = next(r for r in children if r.info.run_name == "round-1")
    for key in ("sample.gen_tokens", "label.judge_scored_frac", "train.steps", "round.accuracy"):
        assert len(c.get_metric_history(round1.info.run_id, key)) == 1, key  # logged once, not once per racer
    versions = sorted(c.search_model_versions("name='ratchet-self-reward-dpo'"), key=lambda v: int(v.version))
    assert [v.version for v in versions] == ["1", "2"]  # each model registered once
    assert len({v.tags["ratchet.stage_key"] for v in versions}) == 2
    champ = c.get_registered_model("ratchet-self-reward-dpo").aliases["champion"]
    assert c.get_model_version("ratchet-self-reward-dpo", champ).tags["ratchet.promoted"] == "true"
    (record,) = (work / "runs").glob("*.json")
    assert json.loads(record.read_text())["state"] == "finished"

    # another split (seed 1): the champion, made version 2 by hand, has no accuracy on it yet
    c.set_registered_model_alias("ratchet-self-reward-dpo", "champion", "2")
    v2 = c.get_model_version("ratchet-self-reward-dpo", "2")
    old_sets = {k for k in v2.tags if k.startswith("ratchet.accuracy.")}
    third = _start(cwd, work, tiny_model, config, api, "seed=1")
    out, err = third.communicate(timeout=900)
    assert third.returncode == 0, err[-4000:]
    v2 = c.get_model_version("ratchet-self-reward-dpo", "2")
    new_sets = {k for k in v2.tags if k.startswith("ratchet.accuracy.")} - old_sets
    assert len(new_sets) == 1  # version 2 was evaluated on the new eval set ...
    new_set = next(iter(new_sets)).removeprefix("ratchet.accuracy.")
    evals = [m for d in (work / "stages").glob("evaluate-*") if (m := read_manifest(d)) is not None]
    assert any(m.info["eval_set"] == new_set and v2.tags["ratchet.stage_dir"] in [p.dir for p in m.parents]
               for m in evals)  # ... as an evaluate stage of its own
    v3 = c.get_model_version("ratchet-self-reward-dpo", "3")  # the new run's round-1 model
    assert v3.tags["ratchet.eval_set"] == new_set
    assert v3.tags["ratchet.gate"].endswith(f"champion version 2's {float(v2.tags[f'ratchet.accuracy.{new_set}']):.4f}"
                                            f" on eval set {new_set}")

    # the credentials are nowhere: not printed, not in the workdir, not in the tracking store
    printed = "".join(o + e for o, e in [*outs, (out, err)])
    assert SECRET not in printed
    for f in [*work.rglob("*"), *server_root.rglob("*")]:
        if f.is_file() and f.stat().st_size < 50_000_000:
            assert SECRET.encode() not in f.read_bytes(), f
    params = {k: v for r in runs for k, v in r.data.params.items()}
    assert params["tracking.uri"] == url
