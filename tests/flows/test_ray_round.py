"""A whole round on a real two-node Ray cluster (loopback), through the CLI: every fan-out
stage (sample, the judge label, evaluate) spreads its units over both nodes and writes what
the local executor writes; the driver killed mid-stage resumes to the same digests, running
only the missing units."""

import pytest

from ratchet.data.manifest import read_manifest
from tests.flows.tiny import CONFIG, ONE_THREAD, overrides, ratchet

pytestmark = pytest.mark.integration

FAN_OUT = ("sample", "label", "evaluate")


def _finished(workdir):
    return {d.name: m for d in (workdir / "stages").iterdir() if (m := read_manifest(d)) is not None}


def test_a_round_on_two_ray_nodes_equals_local_and_survives_its_driver(tiny_model, tmp_path, prefect_harness,
                                                                       ray_cluster, tiny_reference):
    """Guards the cluster promise: a round on a real two-node Ray cluster writes the local executor's
    bytes (the shared reference run), spreads each fan-out stage over both nodes, and its driver
    killed mid-label resumes by running only the missing units. Slow: two runs on the cluster."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    local_dir, local = tiny_reference  # the same run on the local executor
    assert local.returncode == 0, local.stderr[-3000:]

    on_ray = [*overrides(tmp_path / "ray", tiny_model), *ONE_THREAD, "executor.kind=ray", "executor.engines=2",
              f"executor.address={ray_cluster}"]
    killed = ratchet("run", CONFIG, *on_ray, api_url=api, env={"RATCHET_FAILPOINTS": "label:shard"})
    assert killed.returncode == -9, killed.stderr[-3000:]  # the driver died after the judge's first unit
    resumed = ratchet("run", CONFIG, *on_ray, api_url=api)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    ref, done = _finished(local_dir), _finished(tmp_path / "ray")
    assert sorted(done) == sorted(ref)  # same stage keys: the executor is in none of them
    for name, m in ref.items():
        assert {k: f.sha256 for k, f in done[name].outputs.items()} == {k: f.sha256 for k, f in m.outputs.items()}
    for m in done.values():
        if m.stage in FAN_OUT and m.round == 1 or m.stage == "evaluate":
            nodes = {u.get("node") for u in m.info["units"]}
            assert len(nodes) == 2 and None not in nodes, (m.stage, m.round, m.info["units"])
    label = next(m for m in done.values() if m.stage == "label")
    assert 1 <= label.metrics["judge_shards_reused"] < len(label.info["units"]) == 4  # only the missing ones ran
