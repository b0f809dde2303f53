"""filter.kind=rft: the accepted set for rejection-sampling fine-tuning. Keeps completions whose
reward reaches `min_reward`, drops exact duplicates (after whitespace/case normalisation) within
a prompt, drops over-long ones, and keeps at most `max_per_prompt` per prompt (shortest first,
the label's own order, or seeded random)."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data import events
from ratchet.data.events import Shows
from ratchet.data.errors import EmptyStageError
from ratchet.data.records import LabeledCompletion, SFTRow
from ratchet.tasks.filter_kinds import Filter, Rows, labeled, norm


class RFTFilter(Filter):
    """Accepted samples for rejection-sampling fine-tuning: the right ones, deduplicated, capped per prompt."""

    builds: ClassVar[Rows] = "rft"
    shows: ClassVar[Shows] = Shows(rows=("accepted", "accepted rows"))
    kind: Literal["rft"] = "rft"
    min_reward: float = Field(default=1.0, description="accept completions with reward >= this")
    max_per_prompt: int = Field(default=2, ge=1, description="cap on accepted completions per prompt")
    max_tokens: int | None = Field(default=None, ge=1, description="drop accepted completions longer than this")
    prefer: Literal["shortest", "random", "best"] = Field(
        default="shortest", description="which to keep under the cap; best = the label's own order (for mcts: "
        "highest value, then Q, then visits)")
    min_rows: int = Field(default=16, ge=1, description="fewer accepted rows than this stops the round")

    def build(self, req, store) -> tuple[list[SFTRow], dict[str, float]]:
        rows = labeled(req, store)
        kept, metrics = accept(rows, self, req.seed)
        if len(kept) < self.min_rows:
            raise EmptyStageError(
                f"round {req.round}: filter accepted {len(kept)} rows < filter.min_rows={self.min_rows} "
                f"({int(metrics['dropped_below_reward'])} of {len(rows)} completions were below "
                f"filter.min_reward={self.min_reward}). Sample more per prompt (sample.n), raise "
                "sample.temperature, add prompts, or lower filter.min_rows / filter.min_reward."
            )
        return kept, metrics

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"{events.count(m.get('accepted', 0))} rows accepted"]

    def ceiling_checks(self, prompts: int, n: int) -> list[str]:
        most = prompts * min(self.max_per_prompt, n)
        if most >= self.min_rows:
            return []
        return [f"filter.min_rows={self.min_rows} can never be reached: a round accepts at most {most} rows ({prompts} "
                f"prompts x at most min(filter.max_per_prompt={self.max_per_prompt}, sample.n={n}) each), so every "
                f"round would stop at its filter; set filter.min_rows to at most {most}, or raise "
                "filter.max_per_prompt and sample.n, or give the round more prompts"]

    def reward_checks(self, lo: float, hi: float, label: str) -> list[str]:
        if self.min_reward > hi:
            return [f"filter.min_reward={self.min_reward} can never be reached: {label} gives rewards in "
                    f"[{lo:g}, {hi:g}]; set filter.min_reward to at most {hi:g}"]
        return []


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
            elif norm(r.text) in seen or not r.text.strip():
                dropped["duplicate"] += 1
            else:
                seen.add(norm(r.text))
                cands.append(r)
        if cfg.prefer == "shortest":
            cands.sort(key=lambda r: (r.n_tokens, r.index))
        elif cfg.prefer == "best":
            cands.sort(key=lambda r: r.index)
        else:
            rng.shuffle(cands)
        dropped["over_cap"] += max(0, len(cands) - cfg.max_per_prompt)
        kept += [SFTRow(prompt_id=r.prompt_id, prompt=r.prompt, completion=r.text, reward=r.reward, **r.turns())
                 for r in cands[: cfg.max_per_prompt]]
    metrics = {f"dropped_{k}": float(v) for k, v in dropped.items()}
    metrics.update(accepted=float(len(kept)), prompts_covered=float(len({r.prompt_id for r in kept})),
                   prompts=float(len(by_prompt)))
    return kept, metrics
