"""The trainer class of train.kind rft and dpo, one each on every device: TRL's SFTTrainer and
DPOTrainer with what Ratchet needs of them. Every internal of TRL or transformers they reach into
is named in seam.py and checked by tests/models/test_trl_seam.py. Imported only where such a stage
trains (it imports TRL); GRPO's is in grpo_trainer.py.
"""

from __future__ import annotations

import torch
from trl import DPOTrainer, SFTTrainer

def _plain_here() -> bool:
    """Off CUDA, TRL's tiled LM head (built for Triton devices) is replaced by a plain one."""
    return not torch.cuda.is_available()


class RatchetSFTTrainer(SFTTrainer):
    """train.kind=rft. Off CUDA, the model's own cross-entropy instead of TRL's fused LM head.

    TRL patches in a tiled LM head that, off Triton devices, scores every position and also
    computes entropy and top-1 for its metrics. On this project's 2-core CPU that took a TRL step
    from ~2.1 s (plain forward/backward) to ~3.6 s for 8 rows of ~70 tokens; its memory saving only
    pays off on a GPU with a large vocabulary. `plain` (default: off CUDA) says which it computes."""

    def __init__(self, *args, plain: bool | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.plain_loss = _plain_here() if plain is None else plain

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.plain_loss:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        keep = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids", "labels") if k in inputs}
        out = model(**keep, use_cache=False, num_items_in_batch=num_items_in_batch)
        loss = out.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As Trainer.compute_loss does: the token count is the global one, and DDP averages
            # gradients over processes, so each process's share is scaled back up by their number.
            loss = loss * self.accelerator.num_processes
        return (loss, out) if return_outputs else loss


class RatchetDPOTrainer(DPOTrainer):
    """train.kind=dpo: TRL's DPOTrainer that also takes trajectories as token ids with a loss mask,
    and off CUDA scores with a plain LM head (`plain_lm_head`; `plain_head` says whether it does).

    TRL scores every completion token of a pair. A row with `chosen_mask` / `rejected_mask` (1 on
    the model's own tokens, 0 on a tool's or an environment's) is taken as tokenized, and its
    collated `completion_mask`, which every log-probability and the loss are summed over, is
    multiplied by them: a tool segment's tokens get no log-probability, so no gradient.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.data_collator = masked_collator(self.data_collator)
        self.plain_head = False
        if _plain_here():
            inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            self.plain_head = plain_lm_head(inner) and (self.ref_model is None or plain_lm_head(self.ref_model))

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "chosen_mask" in dataset.column_names:  # tokenized by the rollout, token in, token out
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = [*self._signature_columns, "chosen_mask", "rejected_mask"]


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


def masked_collator(collate):
    """`collate` (TRL's preference collator) with the rows' own loss masks applied to its completion_mask."""
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
