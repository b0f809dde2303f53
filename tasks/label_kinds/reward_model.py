"""reward_model: a sequence-classification reward model scores every completion.

The model is fixed (a local directory, `label.model`), not the policy: its files are a
stage of their own (`label-model`), so its digest keys the label stage and its lineage
names it. Runs through the unit loop (tasks/runner/units.py) in a worker, batched, so a resumed
stage scores only the missing units and the executor can spread units over holders.
Every response passes the guard (tasks/label_kinds/guard.py) first, as for the judge: a response that
speaks to its grader is flagged, scored on its text with the flagged sentences cut, and
by default given a reward one below the stage's lowest clean one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.checkers import extract
from ratchet.data.records import Completion, LabeledCompletion
from ratchet.data.userfiles import UserPath
from ratchet.models.sampler import resolve_dtype
from ratchet.tasks.label_kinds.guard import GuardConfig
from ratchet.tasks.label_kinds import Label, Labeled, agreement, injection_stats, labeled_row, truths
from ratchet.tasks.runner.units import UnitWork, run_units


class RewardModelLabel(Label):
    """Reward = a sequence-classification reward model's score of (prompt, completion)."""

    uses_policy: ClassVar[bool] = True  # its own fixed model, in a worker
    kind: Literal["reward_model"] = "reward_model"
    online: ClassVar[str | None] = None  # scores an online step's completions too (scorer)
    model: UserPath = Field(description="a local Hugging Face directory of a *ForSequenceClassification reward model "
                       "(1 label: the reward is its logit; 2 labels: the probability of label 1)")
    batch_size: int = Field(default=16, ge=1, description="completions per forward pass")
    max_length: int = Field(default=1024, ge=16, description="tokens of prompt + response read (the start is cut "
                            "first)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", json_schema_extra={"resolves": "dtype"}, description="auto: as sampler.dtype (bfloat16 where "
        "the hardware runs it natively, float16 on an older GPU, else float32); keyed by what it resolves to")
    shard_size: int = Field(default=256, ge=1, description="completions scored per unit (the unit of resume)")
    guard: GuardConfig = Field(default_factory=GuardConfig, description="what happens to a response that speaks to "
                               "its grader (scores, verdicts, instructions, fences, roles in its text)")

    def run(self, req, store, rows: list[Completion], check_cfg) -> Labeled:
        return score_all(req, store, rows, check_cfg, self)

    def scorer(self, model_dir: Path | None):
        """The reward model, loaded once a stage, scoring each step's completions as a label unit does
        (the guard first, flagged responses penalised within the step)."""
        from ratchet.models.reward_model import RewardScorer

        rm = RewardScorer(model_dir, resolve_dtype(self.dtype), self.batch_size, self.max_length)
        return lambda rows, check_cfg: penalise(scored(rm, rows, check_cfg)[0], self.guard.on_suspect)

    def reward_range(self) -> tuple[float, float]:
        return (-math.inf, math.inf)  # a reward model's logits have no fixed scale

    def fixed_model(self) -> str | None:
        return self.model

    @classmethod
    def check_model(cls, path: Path) -> str | None:
        """What is wrong with a reward model directory (only its config.json is read), if anything."""
        from ratchet.models.reward_model import describe

        found = describe(path)
        return (f"{found}; give a reward model directory, or use label.kind='judge' for a generative judge"
                if isinstance(found, str) else None)


@dataclass
class RewardWork(UnitWork):
    """A unit: `size` completions scored by the reward model."""

    stage = "label"
    model: Path
    cfg: RewardModelLabel
    check: object
    seed: int
    items: list
    size: int

    def open(self, lent=None):
        from ratchet.models.reward_model import RewardScorer

        return RewardScorer(self.model, resolve_dtype(self.cfg.dtype), self.cfg.batch_size, self.cfg.max_length)

    def run(self, scorer, chunk: list[Completion], seed: int):
        return scored(scorer, chunk, self.check)


def scored(scorer, chunk: list[Completion], check) -> tuple[list[LabeledCompletion], dict[str, float]]:
    """`chunk` scored by the reward model, each response through the guard first; the rows and the
    counters."""
    from ratchet.tasks.label_kinds.guard import guard

    t = time.time()
    seen = [guard(c.prompt, c.text) for c in chunk]
    scores = scorer.score([(c.prompt, text) for c, (text, _) in zip(chunk, seen)])
    rows = [labeled_row(c, reward=s, votes=[s], flags=flags or None, extracted=extract(check, c.final), correct=right)
            for c, s, (_, flags), right in zip(chunk, scores, seen, truths(check, chunk))]
    return rows, {"score_s": time.time() - t, "scored": len(chunk)}


def penalise(rows: list[LabeledCompletion], on_suspect: str) -> list[LabeledCompletion]:
    """on_suspect='lowest': every flagged response gets one below the lowest clean reward, so it
    is always the rejected side of a pair (a reward model's scale has no bottom to give)."""
    clean = [r.reward for r in rows if not r.flags]
    if on_suspect != "lowest" or not clean:
        return rows
    floor = min(clean) - 1.0
    return [r.model_copy(update={"reward": floor}) if r.flags else r for r in rows]


def score_all(req, store, rows: list[Completion], check_cfg, cfg: RewardModelLabel) -> Labeled:
    from ratchet.tasks.prepare import model_dir

    done = run_units(RewardWork(items=rows, size=cfg.shard_size, model=model_dir(store, req.parent_model), cfg=cfg,
                                check=check_cfg, seed=req.seed), store.stage_dir(req.stage, req.key) / "shards",
                     req.executor, req.engine)
    out = penalise([LabeledCompletion.model_validate_json(x) for x in done.shards.lines()], cfg.guard.on_suspect)
    cost = done.cost
    metrics = {"rm_s": cost.get("score_s", 0.0), "rm_load_s": done.load_s, "rm_shards_reused": float(done.reused),
               "holders": done.holders, "scored_per_s": cost["scored"] / cost["score_s"] if cost.get("score_s") else 0.0,
               **injection_stats([r.flags or [] for r in out]), **agreement(out)}
    return Labeled(out, metrics, info={"units": done.placement})

