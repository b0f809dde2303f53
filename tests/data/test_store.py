import pytest

from ratchet.data.errors import ArtifactError, TamperedArtifactError
from ratchet.data.manifest import MANIFEST
from ratchet.data.records import SFTRow, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore, stage_key


def _finish(store, key, text="a"):
    d = store.prepare("filter", key)
    (d / "out.txt").write_text(text)
    return store.finish(stage="filter", round=1, key=key, code_version="c", config={"x": 1}, parents=[],
                        outputs={"out.txt": None}, metrics={"n": 1.0})


def test_finish_then_find_roundtrip(tmp_path):
    store = ArtifactStore(tmp_path)
    m = _finish(store, "k" * 64)
    assert (store.dir_of(m) / MANIFEST).exists()
    assert store.find("filter", "k" * 64) == m
    assert m.outputs["out.txt"].sha256 == "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"  # sha256("a")


def test_a_non_finite_metric_is_written_as_strict_json_and_read_back(tmp_path):
    """A diverged run's NaN loss used to be written as null, which the manifest then refused
    to read back: the stage failed after its work was done."""
    import json
    import math

    store = ArtifactStore(tmp_path)
    d = store.prepare("train", "k" * 64)
    (d / "out.txt").write_text("a")
    m = store.finish(stage="train", round=1, key="k" * 64, code_version="c", config={}, parents=[],
                     outputs={"out.txt": None}, metrics={"loss": math.nan, "grad": math.inf, "n": 2.0})

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    text = (store.dir_of(m) / MANIFEST).read_text()
    assert json.loads(text, parse_constant=refuse)["metrics"] == {"loss": "NaN", "grad": "Infinity", "n": 2.0}
    back = store.find("train", "k" * 64).metrics
    assert math.isnan(back["loss"]) and back["grad"] == math.inf and back["n"] == 2.0


def test_tampered_output_is_reported_not_reused(tmp_path):
    store = ArtifactStore(tmp_path)
    m = _finish(store, "k" * 64)
    (store.dir_of(m) / "out.txt").write_text("b")
    with pytest.raises(TamperedArtifactError, match="out.txt: sha256 differs"):
        store.find("filter", "k" * 64)
    (store.dir_of(m) / "out.txt").unlink()
    with pytest.raises(TamperedArtifactError, match="out.txt: missing"):
        store.find("filter", "k" * 64)


def test_an_unchanged_output_is_not_read_again_and_one_edited_under_its_old_mtime_is(tmp_path, monkeypatch):
    """The stat cache (data/digest.py known_sha256): a reused stage's outputs are checked without
    reading them while their size, mtime, inode and ctime hold; a file written in place with the
    same size and its mtime set back is read again (its ctime moved) and refused."""
    import os

    from ratchet.data import digest

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digest, "_known", None)
    store = ArtifactStore(tmp_path / "store")
    m = _finish(store, "k" * 64, "abcd")
    read = []
    real = digest.sha256_file
    monkeypatch.setattr(digest, "sha256_file", lambda p, sync=False: read.append(p) or real(p, sync))
    store.verify(m)
    store.verify(m)
    assert read == []  # digested into the cache as the stage finished: its checks on reuse read nothing
    out = store.dir_of(m) / "out.txt"
    before = out.stat()
    out.write_text("abce")  # the same size, other bytes
    os.utime(out, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert out.stat().st_mtime_ns == before.st_mtime_ns and out.stat().st_size == before.st_size
    with pytest.raises(TamperedArtifactError, match="out.txt: sha256 differs"):
        store.verify(m)
    out.write_text("abcd")
    store.verify(m)
    monkeypatch.setenv("RATCHET_VERIFY", "full")  # the careful: every file read
    n = len(read)
    store.verify(m)
    assert len(read) == n + 1


def test_the_stat_cache_is_written_once_a_batch_and_forgets_files_that_are_gone(tmp_path, monkeypatch):
    """A stage's check hashes its outputs in one batch: one write of the cache, not one a file; and
    a write leaves out the entries of files no longer on the disk, so the cache does not grow with
    every file ever hashed."""
    import json

    from ratchet.data import digest

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digest, "_known", None)
    files = []
    for i in range(3):
        files.append(tmp_path / f"f{i}")
        files[-1].write_text(str(i))
    writes = []
    real = digest._save_known
    monkeypatch.setattr(digest, "_save_known", lambda: writes.append(1) or real())
    with digest.batched():
        with digest.batched():  # nested: still one write, when the outer one ends
            for f in files:
                digest.known_sha256(f)
        assert writes == []
    assert len(writes) == 1
    kept = json.loads((tmp_path / "cache" / "digests.json").read_text())
    assert sorted(kept) == sorted(str(f.resolve()) for f in files)
    files[0].unlink()
    gone = tmp_path / "later"
    gone.write_text("x")
    digest.known_sha256(gone)  # outside a batch: written at once
    assert len(writes) == 2
    kept = json.loads((tmp_path / "cache" / "digests.json").read_text())
    assert sorted(kept) == sorted(str(f.resolve()) for f in [*files[1:], gone])


