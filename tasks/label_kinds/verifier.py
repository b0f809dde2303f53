"""verifier: reward = the task's answer check (RFT / ReST-EM / STaR): 1.0 right or 0.0 wrong
for the built-in checks, the user's score for `data.check.kind: python`.

`label.check` gives the label a check of its own, in place of data.check, while held-out
accuracy keeps data.check: the reward can ask more of a sample than the held-out count does
(its working replayed line by line, a format, a length), and accuracy is still read from the
final answer alone. RFT then keeps, DPO pairs, GRPO rewards and the curriculum's band counts by
the label's check.

Completions of prompts without a reference answer cannot be verified and are an error,
with the fix named. Checked in units written as they finish (tasks/runner/units.py), so a resumed
stage checks only what is missing: a user's function that is slow or fails half way never
pays twice for rows it already scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ratchet.data.checkers import CheckConfig, check_many, score_metrics, score_sums
from ratchet.data.errors import ConfigError
from ratchet.data.records import Completion, LabeledCompletion
from ratchet.tasks.label_kinds import Label, Labeled, item_of, labeled_row
from ratchet.tasks.runner.units import UnitWork, run_units


class VerifierLabel(Label):
    """Reward = the data source's answer check (data.check)."""

    kind: Literal["verifier"] = "verifier"
    online: ClassVar[str | None] = None  # the answer check scores an online step's completions (score)
    shard_size: int = Field(default=256, ge=1, description="completions checked per unit (the unit of resume)")
    check: CheckConfig | None = Field(default=None, description=(
        "the check the label scores with, in place of data.check (unset: data.check). Held-out accuracy keeps "
        "data.check, so the reward may ask more than the held-out count does: e.g. {kind: python, function: "
        "'checks.py:working'} that replays the working, while accuracy reads the final answer"))

    @model_validator(mode="after")
    def _place(self) -> VerifierLabel:
        if self.check is not None:  # its messages (a function that fails, cannot load) name label.check
            self.check.placed("label.check")
        return self

    def run(self, req, store, rows: list[Completion], check_cfg) -> Labeled:
        return Labeled(*verify(req, store, rows, self.scores_with(check_cfg), self.shard_size))

    def scorer(self, model_dir=None):
        def score(rows, check_cfg):
            return checked(self.scores_with(check_cfg), rows)[0]
        return score

    def scores_with(self, data_check):
        return data_check if self.check is None else self.check

    def needs_reference(self) -> bool:
        return True

    def title(self) -> str:
        return self.kind if self.check is None else f"{self.kind} (label.check: {self.check.kind})"

    def checks(self, pipeline) -> list[str]:
        rollout = pipeline.sample.rollout
        if self.check is not None and self.check.reads_return and not rollout.plays:
            return [f"label.check.kind={self.check.kind!r} scores an environment episode's return, but "
                    f"sample.rollout.kind={rollout.kind!r} plays no episode; set sample.rollout.kind='environment' "
                    "(with its env), or give label.check a check of the answer's text"]
        return []


@dataclass
class VerifyWork(UnitWork):
    """A unit: `size` completions through the answer check."""

    stage = "label"
    check: object
    items: list
    size: int
    seed: int = 0

    def open(self, lent=None):
        return None  # no engine: a check that runs code elsewhere starts its own process

    def close(self, engine) -> None:
        pass

    def threads(self, n: int | None) -> int:
        """None: no engine computes here, so this process's torch threads are not the work's to read or
        set. The stage runs in the run's own process (the kind runs no model), where reading them
        imported torch: 3 s of CPU and torch's memory at a run's first label, for nothing."""
        return 0

    def run(self, engine, chunk: list[Completion], seed: int):
        return checked(self.check, chunk)


def checked(check_cfg, rows: list[Completion]) -> tuple[list[LabeledCompletion], dict[str, float]]:
    """`rows` through the answer check, in one batch: the labeled rows and the batch's counters."""
    verdicts = check_many(check_cfg, [item_of(c) for c in rows])
    return ([labeled_row(c, reward=v.reward, extracted=v.extracted, correct=v.correct) for c, v in zip(rows, verdicts)],
            score_sums(verdicts))


def verify(req, store, rows: list[Completion], check_cfg, shard_size: int) -> tuple[list[LabeledCompletion], dict]:
    missing = sorted({r.prompt_id for r in rows if r.answer is None})
    if missing and check_cfg.needs_answer:
        raise ConfigError(
            [f"label.kind='verifier' needs reference answers, but {len(missing)} prompt(s) have none "
             f"(first: {missing[0]!r}); set data.answer_field to the answer column, or give the label a check "
             "that reads none (label.check)"]
        )
    done = run_units(VerifyWork(check=check_cfg, items=rows, size=shard_size),
                     store.stage_dir(req.stage, req.key) / "shards", req.executor, req.engine)
    return [LabeledCompletion.model_validate_json(x) for x in done.shards.lines()], score_metrics(done.cost)

