"""train: the accepted set -> the next round's policy (a full model directory).

kind=rft: supervised fine-tuning on accepted samples with TRL's SFTTrainer.
kind=dpo: DPO on preference pairs with TRL's DPOTrainer; the reference is the
round's starting policy, i.e. the previous round's model.

LoRA through PEFT by default, merged into full weights. The stage checkpoints
inside (train.checkpoint_steps); a resumed stage continues from its last checkpoint.
"""

from __future__ import annotations

from typing import Annotated, assert_never

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.manifest import StageManifest
from ratchet.data.records import PairRow, SFTRow, read_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.models.trainer import DPOTrainConfig, RFTTrainConfig
from ratchet.tasks.stage import StageRequest, run_stage


TrainConfig = Annotated[RFTTrainConfig | DPOTrainConfig, Field(discriminator="kind")]


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
    match cfg:
        case DPOTrainConfig():
            rows = [{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected} for r in read_jsonl(data, PairRow)]
        case RFTTrainConfig():
            rows = [{"prompt": r.prompt, "completion": r.completion} for r in read_jsonl(data, SFTRow)]
        case _:
            assert_never(cfg)
    metrics = train(base, rows, cfg, d, req.seed)
    outputs = {p.relative_to(d).as_posix(): None for p in sorted(d.rglob("*"))
               if p.is_file() and p.parts[len(d.parts)] in ("model", "adapter")}
    outputs["train_log.jsonl"] = None
    return req.finish(store, outputs=outputs, metrics=metrics,
                      info={"adapter": cfg.adapter, "objective": cfg.kind,
                            # DPO's reference policy: the weights this round started from
                            **({"reference": req.parent_model.dir} if isinstance(cfg, DPOTrainConfig) else {})},
                      scratch=("checkpoints",))


def train(store: ArtifactStore, policy: StageManifest, train_set: StageManifest, cfg: RFTTrainConfig | DPOTrainConfig,
          seed: int, round: int, isolate: bool = True, run: str | None = None) -> tuple[StageManifest, bool]:
    return run_stage(store, stage="train", round=round, body=train_body,
                     config=TrainJob(train=cfg, seed=seed), parents=[policy, train_set], isolate=isolate,
                     keep_partial=True, run=run)
