"""The agreement gate: a round trains on its labels only if they agree with the reference
answers well enough, measured before training.

A label that is not the verifier (a judge, a majority vote, a reward model) can be wrong
in ways that make the next model worse. Where prompts carry reference answers (the
calibration slice: every labeled prompt that has one), the label and filter stages
already measure how the label's rewards line up with the verifier's verdicts. The gate
reads that measure after the filter, before training:

    verifier_within_prompt_auc  within each prompt that has right and wrong samples, the
                                chance that the label scores a right one above a wrong
                                one (0.5 = a coin; what best-vs-worst pairs rely on)
    verifier_auc                the same over all labeled samples pooled
    pair_accuracy               share of the filter's pairs with a right chosen and a
                                wrong rejected answer

Below `min`, the round stops with a message that says what was measured and what to do
(`on_below: stop`), or trains anyway and records that it did (`on_below: train`). A
measure over fewer than `min_prompts` prompts (or pairs) is too thin to judge: the round
goes on and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.errors import RatchetError

# metric -> (the stage that measures it, the metric that counts what it was measured on, that count's unit)
# each measure: whether the labels measure it (else the training set does), what it counts, in what
MEASURES = {
    "verifier_within_prompt_auc": (True, "verifier_auc_prompts", "prompts with right and wrong samples"),
    "verifier_auc": (True, "verifier_auc_prompts", "prompts with right and wrong samples"),
    "pair_accuracy": (False, "pairs", "pairs"),
}
MEANING = {
    "verifier_within_prompt_auc": "1.0 = within a prompt it always scores right answers above wrong ones, 0.5 = "
                                  "no better than a coin",
    "verifier_auc": "1.0 = it always scores right answers above wrong ones, 0.5 = no better than a coin",
    "pair_accuracy": "the share of training pairs that prefer a right answer to a wrong one",
}


class AgreementConfig(BaseModel):
    """The label's agreement with reference answers, checked each round before training."""

    model_config = ConfigDict(extra="forbid")
    min: float | None = Field(default=None, ge=0, le=1, description="least agreement to train on the round's labels "
                              "(unset: no gate)")
    metric: Literal["verifier_within_prompt_auc", "verifier_auc", "pair_accuracy"] = Field(
        default="verifier_within_prompt_auc", description="how agreement is measured (see tasks/agreement.py)")
    on_below: Literal["stop", "train"] = Field(default="stop", description="stop: the round stops before training "
                                               "with a message; train: it trains anyway and says so in its summary")
    min_prompts: int = Field(default=8, ge=1, description="fewest prompts (pairs, for pair_accuracy) the measure "
                             "must cover; below it the round goes on, noting that it could not judge")


class LabelDisagreesError(RatchetError):
    """A round's labels disagree with the reference answers more than the config allows."""

    def __init__(self, message: str, round: int):
        super().__init__(message)
        self.round = round


@dataclass(frozen=True)
class Verdict:
    passed: bool  # trains (measured and at or above min, or not judged, or on_below=train)
    note: str  # one line for the round's summary; empty when the gate is off
    value: float | None = None


def check(cfg: AgreementConfig, label: str, k: int, label_metrics: dict[str, float],
          filter_metrics: dict[str, float]) -> Verdict:
    """The gate's verdict for round k; raises LabelDisagreesError when the round must stop."""
    if cfg.min is None:
        return Verdict(True, "")
    on_labels, count_key, unit = MEASURES[cfg.metric]
    metrics = label_metrics if on_labels else filter_metrics
    value, covered = metrics.get(cfg.metric), metrics.get(count_key, 0.0)
    if value is None or covered < cfg.min_prompts:
        why = ("no labeled prompt has a reference answer and both right and wrong samples"
               if value is None else f"it covers {covered:.0f} {unit}, fewer than agreement.min_prompts="
               f"{cfg.min_prompts}")
        return Verdict(True, f"agreement not judged: {cfg.metric} could not be measured well ({why}); trained")
    measured = f"{cfg.metric}={value:.3f} over {covered:.0f} {unit} ({MEANING[cfg.metric]})"
    if value >= cfg.min:
        return Verdict(True, f"agreement {measured} >= agreement.min={cfg.min}", value)
    if cfg.on_below == "train":
        return Verdict(True, f"agreement BELOW the gate: {measured} < agreement.min={cfg.min}; trained anyway "
                       "(agreement.on_below=train)", value)
    raise LabelDisagreesError(
        f"round {k} stopped before training: the {label} label agrees with the reference answers too little to "
        f"train on. Measured {measured}, below agreement.min={cfg.min}. Training on these labels would teach the "
        "model the label's mistakes. The samples, labels and training set are kept. To go on: use a better label "
        "(a verifier, a larger or fixed judge: label.model, a reward model), or lower agreement.min, or set "
        "agreement.on_below=train to train anyway; finished stages are reused either way.", k)
