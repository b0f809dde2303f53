"""train.kind=dpo: DPO with TRL's DPOTrainer on (prompt, chosen, rejected) pairs, against the
round's starting policy; off Triton devices with a plain LM head that scores only the
completions (plain_lm_head)."""

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


def plain_lm_head(model) -> bool:
    """Replace TRL's fused LM head on `model` with a plain one that scores only the labelled positions.

    TRL's DPOTrainer patches the model so `model(..., fused_lm_head=True)` returns per-token
    log-probabilities. Off Triton devices its tiled kernel scores every position, prompt
    included, and recomputes the tiles in backward. This head projects only the positions
    with a label (the completions) through the LM head, in fp32 so bf16 rounding of the
    logits cannot bias the log-ratios, and returns the same fields. Returns False (and
    leaves TRL's head) for models whose logits are scaled or soft-capped.
    """
    import types

    import torch
    from trl.trainer.utils import FusedCausalLMOutput

    text = model.config.get_text_config()
    if any(getattr(text, a, None) is not None
           for a in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")):
        return False
    original = types.MethodType(type(model).forward, model)

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = {k: v for k, v in (("labels", labels), ("shift_labels", shift_labels),
                                       ("num_items_in_batch", num_items_in_batch)) if v is not None}
            return original(*args, **kwargs, **extra)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        mask = labels != -100
        head = self.get_output_embeddings()
        with torch.autocast(hidden.device.type, enabled=False):
            logits = torch.nn.functional.linear(hidden[mask].float(), head.weight.float(),
                                                None if head.bias is None else head.bias.float())
        logp = torch.log_softmax(logits, dim=-1)
        target = labels[mask]
        token_lp = logp.gather(1, target[:, None]).squeeze(1)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
            mean_logits = logits.mean(-1)
            is_top1 = logits.argmax(-1) == target

        def spread(x):
            return x.new_zeros(mask.shape).masked_scatter(mask, x)

        log_probs = spread(token_lp)
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / denom, log_probs=log_probs, entropy=spread(entropy),
                                   log_sum_sq_probs=None, mean_logits=spread(mean_logits), is_top1=spread(is_top1),
                                   label_mask=mask, aux_loss=None)

    model.forward = types.MethodType(forward, model)
    return True


def masked_dpo(trainer_cls):
    """`trainer_cls` (TRL's DPOTrainer) that also takes trajectories as token ids with a loss mask.

    TRL scores every completion token of a pair. A row with `chosen_mask` / `rejected_mask` (1 on
    the model's own tokens, 0 on a tool's or an environment's) is taken as tokenized, and its
    collated `completion_mask`, which every log-probability and the loss are summed over, is
    multiplied by them: a tool segment's tokens get no log-probability, so no gradient.
    """

    class MaskedDPO(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.data_collator = masked_collator(self.data_collator)

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "chosen_mask" in dataset.column_names:  # tokenized by the rollout, token in, token out
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def _set_signature_columns_if_needed(self):
            super()._set_signature_columns_if_needed()
            self._signature_columns = [*self._signature_columns, "chosen_mask", "rejected_mask"]

    MaskedDPO.__name__ = f"Masked{trainer_cls.__name__}"
    return MaskedDPO


def masked_collator(collate):
    """`collate` (TRL's preference collator) with the rows' own loss masks applied to its completion_mask."""
    import torch

    def call(examples):
        masks = [e.pop("chosen_mask", None) for e in examples]
        rmasks = [e.pop("rejected_mask", None) for e in examples]
        out = collate(examples)
        if masks[0] is None:
            return out
        cm = out["completion_mask"]
        full = [[0] * len(e["prompt_ids"]) + list(m) for e, m in zip(examples, masks)]
        full += [[0] * len(e["prompt_ids"]) + list(m) for e, m in zip(examples, rmasks)]
        if collate.max_length is not None:  # cut as the collator cut the ids
            cut = slice(None, collate.max_length) if collate.truncation_mode == "keep_start" else \
                slice(-collate.max_length, None)
            full = [m[cut] for m in full]
        keep = torch.zeros_like(cm)
        for i, m in enumerate(full):
            keep[i, : len(m)] = torch.tensor(m, dtype=cm.dtype)
        out["completion_mask"] = cm * keep
        return out

    call.max_length, call.truncation_mode = collate.max_length, collate.truncation_mode
    return call


def dpo_trainer(model_dir: Path, rows: list[dict], cfg: DPOTrainConfig, out: Path, seed: int):
    """The DPO trainer over `rows`, ready to train: (trainer, tokenizer, precision, plain LM head)."""
    import torch
    from trl import DPOConfig, DPOTrainer

    model, tok, peft_config = load_policy(model_dir, cfg, resolve_precision(cfg.precision))
    args, prec = trainer_args(DPOConfig, cfg, out, seed, beta=cfg.beta, loss_type=list(cfg.loss_type),
                               loss_weights=cfg.loss_weights, label_smoothing=cfg.label_smoothing)
    trainer = masked_dpo(DPOTrainer)(model=model, args=args, train_dataset=chat_dataset(rows), processing_class=tok,
                                     peft_config=peft_config)
    plain = False
    if not torch.cuda.is_available():  # see plain_lm_head: TRL's tiled head is built for Triton devices
        inner = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        plain = plain_lm_head(inner) and (trainer.ref_model is None or plain_lm_head(trainer.ref_model))
    return trainer, tok, prec, plain


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