def test_unfinished_dir_is_not_found_and_is_wiped_unless_partial_kept(tmp_path):
    store = ArtifactStore(tmp_path)
    d = store.prepare("sample", "s" * 64)
    (d / "shard").write_text("partial")
    assert store.find("sample", "s" * 64) is None
    assert (store.prepare("sample", "s" * 64, keep_partial=True) / "shard").exists()
    assert not (store.prepare("sample", "s" * 64) / "shard").exists()


def test_prepare_refuses_a_finished_stage_and_finish_needs_its_outputs(tmp_path):
    store = ArtifactStore(tmp_path)
    _finish(store, "k" * 64)
    with pytest.raises(ArtifactError, match="already complete"):
        store.prepare("filter", "k" * 64)
    store.prepare("filter", "j" * 64)
    with pytest.raises(ArtifactError, match="declared output 'gone.txt'"):
        store.finish(stage="filter", round=1, key="j" * 64, code_version="c", config={}, parents=[],
                     outputs={"gone.txt": None})


def test_stage_key_depends_on_code_config_and_parent_content(tmp_path):
    store = ArtifactStore(tmp_path)
    p1, p2 = _finish(store, "1" * 64, "a"), _finish(store, "2" * 64, "b")
    p3 = _finish(store, "3" * 64, "a")  # same content as p1 under another key
    k = stage_key("train", "c", {"lr": 1}, [p1])
    assert k == stage_key("train", "c", {"lr": 1}, [p3])  # keyed on content, not on where it lives
    assert k != stage_key("train", "c", {"lr": 1}, [p2])
    assert k != stage_key("train", "c2", {"lr": 1}, [p1])
    assert k != stage_key("train", "c", {"lr": 2}, [p1])


def test_jsonl_roundtrip_and_bad_row(tmp_path):
    rows = [SFTRow(prompt_id="a", prompt="p", completion="c", reward=1.0)]
    assert write_jsonl(tmp_path / "x.jsonl", rows) == 1
    assert read_jsonl(tmp_path / "x.jsonl", SFTRow) == rows
    (tmp_path / "bad.jsonl").write_text('{"prompt_id": "a"}\n')
    with pytest.raises(ArtifactError, match="bad.jsonl:1: not a valid SFTRow"):
        read_jsonl(tmp_path / "bad.jsonl", SFTRow)


def test_every_output_is_durable_before_the_manifest_names_it(tmp_path, monkeypatch):
    """fsync of each output file and of each directory that holds one, then the manifest (file and
    rename): a power cut never leaves a manifest vouching for bytes that were still in the cache."""
    import os

    store = ArtifactStore(tmp_path)
    d = store.prepare("train", "t" * 64)
    (d / "model").mkdir()
    for name in ("model/weights.bin", "model/config.json", "train_log.jsonl"):
        (d / name).write_text(name)
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.finish(stage="train", round=1, key="t" * 64, code_version="c", config={}, parents=[],
                 outputs={"model/weights.bin": None, "model/config.json": None, "train_log.jsonl": None})
    manifest_file = synced.index(str(d / (MANIFEST + ".tmp")))
    before = set(synced[:manifest_file])
    assert {str(d / n) for n in ("model/weights.bin", "model/config.json", "train_log.jsonl")} <= before
    assert {str(d / "model"), str(d)} <= before
    assert synced[-1] == str(d)  # the manifest's rename, last


