"""Run records: written atomically, read forward-compatibly, never guessed about; liveness is a lock."""

import json
import subprocess
import sys
import textwrap

import pytest

from ratchet.data.store import ArtifactStore
from ratchet.flows.runs import (RunContext, RunRecord, UnreadableRecordError, _alive, hold_liveness, read_record,
                                records, write_record)
from ratchet.flows.gc import collect_garbage


def _record(name: str = "demo-abc") -> RunRecord:
    ctx = RunContext(run_name=name, workdir="/w", parent_run_id="p1", code_version="c", config_hash="h")
    return RunRecord(ctx=ctx, config={"rounds": 2}, host="elsewhere", pid=1)


def test_a_newer_records_fields_are_read_and_kept(tmp_path):
    (tmp_path / "runs").mkdir()
    path = tmp_path / "runs" / "demo-abc.json"
    body = json.loads(_record().model_dump_json())
    body["lease"] = {"until": 123}  # fields a newer Ratchet wrote, at both levels
    body["ctx"]["cluster"] = "ray://head"
    path.write_text(json.dumps(body))
    rec = read_record(path)
    assert rec.state == "running" and rec.ctx.run_name == "demo-abc"
    write_record(tmp_path, rec.model_copy(update={"state": "failed"}))  # as set_state rewrites it
    again = json.loads(path.read_text())
    assert again["state"] == "failed" and again["lease"] == {"until": 123} and again["ctx"]["cluster"] == "ray://head"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["demo-abc.json"]  # no temporary file left


def test_an_unreadable_record_is_named_and_its_stages_are_kept(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "cut-short.json").write_text('{"ctx": {"run_name": "cut-sh')
    write_record(tmp_path, _record("done-run").model_copy(update={"state": "finished"}))
    good, bad = records(tmp_path)
    assert list(good) == ["done-run"] and "cut-short.json cannot be read" in bad["cut-short"]
    with pytest.raises(UnreadableRecordError, match="move it aside to start that run afresh"):
        read_record(tmp_path / "runs" / "cut-short.json")
    store = ArtifactStore(tmp_path)
    mine, theirs = store.prepare("train", "k1", keep_partial=True), store.prepare("sample", "k2", keep_partial=True)
    store.add_owner(mine, "cut-short")
    store.add_owner(theirs, "done-run")
    left = {x.path.name: x for x in collect_garbage(tmp_path)}
    assert not left[mine.name].remove and "its record cannot be read" in left[mine.name].why and mine.exists()
    assert left[theirs.name].remove and not theirs.exists()  # a finished run's leftover goes, as before


def test_liveness_is_the_lock_a_live_attempt_holds(tmp_path):
    (tmp_path / "runs").mkdir()
    rec = _record().model_copy(update={"host": None})
    assert _alive(tmp_path, rec) is False  # no attempt ever held it
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from ratchet.flows.runs import hold_liveness
        hold_liveness(Path({str(tmp_path)!r}), "demo-abc")
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert _alive(tmp_path, rec) is True  # whatever its command line says
    finally:
        child.kill()  # the kernel drops the lock with the process, however it dies
        child.wait()
    assert _alive(tmp_path, rec) is False
    assert _alive(tmp_path, rec.model_copy(update={"host": "another-host"})) is None  # a lock there may not reach here
    live = hold_liveness(tmp_path, "demo-abc")
    try:
        assert _alive(tmp_path, rec) is True
    finally:
        live.release()
    assert _alive(tmp_path, rec) is False


def test_a_second_attempt_in_the_same_process_waits_too(tmp_path):
    """The lock is the attempt's (its run context owns it), not a table of the process's: a second
    attempt of the run in another thread of this process waits for the first, as one in another
    process does, and goes on when the first releases it."""
    import threading

    (tmp_path / "runs").mkdir()
    first = hold_liveness(tmp_path, "demo-abc")
    said, held = [], []
    second = threading.Thread(target=lambda: held.append(hold_liveness(tmp_path, "demo-abc", said.append)),
                              daemon=True)
    second.start()
    second.join(2)
    try:
        assert second.is_alive() and len(said) == 1 and "is already running" in said[0]  # waiting
    finally:
        first.release()
    second.join(30)
    assert not second.is_alive() and len(held) == 1
    held[0].release()
    first.release()  # a second release is nothing
    assert _alive(tmp_path, _record().model_copy(update={"host": None})) is False


