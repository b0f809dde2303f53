"""train.kind=rft: rejection-sampling fine-tuning, SFT with TRL's SFTTrainer on the accepted
(prompt, completion) rows, the loss on the completion only."""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar, Literal

from ratchet.models.trainer import (OptimSettings, chat_dataset, load_policy, resolve_precision, run_training,
                                    save_merged, token_rows, trainer_args, turn_ids, write_log)


class RFTTrainConfig(OptimSettings):
    """Rejection-sampling fine-tuning: supervised fine-tuning (TRL's SFTTrainer) on the accepted samples."""

    consumes: ClassVar[str] = "rft"  # the rows it trains on: accepted samples (tasks/filter_kinds/ ROWS)
    kind: Literal["rft"] = "rft"

    def fit(self, model_dir: Path, rows: list[dict], out: Path, seed: int) -> dict[str, float]:
        return train_rft(model_dir, rows, self, out, seed)

    def rows_of(self, train_set: Path) -> list[dict]:
        from ratchet.data.records import SFTRow, read_jsonl

        rows = read_jsonl(train_set, SFTRow)
        if token_rows(rows, ["segments"]):  # trajectories: the sampled ids, the model's own tokens trained
            out = []
            for r in rows:
                ids, mask = turn_ids(r.segments)
                out.append({"input_ids": [*r.prompt_ids, *ids], "completion_mask": [0] * len(r.prompt_ids) + mask})
            return out
        return [{"prompt": r.prompt, "completion": r.completion} for r in rows]


def rft_trainer(model_dir: Path, rows: list[dict], cfg: RFTTrainConfig, out: Path, seed: int):
    """The SFT trainer over `rows`, ready to train: (trainer, tokenizer, precision). Rows of
    trajectories (`input_ids`, `completion_mask`) are taken as tokenized; TRL turns the mask into
    the labels it trains on (-100 off the model's own tokens)."""
    from trl import SFTConfig

    from ratchet.models.train_kinds.trainers import RatchetSFTTrainer

    model, tok, peft_config = load_policy(model_dir, cfg, resolve_precision(cfg.precision))
    args, prec = trainer_args(SFTConfig, cfg, out, seed, completion_only_loss=True)
    trainer = RatchetSFTTrainer(model=model, args=args, train_dataset=chat_dataset(rows), processing_class=tok,
                                peft_config=peft_config)
    return trainer, tok, prec


def train_rft(model_dir: Path, rows: list[dict], cfg: RFTTrainConfig, out: Path, seed: int) -> dict[str, float]:
    """SFT on accepted (prompt, completion) rows; writes out/model; returns metrics.

    Resumes from out/checkpoints/ when a previous attempt left a checkpoint.
    """
    started = time.time()
    trainer, tok, prec = rft_trainer(model_dir, rows, cfg, out, seed)
    n_tokens = sum(len(x) for x in trainer.train_dataset["input_ids"])
    resumed = run_training(trainer, out)
    if not trainer.is_world_process_zero():
        return {}
    saving = time.time()
    save_merged(trainer, tok, model_dir, out, cfg.adapter)
    metrics = write_log(trainer, out, started, n_tokens, save_s=time.time() - saving)
    metrics.update(rows=float(len(rows)), bf16=float(prec == "bf16"), resumed=float(resumed is not None),
                   resumed_from_step=float(resumed or 0), processes=float(trainer.args.world_size))
    return metrics
