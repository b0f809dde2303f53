"""filter.kind=pairs: preference pairs for DPO. Per prompt, the best-scored completion against the
worst, when their reward gap reaches `margin`; equal scores never make a pair. Duplicates and
unscored completions are left out first, and an optional length-bias guard refuses pairs whose
chosen side is much longer than the rejected one (the best pair that passes it is taken
instead)."""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.events import Shows
from ratchet.data.errors import EmptyStageError
from ratchet.data.records import LabeledCompletion, PairRow
from ratchet.tasks.filter_kinds import PAIRS_SHOWN, Filter, Rows, labeled, norm, pair_summary, verifier_view


class PairFilter(Filter):
    """Preference pairs (chosen, rejected) per prompt for DPO."""

    builds: ClassVar[Rows] = "pairs"
    shows: ClassVar[Shows] = PAIRS_SHOWN
    kind: Literal["pairs"] = "pairs"
    margin: float = Field(
        default=0.1, ge=0,
        description="least reward gap between chosen and rejected, in the label's units (0-1 for verifier, "
        "consistency and judge p_yes; 0-5 for the judge rubric); equal rewards never pair",
    )
    max_pairs_per_prompt: int = Field(default=1, ge=1, description="pairs per prompt, widest gap first, "
                                      "each completion used once")
    max_length_ratio: float | None = Field(
        default=None, ge=1,
        description="length-bias guard: refuse a pair whose chosen completion has more than this many times the "
        "rejected one's tokens (e.g. 1.5); null = off",
    )
    max_tokens: int | None = Field(default=None, ge=1, description="leave out completions longer than this")
    min_pairs: int = Field(default=16, ge=1, description="fewer pairs than this stops the round")

    def build(self, req, store) -> tuple[list[PairRow], dict[str, float]]:
        kept, metrics = build_pairs(labeled(req, store), self)
        if len(kept) < self.min_pairs:
            raise EmptyStageError(
                f"round {req.round}: filter built {len(kept)} preference pairs < filter.min_pairs={self.min_pairs} "
                f"from {int(metrics['prompts'])} prompts ({int(metrics['dropped_tie_prompts'])} had all-equal "
                f"rewards, {int(metrics['dropped_below_margin_prompts'])} no gap >= filter.margin={self.margin}, "
                f"{int(metrics['dropped_length_bias_prompts'])} only length-biased pairs, "
                f"{int(metrics['dropped_unscored'])} completions unscored). Sample more per prompt (sample.n), "
                "raise sample.temperature, lower filter.margin, raise or drop filter.max_length_ratio, "
                "or lower filter.min_pairs."
            )
        return kept, metrics

    def summary(self, m: dict[str, float]) -> list[str]:
        return pair_summary(m)

    def ceiling_checks(self, prompts: int, n: int) -> list[str]:
        most = prompts * min(self.max_pairs_per_prompt, n // 2)  # each completion in one pair at most
        if most >= self.min_pairs:
            return []
        return [f"filter.min_pairs={self.min_pairs} can never be reached: a round builds at most {most} pairs "
                f"({prompts} prompts x at most min(filter.max_pairs_per_prompt={self.max_pairs_per_prompt}, "
                f"sample.n={n} // 2) each: a completion is in one pair at most), so every round would stop at its "
                f"filter; set filter.min_pairs to at most {most}, or raise filter.max_pairs_per_prompt and sample.n, "
                "or give the round more prompts"]

    def reward_checks(self, lo: float, hi: float, label: str) -> list[str]:
        if self.margin > hi - lo:
            return [f"filter.margin={self.margin} is wider than the reward range [{lo:g}, {hi:g}] of {label}, so no "
                    f"pair can pass; set filter.margin below {hi - lo:g}"]
        return []


def build_pairs(rows: list[LabeledCompletion], cfg: PairFilter) -> tuple[list[PairRow], dict[str, float]]:
    """Pairs per prompt, widest reward gap first; ties and sub-margin gaps never pair.

    Candidates per prompt: scored, non-empty, not over max_tokens, first of each
    duplicate (by sample index). All (chosen, rejected) with gap >= margin and > 0 are
    ranked by (gap desc, chosen index, rejected index); pairs are taken greedily, each
    completion once, skipping any the length guard refuses.
    """
    by_prompt: dict[str, list[LabeledCompletion]] = defaultdict(list)
    for r in rows:
        by_prompt[r.prompt_id].append(r)
    pairs: list[PairRow] = []
    counts = {"unscored": 0, "duplicate": 0, "too_long": 0, "tie_prompts": 0, "below_margin_prompts": 0,
              "length_bias_prompts": 0, "single_prompts": 0}
    for pid in sorted(by_prompt):
        seen, cands = set(), []
        for r in sorted(by_prompt[pid], key=lambda r: r.index):
            if r.reward is None:
                counts["unscored"] += 1
            elif cfg.max_tokens is not None and r.n_tokens > cfg.max_tokens:
                counts["too_long"] += 1
            elif not r.text.strip() or norm(r.text) in seen:
                counts["duplicate"] += 1
            else:
                seen.add(norm(r.text))
                cands.append(r)
        if len(cands) < 2:
            counts["single_prompts"] += 1
            continue
        if len({c.reward for c in cands}) == 1:
            counts["tie_prompts"] += 1
            continue
        gaps = [(c, r) for c in cands for r in cands if c.reward - r.reward > 0 and c.reward - r.reward >= cfg.margin]
        same = [(c, r) for c, r in gaps if c.prompt_ids == r.prompt_ids]  # episodes of one start: DPO shares its ids
        if len(same) < len(gaps):
            counts["different_start"] = counts.get("different_start", 0) + len(gaps) - len(same)
        options = sorted(same,
                         key=lambda cr: (-(cr[0].reward - cr[1].reward), cr[0].index, cr[1].index))
        if not options:
            counts["below_margin_prompts"] += 1
            continue
        used: set[int] = set()
        taken = 0
        for c, r in options:
            if taken == cfg.max_pairs_per_prompt:
                break
            if c.index in used or r.index in used:
                continue
            if cfg.max_length_ratio is not None and c.n_tokens > cfg.max_length_ratio * max(r.n_tokens, 1):
                continue
            used.update((c.index, r.index))
            taken += 1
            pairs.append(PairRow(prompt_id=pid, prompt=c.prompt, chosen=c.text, rejected=r.text,
                                 chosen_reward=c.reward, rejected_reward=r.reward, chosen_tokens=c.n_tokens,
                                 rejected_tokens=r.n_tokens, chosen_correct=c.correct, rejected_correct=r.correct,
                                 prompt_ids=c.prompt_ids, chosen_segments=c.segments, rejected_segments=r.segments,
                                 chosen_outcome=c.outcome, rejected_outcome=r.outcome))
        if taken == 0:
            counts["length_bias_prompts"] += 1
    n = max(len(pairs), 1)
    metrics = {f"dropped_{k}": float(v) for k, v in counts.items()}
    metrics.update(
        pairs=float(len(pairs)), prompts=float(len(by_prompt)),
        prompts_covered=float(len({p.prompt_id for p in pairs})),
        reward_gap_mean=sum(p.chosen_reward - p.rejected_reward for p in pairs) / n,
        chosen_tokens_mean=sum(p.chosen_tokens for p in pairs) / n,
        rejected_tokens_mean=sum(p.rejected_tokens for p in pairs) / n,
    )
    metrics.update(verifier_view(pairs))
    return pairs, metrics
