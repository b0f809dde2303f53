"""The registry never disagrees with the store: retries, locks, the champion gate, redaction."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.data.store import ArtifactStore
from ratchet.flows import tracking
from ratchet.flows.tracking import Tracker, TrackingConfig, TrackingError, redact

ROOT = Path(__file__).parents[2]


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(tracking, "RETRY_DELAYS", (0.0, 0.0, 0.0))


def _model(store: ArtifactStore, name: str):
    """A finished `train` stage holding one small file: enough to register."""
    key = (name * 64)[:64]
    d = store.prepare("train", key)
    (d / "model").mkdir()
    (d / "model" / "weights.bin").write_text(name)
    return store.finish(stage="train", round=1, key=key, code_version="t", config={}, parents=[],
                        outputs={"model/weights.bin": None})


def _tracker(tmp_path) -> tuple[Tracker, ArtifactStore, str]:
    t = Tracker(TrackingConfig(), tmp_path, "t")
    run = t.client.create_run(t.experiment_id).info.run_id
    return t, ArtifactStore(tmp_path), run


def _locked(times: int, real):
    """`real`, failing the first `times` calls as SQLite does under contention."""
    from mlflow.exceptions import MlflowException

    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= times:
            raise MlflowException("(sqlite3.OperationalError) database is locked", "TEMPORARILY_UNAVAILABLE")
        return real(*args, **kwargs)

    return flaky, calls


def test_a_transient_error_is_retried_never_read_as_absent(tmp_path, fast_retries, monkeypatch):
    t, store, run = _tracker(tmp_path)
    m = _model(store, "a")
    assert t.register(run, store, m, {}) == "1"
    raw = t.client._client
    flaky, calls = _locked(2, raw.search_model_versions)
    monkeypatch.setattr(raw, "search_model_versions", flaky)
    assert t.register(run, store, m, {}) == "1"  # found after two retries: no duplicate version
    assert calls["n"] == 3
    assert len(raw.search_model_versions("name='ratchet-t'")) == 1


def test_a_tag_write_that_loses_the_servers_insert_race_is_retried_as_the_upsert_it_is(tmp_path, fast_retries,
                                                                                       monkeypatch):
    """An MLflow server sets a tag by read-then-insert: two clients setting the same new tag at
    once can get a UNIQUE constraint error. Setting a tag is an upsert, so it is repeated; any
    other call with that error is not."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import BAD_REQUEST

    t, store, run = _tracker(tmp_path)
    v = t.register(run, store, _model(store, "a"), {})
    raw = t.client._client
    real, calls = raw.set_model_version_tag, {"n": 0}

    def racing(name, version, key, value):
        calls["n"] += 1
        if calls["n"] == 1:
            real(name, version, key, "0.100000")  # the other client's insert lands first
            raise MlflowException("BAD_REQUEST: (sqlite3.IntegrityError) UNIQUE constraint failed: "
                                  "model_version_tags.key", error_code=BAD_REQUEST)
        return real(name, version, key, value)

    monkeypatch.setattr(raw, "set_model_version_tag", racing)
    t.record_accuracy(v, "E", 0.25)
    assert calls["n"] == 2 and t.accuracy(v, "E") == 0.25

    def unique(*args, **kwargs):
        raise MlflowException("UNIQUE constraint failed: registered_models.name", error_code=BAD_REQUEST)

    monkeypatch.setattr(raw, "create_registered_model", unique)
    with pytest.raises(MlflowException, match="UNIQUE"):
        t.client.create_registered_model("x")  # not an upsert: raised as it is, not retried


def test_a_store_that_keeps_failing_fails_the_stage_and_changes_nothing(tmp_path, fast_retries, monkeypatch):
    t, store, run = _tracker(tmp_path)
    a, b = _model(store, "a"), _model(store, "b")
    v1 = t.register(run, store, a, {})
    assert t.promote_if_better(v1, [_on("E", 0.5)], "h", 0.0).promoted
    raw = t.client._client
    monkeypatch.setattr(raw, "search_model_versions", _locked(99, raw.search_model_versions)[0])
    with pytest.raises(TrackingError, match="search_model_versions failed 4 times.*resumed with the same command"):
        t.register(run, store, b, {})
    monkeypatch.setattr(raw, "search_registered_models", _locked(99, raw.search_registered_models)[0])
    with pytest.raises(TrackingError):
        t.champion()
    monkeypatch.undo()
    assert len(raw.search_model_versions("name='ratchet-t'")) == 1  # nothing registered
    assert t.champion() == v1  # the alias did not move


