"""`ratchet verify` on one stage (flows/verify.py): run again in a scratch store from what its
manifest recorded, compared digest by digest. Over a whole recorded run, through the command, it
is tests/test_doc_commands.py's."""

import json
import os

from pydantic import BaseModel

from ratchet.data.manifest import StageManifest, read_manifest
from ratchet.data.store import ArtifactStore
from ratchet.flows.verify import verify, verify_stage
from ratchet.tasks.runner.stage import StageRequest, run_stage


class Job(BaseModel):
    x: int = 0
    endpoint: dict | None = None


def parent_body(req: StageRequest[Job], store: ArtifactStore) -> StageManifest:
    (store.stage_dir(req.stage, req.key) / "rows.txt").write_text("1\n2\n3\n")
    return req.finish(store, outputs={"rows.txt": 3})


def noisy_body(req: StageRequest[Job], store: ArtifactStore) -> StageManifest:
    """Sums its parent's rows; VERIFY_NOISE stands for whatever makes a re-run write other bytes."""
    rows = store.path(req.parent("parent"), "rows.txt").read_text().split()
    total = sum(map(int, rows)) + req.config.x + int(os.environ.get("VERIFY_NOISE", "0"))
    (store.stage_dir(req.stage, req.key) / "sum.txt").write_text(f"{total}\n")
    (store.stage_dir(req.stage, req.key) / "same.txt").write_text("kept\n")
    ledger = [{"step": 1, "prompt_ids": rows}, {"step": 2, "seeds": [total]}]  # as an online train stage's
    (store.stage_dir(req.stage, req.key) / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    return req.finish(store, outputs={"sum.txt": None, "same.txt": None, "ledger.jsonl": 2},
                      metrics={"sum": float(total), "wall_s": 0.1})


def test_a_stage_run_again_is_identical_or_says_which_files_and_metrics_differ(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path / "w")
    parent, _ = run_stage(store, stage="parent", round=0, body=parent_body, config=Job(), parents=[])
    m, _ = run_stage(store, stage="sum", round=1, body=noisy_body, config=Job(x=4), parents=[parent])
    assert m.ran_by["body"] == "tests.flows.test_verify:noisy_body"
    recorded = {p: p.read_bytes() for p in (tmp_path / "w").rglob("*") if p.is_file()}

    v = verify_stage(store, m, tmp_path / "scratch-1")
    assert (v.verdict, v.files, v.metrics) == ("identical", {}, {}), v

    monkeypatch.setenv("VERIFY_NOISE", "1")  # the re-run's worker writes other bytes
    path, (v,) = verify(store, [m], tmp_path / "w" / "verify" / "r", say=lambda _: None)
    assert v.verdict == "differs" and list(v.files) == ["ledger.jsonl", "sum.txt"] and "2 of 3 output(s)" in v.why
    assert v.why.endswith("the ledger first differs at optimizer step 2 of 2"), v.why
    assert v.files["sum.txt"][0] == m.outputs["sum.txt"].sha256 and v.metrics == {"sum": [10.0, 11.0]}
    assert json.loads(path.read_text())["stages"][0]["verdict"] == "differs"
    kept = path.with_name(path.stem + "-scratch") / "sum-1"  # the re-run's bytes, kept to compare
    assert (kept / m.dir / "sum.txt").read_text() == "11\n"
    assert {p: p.read_bytes() for p in (tmp_path / "w" / "stages").rglob("*") if p.is_file()} == {
        p: b for p, b in recorded.items() if "stages" in p.parts}  # the run's own store is read, never written
    assert (kept / parent.dir).is_symlink()  # the recorded parent, linked


def test_what_cannot_be_run_again_is_said_with_the_reason(tmp_path):
    store = ArtifactStore(tmp_path / "w")
    parent, _ = run_stage(store, stage="parent", round=0, body=parent_body, config=Job(), parents=[])
    served = Job(endpoint={"base_url": "http://127.0.0.1:9/v1", "model": "judge"})
    m, _ = run_stage(store, stage="sum", round=1, body=noisy_body, config=served, parents=[parent])
    v = verify_stage(store, m, tmp_path / "s1")
    assert v.verdict == "not re-runnable" and "its answers come from a server (endpoint http://127.0.0.1:9" in v.why

    m, _ = run_stage(store, stage="sum", round=1, body=noisy_body, config=Job(x=1), parents=[parent])
    other = m.model_copy(update={"code_version": "0123456789abcdef"})
    v = verify_stage(store, other, tmp_path / "s2")
    assert v.verdict == "not re-runnable" and "version 0123456789abcdef ran it" in v.why, v.why
    older = m.model_copy(update={"ran_by": {k: x for k, x in m.ran_by.items() if k != "body"}})
    assert "names no body" in verify_stage(store, older, tmp_path / "s3").why
    moved = m.model_copy(update={"config": {"x": 2, "endpoint": None}})  # its config no longer makes its key
    assert "its key here is" in verify_stage(store, moved, tmp_path / "s4").why
    assert read_manifest(store.dir_of(m)) == m and not (tmp_path / "s4" / m.dir).exists()


def test_the_chain_s_verdicts_are_written_beside_the_run(tmp_path):
    store = ArtifactStore(tmp_path / "w")
    parent, _ = run_stage(store, stage="parent", round=0, body=parent_body, config=Job(), parents=[])
    m, _ = run_stage(store, stage="sum", round=1, body=noisy_body, config=Job(), parents=[parent])
    said: list[str] = []
    path, verdicts = verify(store, [parent, m], tmp_path / "w" / "verify" / "r", say=said.append)
    assert [v.verdict for v in verdicts] == ["identical", "identical"]
    assert said[0] == f"verifying parent (round 0) {parent.dir} ..." and said[1].startswith("  identical")
    assert not any(p.name.endswith("-scratch") for p in path.parent.iterdir())  # nothing differed: no scratch left
