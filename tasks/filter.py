"""filter: labeled completions -> the round's training set.

kind=rft: the accepted set for rejection-sampling fine-tuning. Keeps completions
whose reward reaches `min_reward`, drops exact duplicates (after whitespace/case
normalisation) within a prompt, drops over-long ones, and keeps at most
`max_per_prompt` per prompt (shortest first, or seeded random).

kind=pairs: preference pairs for DPO. Per prompt, the best-scored completion
against the worst, when their reward gap reaches `margin`; equal scores never make
a pair. Duplicates and unscored completions are left out first, and an optional
length-bias guard refuses pairs whose chosen side is much longer than the rejected
one (the best pair that passes it is taken instead).

kind=step_pairs: step-level preference pairs from the MCTS label's trees: at each
expanded node, the highest-Q child against the lowest-Q child when their Q gap
reaches `margin`, each completed by its best (resp. worst) trajectory, so the pair
shares the prefix up to the node and differs from the step where the values part.

Either way, a training set smaller than its minimum stops the round with the knobs
to turn: training on nothing would silently copy the parent model forward.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Annotated, ClassVar, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import events
from ratchet.data.errors import EmptyStageError
from ratchet.data.manifest import StageManifest
from ratchet.data.records import LabeledCompletion, PairRow, SFTRow, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.tasks.stage import StageRequest, run_stage

# What a filter kind writes and a train kind reads: accepted samples for fine-tuning, or preference pairs
Rows = Literal["rft", "pairs"]
ROWS: dict[str, str] = {"rft": "accepted samples", "pairs": "preference pairs"}


class RFTFilter(BaseModel):
    """Accepted samples for rejection-sampling fine-tuning: the right ones, deduplicated, capped per prompt."""

    model_config = ConfigDict(extra="forbid")
    builds: ClassVar[Rows] = "rft"
    reads: ClassVar[tuple[str, str] | None] = None
    kind: Literal["rft"] = "rft"
    min_reward: float = Field(default=1.0, description="accept completions with reward >= this")
    max_per_prompt: int = Field(default=2, ge=1, description="cap on accepted completions per prompt")
    max_tokens: int | None = Field(default=None, ge=1, description="drop accepted completions longer than this")
    prefer: Literal["shortest", "random", "best"] = Field(
        default="shortest", description="which to keep under the cap; best = the label's own order (for mcts: "
        "highest value, then Q, then visits)")
    min_rows: int = Field(default=16, ge=1, description="fewer accepted rows than this stops the round")

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"{events.count(m.get('accepted', 0))} rows accepted"]

    def reward_checks(self, lo: float, hi: float, label: str) -> list[str]:
        if self.min_reward > hi:
            return [f"filter.min_reward={self.min_reward} can never be reached: {label} gives rewards in "
                    f"[{lo:g}, {hi:g}]; set filter.min_reward to at most {hi:g}"]
        return []


class PairFilter(BaseModel):
    """Preference pairs (chosen, rejected) per prompt for DPO."""

    model_config = ConfigDict(extra="forbid")
    builds: ClassVar[Rows] = "pairs"
    reads: ClassVar[tuple[str, str] | None] = None
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

    def summary(self, m: dict[str, float]) -> list[str]:
        return pair_summary(m)

    def reward_checks(self, lo: float, hi: float, label: str) -> list[str]:
        if self.margin > hi - lo:
            return [f"filter.margin={self.margin} is wider than the reward range [{lo:g}, {hi:g}] of {label}, so no "
                    f"pair can pass; set filter.margin below {hi - lo:g}"]
        return []


class StepPairFilter(BaseModel):
    """Step-level preference pairs from the trees of label.kind='mcts' for DPO."""

    model_config = ConfigDict(extra="forbid")
    builds: ClassVar[Rows] = "pairs"
    reads: ClassVar[tuple[str, str] | None] = ("trees.jsonl", "search trees")  # a label kind's extra output
    kind: Literal["step_pairs"] = "step_pairs"
    margin: float = Field(default=0.3, ge=0, le=1, description="least Q gap (0-1) between the preferred and the "
                          "dispreferred sibling step; equal Q never pairs")
    min_visits: int = Field(default=1, ge=1, description="both siblings need at least this many visits")
    max_pairs_per_prompt: int = Field(default=2, ge=1, description="pairs per prompt, widest gap first")
    min_pairs: int = Field(default=16, ge=1, description="fewer pairs than this stops the round")

    def summary(self, m: dict[str, float]) -> list[str]:
        return pair_summary(m)

    def reward_checks(self, lo: float, hi: float, label: str) -> list[str]:
        return []  # Q values are on 0-1 whatever the label


def pair_summary(m: dict[str, float]) -> list[str]:
    out = [f"{events.count(m.get('pairs', 0))} pairs"]
    return out + ([f"pair accuracy {m['pair_accuracy']:.0%}"] if "pair_accuracy" in m else [])


FilterConfig = Annotated[RFTFilter | PairFilter | StepPairFilter, Field(discriminator="kind")]


class FilterJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    filter: FilterConfig
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        covered = [f"{events.count(m.get('prompts_covered', 0))}/{events.count(m['prompts'])} prompts"] \
            if "prompts" in m else []
        return self.filter.summary(m) + covered


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def accept(rows: list[LabeledCompletion], cfg: RFTFilter, seed: int) -> tuple[list[SFTRow], dict[str, float]]:
    by_prompt: dict[str, list[LabeledCompletion]] = defaultdict(list)
    for r in rows:
        by_prompt[r.prompt_id].append(r)
    rng = random.Random(seed)
    kept: list[SFTRow] = []
    dropped = {"below_reward": 0, "duplicate": 0, "too_long": 0, "over_cap": 0}
    for pid in sorted(by_prompt):
        seen, cands = set(), []
        for r in sorted(by_prompt[pid], key=lambda r: r.index):
            if r.reward is None or r.reward < cfg.min_reward:
                dropped["below_reward"] += 1
            elif cfg.max_tokens is not None and r.n_tokens > cfg.max_tokens:
                dropped["too_long"] += 1
            elif _norm(r.text) in seen or not r.text.strip():
                dropped["duplicate"] += 1
            else:
                seen.add(_norm(r.text))
                cands.append(r)
        if cfg.prefer == "shortest":
            cands.sort(key=lambda r: (r.n_tokens, r.index))
        elif cfg.prefer == "best":
            cands.sort(key=lambda r: r.index)
        else:
            rng.shuffle(cands)
        dropped["over_cap"] += max(0, len(cands) - cfg.max_per_prompt)
        kept += [SFTRow(prompt_id=r.prompt_id, prompt=r.prompt, completion=r.text, reward=r.reward)
                 for r in cands[: cfg.max_per_prompt]]
    metrics = {f"dropped_{k}": float(v) for k, v in dropped.items()}
    metrics.update(accepted=float(len(kept)), prompts_covered=float(len({r.prompt_id for r in kept})),
                   prompts=float(len(by_prompt)))
    return kept, metrics


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
            elif not r.text.strip() or _norm(r.text) in seen:
                counts["duplicate"] += 1
            else:
                seen.add(_norm(r.text))
                cands.append(r)
        if len(cands) < 2:
            counts["single_prompts"] += 1
            continue
        if len({c.reward for c in cands}) == 1:
            counts["tie_prompts"] += 1
            continue
        options = sorted(((c, r) for c in cands for r in cands
                          if c.reward - r.reward > 0 and c.reward - r.reward >= cfg.margin),
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
                                 rejected_tokens=r.n_tokens, chosen_correct=c.correct, rejected_correct=r.correct))
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


def verifier_view(pairs: list[PairRow]) -> dict[str, float]:
    """What the verifier thinks of the pairs the label built: right over wrong, and the reverse."""
    known = [p for p in pairs if p.chosen_correct is not None and p.rejected_correct is not None]
    if not known:
        return {}
    return {"pair_accuracy": sum(p.chosen_correct and not p.rejected_correct for p in known) / len(known),
            "pair_inverted": sum(p.rejected_correct and not p.chosen_correct for p in known) / len(known),
            "chosen_correct_frac": sum(p.chosen_correct for p in known) / len(known)}


def tree_pairs(trees: list, cfg: StepPairFilter) -> tuple[list[PairRow], dict[str, float]]:
    from ratchet.tasks.mcts import step_pairs

    pairs: list[PairRow] = []
    gaps, depths = [], []
    for t in trees:
        for p in step_pairs(t, cfg.margin, cfg.min_visits, cfg.max_pairs_per_prompt):
            pairs.append(PairRow(prompt_id=t.prompt_id, prompt=t.prompt, chosen=p["chosen"], rejected=p["rejected"],
                                 chosen_reward=p["chosen_q"], rejected_reward=p["rejected_q"],
                                 chosen_tokens=p["chosen_tokens"], rejected_tokens=p["rejected_tokens"],
                                 chosen_correct=p["chosen_correct"], rejected_correct=p["rejected_correct"]))
            gaps.append(p["gap"])
            depths.append(p["depth"])
    n = max(len(pairs), 1)
    metrics = {"pairs": float(len(pairs)), "prompts": float(len(trees)),
               "prompts_covered": float(len({p.prompt_id for p in pairs})), "q_gap_mean": sum(gaps) / n,
               "pair_depth_mean": sum(depths) / n, "root_pairs": float(sum(d == 0 for d in depths)),
               "chosen_tokens_mean": sum(p.chosen_tokens for p in pairs) / n,
               "rejected_tokens_mean": sum(p.rejected_tokens for p in pairs) / n}
    metrics.update(verifier_view(pairs))
    return pairs, metrics


def _tree_pair_set(req: StageRequest[FilterJob], store: ArtifactStore) -> tuple[list[PairRow], dict[str, float]]:
    import json

    from ratchet.tasks.mcts import Tree

    cfg = req.config.filter
    lab = req.parent("label")
    if "trees.jsonl" not in lab.outputs:
        raise EmptyStageError(f"filter.kind='step_pairs' needs the trees of label.kind='mcts'; the label stage "
                              f"{lab.dir} has none. Set label.kind='mcts' or filter.kind='pairs'")
    trees = [Tree.from_json(json.loads(x)) for x in store.path(lab, "trees.jsonl").read_text().splitlines()]
    kept, metrics = tree_pairs(trees, cfg)
    if len(kept) < cfg.min_pairs:
        raise EmptyStageError(
            f"round {req.round}: the trees of {len(trees)} prompts gave {len(kept)} step pairs < "
            f"filter.min_pairs={cfg.min_pairs} with filter.margin={cfg.margin} and "
            f"filter.min_visits={cfg.min_visits}. Raise label.simulations or label.k, lower filter.margin or "
            "filter.min_visits, add prompts, or lower filter.min_pairs."
        )
    return kept, metrics


def _pair_set(req: StageRequest[FilterJob], rows: list[LabeledCompletion]) -> tuple[list[PairRow], dict[str, float]]:
    cfg = req.config.filter
    kept, metrics = build_pairs(rows, cfg)
    if len(kept) < cfg.min_pairs:
        raise EmptyStageError(
            f"round {req.round}: filter built {len(kept)} preference pairs < filter.min_pairs={cfg.min_pairs} "
            f"from {int(metrics['prompts'])} prompts ({int(metrics['dropped_tie_prompts'])} had all-equal "
            f"rewards, {int(metrics['dropped_below_margin_prompts'])} no gap >= filter.margin={cfg.margin}, "
            f"{int(metrics['dropped_length_bias_prompts'])} only length-biased pairs, "
            f"{int(metrics['dropped_unscored'])} completions unscored). Sample more per prompt (sample.n), raise "
            "sample.temperature, lower filter.margin, raise or drop filter.max_length_ratio, "
            "or lower filter.min_pairs."
        )
    return kept, metrics


def _accepted_set(req: StageRequest[FilterJob], rows: list[LabeledCompletion]) -> tuple[list[SFTRow], dict[str, float]]:
    cfg = req.config.filter
    kept, metrics = accept(rows, cfg, req.seed)
    if len(kept) < cfg.min_rows:
        raise EmptyStageError(
            f"round {req.round}: filter accepted {len(kept)} rows < filter.min_rows={cfg.min_rows} "
            f"({int(metrics['dropped_below_reward'])} of {len(rows)} completions were below "
            f"filter.min_reward={cfg.min_reward}). Sample more per prompt (sample.n), raise sample.temperature, "
            "add prompts, or lower filter.min_rows / filter.min_reward."
        )
    return kept, metrics


def filter_body(req: StageRequest[FilterJob], store: ArtifactStore) -> StageManifest:
    cfg = req.config.filter
    labels = lambda: read_jsonl(store.path(req.parent("label"), "labels.jsonl"), LabeledCompletion)  # noqa: E731
    match cfg:
        case StepPairFilter():
            kept, metrics = _tree_pair_set(req, store)
        case PairFilter():
            kept, metrics = _pair_set(req, labels())
        case RFTFilter():
            kept, metrics = _accepted_set(req, labels())
        case _:
            assert_never(cfg)
    d = store.stage_dir(req.stage, req.key)
    n = write_jsonl(d / "train_set.jsonl", kept)
    return req.finish(store, outputs={"train_set.jsonl": n}, metrics=metrics, info={"rows": cfg.builds})


def filter_rows(store: ArtifactStore, labels: StageManifest, cfg: RFTFilter | PairFilter | StepPairFilter,
                seed: int, round: int, run: str | None = None) -> tuple[StageManifest, bool]:
    return run_stage(store, stage="filter", round=round, body=filter_body,
                     config=FilterJob(filter=cfg, seed=seed), parents=[labels], run=run)
