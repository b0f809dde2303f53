"""train: the accepted set -> the next round's policy (a full model directory).

The train kind (models/train_kinds/: rft, dpo) reads the filter's rows and trains on them;
this stage names none.

LoRA through PEFT by default, merged into full weights. The stage checkpoints
inside (train.checkpoint_steps); a resumed stage continues from its last checkpoint.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.models.train_kinds import RFTTrainConfig, TrainConfig  # noqa: F401 - the default kind, from here
from ratchet.tasks.stage import StageRequest, run_stage


class TrainJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    train: TrainConfig
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        return self.train.summary(m)


def train_body(req: StageRequest[TrainJob], store: ArtifactStore) -> StageManifest:
    from ratchet.models.trainer import train
    from ratchet.tasks.prepare import model_dir

    d = store.stage_dir(req.stage, req.key)
    data = store.path(req.parent("filter"), "train_set.jsonl")
    base = model_dir(store, req.parent_model)
    cfg = req.config.train
    rows = cfg.rows_of(data)
    metrics = train(base, rows, cfg, d, req.seed)
    outputs = {p.relative_to(d).as_posix(): None for p in sorted(d.rglob("*"))
               if p.is_file() and p.parts[len(d.parts)] in ("model", "adapter")}
    outputs["train_log.jsonl"] = None
    return req.finish(store, outputs=outputs, metrics=metrics,
                      info={"adapter": cfg.adapter, "objective": cfg.kind, **cfg.info(req.parent_model.dir)},
                      scratch=("checkpoints",))


def train(store: ArtifactStore, policy: StageManifest, train_set: StageManifest, cfg: TrainConfig,
          seed: int, round: int, isolate: bool = True, run: str | None = None) -> tuple[StageManifest, bool]:
    return run_stage(store, stage="train", round=round, body=train_body,
                     config=TrainJob(train=cfg, seed=seed), parents=[policy, train_set], isolate=isolate,
                     keep_partial=True, run=run)
