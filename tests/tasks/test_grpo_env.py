"""GRPO on an environment's episodes: a step plays the run's environment (examples/environments/
guess.py, in its host processes) through the environment rollout on a real engine, scores each
episode by its return, and trains on the model's turns only: every observation's tokens masked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.integration
def test_a_grpo_step_plays_the_environment_and_masks_its_observations(tiny_model, tmp_path):
    from ratchet.data.records import LabeledCompletion
    from ratchet.flows.config import load_config
    from ratchet.models.train_kinds.grpo import grpo_trainer
    from ratchet.tasks.train import OnlineJob, online_of

    cfg = load_config(ROOT / "flows" / "configs" / "guess_env_rft.yaml", [
        "train={kind: grpo, steps: 1, batch_size: 2, adapter: full, drop_equal: false}", "sample.top_k=0",
        "sample.n=2", "sample.max_tokens=4", "sample.rollout.max_turns=2", "sample.rollout.episode_tokens=200",
        "sampler.backend=hf", "sampler.dtype=float32"])
    job = OnlineJob(train=cfg.train, seed=0, sample=cfg.sample, sampler=cfg.sampler, label=cfg.label,
                    data=cfg.data)
    prompts = [p.model_dump(mode="json") for p in cfg.data.load(0, False).train[:2]]
    trainer, *_ = grpo_trainer(tiny_model, prompts, cfg.train, tmp_path, 0, online_of(job, 0))
    trainer.train()

    rows = [LabeledCompletion.model_validate(json.loads(x))
            for x in (tmp_path / "rollouts" / "00000.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r.outcome is not None and r.reward == r.outcome.ret for r in rows)
    observed = sorted(sum(len(s.token_ids) for s in r.segments if s.role == "env") for r in rows)
    assert observed[-1] > 0  # an episode the environment answered and went on with
    assert all(s.logprobs is not None for r in rows for s in r.segments if s.role == "model")
    assert all(s.logprobs is None for r in rows for s in r.segments if s.role == "env")
    batch = trainer._buffered_inputs[0]
    masked = []  # per row of the batch: the completion's tokens the loss leaves out
    for keep, real in zip(batch["tool_mask"].tolist(), batch["completion_mask"].sum(-1).tolist()):
        masked.append(real - sum(keep[:real]))
    assert sorted(masked) == observed