def test_a_stage_dir_a_tag_names_is_only_ever_a_stage_dir_of_this_store(tmp_path):
    """Registry and run tags live outside the store: whatever one says, no read or export follows
    it out of the store."""
    store = ArtifactStore(tmp_path)
    assert store.recorded_dir("stages/train-0123456789abcdef", "tag") == tmp_path / "stages" / "train-0123456789abcdef"
    assert store.recorded_dir("stages/evaluate.regress-0123456789abcdef", "tag").name.startswith("evaluate.regress")
    for bad in ("../../etc", "/etc/passwd", "stages/../../x-0123456789abcdef", "stages/train-0123456789abcdef/..",
                "stages/train-0123456789abcdef/../../..", "stages/train-xyz", "", "stages/train-0123456789abcdef\n"):
        with pytest.raises(ArtifactError, match="not a stage directory of a Ratchet store"):
            store.recorded_dir(bad, "version 3's ratchet.stage_dir tag")


@pytest.mark.parametrize("edit", [
    {"outputs": {"../../secret": {"sha256": "0" * 64, "bytes": 1}}},
    {"outputs": {"model/../../../etc/passwd": {"sha256": "0" * 64, "bytes": 1}}},
    {"outputs": {"/etc/passwd": {"sha256": "0" * 64, "bytes": 1}}},
    {"outputs": {"model//x": {"sha256": "0" * 64, "bytes": 1}}},
    {"dir": "../elsewhere"},
    {"dir": "stages/filter-kkkkkkkkkkkkkkkk/../../.."},
    {"parents": [{"stage": "sample", "key": "s", "dir": "/tmp", "content": "c"}]},
])
def test_a_manifest_that_names_a_path_outside_its_stage_is_refused_with_the_file_named(tmp_path, edit):
    """Export, verify and lineage read the files a manifest names: an edited manifest can name
    none outside its stage directory, and reading it is a report, not a traceback."""
    import json

    store = ArtifactStore(tmp_path)
    m = _finish(store, "k" * 64)
    path = store.dir_of(m) / MANIFEST
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(ArtifactError, match=rf"{path} is not a Ratchet stage manifest \(.*(outputs|dir).*\).*Delete"):
        store.find("filter", "k" * 64)


def test_a_link_in_a_stage_directory_is_never_followed_out_of_it(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    m = _finish(store, "k" * 64)
    outside = tmp_path / "secret.txt"
    outside.write_text("a")  # the digest the manifest holds: only the link is wrong
    (store.dir_of(m) / "out.txt").unlink()
    (store.dir_of(m) / "out.txt").symlink_to(outside)
    with pytest.raises(ArtifactError, match="leads outside its stage directory"):
        store.path(store.find("filter", "k" * 64), "out.txt")


def test_a_claim_gives_the_finished_stage_or_a_directory_to_compute_it_in(tmp_path):
    """One call for what run_stage used to ask in seven: found and verified, or prepared (an
    unfinished one wiped unless it resumes, the run recorded as its owner) under the key's lock."""
    store = ArtifactStore(tmp_path)
    key = "c" * 64
    with store.claim("s", key, run="run-a") as c:
        assert c.found is None and c.dir == store.stage_dir("s", key) and store.owners(c.dir) == ["run-a"]
        (c.dir / "shards").mkdir()
        (c.dir / "shards" / "00000.jsonl").write_text("{}\n")
    with store.claim("s", key, keep_partial=True, run="run-b") as c:  # resumed: its units are kept
        assert (c.dir / "shards" / "00000.jsonl").exists() and store.owners(c.dir) == ["run-a", "run-b"]
        (c.dir / "out.txt").write_text("done")
        store.finish(stage="s", round=1, key=key, code_version="c", config={}, parents=[], outputs={"out.txt": None})
        assert (c.dir / "shards").is_dir()  # not named as scratch to finish: as a kill before its clean-up leaves it
    with store.claim("s", key) as c:
        assert c.found is not None and c.dir is None and not c.by_another
        assert not (store.dir_of(c.found) / "shards").exists()  # dropped once found
    (store.stage_dir("s", key) / "out.txt").write_text("changed")
    with pytest.raises(TamperedArtifactError):
        with store.claim("s", key):
            pass


def test_a_file_another_process_hashed_after_this_one_read_the_cache_is_not_read_again(tmp_path, monkeypatch):
    """A run's own process reads the stat cache as it starts; its stage workers digest their outputs
    later, into the same file. Its checks of those outputs (a reused stage's, the lineage's at the
    run's end) take the workers' digests, not the files' bytes; a file changed since is still read."""
    import os
    import subprocess
    import sys

    from ratchet.data import digest

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digest, "_known", None)
    first, later = tmp_path / "first", tmp_path / "later"
    first.write_text("a")
    later.write_text("b" * 1000)
    digest.known_sha256(first)  # this process has read (and written) the cache
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from ratchet.data import digest; "
                    "digest.known_sha256(Path(sys.argv[1]))", str(later)], check=True, cwd=tmp_path,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    read = []
    real = digest.sha256_file
    monkeypatch.setattr(digest, "sha256_file", lambda p, sync=False: read.append(p.name) or real(p, sync))
    assert digest.known_sha256(later) == real(later) and read == []
    assert digest.known_sha256(first) == real(first) and read == []  # its own entry kept through the re-read
    later.write_text("c" * 1000)
    assert digest.known_sha256(later) == real(later) and read == ["later"]


