"""Lineage over hand-built manifests: order, verification, tampering, missing parents."""

import shutil

from pydantic import BaseModel

from ratchet.data.store import ArtifactStore
from ratchet.flows.lineage import reads, render_mermaid, render_text, walk
from ratchet.tasks.runner.stage import StageRequest


def _stage(store, stage, rnd, parents, text):
    key = f"{stage}{rnd}".ljust(64, "0")
    d = store.prepare(stage, key)
    (d / "out.txt").write_text(text)
    return store.finish(stage=stage, round=rnd, key=key, code_version="c", config={"s": stage}, parents=parents,
                        outputs={"out.txt": None})


def _chain(tmp_path):
    store = ArtifactStore(tmp_path)
    prompts = _stage(store, "prompts", 0, [], "p")
    base = _stage(store, "base", 0, [], "w0")
    s1 = _stage(store, "sample", 1, [base, prompts], "s1")
    f1 = _stage(store, "filter", 1, [s1], "f1")
    t1 = _stage(store, "train", 1, [base, f1], "w1")
    s2 = _stage(store, "sample", 2, [t1, prompts], "s2")
    f2 = _stage(store, "filter", 2, [s2], "f2")
    t2 = _stage(store, "train", 2, [t1, f2], "w2")
    return store, t2


def test_walk_reads_round_by_round_back_to_the_base(tmp_path):
    store, t2 = _chain(tmp_path)
    links = walk(store, t2)
    assert [(x.stage, x.round) for x in links] == [
        ("train", 2), ("filter", 2), ("sample", 2), ("prompts", 0),
        ("train", 1), ("filter", 1), ("sample", 1), ("base", 0)]
    assert all(x.verified for x in links)
    assert "8 links, all verified" in render_text(links)
    assert render_mermaid(links).count("-->") == sum(len(x.parents) for x in links)


def test_tampered_and_missing_links_are_reported(tmp_path):
    store, t2 = _chain(tmp_path)
    (tmp_path / "stages" / f"filter-{'filter1'.ljust(16, '0')}" / "out.txt").write_text("edited")
    shutil.rmtree(tmp_path / "stages" / f"base-{'base0'.ljust(16, '0')}")
    links = {(x.stage, x.round): x for x in walk(store, t2)}
    assert not links[("filter", 1)].verified and "sha256 differs" in links[("filter", 1)].problem
    assert not links[("base", -1)].verified and "manifest missing" in links[("base", -1)].problem
    assert links[("train", 2)].verified
    assert "2 with problems" in render_text(list(links.values()))


def test_each_link_names_the_user_files_its_config_was_keyed_by(tmp_path):
    """A data file, a scoring function's and an environment's file: each with the digest that keyed
    the stage, wherever its config holds it (a held-out set's own check included)."""
    d1, d2, d3, d4 = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)
    prompts = {"data": {"kind": "file", "path": "/u/rows.jsonl", "eval_path": "/u/held.jsonl",
                        "check": {"kind": "python", "function": "/u/score.py:score", "source": d3}},
               "seed": 0, "sources": {"path": d1, "eval_path": d2}}
    assert reads(prompts) == {"/u/rows.jsonl": d1, "/u/held.jsonl": d2, "/u/score.py:score": d3}
    sample = {"sample": {"rollout": {"kind": "environment", "env": "pkg.envs:Maze", "args": {"n": 3}, "source": d4}},
              "sets": [{"name": "x", "check": {"kind": "python", "function": "trl.rewards:accuracy_reward",
                                               "source": d3}}]}
    assert reads(sample) == {"pkg.envs:Maze": d4, "trl.rewards:accuracy_reward": d3}
    assert reads({"label": {"kind": "judge", "source": "not a digest", "model": "x:y"}}) == {}

    store = ArtifactStore(tmp_path)
    key = "prompts0".ljust(64, "0")
    (store.prepare("prompts", key) / "out.txt").write_text("p")
    m = store.finish(stage="prompts", round=0, key=key, code_version="c", config=prompts, parents=[],
                     outputs={"out.txt": None})
    text = render_text(walk(store, m))
    assert f"    reads /u/rows.jsonl  sha256 {d1[:16]}" in text and f"reads /u/score.py:score  sha256 {d3[:16]}" in text


class Job(BaseModel):
    x: int = 0


def code_body(req: StageRequest[Job], store):
    (store.stage_dir(req.stage, req.key) / "out.txt").write_text(str(req.config.x))
    return req.finish(store, outputs={"out.txt": None})


def test_a_link_names_the_commit_that_ran_it_and_its_code_version_opens(tmp_path, monkeypatch):
    """Each stage's manifest records the git commit (and whether the package's files differed from it)
    and the package version that ran it; its code version is kept in the store, once per digest,
    as every definition it covers, which `ratchet lineage --code DIGEST` prints."""

    from ratchet.flows.cli import main
    from ratchet.flows.lineage import render_code
    from ratchet.tasks.runner import code_reach
    from ratchet.tasks.runner.stage import run_stage

    monkeypatch.setattr(code_reach, "source", lambda: {"commit": "1a2b3c4d5e6f7a8b9c0d", "dirty": True,
                                                       "version": "0.1.0"})
    store = ArtifactStore(tmp_path / "runs")
    m, _ = run_stage(store, stage="s", round=1, body=code_body, config=Job(x=1), parents=[])
    assert m.ran_by == {"commit": "1a2b3c4d5e6f7a8b9c0d", "dirty": True, "version": "0.1.0",
                        "body": "tests.flows.test_lineage:code_body"}  # what `ratchet verify` runs again
    [link] = walk(store, m)
    assert f"code {m.code_version} (commit 1a2b3c4d5e6f dirty, ratchet 0.1.0)  verified" in render_text([link])
    opened = store.code(m.code_version)
    assert opened["digest"] == m.code_version
    names = {(mod, name) for mod, name, _ in opened["definitions"]}
    assert ("tests.flows.test_lineage", "code_body") in names and ("tests.flows.test_lineage", "Job") in names
    assert "pydantic" in opened["libraries"]  # Job is a pydantic model: its version is in the key
    text = render_code(opened)
    assert text.startswith(f"code {m.code_version}: ") and "    code_body" in text
    monkeypatch.chdir(tmp_path)
    assert main(["lineage", "--workdir", "runs", "--code", m.code_version]) == 0  # no run recorded: the store's
    assert main(["lineage", "flows/configs/default.yaml", "workdir=runs", "--code", m.code_version]) == 2  # no such file here
    import pytest

    from ratchet.data.errors import ArtifactError

    with pytest.raises(ArtifactError, match="is not kept"):
        store.code("0" * 16)
    with pytest.raises(ArtifactError, match="is not a code version"):
        store.code("../../etc")
