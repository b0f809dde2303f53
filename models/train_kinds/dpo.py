"""train.kind=dpo: DPO with TRL's DPOTrainer on (prompt, chosen, rejected) pairs, against the
round's starting policy (RatchetDPOTrainer, models/train_kinds/trainers.py: trajectories with
their loss masks, and off Triton devices a plain LM head that scores only the completions)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ratchet.models.trainer import (OptimSettings, chat_dataset, load_policy, resolve_precision, run_training,
                                    save_merged, token_rows, trainer_args, turn_ids, write_log)


DPOLoss = Literal["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]


class DPOTrainConfig(OptimSettings):
    """DPO with TRL's DPOTrainer. The reference is the round's starting policy: with LoRA it is
    the same weights with the adapter off (no second model in memory); full fine-tuning keeps a
    frozen copy."""

    consumes: ClassVar[str] = "pairs"  # preference pairs
    kind: Literal["dpo"] = "dpo"
    learning_rate: float = Field(default=5e-5, gt=0, description="peak learning rate (LoRA DPO; ~5e-7 full)")
    beta: float = Field(default=0.1, gt=0, description="strength of the pull toward the reference policy "
                        "(for ipo: its regularisation tau)")
    loss_type: list[DPOLoss] = Field(default_factory=lambda: ["sigmoid"], min_length=1,
                                     description="TRL DPO loss variants; several are summed with loss_weights")
    loss_weights: list[float] | None = Field(default=None, description="one weight per loss_type entry")
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5,
                                   description="assumed label-flip rate (robust) or epsilon (exo_pair)")

    @model_validator(mode="after")
    def _loss_settings(self) -> DPOTrainConfig:
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"train.loss_weights has {len(self.loss_weights)} entries for {len(self.loss_type)} "
                             f"loss_type entries {self.loss_type}; give one weight per loss or drop loss_weights")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0:
            raise ValueError("train.loss_type 'exo_pair' needs train.label_smoothing > 0 (1e-3 is typical)")
        return self

    def fit(self, model_dir: Path, rows: list[dict], out: Path, seed: int) -> dict[str, float]:
        return train_dpo(model_dir, rows, self, out, seed)

    def rows_of(self, train_set: Path) -> list[dict]:
        from ratchet.data.records import PairRow, read_jsonl

        rows = read_jsonl(train_set, PairRow)
        if token_rows(rows, ["chosen_segments"]):  # trajectories: the sampled ids, tool tokens masked
            out = []
            for r in rows:
                (chosen, cmask), (rejected, rmask) = turn_ids(r.chosen_segments), turn_ids(r.rejected_segments)
                out.append({"prompt_ids": list(r.prompt_ids), "chosen_ids": chosen, "rejected_ids": rejected,
                            "chosen_mask": cmask, "rejected_mask": rmask})
            return out
        return [{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected} for r in rows]

    def info(self, start_model: str) -> dict[str, str]:
        return {"reference": start_model}  # DPO's reference policy: the weights this round started from


def dpo_trainer(model_dir: Path, rows: list[dict], cfg: DPOTrainConfig, out: Path, seed: int):
    """The DPO trainer over `rows`, ready to train: (trainer, tokenizer, precision, plain LM head)."""
    from trl import DPOConfig

    from ratchet.models.train_kinds.trainers import RatchetDPOTrainer

    model, tok, peft_config = load_policy(model_dir, cfg, resolve_precision(cfg.precision))
    args, prec = trainer_args(DPOConfig, cfg, out, seed, beta=cfg.beta, loss_type=list(cfg.loss_type),
                               loss_weights=cfg.loss_weights, label_smoothing=cfg.label_smoothing)
    trainer = RatchetDPOTrainer(model=model, args=args, train_dataset=chat_dataset(rows), processing_class=tok,
                                peft_config=peft_config)
    return trainer, tok, prec, trainer.plain_head


def train_dpo(model_dir: Path, rows: list[dict], cfg: DPOTrainConfig, out: Path, seed: int) -> dict[str, float]:
    """DPO on (prompt, chosen, rejected) rows against the starting policy; writes out/model.

    Resumes from out/checkpoints/ when a previous attempt left a checkpoint.
    """
    started = time.time()
    trainer, tok, prec, plain = dpo_trainer(model_dir, rows, cfg, out, seed)
    d = trainer.train_dataset
    n_tokens = sum(len(p) + len(c) + len(r) for p, c, r in zip(d["prompt_ids"], d["chosen_ids"], d["rejected_ids"]))
    resumed = run_training(trainer, out)
    if not trainer.is_world_process_zero():
        return {}
    saving = time.time()
    save_merged(trainer, tok, model_dir, out, cfg.adapter)
    metrics = write_log(trainer, out, started, n_tokens, save_s=time.time() - saving)
    last = [h for h in trainer.state.log_history if "rewards/margins" in h]
    if last:
        for k in ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected"):
            metrics["last_" + k.replace("/", "_")] = float(last[-1][k])
    metrics.update(rows=float(len(rows)), bf16=float(prec == "bf16"), resumed=float(resumed is not None),
                   resumed_from_step=float(resumed or 0), plain_lm_head=float(plain),
                   processes=float(trainer.args.world_size))
    return metrics
