"""Full-content sha256 digests of files, directories and JSON-able values."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_dir(path: Path, exclude: tuple[str, ...] = ()) -> str:
    """Digest of a directory tree: relative paths and file digests, sorted."""
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        rel = p.relative_to(path).as_posix()
        if rel in exclude:
            continue
        h.update(rel.encode())
        h.update(b"\0")
        h.update(sha256_file(p).encode())
        h.update(b"\n")
    return h.hexdigest()


def sha256_json(value: Any) -> str:
    """Digest of a JSON-able value with sorted keys, so dict order never matters."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
