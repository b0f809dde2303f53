"""Scheduled continuation against a real Prefect server on loopback.

A first run registers the base model (version 1) and its round-1 model (version 2); the
test points the MLflow `champion` alias at version 2 (a user's manual promotion). Then
`ratchet serve --cron` deploys the pipeline, a run of the deployment is triggered, and
it must continue from version 2: its round is round 2, its model's parent is version 2,
and the lineage walks through version 2 back to the base model. A second deployment on
a process work pool, run by `prefect worker start --run-once`, finds the same champion
and reuses that work instead of redoing it.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.tiny import CONFIG, ROOT, free_port, overrides, ratchet

pytestmark = pytest.mark.integration
CRON = "0 4 1 1 *"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free loopback port, with its own PREFECT_HOME; stopped after."""
    import httpx

    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            _stop(proc)
            pytest.fail(f"Prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
        time.sleep(1)
    yield {"url": url, "home": home}
    _stop(proc)
    log.close()


def _client(url):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(url)


def _wait_deployment(url, name, proc=None, timeout=120):
    from prefect.exceptions import ObjectNotFound

    deadline = time.time() + timeout
    with _client(url) as c:
        while time.time() < deadline:
            try:
                return c.read_deployment_by_name(name)
            except ObjectNotFound:
                if proc is not None and proc.poll() is not None:
                    pytest.fail(f"`ratchet serve` exited with {proc.returncode}")
                time.sleep(1)
    pytest.fail(f"deployment {name} never appeared")


def _wait_final(url, flow_run_id, timeout=480):
    deadline = time.time() + timeout
    with _client(url) as c:
        while time.time() < deadline:
            fr = c.read_flow_run(flow_run_id)
            if fr.state is not None and fr.state.is_final():
                return fr
            time.sleep(2)
    pytest.fail(f"flow run {flow_run_id} did not finish in {timeout}s")


def test_serve_continues_from_the_champion(tiny_model, tmp_path, prefect_server):
    """Guards scheduled runs: `ratchet serve --cron` deploys on a real Prefect server, and a run of the
    deployment continues from the champion a user chose (version 2) as round 2, in its own MLflow
    parent run, on the next prompts of the pool, with a verified lineage back to the base model.
    Slow: a first run, then the serve process and the deployment's run through Prefect's runner."""
    from ratchet.flows.config import load_config
    from ratchet.flows.lineage import walk
    from ratchet.flows.stages import start_manifest
    from ratchet.flows.tracking import Tracker
    from ratchet.data.store import ArtifactStore

    url = prefect_server["url"]
    ov = overrides(tmp_path / "work", tiny_model) + ["data.prompts_per_round=4"]  # 3 rounds' worth in the pool
    first = ratchet("run", CONFIG, *ov, api_url=url)
    assert first.returncode == 0, first.stderr[-3000:]
    cfg = load_config(CONFIG, ov)
    t = Tracker(cfg.tracking, tmp_path / "work", cfg.name)
    t.client.set_registered_model_alias(t.model_name, "champion", "2")
    store = ArtifactStore(tmp_path / "work")
    v2 = start_manifest(store, t, "2")
    assert v2.stage == "train" and v2.round == 1

    serve_log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen([sys.executable, "-m", "ratchet.flows.cli", "serve", str(CONFIG), *ov, "--cron", CRON],
                             cwd=ROOT, env={**os.environ, "PREFECT_API_URL": url, "PREFECT_RUNNER_POLL_FREQUENCY": "1"},
                             stdout=serve_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        dep = _wait_deployment(url, f"ratchet-continue/{cfg.name}", serve)
        assert [s.schedule.cron for s in dep.schedules] == [CRON] and all(s.active for s in dep.schedules)
        assert dep.parameters["start_from"] == "champion"
        assert dep.parameters["config"]["workdir"] == str((tmp_path / "work").resolve())
        assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit == 1
        with _client(url) as c:
            flow_run = c.create_flow_run_from_deployment(dep.id)
        done = _wait_final(url, flow_run.id)
    finally:
        _stop(serve)
        serve_log.close()
    assert done.state.is_completed(), (done.state, (tmp_path / "serve.log").read_text()[-4000:])

    # the scheduled run continued from version 2, as round 2, in its own MLflow parent run
    versions = {str(v.version): v for v in t.client.search_model_versions(f"name='{t.model_name}'")}
    assert sorted(versions, key=int) == ["1", "2", "3"]
    v3 = versions["3"]
    assert v3.tags["ratchet.parent_version"] == "2" and v3.tags["ratchet.round"] == "2"
    parent = t.client.get_run(v3.run_id).data.tags["mlflow.parentRunId"]
    run = t.client.get_run(parent)
    assert run.info.status == "FINISHED" and run.data.tags["ratchet.start_version"] == "2"
    assert run.data.tags["ratchet.run"].endswith("-from-v2")
    children = t.client.search_runs([t.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.info.run_name for r in children) == ["round-1", "round-2"]

    # it trained on the next 4 prompts of the pool, where the first run stopped, and says so
    assert versions["2"].tags["ratchet.prompts"] == "train prompts 0-3 of a pool of 12 (pass 1)"
    assert v3.tags["ratchet.prompts"] == "train prompts 4-7 of a pool of 12 (pass 1)"

    # and its lineage runs through version 2's training back to the base model, all verified
    links = walk(store, start_manifest(store, t, "3"))
    assert [x.stage for x in links if x.stage in ("train", "base")] == ["train", "train", "base"]
    assert [x.summary for x in links if x.stage == "slice"] == [v3.tags["ratchet.prompts"],
                                                                 versions["2"].tags["ratchet.prompts"]]
    assert v2.dir in [x.dir for x in links] and all(x.verified for x in links)
    md = Path(t.client.download_artifacts(parent, "lineage/lineage.md", str(tmp_path))).read_text()
    assert "continued from version 2" in md and "```mermaid" in md

    # a work-pool deployment run by a worker: same champion, so the same run, all reused
    stamps = {d.name: (d / "manifest.json").stat().st_mtime_ns for d in (tmp_path / "work" / "stages").iterdir()}
    pooled = ratchet("serve", CONFIG, *ov, "--cron", CRON, "--pool", "ratchet-test", "--name", "nightly",
                     api_url=url, timeout=120)
    assert pooled.returncode == 0, pooled.stderr[-3000:]
    dep = _wait_deployment(url, "ratchet-continue/nightly")
    with _client(url) as c:
        assert c.read_work_pool("ratchet-test").type == "process"
        flow_run = c.create_flow_run_from_deployment(dep.id)
    worker = subprocess.run([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool",
                             "ratchet-test", "--run-once"], cwd=tmp_path, env={**os.environ, "PREFECT_API_URL": url},
                            capture_output=True, text=True, timeout=480, start_new_session=True)
    done = _wait_final(url, flow_run.id, timeout=60)
    assert done.state.is_completed(), (done.state, worker.stdout[-3000:], worker.stderr[-3000:])
    assert {d.name: (d / "manifest.json").stat().st_mtime_ns
            for d in (tmp_path / "work" / "stages").iterdir()} == stamps
    assert len(t.client.search_model_versions(f"name='{t.model_name}'")) == 3
