"""filter: labeled completions -> the round's training set, with the configured kind
(tasks/filter_kinds/): accepted samples for RFT, or preference pairs for DPO.

    rft         accepted samples for rejection-sampling fine-tuning
    length      rft's, of the outputs whose length fits what their level implies
    pairs       best-vs-worst preference pairs per prompt for DPO
    step_pairs  step-level preference pairs from the tree search's trees

A training set smaller than its minimum stops the round with the knobs to turn: training on
nothing would silently copy the parent model forward.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import events
from ratchet.data.manifest import StageManifest
from ratchet.data.records import write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.tasks.filter_kinds.length import LengthFilter
from ratchet.tasks.filter_kinds.pairs import PairFilter
from ratchet.tasks.filter_kinds.rft import RFTFilter
from ratchet.tasks.filter_kinds.step_pairs import StepPairFilter
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest

# The registration of every filter kind: its module's class, one member each.
FilterConfig = Annotated[RFTFilter | LengthFilter | PairFilter | StepPairFilter, Field(discriminator="kind")]


class FilterJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    filter: FilterConfig
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        covered = [f"{events.count(m.get('prompts_covered', 0))}/{events.count(m['prompts'])} prompts"] \
            if "prompts" in m else []
        return self.filter.summary(m) + covered


def filter_body(req: StageRequest[FilterJob], store: ArtifactStore) -> StageManifest:
    cfg = req.config.filter
    kept, metrics = cfg.build(req, store)
    n = write_jsonl(store.stage_dir(req.stage, req.key) / "train_set.jsonl", kept)
    return req.finish(store, outputs={"train_set.jsonl": n}, metrics=metrics, info={"rows": cfg.builds})


def filter_rows(store: ArtifactStore, labels: StageManifest, cfg: FilterConfig, seed: int, round: int,
                run: str | None = None) -> Made:
    return STAGE.run(store, round=round, config=FilterJob(filter=cfg, seed=seed), parents=[labels], run=run)


def filter_step(at: At, k: int, labels: StageManifest) -> Made:
    """Round k's training set from its labels (filter:)."""
    return filter_rows(at.store, labels, at.cfg.filter, at.seed(k), k, run=at.run)


STAGE = Stage("filter", "data", filter_body, filter_step, Records(datasets=(("train_set.jsonl", "training"),)))
