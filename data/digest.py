"""Full-content sha256 digests of files, directories and JSON-able values.

`known_sha256` is `sha256_file` with a stat cache, as `git status` trusts its index: a file whose
size, mtime, inode and ctime are what they were when it was last hashed is not read again. The
ctime is the kernel's own (changing a file's contents sets it, and no call sets it back), so a
file written in place and given its old mtime again (`touch -d`, `os.utime`) is hashed again. The
cache is one JSON file in the user's cache (`RATCHET_CACHE`), a line per file, written atomically
by whichever process hashes last; losing it costs a re-hash. A process reads it as it first looks a
file up, and again where a file has no entry that holds and the cache's file changed since (a stage
worker's outputs, digested after the run's own process read it: its lineage's check at the run's end
read every weights file of the run again). A link (`link`) keeps the file's entries. `ratchet verify` and
`RATCHET_VERIFY=full` hash every file. A stage's outputs enter it as the store digests them at the
stage's end (their first check on reuse reads nothing); within `batched()` it is written once, at
the end, not once a file; and each write leaves out the files that are gone (a deleted run's,
a test's), so it holds what is on the disk, not everything ever hashed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def sha256_file(path: Path, sync: bool = False) -> str:
    """The file's sha256; `sync`: also make its bytes durable (fsync) before the digest vouches for them."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


_STATS = "digests.json"
_known: dict[str, list] | None = None
_read_at: list | None = None  # the cache file's stat key when this process last read or wrote it
_added: set[str] = set()  # the files this process hashed since it last wrote the cache


def _cache_path() -> Path:
    root = os.environ.get("RATCHET_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                           os.path.expanduser("~/.cache"), "ratchet")
    return Path(root) / _STATS


def _stat_key(st: os.stat_result) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _holds(entry, key: list) -> bool:
    """Whether a cache entry (stat key and digest, as a cache file holds it: anything, if the file was
    edited or is another program's) vouches for a file whose stat key is `key`."""
    return isinstance(entry, list) and len(entry) == 5 and entry[:4] == key and isinstance(entry[4], str)


def full_hashing() -> bool:
    """RATCHET_VERIFY=full: every digest from the file's bytes, the stat cache unread."""
    return os.environ.get("RATCHET_VERIFY", "") == "full"


@contextlib.contextmanager
def hashing_everything():
    """Within it, every digest is made from the file's bytes (what `ratchet verify` checks with)."""
    was = os.environ.get("RATCHET_VERIFY")
    os.environ["RATCHET_VERIFY"] = "full"
    try:
        yield
    finally:
        if was is None:
            os.environ.pop("RATCHET_VERIFY", None)
        else:
            os.environ["RATCHET_VERIFY"] = was


_batches = 0  # open batched() blocks: the cache is written when the last one ends
_dirty = False  # entries this process added since it last wrote the cache


@contextlib.contextmanager
def batched():
    """Within it, the stat cache is written once, at the end, however many files are hashed (a
    stage's check on reuse, its outputs digested at its end)."""
    global _batches
    _batches += 1
    try:
        yield
    finally:
        _batches -= 1
        if not _batches and _dirty:
            _save_known()


def known_sha256(path: Path, *, sync: bool = False, fresh: bool = False) -> str:
    """`sha256_file`, skipped where the file's size, mtime, inode and ctime are those it had when it was
    last hashed (module docstring). `fresh`: hash it whatever the cache says, and keep the answer
    (a file just written); `sync`: as sha256_file's."""
    global _known, _dirty
    real = os.path.realpath(path)
    st = os.stat(real)
    if _known is None:
        _load()
    if not fresh and not full_hashing():
        if not _holds(_known.get(real), _stat_key(st)):
            _read_again()  # another process may have hashed it since
        if _holds(was := _known.get(real), _stat_key(st)):
            return was[4]
    digest = sha256_file(Path(real), sync)
    if _stat_key(os.stat(real)) == _stat_key(st):  # unchanged while it was read
        _known[real] = [*_stat_key(st), digest]
        _added.add(real)
        _dirty = True
        if not _batches:
            _save_known()
    return digest


def link_or_copy(src: Path, dst: Path) -> None:
    """`link`, or a copy (with its metadata) where the file system cannot link: how a model is put
    into the store (the base stage) and into an MLflow model (a registration). Many in a row belong
    in one `batched()`."""
    import shutil

    try:
        link(src, dst)
    except OSError:  # another file system, or links not allowed there
        shutil.copy2(src, dst)


def link(src: Path, dst: Path) -> None:
    """`os.link(src, dst)`, the stat cache's entries for the file carried to the new name and kept for
    its others. A link changes the file's ctime (its link count), which the cache reads as a change
    under every name the file has: a model linked into the store (the base stage) or into an MLflow
    model (a registration) was read again at its next check under each of its names, the user's own,
    the base stage's and every earlier run's (the run's lineage at its end, the next run's checks).
    Carried only where an entry held for the file as it was just before the link and its size, mtime
    and inode are the same after it."""
    global _dirty
    real = os.path.realpath(src)
    before = _stat_key(os.stat(real))
    os.link(src, dst)
    if full_hashing():
        return
    if _known is None:
        _load()
    held = lambda: [k for k, v in list(_known.items()) if _holds(v, before)]  # noqa: E731
    names = held() or (_read_again() and held())
    after = _stat_key(os.stat(real))
    if not names or after[:3] != before[:3]:
        return
    digest = _known[names[0]][4]
    for name in {*names, real, os.path.realpath(dst)}:
        _known[name] = [*after, digest]
        _added.add(name)
    _dirty = True
    if not _batches:
        _save_known()


def _load() -> None:
    """This process's first read of the cache."""
    global _known, _read_at
    _known, _read_at = {}, None
    _read_again()


def _cache_stat() -> list | None:
    try:
        return _stat_key(os.stat(_cache_path()))
    except OSError:
        return None


def _merged(others) -> dict[str, list]:
    """This process's entries with a cache file's (`others`) over them, but for those this process added
    since it last wrote the file (copied first: a stage's threads may add to them meanwhile)."""
    known = _known or {}
    mine = {k: known[k] for k in list(_added) if k in known}
    return {**known, **(others if isinstance(others, dict) else {}), **mine}


def _read_again() -> bool:
    """The cache file's entries taken into this process's (but what it hashed since it last wrote
    the file), where the file changed since this process last read or wrote it; whether it had."""
    global _known, _read_at
    now = _cache_stat()
    if now is None or now == _read_at:
        return False
    try:
        others = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return False
    _known, _read_at = _merged(others), now
    return True


def _save_known() -> None:
    """The cache merged with what other processes wrote since, less the files that are gone."""
    global _known, _dirty, _read_at
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:  # another process's entries, kept
            others = json.loads(path.read_text())
        except (OSError, ValueError):
            others = {}
        merged = {k: v for k, v in _merged(others).items() if os.path.exists(k)}
        tmp = path.with_name(f"{_STATS}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged))
        tmp.replace(path)
        _known, _dirty, _read_at = merged, False, _cache_stat()
        _added.clear()
    except OSError:  # a read-only cache costs a re-hash next time, nothing else
        pass


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_json(value: Any) -> str:
    """Digest of a JSON-able value with sorted keys, so dict order never matters."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
