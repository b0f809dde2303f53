"""Lineage over hand-built manifests: order, verification, tampering, missing parents."""

import shutil

from ratchet.data.store import ArtifactStore
from ratchet.flows.lineage import reads, render_mermaid, render_text, walk


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
