"""Prompt sources: the built-in verifiable task, or the user's own prompts.

Built-in `addition`: "What is a + b?" over every pair a < a_max, b < b_max,
shuffled by seed and split by pair into disjoint train and held-out sets, so a
held-out question is never trained on.

Users bring JSONL, Parquet, or a `datasets` dataset (a `save_to_disk` directory
or a name `load_dataset` can resolve) with a prompt field and an optional
reference answer field.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.checkers import CheckConfig, NumberCheck
from ratchet.data.errors import ConfigError
from ratchet.data.records import Prompt


class AdditionSource(BaseModel):
    """Built-in: single-step integer addition with a checkable answer."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["addition"] = "addition"
    a_max: int = Field(default=20, ge=1, description="first operand ranges over 0..a_max-1")
    b_max: int = Field(default=10, ge=1, description="second operand ranges over 0..b_max-1")
    template: str = Field(default="What is {a} + {b}?", description="prompt text with {a} and {b}")
    eval_size: int = Field(default=50, ge=1, description="pairs held out for evaluation")
    train_size: int | None = Field(default=None, ge=1, description="cap on train prompts (None = all the rest)")
    check: CheckConfig = Field(default_factory=NumberCheck, description="answer check")


class FileSource(BaseModel):
    """User prompts from JSONL, Parquet or a `datasets` dataset."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["file"] = "file"
    path: str = Field(description="a .jsonl/.parquet file, a save_to_disk directory, or a datasets name")
    split: str = Field(default="train", description="split name for datasets")
    prompt_field: str = Field(default="prompt", description="column holding the prompt text")
    answer_field: str | None = Field(default="answer", description="column with the reference answer, or null")
    eval_path: str | None = Field(default=None, description="separate held-out file; else eval_size rows are split off")
    eval_size: int = Field(default=50, ge=1, description="rows held out when eval_path is not given")
    train_size: int | None = Field(default=None, ge=1, description="cap on train prompts")
    check: CheckConfig = Field(default_factory=NumberCheck, description="answer check for rows with answers")


SourceConfig = Annotated[AdditionSource | FileSource, Field(discriminator="kind")]


def load_split(cfg: AdditionSource | FileSource, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval), deterministic in seed, disjoint."""
    match cfg.kind:
        case "addition":
            return _addition(cfg, seed)
        case "file":
            return _file(cfg, seed)


def _addition(cfg: AdditionSource, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    pairs = [(a, b) for a in range(cfg.a_max) for b in range(cfg.b_max)]
    if cfg.eval_size >= len(pairs):
        raise ConfigError(
            [f"data.eval_size={cfg.eval_size} leaves no train prompts out of {len(pairs)} pairs; "
             "lower data.eval_size or raise data.a_max / data.b_max"]
        )
    random.Random(seed).shuffle(pairs)
    rows = [
        Prompt(id=f"add-{a}-{b}", prompt=cfg.template.format(a=a, b=b), answer=str(a + b), task="addition")
        for a, b in pairs
    ]
    ev, tr = rows[: cfg.eval_size], rows[cfg.eval_size :]
    return tr[: cfg.train_size] if cfg.train_size else tr, ev


def _read_rows(path: str, split: str) -> list[dict]:
    p = Path(path)
    if p.suffix == ".jsonl" or p.suffix == ".json":
        if not p.is_file():
            raise ConfigError([f"data.path={path!r} does not exist; give an existing .jsonl file"])
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        if not p.is_file():
            raise ConfigError([f"data.path={path!r} does not exist; give an existing .parquet file"])
        return pq.read_table(p).to_pylist()
    import datasets

    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    else:
        ds = datasets.load_dataset(path, split=split)
    return ds.to_list()


def _to_prompts(rows: list[dict], cfg: FileSource, source: str) -> list[Prompt]:
    if rows and cfg.prompt_field not in rows[0]:
        raise ConfigError(
            [f"data.prompt_field={cfg.prompt_field!r} is not a column of {source} (columns: {sorted(rows[0])}); "
             "set data.prompt_field to the column holding the prompt"]
        )
    af = cfg.answer_field if rows and cfg.answer_field in rows[0] else None
    out = []
    for i, r in enumerate(rows):
        ans = r.get(af) if af else None
        out.append(Prompt(id=str(r.get("id", f"row-{i}")), prompt=str(r[cfg.prompt_field]),
                          answer=None if ans is None else str(ans), task="file"))
    return out


def _file(cfg: FileSource, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    rows = _to_prompts(_read_rows(cfg.path, cfg.split), cfg, cfg.path)
    if cfg.eval_path:
        ev = _to_prompts(_read_rows(cfg.eval_path, cfg.split), cfg, cfg.eval_path)
        tr = rows
    else:
        if cfg.eval_size >= len(rows):
            raise ConfigError([f"data.eval_size={cfg.eval_size} >= {len(rows)} rows in {cfg.path}; "
                               "lower data.eval_size or give data.eval_path"])
        random.Random(seed).shuffle(rows)
        ev, tr = rows[: cfg.eval_size], rows[cfg.eval_size :]
    return tr[: cfg.train_size] if cfg.train_size else tr, ev
