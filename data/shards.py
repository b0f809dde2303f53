"""A stage's units of work on disk: `shards/NNNNN.jsonl`, each written whole and atomically,
with what it cost (`NNNNN.cost.json`) written before it.

A shard file exists exactly when its unit is done, so a resumed stage computes only the
missing shards, and its metrics sum the cost of every shard, whichever attempt computed
it: a stage resumed from all of its shards reports what the uninterrupted stage would.
The folder is scratch: the stage folds the shards into its outputs and the store removes
them after the manifest is written (ArtifactStore.finish(scratch=...)).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ratchet.data.digest import sha256_json


def count(items: int, size: int) -> int:
    return (items + size - 1) // size


class Shards:
    def __init__(self, folder: Path, n: int):
        self.dir, self.n = Path(folder), n
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, i: int) -> Path:
        return self.dir / f"{i:05d}.jsonl"

    def has(self, i: int) -> bool:
        return self.path(i).exists()

    def missing(self) -> list[int]:
        return [i for i in range(self.n) if not self.has(i)]

    def write(self, i: int, rows: Iterable[BaseModel | dict], cost: dict[str, float],
              holder: dict[str, Any] | None = None) -> None:
        """The shard's cost (and which engine holder computed it), then the shard itself; all
        atomic, the shard last."""
        if holder is not None:
            _atomic(self.dir / f"{i:05d}.holder.json", json.dumps(holder, sort_keys=True))
        _atomic(self.dir / f"{i:05d}.cost.json", json.dumps(cost, sort_keys=True))
        _atomic(self.path(i), "".join((r.model_dump_json() if isinstance(r, BaseModel) else
                                       json.dumps(r, sort_keys=True)) + "\n" for r in rows))

    def lines(self) -> Iterator[str]:
        for i in range(self.n):
            yield from (x for x in self.path(i).read_text().splitlines() if x.strip())

    def holders(self) -> list[dict[str, Any]]:
        """Which holder computed each unit (empty dicts for units written without one)."""
        paths = [self.dir / f"{i:05d}.holder.json" for i in range(self.n)]
        return [json.loads(p.read_text()) if p.exists() else {} for p in paths]

    def cost(self) -> dict[str, float]:
        """Every cost key summed over the shards (a shard written without one counts as 0)."""
        total: dict[str, float] = {}
        for i in range(self.n):
            p = self.dir / f"{i:05d}.cost.json"
            for k, v in (json.loads(p.read_text()) if p.exists() else {}).items():
                total[k] = total.get(k, 0.0) + float(v)
        return total


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def unit_seed(seed: int, unit: int) -> int:
    """A unit's seed: a function of the stage seed and the unit's index, nothing else."""
    return int(sha256_json([seed, unit])[:8], 16)
