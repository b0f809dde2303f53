"""A stage added the way a new stage is: one module that declares it. Its registration line is the
test's (tests/tasks/test_toy_stage.py), in place of a line in tasks/registry.py.

`dedupe` runs in each round right after the filter (`after="filter"`), on its training set: it
keeps the first of rows that repeat a prompt and its completion. What it writes is the training
set the round's train stage reads, which finds it by the file it holds, whichever stage made it.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict

from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest

FILE = "train_set.jsonl"


class DedupeJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"{m.get('dropped', 0):.0f} repeated rows dropped, {m.get('rows', 0):.0f} kept"]


def dedupe_body(req: StageRequest[DedupeJob], store: ArtifactStore) -> StageManifest:
    src = req.holding(FILE)
    seen, kept = set(), []
    for line in store.path(src, FILE).read_text().splitlines():
        row = json.loads(line)
        key = json.dumps([row.get("prompt"), row.get("completion"), row.get("chosen"), row.get("rejected")])
        if key not in seen:
            seen.add(key)
            kept.append(line)
    d = store.stage_dir(req.stage, req.key)
    (d / FILE).write_text("".join(x + "\n" for x in kept))
    total = len(store.path(src, FILE).read_text().splitlines())
    return req.finish(store, outputs={FILE: len(kept)}, metrics={"rows": len(kept), "dropped": total - len(kept)},
                      info=dict(src.info))


def dedupe_step(at: At, k: int, train_set: StageManifest) -> Made:
    return DEDUPE.run(at.store, round=k, config=DedupeJob(seed=at.seed(k)), parents=[train_set], run=at.run)


DEDUPE = Stage("dedupe", "data", dedupe_body, dedupe_step, Records(datasets=((FILE, "deduped"),)), after="filter")
