"""The seam between Ratchet and the internals of TRL and transformers, in one table.

Every private method a trainer class of ours overrides, every attribute it sets that the library
reads, and every line of the library's source it relies on, with the class of ours that rests on
it and why. tests/models/test_trl_seam.py checks each entry against the installed libraries, one
test an entry, and that no trainer class of ours overrides a method this table does not name: a
TRL that moves one fails there, instead of training differently without a word.

The pinned versions it was read from: TRL 1.16.0, transformers 5.x (pyproject). Importing this
module imports no library; the classes are in trainers.py (train.kind rft and dpo) and
grpo_trainer.py (grpo: GRPOTrainer's import alone costs 5 s and 240 MB more, so only a GRPO stage
pays it).
"""

from __future__ import annotations

from dataclasses import dataclass

TRL_VERSION = "1.16.0"


@dataclass(frozen=True)
class Reach:
    """One thing of a library's a class of ours depends on.

    `owner`: the library's class or module, dotted; `member`: its method or attribute. A method has
    `params`, the parameters (after self) it is called or overridden with; an attribute has none.
    `source`: a line the owner's source must still contain (where the reach depends on it)."""

    owner: str
    member: str
    ours: str
    why: str
    params: tuple[str, ...] | None = None
    source: str | None = None


SEAM: tuple[Reach, ...] = (
    # train.kind=rft -----------------------------------------------------------------------------
    Reach("trl.SFTTrainer", "compute_loss", "RatchetSFTTrainer",
          "off CUDA, the model's own cross-entropy instead of TRL's tiled LM head (2.1 s a step against 3.6 s)",
          params=("model", "inputs", "return_outputs", "num_items_in_batch")),
    # train.kind=dpo -----------------------------------------------------------------------------
    Reach("trl.DPOTrainer", "_prepare_dataset", "RatchetDPOTrainer",
          "trajectories come tokenized (with their loss masks) and are taken as they are",
          params=("dataset", "processing_class", "args", "dataset_name")),
    Reach("transformers.Trainer", "_set_signature_columns_if_needed", "RatchetDPOTrainer",
          "the rows' chosen_mask and rejected_mask reach the collator", params=()),
    Reach("transformers.Trainer", "_signature_columns", "RatchetDPOTrainer",
          "the columns kept, extended by the two masks", source="self._signature_columns ="),
    Reach("trl.trainer.dpo_trainer.DataCollatorForPreference", "completion_mask", "masked_collator",
          "the collated mask every log-probability and the loss are summed over, multiplied by the rows' own",
          source='"completion_mask"'),
    Reach("trl.trainer.dpo_trainer.DataCollatorForPreference", "truncation_mode", "masked_collator",
          "the rows' masks are cut where the collator cut the ids", source="self.truncation_mode"),
    Reach("trl.DPOTrainer", "fused_lm_head", "plain_lm_head",
          "TRL asks the model for per-token log-probabilities with this keyword; off CUDA a plain head answers",
          source="fused_lm_head=True"),
    Reach("trl.trainer.utils.FusedCausalLMOutput", "__init__", "plain_lm_head", "what the plain head returns",
          params=("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask",
                  "aux_loss")),
    # train.kind=grpo ----------------------------------------------------------------------------
    Reach("trl.GRPOTrainer", "_get_per_token_logps_and_entropies", "RatchetGRPOTrainer",
          "the chunks of rows a dropped group fills are not run",
          params=("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size")),
    Reach("trl.GRPOTrainer", "_get_train_sampler", "RatchetGRPOTrainer",
          "each epoch's order seeded by the stage seed and the epoch (a resume draws the same)", params=("dataset",)),
    Reach("trl.GRPOTrainer", "compute_loss", "RatchetGRPOTrainer",
          "a micro-batch whose every token is masked gives a zero gradient unrun",
          params=("model", "inputs", "return_outputs", "num_items_in_batch")),
    *(Reach("trl.GRPOTrainer", a, "RatchetGRPOTrainer",
            "TRL's vLLM path, run by Ratchet's engine (EngineSync in grpo.py)", source=f"self.{a} =")
      for a in ("use_vllm", "vllm_mode", "vllm_generation", "_last_loaded_step")),
    Reach("trl.GRPOTrainer", "sync trigger", "EngineSync",
          "the policy's weights go to the engine when this holds, read each step",
          source="if self.state.global_step != self._last_loaded_step:"),
    # every kind ---------------------------------------------------------------------------------
    Reach("transformers.TrainingArguments", "_n_gpu", "one_device (models/trainer.py)",
          "one process trains on one GPU: the Trainer would otherwise split each batch over all it sees",
          source="self._n_gpu ="),
)


def reaches(ours: str) -> tuple[Reach, ...]:
    """The entries a class or function of ours rests on."""
    return tuple(r for r in SEAM if r.ours == ours)
