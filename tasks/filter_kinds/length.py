"""filter.kind=length: accepted samples, as `rft` accepts them, of the outputs whose length fits what
their prompt implies (Lee et al., ICML 2025: a self-labelled sum one digit short is wrong, however
many models agree on it).

A sample's length is its tokens (`measure: tokens`: the working and all) or its answer's
characters (`measure: answer`: what the check read). What fits it:

- `by: level` (the default): what its level implies. The round's accepted samples give each level
  their median length; a straight line through the medians of the levels below it says what this
  level's should be, so the hardest level, which the round labels itself, is measured by the
  easier ones it learned first (and never the other way round). With fewer than two levels below
  it, its own median.
- `by: level_median`: its level's own median. For a form whose length grows faster than its level
  (a working that repeats the digits still to add on every line), the line through the levels below
  falls short of the new level: on the worked form at 10 digits it said 428 tokens where the right
  answers took 457-481 and two answers one digit's step short took 420-426, so a tighter margin
  dropped the right ones first. The level's own median (473 there) holds both apart.
- `by: prompt`: the median length of its prompt's accepted samples.

A sample whose length is more than `margin` (a share: 0.25 is a quarter) from that is dropped
before the rest of rft's rules (duplicates, the cap per prompt). Only for a task with levels
(data.levels): every row carries its prompt's level.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import median
from typing import Literal

from pydantic import Field

from ratchet.data import events
from ratchet.data.errors import EmptyStageError
from ratchet.data.records import LabeledCompletion, SFTRow
from ratchet.tasks.filter_kinds import labeled
from ratchet.tasks.filter_kinds.rft import RFTFilter, accept


class LengthFilter(RFTFilter):
    """RFT's accepted samples, of the outputs whose length fits their level (or their prompt)."""

    kind: Literal["length"] = "length"
    by: Literal["level", "level_median", "prompt"] = Field(
        default="level", description="what a sample's length is held to: its level's (a line through the lower "
        "levels' median lengths), its level's own median (level_median: for a form whose length grows faster "
        "than its level), or its prompt's (the median of its prompt's accepted samples)")
    measure: Literal["tokens", "answer"] = Field(default="tokens", description="a sample's length: its tokens, or "
                                                 "its answer's characters (the answer the check read)")
    margin: float = Field(default=0.25, gt=0, description="the share a length may be off what fits it before the "
                          "sample is dropped (0.25: a quarter either way)")

    def build(self, req, store) -> tuple[list[SFTRow], dict[str, float]]:
        rows = labeled(req, store)
        fitting, metrics = fits(rows, self)
        kept, accepted = accept(fitting, self, req.seed)
        metrics.update(accepted)
        if len(kept) < self.min_rows:
            raise EmptyStageError(
                f"round {req.round}: filter accepted {len(kept)} rows < filter.min_rows={self.min_rows} "
                f"({int(metrics['dropped_length'])} of {len(rows)} completions were dropped for their length, "
                f"{int(accepted['dropped_below_reward'])} were below filter.min_reward={self.min_reward}). Widen "
                "filter.margin, sample more per prompt (sample.n), or lower filter.min_rows.")
        return kept, metrics

    def checks(self, pipeline) -> list[str]:
        if not pipeline.data.level_list():
            return [f"filter.kind='length' holds each output to what its level implies, and data.kind="
                    f"{pipeline.data.kind!r} has no levels here; give data.levels, or use filter.kind=rft"]
        return []

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"{events.count(m.get('accepted', 0))} rows accepted",
                f"{events.count(m.get('dropped_length', 0))} dropped for their length"]


def length_of(r: LabeledCompletion, measure: str) -> int | None:
    if measure == "tokens":
        return r.n_tokens
    return None if r.extracted is None else len(r.extracted)


def expected(points: dict[int, float], level: int) -> float | None:
    """What a level's length should be: a least-squares line through the (level, median) points of
    the levels below it, at `level`; with fewer than two below, the level's own median."""
    others = {x: y for x, y in points.items() if x < level}
    if len(others) < 2:
        return points.get(level)
    n = len(others)
    mx, my = sum(others) / n, sum(others.values()) / n
    slope = sum((x - mx) * (y - my) for x, y in others.items()) / sum((x - mx) ** 2 for x in others)
    return my + slope * (level - mx)


def fits(rows: list[LabeledCompletion], cfg: LengthFilter) -> tuple[list[LabeledCompletion], dict[str, float]]:
    """The rows whose length is within `margin` of what fits them, and how many were not, by level."""
    good = [r for r in rows if r.reward is not None and r.reward >= cfg.min_reward
            and length_of(r, cfg.measure) is not None]
    group = (lambda r: r.prompt_id) if cfg.by == "prompt" else (lambda r: r.level)
    lengths: dict = defaultdict(list)
    for r in good:
        lengths[group(r)].append(length_of(r, cfg.measure))
    medians = {g: float(median(v)) for g, v in lengths.items()}
    want_of = expected if cfg.by == "level" else (lambda points, g: points.get(g))  # the line, or its own
    judged = {id(r) for r in good}
    kept, dropped = [], defaultdict(int)
    for r in rows:
        n, g = length_of(r, cfg.measure), group(r)
        want = want_of(medians, g) if g is not None else None
        if id(r) in judged and want is not None and n is not None and abs(n - want) > cfg.margin * max(want, 1.0):
            dropped[r.level] += 1
            continue
        kept.append(r)
    metrics = {"dropped_length": float(sum(dropped.values()))}
    metrics.update({f"dropped_length.level_{k}": float(v) for k, v in sorted(dropped.items()) if k is not None})
    if cfg.by != "prompt":
        metrics.update({f"expected_length.level_{k}": v for k in sorted(medians) if k is not None
                        and (v := want_of(medians, k)) is not None})
    return kept, metrics
