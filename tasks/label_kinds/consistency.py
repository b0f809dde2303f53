"""consistency: majority-vote pseudo-labels, no reference answers needed.

A prompt's sampled answers vote; a unique majority holding at least `min_agreement` of
the samples becomes the pseudo-label, and completions that agree with it get reward 1.0.
Ties and weak majorities label nothing rather than guess. Where references exist, the
share of pseudo-labels that are right is logged: it says whether self-consistency is
informative for this model.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.checkers import answer_key, extract
from ratchet.data.records import Completion, LabeledCompletion
from ratchet.tasks.label_kinds import Label, Labeled, agreement, labeled_row, truths, voting_check


class ConsistencyLabel(Label):
    """Reward = agreement with the majority answer of the prompt's own samples (label-free)."""

    kind: Literal["consistency"] = "consistency"
    online: ClassVar[str | None] = (  # why it cannot be train.kind=grpo's reward
        "scores a completion by its group's majority vote, the very group GRPO compares it with: the "
        'advantage would reward agreeing with the group, not being right')
    min_agreement: float = Field(
        default=0.5, gt=0, le=1,
        description="share of a prompt's samples the majority answer needs; below it the prompt stays unlabeled",
    )
    min_votes: int = Field(default=2, ge=1, description="fewest samples that must agree on the majority answer")

    def run(self, req, store, rows: list[Completion], check_cfg) -> Labeled:
        labeled, metrics = majority_vote(rows, check_cfg, self)
        return Labeled(labeled, {**metrics, **agreement(labeled)})

    def checks(self, pipeline) -> list[str]:
        return voting_check(self.kind, pipeline)


def majority_vote(rows: list[Completion], check_cfg, cfg: ConsistencyLabel
                  ) -> tuple[list[LabeledCompletion], dict[str, float]]:
    by_prompt: dict[str, list[Completion]] = defaultdict(list)
    for r in rows:
        by_prompt[r.prompt_id].append(r)
    audit = dict(zip(((r.prompt_id, r.index) for r in rows), truths(check_cfg, rows)))
    out: list[LabeledCompletion] = []
    labeled, agreement, right, with_ref = 0, [], 0, 0
    for pid in sorted(by_prompt):
        comps = sorted(by_prompt[pid], key=lambda r: r.index)
        keys = [extract(check_cfg, c.final) for c in comps]
        votes = Counter(k for k in keys if k is not None)
        label = None
        if votes:
            top = max(votes.values())
            winners = [k for k, v in votes.items() if v == top]
            agreement.append(top / len(comps))
            if len(winners) == 1 and top >= cfg.min_votes and top / len(comps) >= cfg.min_agreement:
                label = winners[0]
        else:
            agreement.append(0.0)
        if label is not None:
            labeled += 1
            ref = comps[0].answer
            if ref is not None:
                with_ref += 1
                right += answer_key(check_cfg, ref) == label
        for c, k in zip(comps, keys):
            out.append(labeled_row(c, reward=float(label is not None and k == label), extracted=k,
                                   correct=audit[c.prompt_id, c.index]))
    n = max(len(by_prompt), 1)
    metrics = {"labeled_prompts_frac": labeled / n, "agreement_mean": sum(agreement) / n}
    if with_ref:
        metrics["pseudo_label_accuracy"] = right / with_ref
    return out, metrics