def _on(eval_set: str, acc: float, name: str = "h"):
    from ratchet.flows.tracking import SetScore

    return SetScore(name=name, eval_set=eval_set, accuracy=acc)


def test_the_champion_is_compared_on_the_same_eval_set_and_decided_once(tmp_path):
    t, store, run = _tracker(tmp_path)
    v1, v2, v3 = (t.register(run, store, _model(store, x), {}) for x in "abc")
    t.record_accuracy(v1, "A", 0.50)
    first = t.promote_if_better(v1, [_on("A", 0.50)], "h", 0.0)
    assert first.promoted and first.reason.startswith("first champion")

    t.record_accuracy(v2, "B", 0.60)  # another split: 0.60 on B says nothing against 0.50 on A
    ask = t.promote_if_better(v2, [_on("B", 0.60)], "h", 0.0)
    assert (ask.promoted, ask.needs_eval, ask.needs_sets) == (False, v1, ("h",))
    assert t.decided(v2) is None and t.champion() == v1
    t.record_accuracy(v1, "B", 0.70)  # the champion, evaluated on B
    lost = t.promote_if_better(v2, [_on("B", 0.60)], "h", 0.0)
    assert not lost.promoted and lost.reason == "accuracy 0.6000 <= champion version 1's 0.7000 on eval set B"
    assert t.champion() == v1

    t.record_accuracy(v3, "A", 0.55)
    held = t.promote_if_better(v3, [_on("A", 0.55)], "h", 0.1)  # min_improvement is part of the bar
    assert not held.promoted and "0.5000 + 0.1" in held.reason
    # decided once: asking again (a resumed run) returns the recorded decision
    assert t.promote_if_better(v3, [_on("A", 0.99)], "h", 0.0) == held
    assert t.version(v3).tags["ratchet.promoted"] == "false"
    assert t.version(v1).tags["ratchet.promoted"] == "true"


def test_the_gate_decides_on_its_set_and_refuses_a_drop_on_another(tmp_path):
    """Several held-out sets: the gate's set decides, and with max_drop a model that loses more
    than that on any other set is refused, each set against the champion on the same eval set."""
    t, store, run = _tracker(tmp_path)
    v1, v2, v3, v4 = (t.register(run, store, _model(store, x), {}) for x in "abcd")
    for v, task, reg in ((v1, 0.50, 0.80), (v2, 0.70, 0.70), (v3, 0.70, 0.76), (v4, 0.70, 0.40)):
        t.record_accuracy(v, "T", task)
        t.record_accuracy(v, "R", reg)
    scores = lambda task, reg: [_on("T", task, "task"), _on("R", reg, "reg")]  # noqa: E731
    assert t.promote_if_better(v1, scores(0.50, 0.80), "task", 0.0, 0.05).promoted

    dropped = t.promote_if_better(v2, scores(0.70, 0.70), "task", 0.0, 0.05)  # 10 points down on reg
    assert not dropped.promoted and t.champion() == v1
    assert dropped.reason == ("accuracy 0.7000 > champion version 1's 0.5000 on task (eval set T); refused: reg "
                              "dropped 10.0 points (0.7000 < 0.8000), more than max_drop 0.05")
    assert t.promote_if_better(v3, scores(0.70, 0.76), "task", 0.0, 0.05).promoted  # 4 points: within max_drop
    # without max_drop the other sets are reported, not gated: the champion's accuracy on them is not needed
    assert t.promote_if_better(v4, [_on("T", 0.80, "task"), _on("NEW", 0.10, "reg")], "task", 0.0).promoted


