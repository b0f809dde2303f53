"""TRL's GRPOTrainer as train.kind=grpo drives it (models/train_kinds/grpo.py `grpo_trainer`): its
generations come from Ratchet's engine, with the policy's weights synced to it from memory, and
the engine's log-probabilities go to TRL's importance-sampling correction (its vLLM path, which
the engine stands in for). Imported only where a GRPO stage trains (it imports TRL).

The seam, against the pinned TRL (1.16.0): this subclass overrides two of GRPOTrainer's private
methods and its `compute_loss`, and sets four attributes of its vLLM path. Each is named in
seam.py, with the parameters used here; tests/models/test_trl_seam.py checks the installed TRL
still has them, so a TRL that moved them fails that test instead of training differently.

- `_get_per_token_logps_and_entropies`: skips the chunks of rows a dropped group fills.
- `_get_train_sampler`: each epoch's order seeded by the stage seed and the epoch (resumable).
- `compute_loss`: a micro-batch whose every token is masked gives a zero gradient unrun.
- `use_vllm`, `vllm_mode`, `vllm_generation`, `_last_loaded_step`: TRL's vLLM path, run by
  Ratchet's engine (`EngineSync` in grpo.py).
"""

from __future__ import annotations

from collections.abc import Callable

from trl import GRPOTrainer


class RatchetGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose generations come from Ratchet's engine. `engine_sync(trainer)` makes what
    stands in for TRL's `vllm_generation`; `seed`: the stage seed (each epoch's order);
    `skip_masked`: leave out of the model the rows no token of which is in the loss (off in several
    processes, where DDP needs every process to run every micro-batch)."""

    def __init__(self, *, engine_sync: Callable, seed: int, skip_masked: bool, step_seed: Callable, **kw):
        super().__init__(**kw)
        self.seed, self.skip_masked, self.step_seed = seed, skip_masked, step_seed
        self.use_vllm = True
        self.vllm_mode = "ratchet"
        self.vllm_generation = engine_sync(self)
        self._last_loaded_step = 0  # the engine starts with the weights the policy starts from
        self.micro_batches = {"run": 0, "skipped": 0, "chunks_skipped": 0}
        self.rows_read: list[bool] = []  # the step's rows, in order: whether the loss reads each

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, **kw):
        """Without gradients, over the step's rows in their order (TRL's log-probabilities of the
        sampled tokens, for the importance-sampling correction): a chunk of rows the loss reads none
        of is not run, its log-probabilities left 0 (every use of them is masked, and the policy
        ratio they enter, exp(logp - 0), cannot overflow). A group is contiguous and the chunks are
        the micro-batches, so a dropped group's chunks are skipped, and the others are run exactly
        as they would be. Not with a KL term (beta > 0): the reference's log-probabilities come
        through here too, and a 0 there could overflow the KL estimate of a masked token."""
        import torch

        rows, size = input_ids.size(0), batch_size or input_ids.size(0)
        plain = not any(v is not None and v is not False for v in kw.values())  # text only, no aux loss
        if not self.skip_masked or torch.is_grad_enabled() or self.beta != 0.0 or not plain \
                or len(self.rows_read) != rows or all(self.rows_read):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, **kw)
        chunks = [(start, min(start + size, rows)) for start in range(0, rows, size)]
        done = {c: super(RatchetGRPOTrainer, self)._get_per_token_logps_and_entropies(
            model, input_ids[c[0]:c[1]], attention_mask[c[0]:c[1]], logits_to_keep, c[1] - c[0])[0]
            for c in chunks if any(self.rows_read[c[0]:c[1]])}
        dtype = next(iter(done.values())).dtype if done else torch.float32
        self.micro_batches["chunks_skipped"] += len(chunks) - len(done)
        return torch.cat([done[c] if c in done else torch.zeros(c[1] - c[0], logits_to_keep, dtype=dtype,
                                                                device=input_ids.device) for c in chunks]), \
            None, None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """A micro-batch whose every token is masked (its groups taught nothing and were dropped)
        has a loss and a gradient of zero: it is not run through the model. The trainable weights
        get the zero gradient it would have given, so the optimizer steps as it would have."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        if self.skip_masked and not return_outputs and not bool(mask.any()):
            self.micro_batches["skipped"] += 1
            return sum((p * 0.0).sum() for p in model.parameters() if p.requires_grad)
        self.micro_batches["run"] += 1
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _get_train_sampler(self, dataset=None):
        """TRL's sampler draws each epoch's order from one generator, so a run resumed in a later
        epoch would draw the first epoch's order again: here each epoch's order is seeded by the
        seed and the epoch (the Trainer sets the epoch before it iterates, resumed or not)."""
        sampler = super()._get_train_sampler(dataset)
        if getattr(sampler, "generator", None) is not None:
            seed, step_seed = self.seed, self.step_seed
            sampler.set_epoch = lambda epoch: sampler.generator.manual_seed(step_seed(seed, -1 - int(epoch)))
        return sampler
