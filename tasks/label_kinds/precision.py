"""Label precision: how often the labels a round made itself are right, by references it never read.

Above data.labeled_levels, a train prompt reaches no stage with its reference answer, so a round
labels it itself (a vote across models, a vote among one model's samples). Its mistakes are what
the next round learns, and Lee et al. show them compounding round after round. This measures
them, per level, once the round is done: the share of the prompts its label labeled (a sample
earned the top reward) whose label the hidden reference calls right. The references come from
the task's source (data/prompts.py `references`), outside every stage: what this says reaches no
stage's inputs and no key, only the console, MLflow and the report.
"""

from __future__ import annotations

from collections import defaultdict

from ratchet.data.checkers import Item, check_many
from ratchet.data.records import LabeledCompletion


def precision(rows: list[LabeledCompletion], references: dict[str, str], check_cfg, top: float) -> dict[str, float]:
    """Per level (`precision.level_N`, and over all levels, `precision`): of the prompts with a hidden
    reference whose samples the label labeled (one sample earned `top`: the prompt's label is its
    answer), the share the reference calls right; `self_labeled.level_N`: how many prompts that is,
    `sampled.level_N`: of how many sampled."""
    chosen: dict[str, LabeledCompletion] = {}
    sampled: dict[int | None, set[str]] = defaultdict(set)
    for r in sorted(rows, key=lambda r: (r.prompt_id, r.index)):
        if r.prompt_id not in references:
            continue
        sampled[r.level].add(r.prompt_id)
        if r.reward is not None and r.reward >= top and r.prompt_id not in chosen:
            chosen[r.prompt_id] = r
    picked = list(chosen.values())
    verdicts = check_many(check_cfg, [Item(r.final, references[r.prompt_id], r.prompt, r.prompt_id, {}, None, None)
                                      for r in picked])
    right: dict[int | None, list[bool]] = defaultdict(list)
    for r, v in zip(picked, verdicts):
        right[r.level].append(bool(v.correct))
    out: dict[str, float] = {}
    for level in sorted(sampled, key=lambda x: -1 if x is None else x):
        at = "" if level is None else f".level_{level}"
        out[f"sampled{at}"] = float(len(sampled[level]))
        out[f"self_labeled{at}"] = float(len(right[level]))
        if right[level]:
            out[f"precision{at}"] = sum(right[level]) / len(right[level])
    if every := [x for v in right.values() for x in v]:
        out["precision"] = sum(every) / len(every)
    return out


def said(m: dict[str, float]) -> str:
    """The measure as the console says it: each level's precision and how many labels it is of."""
    levels = sorted(int(k.rsplit("_", 1)[1]) for k in m if k.startswith("precision.level_"))
    parts = [f"L{n} {m[f'precision.level_{n}']:.0%} of {int(m[f'self_labeled.level_{n}'])}" for n in levels]
    return "label precision (its own labels the hidden references call right): " + (", ".join(parts) or "no label")
