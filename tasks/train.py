"""train: the accepted set -> the next round's policy (a full model directory).

kind=rft: supervised fine-tuning on accepted samples with TRL's SFTTrainer, LoRA
through PEFT by default, merged into full weights. The stage checkpoints inside
(train.checkpoint_steps); a resumed stage continues from its last checkpoint.
"""

from __future__ import annotations

import shutil
from typing import Annotated

from pydantic import Field

from data.manifest import StageManifest
from data.records import SFTRow, read_jsonl
from data.store import ArtifactStore
from models.trainer import RFTTrainConfig
from tasks.stage import StageRequest, code_version, run_stage

CODE = code_version("tasks.train", "models.trainer", "data.records")

TrainConfig = Annotated[RFTTrainConfig, Field(discriminator="kind")]


def train_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    from models.trainer import train_rft
    from tasks.prepare import model_dir

    cfg = RFTTrainConfig.model_validate(req.config["train"])
    rows = read_jsonl(store.path(req.parent("filter"), "train_set.jsonl"), SFTRow)
    d = store.stage_dir(req.stage, req.key)
    metrics = train_rft(model_dir(store, req.parent_model),
                        [{"prompt": r.prompt, "completion": r.completion} for r in rows], cfg, d, req.seed)
    shutil.rmtree(d / "checkpoints", ignore_errors=True)
    outputs = {p.relative_to(d).as_posix(): None for p in sorted(d.rglob("*"))
               if p.is_file() and p.parts[len(d.parts)] in ("model", "adapter")}
    outputs["train_log.jsonl"] = None
    return store.finish(stage=req.stage, round=req.round, key=req.key, code_version=req.code_version,
                        config=req.config, parents=req.parents, outputs=outputs, metrics=metrics,
                        info={"adapter": cfg.adapter}, started=req.started)


def train(store: ArtifactStore, policy: StageManifest, train_set: StageManifest, cfg: RFTTrainConfig,
          seed: int, round: int, isolate: bool = True) -> tuple[StageManifest, bool]:
    config = {"train": cfg.model_dump(), "seed": seed}
    return run_stage(store, stage="train", round=round, body="tasks.train:train_body", code=CODE,
                     config=config, parents=[policy, train_set], isolate=isolate, keep_partial=True)