def test_the_gate_asks_for_the_champion_on_every_set_it_reads(tmp_path):
    t, store, run = _tracker(tmp_path)
    v1, v2 = (t.register(run, store, _model(store, x), {}) for x in "ab")
    t.record_accuracy(v1, "T", 0.5)
    assert t.promote_if_better(v1, [_on("T", 0.5, "task")], "task", 0.0).promoted
    ask = t.promote_if_better(v2, [_on("T", 0.6, "task"), _on("R", 0.6, "reg")], "task", 0.0, 0.0)
    assert (ask.promoted, ask.needs_eval, ask.needs_sets) == (False, v1, ("reg",)) and t.decided(v2) is None
    t.record_accuracy(v1, "R", 0.6)
    assert t.promote_if_better(v2, [_on("T", 0.6, "task"), _on("R", 0.6, "reg")], "task", 0.0, 0.0).promoted


def test_two_processes_register_and_open_rounds_once(tmp_path):
    """Registration and round-run creation are check-then-write: two racing processes must not
    both see "absent"."""
    t, store, run = _tracker(tmp_path)
    m = _model(store, "a")
    parent = t.client.create_run(t.experiment_id).info.run_id
    script = (
        "import json, sys; from pathlib import Path; from ratchet.data.store import ArtifactStore; "
        "from ratchet.data.manifest import read_manifest; from ratchet.flows.tracking import Tracker, TrackingConfig; "
        f"root = Path({str(tmp_path)!r}); t = Tracker(TrackingConfig(), root, 't'); s = ArtifactStore(root); "
        f"m = read_manifest(root / {m.dir!r}); "
        f"v = t.register({run!r}, s, m, {{}}); c = t.child({parent!r}, 1, {{}}); print(json.dumps([v, c]))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(3)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert {v for v, _ in outs} == {"1"} and len({c for _, c in outs}) == 1
    assert len(t.client.search_model_versions("name='ratchet-t'")) == 1
    children = t.client.search_runs([t.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 1


def test_lineage_takes_the_champion_as_export_does(tmp_path):
    from ratchet.data.errors import RatchetError
    from ratchet.flows.lineage import resolve

    t, store, run = _tracker(tmp_path)
    with pytest.raises(RatchetError, match="has no champion yet; name a version"):
        resolve("champion", store, t)
    m = _model(store, "a")
    v = t.register(run, store, m, {})
    t.client.set_registered_model_alias(t.model_name, "champion", v)
    assert resolve("champion", store, t).key == m.key == resolve(v, store, t).key


def test_lineage_reports_a_registry_that_disagrees_with_the_store(tmp_path):
    from ratchet.data.manifest import read_manifest
    from ratchet.flows.lineage import annotate, walk

    t, store, run = _tracker(tmp_path)
    m = _model(store, "a")
    v = t.register(run, store, m, {})
    links = walk(store, m)
    annotate(links, t)
    assert links[0].verified and links[0].model_version == v
    # the stage is recomputed in place with other bytes, manifest and all: self-consistent, but
    # not what version 1 was registered as
    d = store.dir_of(m)
    (d / "manifest.json").unlink()
    (d / "model" / "weights.bin").write_text("other")
    again = store.finish(stage="train", round=1, key=m.key, code_version="t", config={}, parents=[],
                         outputs={"model/weights.bin": None})
    assert read_manifest(d) == again
    links = walk(store, again)
    annotate(links, t)
    assert not links[0].verified and links[0].problem.startswith(f"registry version {v} records content")


def test_credentials_never_stay_in_the_config(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    cfg = TrackingConfig(uri="https://alice:s3cret@mlflow.example.com:5000/path")
    assert cfg.uri == "https://mlflow.example.com:5000/path"
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("alice", "s3cret")
    assert "s3cret" not in json.dumps(cfg.model_dump())
    assert redact("https://alice:s3cret@host/x?token=abc&a=1") == "https://alice:***@host/x?token=***&a=1"
    assert redact("sqlite:////abs/runs/mlflow.db") == "sqlite:////abs/runs/mlflow.db"
    # every form a URI with a credential takes
    for uri, shown in [("postgresql+psycopg2://mlflow:s3cret@db:5432/mlflow", "postgresql+psycopg2://mlflow:***@db:5432/mlflow"),
                       ("mysql://root:s3cret@10.0.0.2/mlflow?ssl_key=/k&charset=utf8",
                        "mysql://root:***@10.0.0.2/mlflow?ssl_key=***&charset=utf8"),
                       ("alice:s3cret@mlflow.example.com:5000", "alice:***@mlflow.example.com:5000"),
                       ("//alice:s3cret@host/x", "//alice:***@host/x"),
                       ("http://:s3cret@host", "http://:***@host"),
                       ("https://a:b:s3cret@host", "https://a:***@host"),
                       ("https://host/x?X-Amz-Signature=s3cret&X-Amz-Credential=s3cret", "https://host/x?X-Amz-Signature=***&X-Amz-Credential=***"),
                       ("https://alice@host/p", "https://alice@host/p"),
                       ("databricks://profile", "databricks://profile")]:
        assert redact(uri) == shown, uri
        assert "s3cret" not in redact(uri)
    with pytest.raises(ValueError, match=r"secret in its query string \(token\).*MLFLOW_TRACKING_TOKEN"):
        TrackingConfig(uri="https://host/?token=abc")
    # a credential is never taken from the command line, where ps shows it; the config file moves it to the env
    r = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "config", "flows/configs/default.yaml",
                        "tracking.uri=http://bob:hunter2@127.0.0.1:5999"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "hunter2" not in r.stdout + r.stderr
    assert "tracking.uri=http://bob:***@127.0.0.1:5999: a password or token on the command line" in r.stderr
    assert "MLFLOW_TRACKING_PASSWORD" in r.stderr


def test_the_gates_lease_is_held_by_one_tracker_at_a_time_whatever_its_workdir(tmp_path, monkeypatch):
    """Runs in different workdirs share only the tracking server: the champion gate's
    read-compare-set holds a lease in the registry itself, which one holder at a time gets (the
    registry's database refuses a second model of one name; here a SQLite database, as a server
    behind several workdirs would use, with the lease on as it is for a server's URI)."""
    import threading
    import time as _time

    import ratchet.flows.tracking as tracking

    uri = f"sqlite:///{tmp_path / 'server.db'}"
    trackers = [Tracker(TrackingConfig(uri=uri, model_name="shared"), tmp_path / f"work{i}", "t") for i in range(3)]
    for t in trackers:
        t.lease_in_registry = True
    inside, most, order = [0], [0], []

    def gate(t: Tracker, i: int):
        for _ in range(3):
            with t.registry_lease():
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                _time.sleep(0.02)
                order.append(i)
                inside[0] -= 1

    threads = [threading.Thread(target=gate, args=(t, i)) for i, t in enumerate(trackers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert most[0] == 1 and sorted(order) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # a lease whose holder died inside the gate is taken over once it is stale, and released after
    t = trackers[0]
    t.client.create_registered_model("shared.gate-lease", tags={"ratchet.holder": "gone:1",
                                                               "ratchet.since": str(_time.time() - 10)})
    with pytest.raises(TrackingError, match="held by gone:1"):  # 10 s: a holder still deciding, waited for
        with t.registry_lease(wait_s=0.5):
            pass
    monkeypatch.setattr(tracking, "LEASE_STALE_S", 5.0)  # now 10 s is stale
    with t.registry_lease():
        assert t.client.get_registered_model("shared.gate-lease").tags["ratchet.holder"] != "gone:1"
    assert "shared.gate-lease" not in {m.name for m in t.client.search_registered_models()}
    # a store reads a model's row and its tags in two queries: a lease moved between them reads
    # with no tags. That torn read is never a stale lease: the live one that holds the name now stays
    t.client.create_registered_model("shared.gate-lease", tags={"ratchet.holder": "live:1",
                                                               "ratchet.since": str(_time.time())})
    from mlflow.entities.model_registry import RegisteredModel

    read = t.client.get_registered_model
    monkeypatch.setattr(t.client, "get_registered_model", lambda n: RegisteredModel(
        n, creation_timestamp=read(n).creation_timestamp))  # the row, then no tags under its name
    with pytest.raises(TrackingError, match="held by a run that left no holder tag"):
        with t.registry_lease(wait_s=0.5):
            pass
    assert read("shared.gate-lease").tags["ratchet.holder"] == "live:1"


def _lease_racer(uri: str, work: str, log: str, barrier, rounds: int, stale_s: float) -> None:
    """One of two processes: each round, wait for the other, then pass through the gate's lease,
    writing when it is inside (O_APPEND lines, one write each)."""
    import time as _time

    tracking.LEASE_STALE_S = stale_s
    t = Tracker(TrackingConfig(uri=uri, model_name="shared"), Path(work), "t")
    t.lease_in_registry = True
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    for r in range(rounds):
        barrier.wait(timeout=180)  # generous: a loaded machine starts processes slowly; the order is what counts
        with t.registry_lease(wait_s=180):
            os.write(fd, f"{r} in {os.getpid()} {_time.time()}\n".encode())
            _time.sleep(0.3)
            os.write(fd, f"{r} out {os.getpid()} {_time.time()}\n".encode())
        barrier.wait(timeout=180)  # the parent plants the next stale lease while both wait here


def test_two_processes_never_both_take_over_a_stale_lease_on_a_database_registry(tmp_path, monkeypatch):
    """A registry on a real database (SQLite, as a tracking server behind several workdirs would
    use), two processes: each round the lease left behind is stale, both see it at once and race
    to take it over; one takes it and the other waits for its release. Releasing a lease that
    was taken over leaves the new holder's alone."""
    import multiprocessing as mp
    import threading
    import time as _time

    uri, log, rounds = f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "gate.log"), 4
    open(log, "w").close()
    t = Tracker(TrackingConfig(uri=uri, model_name="shared"), tmp_path / "work", "t")
    ctx = mp.get_context("spawn")  # fresh interpreters: a fork of this threaded process can inherit a held lock
    barrier = ctx.Barrier(3)
    racers = [ctx.Process(target=_lease_racer, args=(uri, str(tmp_path / f"w{i}"), log, barrier, rounds, 30.0))
              for i in range(2)]
    for p in racers:
        p.start()
    for r in range(rounds):
        t.client.create_registered_model("shared.gate-lease", tags={"ratchet.holder": f"dead-{r}",
                                                                   "ratchet.since": str(_time.time() - 60)})
        barrier.wait(timeout=180)  # both racers start at once, against a lease a dead run left
        barrier.wait(timeout=180)  # both have been through
    for p in racers:
        p.join(timeout=180)
        assert p.exitcode == 0
    events = [line.split() for line in open(log).read().splitlines()]
    assert len(events) == 4 * rounds
    inside, most = 0, 0
    for _, what, _, _ in sorted(events, key=lambda e: float(e[3])):
        inside += 1 if what == "in" else -1
        most = max(most, inside)
    assert most == 1, events  # never two inside at once
    names = {m.name for m in t.client.search_registered_models()}
    assert "shared.gate-lease" not in names and all(f"shared.gate-lease.gone-dead-{r}" in names for r in range(rounds))

    # a holder whose lease was taken over (it stayed inside past LEASE_STALE_S) releases nothing of the next one's
    monkeypatch.setattr(tracking, "LEASE_STALE_S", 0.5)
    other = Tracker(TrackingConfig(uri=uri, model_name="shared"), tmp_path / "work2", "t")
    t.lease_in_registry = other.lease_in_registry = True
    took, done = threading.Event(), threading.Event()

    def take_over():
        with other.registry_lease(wait_s=300):
            took.set()
            done.wait(300)

    with t.registry_lease():
        mine = t.client.get_registered_model("shared.gate-lease").tags["ratchet.holder"]
        th = threading.Thread(target=take_over)
        th.start()
        assert took.wait(300)
    theirs = t.client.get_registered_model("shared.gate-lease").tags["ratchet.holder"]
    assert theirs != mine  # the stale holder's release left the new holder's lease in place
    done.set()
    th.join(300)
    assert "shared.gate-lease" not in {m.name for m in t.client.search_registered_models()}


def _schema(db: Path) -> tuple[list[list[str]], list]:
    """A store's tables, indexes and schema revision. Each statement's lines are sorted: MLflow's
    migrations write a rebuilt table's constraints in an order that varies between processes."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as c:
        return (sorted(sorted(x.strip().rstrip(",") for x in (r[0] or "").splitlines())
                       for r in c.execute("SELECT sql FROM sqlite_master")),
                list(c.execute("SELECT version_num FROM alembic_version")))


def test_a_new_sqlite_store_is_a_copy_of_the_schema_mlflows_migrations_built(tmp_path, monkeypatch):
    """The first new store builds the cached empty one with MLflow's migrations; the next is a
    copy of it: the same tables and schema revision as a store MLflow creates itself, its default
    experiment added by MLflow as in its own, and an existing store untouched."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    first, second = Tracker(TrackingConfig(), tmp_path / "a", "t"), Tracker(TrackingConfig(), tmp_path / "b", "t")
    [template] = (tmp_path / "cache" / "mlflow-schema").iterdir()
    own = MlflowClient(f"sqlite:///{tmp_path / 'own.db'}")  # MLflow's migrations, not the copy
    defaults = [(e.name, e.artifact_location) for e in own.search_experiments()]
    assert _schema(tmp_path / "b" / "mlflow.db") == _schema(template) == _schema(tmp_path / "own.db")
    assert [(e.name, e.artifact_location) for e in second.client.search_experiments(filter_string="name = 'Default'")] \
        == defaults
    assert first.client.get_experiment_by_name("ratchet-t").experiment_id == "1"
    assert [p.name for p in (tmp_path / "b").iterdir() if p.name.endswith(".tmp")] == []
    before = (tmp_path / "a" / "mlflow.db").read_bytes()
    tracking._fresh_sqlite_store(tmp_path / "a" / "mlflow.db")
    assert (tmp_path / "a" / "mlflow.db").read_bytes() == before


def test_a_lease_gone_while_the_store_reads_it_back_is_tried_again(tmp_path, monkeypatch):
    """A store that finds the lease's name taken reads the model back for its message; a lease
    released or moved in between makes that read 'does not exist' (MLflow's SQL store, seen in a
    two-process race). The gate tries again, as for a lease released before it looked."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    t = Tracker(TrackingConfig(uri=f"sqlite:///{tmp_path / 'server.db'}", model_name="shared"), tmp_path / "w", "t")
    t.lease_in_registry = True
    real, calls = t.client.create_registered_model, []

    def create(name, **kw):
        calls.append(name)
        if len(calls) == 1:
            raise MlflowException(f"Registered Model with name={name} not found", error_code=RESOURCE_DOES_NOT_EXIST)
        return real(name, **kw)

    monkeypatch.setattr(t.client, "create_registered_model", create)
    with t.registry_lease(wait_s=5):
        assert {m.name for m in t.client.search_registered_models()} == {"shared.gate-lease"}
    assert calls == ["shared.gate-lease"] * 2


def test_a_train_log_with_empty_metrics_is_logged_without_them(tmp_path):
    """A GRPO step whose groups all taught nothing trains on no tokens, and TRL logs its clip ratios
    as null: the round's curve is logged without them, as are an online stage's steps (steps.jsonl:
    a step read from stored rollouts has no generation rate). Before, the null stopped the round
    after its train stage had finished."""
    t, store, run = _tracker(tmp_path)
    key = "e" * 64
    d = store.prepare("train", key)
    log = [{"step": 1, "loss": 0.5, "clip_ratio/low_min": 0.0}, {"step": 2, "loss": 0.0, "clip_ratio/low_min": None}]
    (d / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (d / "steps.jsonl").write_text(json.dumps({"step": 1, "reward": 0.25, "gen_tokens_per_s": None}) + "\n")
    m = store.finish(stage="train", round=1, key=key, code_version="t", config={}, parents=[],
                     outputs={"train_log.jsonl": None})
    t.log_train_curve(run, store, m)
    history = lambda name: [(x.step, x.value) for x in t.client.get_metric_history(run, name)]
    assert history("train/loss") == [(1, 0.5), (2, 0.0)] and history("train/clip_ratio/low_min") == [(1, 0.0)]
    assert history("online/reward") == [(1, 0.25)] and history("online/gen_tokens_per_s") == []