def test_a_second_attempt_of_a_live_run_names_the_holder_and_waits_for_it(tmp_path):
    """Two attempts of one run never run side by side: the second says which process holds it
    and starts only when that one has ended (here: killed, as a lost session ends)."""
    import socket
    import threading

    (tmp_path / "runs").mkdir()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, socket, time
        from pathlib import Path
        from ratchet.flows.runs import RunContext, RunRecord, hold_liveness, write_record
        ctx = RunContext(run_name="demo-abc", workdir="/w", parent_run_id="p1", code_version="c", config_hash="h")
        hold_liveness(Path({str(tmp_path)!r}), "demo-abc")
        write_record(Path({str(tmp_path)!r}), RunRecord(ctx=ctx, config={{}}, host=socket.gethostname(),
                                                        pid=os.getpid()))
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    said: list[str] = []
    held = []
    second = threading.Thread(target=lambda: held.append(hold_liveness(tmp_path, "demo-abc", said.append)),
                              daemon=True)
    try:
        assert child.stdout.readline().strip() == "held"
        second.start()
        second.join(2)
        assert second.is_alive()  # waiting, not running beside it
        (line,) = said
        assert f"run demo-abc is already running in {tmp_path} (pid {child.pid} on {socket.gethostname()})" in line
        assert "waiting for it to end" in line
    finally:
        child.kill()
        child.wait()
    second.join(30)
    assert not second.is_alive()  # the holder is gone: this attempt goes on
    try:
        assert _alive(tmp_path, _record().model_copy(update={"host": None})) is True
    finally:
        held[0].release()


def test_the_code_digest_follows_what_runs_not_comments_or_layout(tmp_path):
    from ratchet.tasks.runner.code_reach import code_digest

    for pkg in ("data", "models", "tasks", "flows"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    helper = tmp_path / "tasks" / "helper.py"
    helper.write_text("def f():\n    return 1\n")
    before = code_digest(tmp_path)
    helper.write_text('"""Helper."""\n# what f gives\ndef f():\n    """One."""\n\n    return 1  # one\n')
    assert code_digest(tmp_path) == before
    helper.write_text("def f():\n    return 2\n")
    edited = code_digest(tmp_path)
    assert edited != before
    (tmp_path / "flows" / "extra.py").write_text("X = 1\n")
    assert code_digest(tmp_path) != edited  # a new module is code too
    helper.rename(tmp_path / "data" / "helper.py")
    assert code_digest(tmp_path) not in (before, edited)  # and so is where a module lives
    (tmp_path / "data" / "notes.txt").write_text("not code")
    moved = code_digest(tmp_path)
    (tmp_path / "data" / "notes.txt").write_text("still not code")
    assert code_digest(tmp_path) == moved


def test_a_fixed_file_continues_the_same_run_and_a_resume_reads_it_as_it_is_now(tmp_path, monkeypatch):
    """Decided for each file a run reads (docs/guides/resume-lineage.md): a reward function's file,
    an environment's file with a module beside it, a data file. An edit names no new run; the
    stages that read the file are keyed by its new digest; `ratchet resume` digests each file again
    instead of failing on the digest its last attempt recorded."""
    from ratchet.flows.runs import resumed_config
    from ratchet.flows.config import config_from_dict
    from ratchet.flows.runs import run_name_for
    from ratchet.tasks.runner.stage import keyed

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text("def score(completion, **fields):\n    return 1.0\n")
    (tmp_path / "env.py").write_text("from helper import obs\n\n\nclass Env:\n    def reset(self, seed):\n"
                                     "        return obs()\n\n    def step(self, action):\n"
                                     "        return None, 1.0, True\n")
    (tmp_path / "helper.py").write_text("def obs():\n    return 'start'\n")
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"id": "q{i}", "prompt": "p{i}", "answer": "{i}"}}\n'
                                                 for i in range(8)))

    def cfg(**over):
        return config_from_dict({"data": {"kind": "file", "path": "rows.jsonl", "eval_size": 2,
                                          "check": {"kind": "python", "function": "rewards.py:score"}},
                                 "sample": {"max_tokens": 16, "rollout": {"kind": "environment", "env": "env.py:Env",
                                                                          "episode_tokens": 64}}, **over})

    a = cfg()
    (tmp_path / "rewards.py").write_text("def score(completion, **fields):\n    return 0.5\n")  # a fix
    (tmp_path / "helper.py").write_text("def obs():\n    return 'begin'\n")  # the environment's helper
    (tmp_path / "rows.jsonl").write_text((tmp_path / "rows.jsonl").read_text() + '{"id": "q9", "prompt": "p9"}\n')
    b = cfg()
    assert run_name_for(a) == run_name_for(b) != run_name_for(cfg(rounds=5))  # the config names it, not the files
    assert a.data.check.source != b.data.check.source and a.sample.rollout.source != b.sample.rollout.source
    assert keyed(a.data) != keyed(b.data) and keyed(a.sample) != keyed(b.sample)  # what reads them is re-keyed

    record = RunRecord(ctx=RunContext(run_name=run_name_for(a), workdir=str(tmp_path), parent_run_id="p",
                                      code_version="c", config_hash="h"), config=a.model_dump(mode="json"))
    resumed = resumed_config(record, tmp_path)
    assert resumed.data.check.source == b.data.check.source  # the file as it is now, not as recorded
    assert resumed.sample.rollout.source == b.sample.rollout.source
    assert resumed.model_dump(exclude={"workdir"}) == b.model_dump(exclude={"workdir"})  # nothing else changed