def test_a_link_keeps_a_file_s_cache_entries_and_a_changed_file_is_still_read(tmp_path, monkeypatch):
    """A link changes the file's ctime under every name it has; `digest.link` (a model linked into the
    store, or into an MLflow model) carries the file's entry to the new name and keeps it for the
    others (the user's model, an earlier stage's copy), so none is read again; a file changed in
    place under its old mtime before a link has no entry to carry and is read."""
    import os

    from ratchet.data import digest

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digest, "_known", None)
    src = tmp_path / "weights"
    src.write_bytes(b"w" * 4096)
    want = digest.known_sha256(src)
    digest.link(src, tmp_path / "stage")
    read = []
    real = digest.sha256_file
    monkeypatch.setattr(digest, "sha256_file", lambda p, sync=False: read.append(p.name) or real(p, sync))
    digest.link(tmp_path / "stage", tmp_path / "mlflow")  # from its second name: the first's entry kept too
    assert {digest.known_sha256(tmp_path / n) for n in ("weights", "stage", "mlflow")} == {want} and read == []
    before = src.stat()
    src.write_bytes(b"v" * 4096)  # the same size, other bytes, the mtime set back
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    digest.link(src, tmp_path / "again")
    assert digest.known_sha256(tmp_path / "again") == real(src) != want and read == ["again"]


@pytest.mark.parametrize("kept", ["[1, 2, 3]", "{not json", "null", None])
def test_a_broken_stat_cache_costs_a_read_and_is_written_sound_again(tmp_path, monkeypatch, kept):
    """The cache is a file in the user's cache that anything may have written: not JSON, not a mapping,
    entries of the wrong shape or type (one that matches the file's stat key but has no digest, or a
    digest that is not text). Each is a miss: the file is read, its digest is right, and the cache is
    written sound again; a link from such an entry carries nothing."""
    import json
    import os

    from ratchet.data import digest

    monkeypatch.setenv("RATCHET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digest, "_known", None)
    f = tmp_path / "weights"
    f.write_bytes(b"w" * 100)
    st = f.stat()
    key = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    if kept is None:  # a mapping whose entries are of the wrong shape
        kept = json.dumps({os.path.realpath(f): key, os.path.realpath(tmp_path / "x"): [*key, 7]})
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "digests.json").write_text(kept)
    want = digest.sha256_file(f)
    digest.link(f, tmp_path / "linked")  # nothing sound to carry: no error, no entry
    assert digest.known_sha256(tmp_path / "linked") == want
    assert digest.known_sha256(f) == want
    cache = json.loads((tmp_path / "cache" / "digests.json").read_text())
    names = {os.path.realpath(f), os.path.realpath(tmp_path / "linked")}
    assert set(cache) == names and {cache[n][4] for n in names} == {want}
