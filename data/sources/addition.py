"""addition: the built-in verifiable task, "What is a + b?" over every pair a < a_max, b < b_max,
shuffled by seed and split by pair into disjoint train and held-out sets, so a held-out
question is never trained on.

With `levels` (digit counts), level N asks N-digit + N-digit: each level draws its own
eval_size held-out and train_size train pairs, seeded by the level, so a level's prompts are
the same whichever other levels the config lists."""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ratchet.data.checkers import CheckConfig, NumberCheck
from ratchet.data.errors import ConfigError
from ratchet.data.records import Prompt
from ratchet.data.sources.base import PoolSource, Split, check_placeholders

LEVEL_TRAIN = 500  # train pairs a level draws where train_size is unset
MAX_DIGITS = 18


class AdditionSource(PoolSource):
    """Built-in: single-step integer addition with a checkable answer."""

    kind: Literal["addition"] = "addition"
    a_max: int = Field(default=20, ge=1, description="first operand ranges over 0..a_max-1")
    b_max: int = Field(default=10, ge=1, description="second operand ranges over 0..b_max-1")
    template: str = Field(default="What is {a} + {b}?", description="prompt text with {a} and {b}")
    eval_size: int = Field(default=50, ge=1, description="pairs held out for evaluation")
    train_size: int | None = Field(default=None, ge=1, description="cap on train prompts (None = all the rest; "
                                   f"with levels, {LEVEL_TRAIN} a level, or what the level has)")
    check: CheckConfig = Field(default_factory=NumberCheck, description="answer check")
    levels: list[int] | None = Field(default=None, exclude_if=lambda v: v is None, min_length=1,
                                     description="difficulty levels, each a digit count: level N asks N-digit + "
                                     "N-digit (level 1: 0-9), with eval_size held-out and train_size train pairs of "
                                     "its own; a_max and b_max do not apply. Unset: every pair a < a_max, b < b_max")

    @field_validator("template")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        return check_placeholders(v, {"a", "b"})

    @field_validator("levels")
    @classmethod
    def _levels(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if bad := [x for x in v if not 1 <= x <= MAX_DIGITS]:
            raise ValueError(f"levels {bad} are not digit counts from 1 to {MAX_DIGITS}")
        if v != sorted(set(v)):
            raise ValueError(f"levels {v} must rise, each once: easiest first (e.g. [1, 2, 3])")
        return v

    @model_validator(mode="after")
    def _level_sizes(self) -> AdditionSource:
        if self.levels is None:
            return self
        fields = type(self).model_fields
        if given := sorted(n for n in ("a_max", "b_max") if getattr(self, n) != fields[n].default):
            raise ValueError(f"data.{' and data.'.join(given)} do not apply with data.levels (each level's operands "
                             "have its number of digits); drop them")
        if self.levels[0] == 1 and self.eval_size >= 100:
            raise ValueError(f"level 1 (one digit) has 100 pairs: eval_size={self.eval_size} leaves none to train on; "
                             "lower data.eval_size, or start the levels at 2")
        return self

    def load(self, seed: int, train_answers: bool) -> Split:
        return _addition(self, seed) if self.levels is None else _levelled(self, seed)


def _addition(cfg: AdditionSource, seed: int) -> Split:
    pairs = [(a, b) for a in range(cfg.a_max) for b in range(cfg.b_max)]
    if cfg.eval_size >= len(pairs):
        raise ConfigError(
            [f"data.eval_size={cfg.eval_size} leaves no train prompts out of {len(pairs)} pairs; "
             "lower data.eval_size or raise data.a_max / data.b_max"]
        )
    random.Random(seed).shuffle(pairs)
    rows = [
        Prompt(id=f"add-{a}-{b}", prompt=cfg.template.format(a=a, b=b), answer=str(a + b), task="addition")
        for a, b in pairs
    ]
    ev, tr = rows[: cfg.eval_size], rows[cfg.eval_size :]
    return Split(tr[: cfg.train_size] if cfg.train_size else tr, ev)


def _levelled(cfg: AdditionSource, seed: int) -> Split:
    """Each level's own pairs, drawn apart: eval_size held out first, then train_size to train on."""
    train, ev = [], []
    for n in cfg.levels:
        lo, hi = (0 if n == 1 else 10 ** (n - 1)), 10 ** n - 1
        space = (hi - lo + 1) ** 2
        want = min(cfg.eval_size + (cfg.train_size or LEVEL_TRAIN), space)  # level 1 trains on what it has
        rng = random.Random(f"addition-{seed}-level-{n}")
        if space <= 4 * want:
            pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
            rng.shuffle(pairs)
            pairs = pairs[:want]
        else:
            seen: set[tuple[int, int]] = set()
            pairs = []
            while len(pairs) < want:
                pair = (rng.randint(lo, hi), rng.randint(lo, hi))
                if pair not in seen:
                    seen.add(pair)
                    pairs.append(pair)
        rows = [Prompt(id=f"add-{a}-{b}", prompt=cfg.template.format(a=a, b=b), answer=str(a + b), task="addition",
                       level=n) for a, b in pairs]
        ev += rows[:cfg.eval_size]
        train += rows[cfg.eval_size:]
    return Split(train, ev)
