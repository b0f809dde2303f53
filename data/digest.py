"""Full-content sha256 digests of files, directories and JSON-able values."""

from __future__ import annotations

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
