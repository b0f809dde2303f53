"""vote: a majority vote across models, no reference answers needed (Lee et al., ICML 2025).

The round's policy and `models - 1` voters answer the same prompts: voters of the same round
trained with other seeds (`of: seeds`: every model of the run is trained `models` times, each
with its own seed), or the versions before the policy (`of: versions`). Each model's answer to a
prompt is the majority of its own samples; where at least `share` of the models give one answer,
it is the prompt's label, and every sample of every model that gives it earns reward 1.0 (0.0
where it does not). A prompt below the share labels nothing: its samples are unscored. So an
error the models do not share is voted down, which a vote among one model's samples cannot do.

The models' samples are the label stage's parents (each model's sample stage), so the label is
keyed by every model's output and its lineage names each model.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from ratchet.data.checkers import answer_key, extract
from ratchet.data.records import Completion, LabeledCompletion, read_jsonl
from ratchet.tasks.label_kinds import Label, Labeled, agreement, labeled_row, truths, voting_check

SAMPLES = "samples.jsonl"


class VoteLabel(Label):
    """Reward = agreement with the answer at least `share` of the models give (label-free)."""

    kind: Literal["vote"] = "vote"
    online: ClassVar[str | None] = "votes across models' finished sample stages, and an online trainer has none"
    models: int = Field(default=3, ge=2, description="models that answer each prompt: the round's policy and "
                        "models - 1 voters (2 or more: one model's own samples vote with label.kind=consistency)")
    share: float = Field(default=0.7, gt=0.5, le=1, description="share of the models whose answer must agree for it "
                         "to be the prompt's label, above a half: 0.7 of 5 is 4 models, of 3 all three")
    of: Literal["seeds", "versions"] = Field(
        default="seeds", description="the voters: seeds (each model of the run trained `models` times from the same "
        "start, each time with its own seed: the cold start and every round's training; each voter a registered "
        "version) or versions (the `models - 1` versions before the round's policy; no more training)")

    @field_validator("models", mode="before")
    @classmethod
    def _more_than_one(cls, v):
        if isinstance(v, int) and v < 2:
            raise ValueError("a vote across models needs 2 or more (a vote among one model's own samples is "
                             "label.kind=consistency)")
        return v

    def voters(self) -> int:
        return self.models - 1

    def trains_voters(self) -> bool:
        return self.of == "seeds"

    def run(self, req, store, rows: list[Completion], check_cfg) -> Labeled:
        members = [read_jsonl(store.path(p, SAMPLES), Completion) for p in req.parents if SAMPLES in p.outputs]
        labeled, metrics = vote(members or [rows], check_cfg, self)
        return Labeled(labeled, {**metrics, **agreement(labeled)})

    def checks(self, pipeline) -> list[str]:
        return voting_check(self.kind, pipeline)

    def title(self) -> str:
        return f"vote of {self.models} models ({self.of})"


def member_answer(keys: list[str | None]) -> str | None:
    """A model's answer to a prompt: the unique majority of its samples' answers (None: no answer,
    or a tie)."""
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return None
    top = max(votes.values())
    winners = [k for k, v in votes.items() if v == top]
    return winners[0] if len(winners) == 1 else None


def vote(members: list[list[Completion]], check_cfg, cfg: VoteLabel) -> tuple[list[LabeledCompletion], dict]:
    """Every model's samples labeled by the models' vote: `members[0]` the policy's, then each
    voter's. A voter's sample keeps its place after the policy's: index = model * samples + its own."""
    by_prompt: dict[str, list[list[Completion]]] = defaultdict(lambda: [[] for _ in members])
    for m, rows in enumerate(members):
        for r in rows:
            by_prompt[r.prompt_id][m].append(r)
    everyone = [c for rows in members for c in rows]
    audit = dict(zip((id(c) for c in everyone), truths(check_cfg, everyone)))  # where references exist
    out: list[LabeledCompletion] = []
    labeled, shares, right, with_ref = 0, [], 0, 0
    for pid in sorted(by_prompt):
        each = [sorted(rows, key=lambda r: r.index) for rows in by_prompt[pid]]
        keys = [[extract(check_cfg, c.final) for c in rows] for rows in each]
        answers = Counter(a for a in (member_answer(k) for k in keys) if a is not None)
        label, share = None, 0.0
        if answers:
            top = max(answers.values())
            share = top / len(members)
            winners = [a for a, v in answers.items() if v == top]
            if len(winners) == 1 and share >= cfg.share:
                label = winners[0]
        shares.append(share)
        flat = [c for rows in each for c in rows]
        if label is not None:
            labeled += 1
            ref = flat[0].answer if flat else None
            if ref is not None:
                with_ref += 1
                right += answer_key(check_cfg, ref) == label
        width = max((len(rows) for rows in each), default=0)
        for m, (rows, ks) in enumerate(zip(each, keys)):
            for c, k in zip(rows, ks):
                row = labeled_row(c, reward=None if label is None else float(k == label), extracted=k,
                                  correct=audit[id(c)])
                out.append(row.model_copy(update={"index": m * width + c.index}) if m else row)
    n = max(len(by_prompt), 1)
    metrics = {"labeled_prompts_frac": labeled / n, "vote_share_mean": sum(shares) / n, "models": float(len(members))}
    if with_ref:
        metrics["pseudo_label_accuracy"] = right / with_ref
    return out, metrics
