"""run_stage: reuse by key, worker isolation, errors carried back from the worker."""

import pytest
from pydantic import BaseModel

from ratchet.data.errors import ConfigError, EmptyStageError, RatchetError, StageFailedError
from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.data.procs import services
from ratchet.data.procs.entry import entry
from ratchet.tasks.runner.stage import StageRequest, body_code, run_stage

CALLS: list[str] = []


class X(BaseModel):
    x: int = 0


def ok_body(req: StageRequest[X], store: ArtifactStore) -> StageManifest:
    CALLS.append(req.key)
    assert isinstance(req.config, X)  # typed, in this process and in a worker
    d = store.stage_dir(req.stage, req.key)
    (d / "out.txt").write_text(str(req.config.x))
    return req.finish(store, outputs={"out.txt": None})


def empty_body(req: StageRequest[X], store):
    raise EmptyStageError("round 1: nothing accepted; lower filter.min_rows")


def crash_body(req: StageRequest[X], store):
    import os

    (store.stage_dir(req.stage, req.key) / "partial.txt").write_text("half")
    os.kill(os.getpid(), 9)


def test_finished_stage_is_reused_not_recomputed(tmp_path):
    store = ArtifactStore(tmp_path)
    CALLS.clear()
    m1, reused1 = run_stage(store, stage="s", round=1, body=ok_body, code="c", config=X(x=1), parents=[])
    m2, reused2 = run_stage(store, stage="s", round=1, body=ok_body, code="c", config=X(x=1), parents=[])
    m3, _ = run_stage(store, stage="s", round=1, body=ok_body, code="c", config=X(x=2), parents=[])
    assert (reused1, reused2) == (False, True)
    assert m1 == m2 and m3.key != m1.key
    assert len(CALLS) == 2
    assert (store.dir_of(m3) / "out.txt").read_text() == "2"


def test_worker_process_runs_the_body(tmp_path):
    store = ArtifactStore(tmp_path)
    CALLS.clear()
    m, _ = run_stage(store, stage="s", round=1, body=ok_body, code="c", config=X(x=7), parents=[],
                     isolate=True)
    assert CALLS == []  # ran in another process
    assert (store.dir_of(m) / "out.txt").read_text() == "7"
    assert store.find("s", m.key) == m


def chatty_body(req: StageRequest[X], store: ArtifactStore) -> StageManifest:
    import os
    import sys

    print("engine config: " + "x" * 3000)  # what an engine prints on start
    print("a warning from a library", file=sys.stderr)
    os.system("echo from a subprocess of the worker")
    return ok_body(req, store)


def test_worker_output_goes_to_the_stage_log_not_the_terminal(tmp_path, capfd, monkeypatch):
    from ratchet.data import events

    monkeypatch.delenv("RATCHET_VERBOSE", raising=False)
    seen = []
    unsubscribe = events.subscribe(seen.append)
    try:
        store = ArtifactStore(tmp_path)
        m, _ = run_stage(store, stage="s", round=3, body=chatty_body, code="c", config=X(x=1), parents=[],
                         isolate=True)
        again, reused = run_stage(store, stage="s", round=3, body=chatty_body, code="c", config=X(x=1), parents=[],
                                  isolate=True)
    finally:
        unsubscribe()
    out, err = capfd.readouterr()
    assert "engine config" not in out + err and "a warning" not in out + err and "from a subprocess" not in out
    log = (store.dir_of(m) / events.STAGE_LOG).read_text()
    assert "engine config: xxx" in log and "a warning from a library" in log and "from a subprocess" in log
    assert [(e.kind, e.stage, e.round) for e in seen] == [("start", "s", 3), ("done", "s", 3), ("reused", "s", 3)]
    assert seen[0].dir == store.dir_of(m) and reused


