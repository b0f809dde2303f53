"""addition: the built-in verifiable task, "What is a + b?" over every pair a < a_max, b < b_max,
shuffled by seed and split by pair into disjoint train and held-out sets, so a held-out
question is never trained on."""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field, field_validator

from ratchet.data.checkers import CheckConfig, NumberCheck
from ratchet.data.errors import ConfigError
from ratchet.data.records import Prompt
from ratchet.data.sources.base import PoolSource, Split, check_placeholders


class AdditionSource(PoolSource):
    """Built-in: single-step integer addition with a checkable answer."""

    kind: Literal["addition"] = "addition"
    a_max: int = Field(default=20, ge=1, description="first operand ranges over 0..a_max-1")
    b_max: int = Field(default=10, ge=1, description="second operand ranges over 0..b_max-1")
    template: str = Field(default="What is {a} + {b}?", description="prompt text with {a} and {b}")
    eval_size: int = Field(default=50, ge=1, description="pairs held out for evaluation")
    train_size: int | None = Field(default=None, ge=1, description="cap on train prompts (None = all the rest)")
    check: CheckConfig = Field(default_factory=NumberCheck, description="answer check")

    @field_validator("template")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        return check_placeholders(v, {"a", "b"})

    def load(self, seed: int, train_answers: bool) -> Split:
        return _addition(self, seed)


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
