"""filter: labeled completions -> the accepted set for rejection-sampling fine-tuning.

Keeps completions whose reward reaches `min_reward`, drops exact duplicates
(after whitespace/case normalisation) within a prompt, drops over-long ones, and
keeps at most `max_per_prompt` per prompt (shortest first, or seeded random).
An accepted set smaller than `min_rows` stops the round: training on nothing
would silently copy the parent model forward.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from data.errors import EmptyStageError
from data.manifest import StageManifest
from data.records import LabeledCompletion, SFTRow, read_jsonl, write_jsonl
from data.store import ArtifactStore
from tasks.stage import StageRequest, code_version, run_stage

CODE = code_version("tasks.filter", "data.records")


class RFTFilter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["rft"] = "rft"
    min_reward: float = Field(default=1.0, description="accept completions with reward >= this")
    max_per_prompt: int = Field(default=2, ge=1, description="cap on accepted completions per prompt")
    max_tokens: int | None = Field(default=None, ge=1, description="drop accepted completions longer than this")
    prefer: Literal["shortest", "random"] = Field(default="shortest", description="which to keep under the cap")
    min_rows: int = Field(default=16, ge=1, description="fewer accepted rows than this stops the round")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def accept(rows: list[LabeledCompletion], cfg: RFTFilter, seed: int) -> tuple[list[SFTRow], dict[str, float]]:
    by_prompt: dict[str, list[LabeledCompletion]] = defaultdict(list)
    for r in rows:
        by_prompt[r.prompt_id].append(r)
    rng = random.Random(seed)
    kept: list[SFTRow] = []
    dropped = {"below_reward": 0, "duplicate": 0, "too_long": 0, "over_cap": 0}
    for pid in sorted(by_prompt):
        seen, cands = set(), []
        for r in sorted(by_prompt[pid], key=lambda r: r.index):
            if r.reward < cfg.min_reward:
                dropped["below_reward"] += 1
            elif cfg.max_tokens is not None and r.n_tokens > cfg.max_tokens:
                dropped["too_long"] += 1
            elif _norm(r.text) in seen or not r.text.strip():
                dropped["duplicate"] += 1
            else:
                seen.add(_norm(r.text))
                cands.append(r)
        if cfg.prefer == "shortest":
            cands.sort(key=lambda r: (r.n_tokens, r.index))
        else:
            rng.shuffle(cands)
        dropped["over_cap"] += max(0, len(cands) - cfg.max_per_prompt)
        kept += [SFTRow(prompt_id=r.prompt_id, prompt=r.prompt, completion=r.text, reward=r.reward)
                 for r in cands[: cfg.max_per_prompt]]
    metrics = {f"dropped_{k}": float(v) for k, v in dropped.items()}
    metrics.update(accepted=float(len(kept)), prompts_covered=float(len({r.prompt_id for r in kept})),
                   prompts=float(len(by_prompt)))
    return kept, metrics


def filter_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    cfg = RFTFilter.model_validate(req.config["filter"])
    rows = read_jsonl(store.path(req.parent("label"), "labels.jsonl"), LabeledCompletion)
    kept, metrics = accept(rows, cfg, req.seed)
    if len(kept) < cfg.min_rows:
        raise EmptyStageError(
            f"round {req.round}: filter accepted {len(kept)} rows < filter.min_rows={cfg.min_rows} "
            f"({int(metrics['dropped_below_reward'])} of {len(rows)} completions were wrong). "
            "Sample more per prompt (sample.n), raise sample.temperature, add prompts, "
            "or lower filter.min_rows / filter.min_reward."
        )
    d = store.stage_dir(req.stage, req.key)
    n = write_jsonl(d / "train_set.jsonl", kept)
    return store.finish(stage=req.stage, round=req.round, key=req.key, code_version=req.code_version,
                        config=req.config, parents=req.parents, outputs={"train_set.jsonl": n},
                        metrics=metrics, started=req.started)


def filter_rows(store: ArtifactStore, labels: StageManifest, cfg: RFTFilter, seed: int,
                round: int) -> tuple[StageManifest, bool]:
    config = {"filter": cfg.model_dump(), "seed": seed}
    return run_stage(store, stage="filter", round=round, body="tasks.filter:filter_body", code=CODE,
                     config=config, parents=[labels])