def test_worker_errors_come_back_typed(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(EmptyStageError, match="lower filter.min_rows"):
        run_stage(store, stage="s", round=1, body=empty_body, code="c", config=X(), parents=[], isolate=True)


def test_killed_worker_keeps_partial_files_and_says_how_to_resume(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(StageFailedError, match=r"exit code -9.*re-run the same command to resume.*stage.log"):
        run_stage(store, stage="s", round=1, body=crash_body, code="c", config=X(), parents=[],
                  isolate=True, keep_partial=True)
    (d,) = (tmp_path / "stages").iterdir()
    assert (d / "partial.txt").read_text() == "half"
    assert not (d / "manifest.json").exists()


def test_a_body_must_be_importable_and_name_its_job(tmp_path):
    store = ArtifactStore(tmp_path)

    def local(req: StageRequest[X], store):
        raise AssertionError("never run")

    with pytest.raises(RatchetError, match="module-level function"):
        run_stage(store, stage="s", round=1, body=local, code="c", config=X(), parents=[], isolate=True)

    def untyped(req, store):
        raise AssertionError("never run")

    with pytest.raises(RatchetError, match=r"StageRequest\[Job\]"):
        run_stage(store, stage="s", round=1, body=untyped, code="c", config=X(), parents=[])


def test_a_stage_is_keyed_by_the_definitions_its_body_can_run():
    """The two edits that re-keyed stages they never run: the DPO loss is no code of sampling or of
    RFT training, and no answer check is code of training; a label stage runs the check its job
    holds, not every kind of check."""
    from ratchet.data.checks.number import NumberCheck
    from ratchet.data.checks.regex import RegexCheck
    from ratchet.data.prompts import AdditionSource
    from ratchet.models.sampler import SamplerConfig
    from ratchet.models.train_kinds import DPOTrainConfig, RFTTrainConfig
    from ratchet.tasks import label, sample, train
    from ratchet.tasks.runner.code_reach import reach, roots_of

    def modules(body, job):
        return {m for m, _ in reach(roots_of(body, job))}

    sampling = modules(sample.sample_body, sample.SampleJob(sample=sample.SampleConfig(), sampler=SamplerConfig(),
                                                            seed=0))
    assert "ratchet.models.sampler" in sampling and "ratchet.models.train_kinds.dpo" not in sampling
    rft = modules(train.train_body, train.TrainJob(train=RFTTrainConfig(), seed=0))
    dpo = modules(train.train_body, train.TrainJob(train=DPOTrainConfig(), seed=0))
    assert "ratchet.models.train_kinds.rft" in rft and "ratchet.models.train_kinds.dpo" not in rft
    assert "ratchet.models.train_kinds.dpo" in dpo
    assert not any(m.startswith("ratchet.data.checks") for m in rft | dpo)
    by_number = modules(label.label_body, label.LabelJob(label=label.VerifierLabel(),
                                                         data=AdditionSource(check=NumberCheck())))
    by_regex = modules(label.label_body, label.LabelJob(label=label.VerifierLabel(),
                                                        data=AdditionSource(check=RegexCheck(pattern=r"(\d+)"))))
    assert "ratchet.data.checks.number" in by_number and "ratchet.data.checks.regex" not in by_number
    assert "ratchet.data.checks.regex" in by_regex


def test_editing_code_a_body_cannot_run_keeps_its_key(tmp_path, monkeypatch):
    """Through a relative import, a function's own import, an attribute of a module and a kind union:
    an edit to a definition the body reaches re-keys it; one to a sibling it never calls, or to a kind
    its job does not hold, does not."""
    import importlib
    import sys

    from ratchet.tasks.runner import code_reach

    pkg = tmp_path / "reachpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "body.py").write_text(
        "from typing import Annotated\n\nfrom pydantic import BaseModel, Field\n\n"
        "from .kinds import A, B\n\n"
        "Kind = Annotated[A | B, Field(discriminator='kind')]\n\n\n"
        "class Job(BaseModel):\n    k: Kind\n\n\n"
        "def body(req, store):\n    from reachpkg import helpers\n    return helpers.used() + req.config.k.run()\n")
    (pkg / "kinds.py").write_text(
        "from typing import Literal\n\nfrom pydantic import BaseModel\n\n\n"
        "class A(BaseModel):\n    kind: Literal['a'] = 'a'\n\n    def run(self):\n        return 1\n\n\n"
        "class B(BaseModel):\n    kind: Literal['b'] = 'b'\n\n    def run(self):\n        return 2\n")
    helpers = "from .deep import g\n\n\ndef used():\n    return g()\n\n\ndef unused():\n    return {}\n"
    (pkg / "helpers.py").write_text(helpers.format(0))
    (pkg / "deep.py").write_text("def g():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    def version():
        body = importlib.import_module("reachpkg.body")
        kinds = importlib.import_module("reachpkg.kinds")
        return body_code(body.body, config=body.Job(k=kinds.A()))

    try:
        before = version()
        (pkg / "helpers.py").write_text(helpers.format(1))
        assert version() == before  # unused() is never called
        (pkg / "kinds.py").write_text((pkg / "kinds.py").read_text().replace("return 2", "return 3"))
        assert version() == before  # the job holds kind a
        (pkg / "deep.py").write_text("def g():\n    return 2\n")
        after = version()
        assert after != before  # used() calls g()
        (pkg / "kinds.py").write_text((pkg / "kinds.py").read_text().replace("return 1", "return 4"))
        assert version() != after  # A.run is what the body runs
    finally:
        for m in [m for m in sys.modules if m.startswith("reachpkg")]:
            del sys.modules[m]
        code_reach._find.cache_clear()


def test_a_kept_code_version_is_worked_out_again_when_anything_it_read_changes(tmp_path, monkeypatch):
    """A stage's code version is kept in the user's cache between processes (tasks/runner/code_reach.py
    `digest`); it is taken again only while every file it parsed is unchanged and every module
    name it looked up finds the same: here a new module where `sub.f` named a function."""
    import importlib
    import sys

    from ratchet.tasks.runner import code_reach

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    pkg = tmp_path / "keptpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("def f():\n    return 1\n")
    (pkg / "body.py").write_text("def body(req, store):\n    from keptpkg import sub\n    return sub.f()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    def version():
        code_reach._find.cache_clear()  # as in a new process
        return body_code(importlib.import_module("keptpkg.body").body)

    def fresh():
        code_reach._find.cache_clear()
        found = code_reach.reach([("keptpkg.body", "body")])
        return code_reach.sha256_text("\n".join(f"{m}:{n}\0{c}" for (m, n), c in sorted(found.items())))[:16]

    try:
        first = version()
        assert (tmp_path / "cache" / "code-versions.json").exists() and version() == first == fresh()
        (pkg / "sub" / "__init__.py").write_text("def f():\n    return 2\n")
        edited = version()
        assert edited != first and edited == fresh()
        (pkg / "sub" / "f.py").write_text("def g():\n    return 3\n")  # `sub.f` is now this module
        importlib.invalidate_caches()
        assert version() == fresh() != edited
        (tmp_path / "cache" / "code-versions.json").write_text("{not json")  # a broken cache is worked around
        assert version() == fresh()
    finally:
        for m in [m for m in sys.modules if m.startswith("keptpkg")]:
            del sys.modules[m]
        code_reach._find.cache_clear()


def test_the_installed_distributions_are_read_once_for_each_set_of_them(tmp_path, monkeypatch):
    """Which distribution provides an import name is kept in the user's cache (`_distributions`), keyed
    by the distributions installed on sys.path: a process whose sys.path[0] differs (`python -m`, `-c`,
    pytest) but holds the same distributions reads the kept answer, and an install is a new set that is
    read again while the others stay kept beside it."""
    import importlib.metadata
    import sys

    from ratchet.tasks.runner import code_reach

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # "" on sys.path: a folder that holds no distribution
    read = []
    real = importlib.metadata.packages_distributions
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: read.append(1) or real())
    site = tmp_path / "site"
    site.mkdir()

    def found(path0):
        monkeypatch.setattr(sys, "path", [path0, *[p for p in sys.path if p not in ("", str(tmp_path))]])
        code_reach._distributions.cache_clear()  # as in a new process
        return code_reach._distributions()

    try:
        first = found(str(tmp_path))
        assert read == [1] and found("") == first and read == [1]  # another sys.path[0] holding no distribution
        monkeypatch.syspath_prepend(str(site))
        (site / "newlib-1.0.dist-info").mkdir()  # an install: a set not read before
        found("")
        assert len(read) == 2
        (site / "newlib-1.0.dist-info").rmdir()
        assert found("") == first and len(read) == 2  # the first set, still kept
    finally:
        code_reach._distributions.cache_clear()


def test_a_file_edited_while_its_stage_runs_is_never_recorded_under_the_older_digest(tmp_path, monkeypatch):
    """Each file a stage's key was made from is digested again before its manifest is written: a data
    file, a user function's helper, a module of code the body runs. An edit to any fails the stage,
    naming the file, and records nothing; a comment in the code (its code version unchanged) does
    not; the same stage then runs again with the file as it is."""
    import importlib
    import sys

    from ratchet.data.userfiles import source_digest
    from ratchet.tasks.runner import code_reach

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    pkg = tmp_path / "editpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("def touch():\n    return 1\n")
    (pkg / "body.py").write_text(
        "from typing import Annotated\n\nfrom pydantic import BaseModel\n\n"
        "from ratchet.data.userfiles import UserFile, UserPath\nfrom ratchet.tasks.runner.stage import StageRequest\n\n"
        "from editpkg.helper import touch\n\nEDITS = []\n\n\n"
        "class Job(BaseModel):\n    data: UserPath\n"
        "    function: Annotated[str, UserFile(spec=True, digest='source')]\n    source: str | None = None\n\n\n"
        "def body(req: StageRequest[Job], store):\n    touch()\n    for edit in EDITS:\n        edit()\n"
        "    (store.stage_dir(req.stage, req.key) / 'out.txt').write_text('x')\n"
        "    return req.finish(store, outputs={'out.txt': None})\n")
    data, user = tmp_path / "prompts.jsonl", tmp_path / "user"
    data.write_text('{"prompt": "1 + 1"}\n')
    user.mkdir()
    (user / "rewards.py").write_text("from scale import k\n\n\ndef score(completion, **f):\n    return k\n")
    (user / "scale.py").write_text("k = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        mod = importlib.import_module("editpkg.body")
        spec = f"{user / 'rewards.py'}:score"
        store = ArtifactStore(tmp_path / "w")

        def run(edit=None):
            mod.EDITS[:] = [edit] if edit else []
            job = mod.Job(data=str(data), function=spec, source=source_digest(spec))
            return run_stage(store, stage="s", round=1, body=mod.body, config=job, parents=[])

        def appended(path, text):
            return lambda: path.write_text(path.read_text() + text)

        for path, text, says in [(data, '{"prompt": "2 + 2"}\n', str(data)),
                                 (user / "scale.py", "k = 2.0\n", str(user / "rewards.py")),
                                 (pkg / "helper.py", "\n\ndef touch():\n    return 2\n", "its code version changed")]:
            with pytest.raises(StageFailedError) as e:
                run(appended(path, text))
            assert says in str(e.value) and "while the stage ran" in str(e.value), str(e.value)
            assert not list((tmp_path / "w" / "stages").glob("*/manifest.json"))  # nothing recorded
        assert str(pkg / "helper.py") in str(e.value)  # the code version names the file that changed it
        code_reach._find.cache_clear()
        for m in [m for m in sys.modules if m.startswith("editpkg")]:
            del sys.modules[m]
        mod = importlib.import_module("editpkg.body")  # as the next run imports the edited code
        m, reused = run(appended(pkg / "helper.py", "# a comment: the same code version\n"))
        assert not reused and store.find("s", m.key) == m
    finally:
        for m in [m for m in sys.modules if m.startswith("editpkg")]:
            del sys.modules[m]
        code_reach._find.cache_clear()


def slow_body(req: StageRequest[X], store):
    import time

    time.sleep(1.0)
    return ok_body(req, store)


def test_two_processes_on_one_key_compute_it_once(tmp_path):
    """Two pipelines reaching the same stage at once: one computes, the other reuses."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys; from pathlib import Path; from ratchet.data.store import ArtifactStore; "
        "from ratchet.tasks.runner.stage import run_stage; from tests.tasks.test_stage import X, slow_body; "
        f"m, reused = run_stage(ArtifactStore(Path({str(tmp_path)!r})), stage='s', round=1, "
        "body=slow_body, code='c', config=X(x=3), parents=[]); "
        "print(json.dumps({'reused': reused, 'key': m.key}))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in procs]
    assert sorted(o["reused"] for o in outs) == [False, True]
    assert outs[0]["key"] == outs[1]["key"]


def orphan_body(req: StageRequest[X], store):
    import time

    (store.stage_dir(req.stage, req.key) / "pid").write_text(str(__import__("os").getpid()))
    time.sleep(60)


def test_worker_dies_with_its_orchestrator(tmp_path):
    """SIGKILL the orchestrator mid-stage: its worker must not live on and keep writing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.procs import gone_within

    script = (
        "from pathlib import Path; from ratchet.data.store import ArtifactStore; "
        "from ratchet.tasks.runner.stage import run_stage; from tests.tasks.test_stage import X, orphan_body; "
        f"run_stage(ArtifactStore(Path({str(tmp_path)!r})), stage='s', round=1, "
        "body=orphan_body, code='c', config=X(), parents=[], isolate=True)"
    )
    orch = subprocess.Popen([sys.executable, "-c", script])
    pid_file = None
    for _ in range(200):
        found = list((tmp_path / "stages").glob("s-*/pid")) if (tmp_path / "stages").exists() else []
        if found and found[0].read_text():
            pid_file = found[0]
            break
        time.sleep(0.1)
    assert pid_file is not None, "worker never started"
    worker = int(pid_file.read_text())
    os.kill(orch.pid, signal.SIGKILL)
    orch.wait()
    assert gone_within(worker, 5), "the worker outlived its killed orchestrator"


# warm workers: the run's fork server (data/procs/forkserver.py) -------------------------------------

@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    """One fork server for this module's tests, as `ratchet run` holds one for a run: started by
    the run itself, as a user's is, not forked from the suite's template (tests/conftest.py)."""
    from ratchet.data.procs import forkserver
    from ratchet.tasks.runner.stage import WORKER_LIBRARIES

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(forkserver.TEMPLATE, raising=False)
        with forkserver.for_run(True, tmp_path_factory.mktemp("fork") / "forkserver.log", WORKER_LIBRARIES) as server:
            yield server


def where_body(req: StageRequest[X], store: ArtifactStore) -> StageManifest:
    import json
    import os
    import sys

    d = store.stage_dir(req.stage, req.key)
    (d / "out.txt").write_text(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "env": os.environ.get("RATCHET_TEST_STAGE_ENV"),
        "threads": len(os.listdir("/proc/self/task")), "torch": "torch" in sys.modules}))
    print("from the forked worker")
    return req.finish(store, outputs={"out.txt": None})


def test_a_forked_worker_is_a_process_of_its_own_with_the_stage_s_environment(tmp_path, fork_server, monkeypatch):
    import json
    import os

    from ratchet.data import events

    monkeypatch.setenv("RATCHET_TEST_STAGE_ENV", "set after the server started")
    monkeypatch.chdir(tmp_path)
    store = ArtifactStore(tmp_path / "store")
    assert fork_server.wait_ready(120)
    m, _ = run_stage(store, stage="s", round=1, body=where_body, code="c", config=X(x=1), parents=[], isolate=True)
    got = json.loads((store.dir_of(m) / "out.txt").read_text())
    assert got["ppid"] == fork_server.proc.pid and got["pid"] not in (os.getpid(), fork_server.proc.pid)
    assert got["env"] == "set after the server started" and got["cwd"] == str(tmp_path)
    assert got["torch"] and got["threads"] == 1  # imported before the fork; and no thread came along
    assert fork_server.ready == 1  # the server was single-threaded when it forked
    assert "from the forked worker" in (store.dir_of(m) / events.STAGE_LOG).read_text()
    # a second stage gets another process, from the same server
    m2, _ = run_stage(store, stage="s", round=2, body=where_body, code="c", config=X(x=2), parents=[], isolate=True)
    again = json.loads((store.dir_of(m2) / "out.txt").read_text())
    assert again["ppid"] == fork_server.proc.pid and again["pid"] != got["pid"]


def test_forked_workers_fail_and_die_as_cold_ones_do_and_a_dead_server_is_replaced(tmp_path, fork_server):
    import json
    import signal

    store = ArtifactStore(tmp_path)
    with pytest.raises(EmptyStageError, match="lower filter.min_rows"):
        run_stage(store, stage="s", round=1, body=empty_body, code="c", config=X(), parents=[], isolate=True)
    with pytest.raises(StageFailedError, match=r"exit code -9.*re-run the same command to resume"):
        run_stage(store, stage="s", round=2, body=crash_body, code="c", config=X(), parents=[], isolate=True,
                  keep_partial=True)
    # its log follows a rename (a run names it once the run has a name), never over another's
    first_log = fork_server.log_path
    taken = tmp_path / "taken.log"
    taken.write_text("another run's")
    fork_server.rename_log(taken)
    assert fork_server.log_path == first_log and taken.read_text() == "another run's"
    fork_server.rename_log(tmp_path / "named.log")
    assert fork_server.log_path == tmp_path / "named.log" and not first_log.exists()
    first = fork_server.proc.pid
    fork_server.proc.send_signal(signal.SIGKILL)
    fork_server.proc.wait()
    # the next stage starts another server, here from a thread that ends with the stage (as a
    # Prefect task's may, in a copy of the run's context, as Prefect's runner makes one): the
    # server must outlive that thread, as it lives as long as the run
    import contextvars
    import threading
    import time

    done = {}
    t = threading.Thread(target=contextvars.copy_context().run,
                         args=(lambda: done.update(m=run_stage(store, stage="s", round=3, body=where_body, code="c",
                                                               config=X(x=3), parents=[], isolate=True)[0]),))
    t.start()
    t.join()
    # forked at once from the new server, its imports not yet done (the stage imports what it lacks)
    assert json.loads((store.dir_of(done["m"]) / "out.txt").read_text())["ppid"] == fork_server.proc.pid != first
    time.sleep(1)
    assert fork_server.alive(), "the restarted fork server died with the thread that started it"
    assert (tmp_path / "named.log").exists() and not first_log.exists()  # the new server writes to the new name
    m, _ = run_stage(store, stage="s", round=4, body=ok_body, code="c", config=X(x=4), parents=[], isolate=True)
    assert (store.dir_of(m) / "out.txt").read_text() == "4"


def test_the_fork_server_refuses_to_fork_beside_a_thread():
    import threading

    from ratchet.data.procs.forkserver import _unsafe

    assert _unsafe() is None or "threads" in _unsafe()  # pytest may hold threads of its own
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert "threads" in _unsafe()
    finally:
        stop.set()
        t.join()


@entry
def where_called(x):
    import os

    return {"pid": os.getpid(), "x": x}


@entry
def refuses(field):
    raise ConfigError([f"{field}: no such model"], source="model")


@entry
def dies_unless_in(pid):
    import os

    if os.getpid() != pid:
        os._exit(3)
    return "made here"


def test_a_call_is_made_in_a_child_of_the_fork_server_or_else_here(fork_server):
    """forkserver.call: the run's own calls that need heavy imports (its base model saved for
    MLflow, its report's figures) are made in a forked child; whatever keeps that from working
    makes the call in this process, so its outcome is a direct call's."""
    import os

    from ratchet.data.procs import forkserver

    assert fork_server.wait_ready(120)
    got = forkserver.call(where_called, [1, "a"])
    assert got["x"] == [1, "a"] and got["pid"] not in (os.getpid(), fork_server.proc.pid)
    with pytest.raises(ConfigError, match="model.path: no such model") as e:  # the caller's own error, as raised
        forkserver.call(refuses, "model.path")
    assert e.value.problems == ["model.path: no such model"] and e.value.source == "model"
    assert forkserver.call(dies_unless_in, os.getpid()) == "made here"  # the child died
    assert forkserver.call(where_called, lambda: 0)["pid"] == os.getpid()  # no pickle
    with pytest.raises(TypeError, match="not a declared entry"):  # a forked child runs an entry, nothing else
        forkserver.call(imported.main, "os")
    with services.held(server=None):  # code outside the run's services
        assert forkserver.call(where_called, 1)["pid"] == os.getpid()  # no server


WARMED: list[int] = []  # the pids of the processes that called warm_here


def warm_here() -> None:
    import os

    WARMED.append(os.getpid())


WARMED_WITH: list = []


def warm_with(*args: str) -> None:
    import os

    WARMED_WITH.append([os.getpid(), list(args)])


@entry
def warmed():
    import gc
    import os

    return {"pid": os.getpid(), "warmed": list(WARMED), "with": list(WARMED_WITH), "frozen": gc.get_freeze_count()}


def test_a_preload_may_call_a_function_whose_cache_every_child_inherits(tmp_path, monkeypatch):
    """A preload `module:function` is imported and called once in the server (the run's preloads fill
    MLflow's map of the installed packages so: flows/inputs.py run_preload), one made by `preload_call`
    with its arguments (the run's tokenizer); each forked child holds what they made, and none calls
    them again. Each child's collector starts with the server's objects frozen (none of its collections
    scans them)."""
    import os

    from ratchet.data.procs import forkserver

    monkeypatch.delenv(forkserver.TEMPLATE, raising=False)  # its own imports, not the suite's template's
    server = forkserver.ForkServer(tmp_path / "forkserver.log", ("json", f"{__name__}:warm_here",
                                                                 forkserver.preload_call(warm_with, "a b", "c:d")))
    server.start()
    try:
        assert server.wait_ready(60)
        pid = server.proc.pid
        with services.held(server=server):
            first, second = forkserver.call(warmed), forkserver.call(warmed)
    finally:
        server.stop()
    assert first["warmed"] == second["warmed"] == [pid]
    assert first["with"] == second["with"] == [[pid, ["a b", "c:d"]]]
    assert first["frozen"] > 10_000 and second["frozen"] > 10_000
    assert len({first["pid"], second["pid"], pid, os.getpid()}) == 4 and WARMED == WARMED_WITH == []
    from ratchet.flows.inputs import run_preload
    from ratchet.models import mlflow_model

    assert "ratchet.models.mlflow_model:warm" in run_preload()
    mlflow_model.warm()  # MLflow's helper is there: the map is made, and a save reads it
    from mlflow.utils import requirements_utils

    assert requirements_utils._PACKAGES_TO_MODULES and "torch" in requirements_utils._PACKAGES_TO_MODULES


def test_imports_frozen_run_no_collection_and_freeze_what_they_made():
    """`imports_frozen` (a fork server's, a warm engine's, a Prefect server's and a run's own imports):
    the collector is off in the block and runs no collection at its end, what the block made (what it
    dropped in cycles too) is frozen, and the collector is as it was before."""
    import gc
    import weakref

    class Node:
        pass

    from ratchet.data.procs.forkserver import imports_frozen

    runs = []
    gc.callbacks.append(seen := lambda phase, info: runs.append(info["generation"]) if phase == "stop" else None)
    frozen = gc.get_freeze_count()
    try:
        with imports_frozen():
            assert not gc.isenabled()
            a, b = Node(), Node()
            a.other, b.other = b, a
            dropped = weakref.ref(a)
            del a, b
            many = [Node() for _ in range(100_000)]  # would have run the youngest generation's collection often
            assert runs == [] and dropped() is not None and len(many) == 100_000
            kept = Node()
        assert runs == [] and gc.isenabled()
        assert gc.get_freeze_count() > frozen and kept not in gc.get_objects()
        gc.collect()  # a later collection scans none of it: the dropped cycle stays
        assert dropped() is not None and kept not in gc.get_objects()
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()
        gc.collect()


def _ppid(pid: int) -> int:
    from pathlib import Path

    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_fork_server_forked_from_a_template_serves_its_run_and_ends_with_it(tmp_path, monkeypatch):
    """Guards the fork template (forkserver.template), which the suite's runs fork their servers
    from (tests/conftest.py): a run's server is the template's child, ready at once with the
    template's imports and its preloaded calls made, forking the run's stages in the run's
    environment and directory, in a process group of its own; it ends when the run ends its services
    or dies; a run with failpoints armed, or whose template is not there, starts its own."""
    import json
    import os
    import subprocess
    import sys
    import time

    from ratchet.data.procs import forkserver
    from tests.procs import gone_within

    monkeypatch.setenv("RATCHET_TEST_STAGE_ENV", "the run's")
    monkeypatch.chdir(tmp_path)
    with services.held(server=None), \
            forkserver.templated(("json", f"{__name__}:warm_here"), tmp_path / "template.log") as path:
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        import socket

        for junk, fds in ((b"not json", []), (b'{"env": {}}', []), (b"[1, 2]", [0, 1, 2])):  # broken requests
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(path)
                socket.send_fds(s, [junk], fds)
                assert s.recv(4096) == b""  # refused: the template closes it and keeps listening
        assert (tmp_path / "template.log").read_text().count("a request refused") == 3
        with forkserver.for_run(True, tmp_path / "server.log", ("json", f"{__name__}:warm_here", "csv")) as server:
            assert server.wait_ready(10) and server.ready == 1
            template = _ppid(server.proc.pid)
            assert template != os.getpid() and "listening" in (tmp_path / "template.log").read_text()
            assert os.getpgid(server.proc.pid) == server.proc.pid  # a group of its own, not the template's starter's
            got = forkserver.call(warmed)
            assert got["warmed"] == [template]  # the template's call, inherited: not made again
            store = ArtifactStore(tmp_path / "store")
            m, _ = run_stage(store, stage="s", round=1, body=where_body, code="c", config=X(x=1), parents=[],
                             isolate=True)
            out = json.loads((store.dir_of(m) / "out.txt").read_text())
            assert out["ppid"] == server.proc.pid and out["env"] == "the run's" and out["cwd"] == str(tmp_path)
            assert out["threads"] == 1
            pid = server.proc.pid
        assert gone_within(pid, 10), "the server outlived its run's services"

        # a run killed by SIGKILL: its server reads the end of its requests, and goes
        script = ("import time; from ratchet.data.procs import forkserver; "
                  "s = forkserver.TemplatedServer(None, ('json',)); s.start(); s.wait_ready(10); "
                  "print(s.proc.pid, flush=True); time.sleep(600)")
        run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        served = int(run.stdout.readline())
        assert _ppid(served) == template
        run.kill()
        run.wait()
        assert gone_within(served, 10), "the server outlived its killed run"

        # failpoints armed (a kill of the process's group must take the run with it): the run's own server
        monkeypatch.setenv("RATCHET_FAILPOINTS", "sample:shard")
        server = forkserver.TemplatedServer(None, ("json",))
        server.start()
        try:
            assert server.wait_ready(60) and _ppid(server.proc.pid) == os.getpid()
        finally:
            server.stop()
    monkeypatch.delenv("RATCHET_FAILPOINTS")
    monkeypatch.setenv(forkserver.TEMPLATE, str(tmp_path / "no-template"))
    server = forkserver.TemplatedServer(None, ("json",))
    server.start()
    try:
        assert server.wait_ready(60) and _ppid(server.proc.pid) == os.getpid()  # started here, as without one
    finally:
        server.stop()


def test_a_run_s_services_are_the_run_s_not_the_process_s(tmp_path):
    """Two runs in two threads of one process each hold a fork server of their own at the same time;
    a task submitted from a run (run in a copy of its context, as Prefect's runner does) finds its
    run's; a thread started without a run's context finds none; a run that ends leaves none."""
    import contextvars
    import threading

    from ratchet.data.procs import forkserver

    seen: dict[str, object] = {}
    both = threading.Barrier(2)

    def run(name):
        with forkserver.for_run(True, tmp_path / f"{name}.log") as server:
            both.wait(timeout=60)  # both runs hold a server at once
            seen[name], seen[f"{name} sees"] = server, forkserver.current()
            for how, target in (("task", contextvars.copy_context().run), ("plain", lambda f: f())):
                look = (lambda how=how: seen.update({f"{name} {how}": forkserver.current()}))
                t = threading.Thread(target=target, args=(look,))
                t.start()
                t.join()
            both.wait(timeout=60)  # neither ends before the other has looked
        seen[f"{name} after"] = forkserver.current()

    with services.held(server=None):  # not this module's server
        runs = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
        for t in runs:
            t.start()
        for t in runs:
            t.join()
        assert forkserver.current() is None
    a, b = seen["a"], seen["b"]
    assert isinstance(a, forkserver.ForkServer) and isinstance(b, forkserver.ForkServer) and a is not b
    assert seen["a sees"] is seen["a task"] is a and seen["b sees"] is seen["b task"] is b
    assert seen["a plain"] is seen["b plain"] is seen["a after"] is seen["b after"] is None
    assert not a.alive() and not b.alive()  # each stopped with its run


@entry
def imported(name):
    import os
    import sys

    return {"ppid": os.getppid(), "imported": name in sys.modules}


def test_a_server_started_before_its_log_has_a_name_keeps_what_it_said_for_the_log(tmp_path):
    """`ratchet run` starts its fork server before its inputs have passed their checks (the model's
    are made in a child of it), when nothing may be written yet: the server's output goes to a
    file without a name, carried into the log the run's services name later. A call that names the
    modules it needs (`after`) is forked once they are imported, not after all the server's."""
    import time

    from ratchet.data.procs import forkserver
    from ratchet.tasks.runner.stage import WORKER_LIBRARIES

    with services.held(server=None), forkserver.for_run(True, None, WORKER_LIBRARIES) as server:  # a run's own
        got = forkserver.call(imported, "transformers", after=("torch", "transformers"))
        assert got == {"ppid": server.proc.pid, "imported": True}
        assert server.wait_ready(120)  # the server says so on its output, before its log has a name
        assert list(tmp_path.iterdir()) == []
        log = tmp_path / "logs" / "run.forkserver.log"
        with forkserver.for_run(True, log) as again:  # the run's services keep the server and name its log
            assert again is None and forkserver.current() is server
        deadline = time.time() + 30
        said = "fork server: "  # its imports made, or forked from the suite's template with them made
        while said not in (log.read_text() if log.exists() else "") and time.time() < deadline:
            time.sleep(0.1)
        assert said in log.read_text()
        server.rename_log(tmp_path / "logs" / "named.log")  # named again once the run has a name: a rename
        assert not log.exists() and said in (tmp_path / "logs" / "named.log").read_text()
