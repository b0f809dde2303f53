"""A model directory's tokenizer, loaded once for all of a run's stage workers.

    tok = load(model_dir)            # AutoTokenizer.from_pretrained(model_dir), or the run's copy

Most stage workers load their model's tokenizer (to lay out prompts, to read token ids, to
train), and transformers' load parses tokenizer.json in Python and copies what it built: 0.3 s
of CPU for the default model's 49,152 tokens in a process that has loaded one before, 0.9-1.7 s
in a worker just forked beside the run's others (py-spy on a tiny run: most of a label
worker's 1.4 s). A run's stages read one tokenizer's files, the base model's, which every
trained model keeps byte for byte. So the run's fork server loads them once (`preload`, one of
its preloads: flows/inputs.py `run_preload`), and each process forked from it takes that copy
the first time it asks for a directory whose files are the same (`load`). A tokenizer is never
shared: a process takes the inherited copy once (its later loads are its own), and the fork
server never uses it, so one stage's changes to its tokenizer (a pad token, a padding side)
reach no other. A directory whose files differ is transformers' load as before.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

# a model directory's weight files: the files that are not its tokenizer's (nor, to models/warm.py, its shape)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")

_LOADED: dict[str, Any] = {}  # files' digest -> a tokenizer loaded before this process was forked


def files_digest(model_dir: Path | str, h=None) -> str:
    """The digest of a model directory's files but its weights (its tokenizer's, its config,
    its chat template), each after its name, added to `h` (a hashlib hash; a new sha256 where
    none): two directories with the same one load the same tokenizer."""
    h = h or hashlib.sha256()
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES):
            h.update(b"\0" + p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def preload(*model_dirs: str) -> None:
    """Load each directory's tokenizer here, for the processes forked from this one after (a fork
    server's preload). One that does not load is left to the process that asks for it, which
    raises transformers' error as it would have."""
    from transformers import AutoTokenizer

    for d in model_dirs:
        with contextlib.suppress(Exception):
            key = files_digest(d)
            if key not in _LOADED:
                _LOADED[key] = AutoTokenizer.from_pretrained(d)


def load(model_dir: Path | str):
    """`AutoTokenizer.from_pretrained(model_dir)`, or the copy this process inherited for a
    directory with the same files, the first time it is asked for."""
    if _LOADED:
        with contextlib.suppress(OSError):
            if (tok := _LOADED.pop(files_digest(model_dir), None)) is not None:
                return tok
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
