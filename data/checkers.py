"""Answer checks: read a response's final answer and compare it with the reference.

Each kind is one module of data/checks/ (its config model carries its behaviour); this module
registers them and gives the stages one way to call any of them. The built-in checks must
not be easy to game: `number` reads the last number and refuses enumerations, `steps` also
wants every running value stated (see their modules).

    number   the last number equals the reference
    exact    the whole response, normalized, equals it
    regex    group 1 of the pattern's last match equals it
    steps    a worked answer: every listed value stated in order, the last one last
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ratchet.data.checks.base import Check, Item, Verdict
from ratchet.data.checks.exact import ExactCheck
from ratchet.data.checks.number import NumberCheck
from ratchet.data.checks.regex import RegexCheck
from ratchet.data.checks.steps import StepsCheck, listed_values, shown_steps, worked

# The registration of every check kind: one member each.
AnyCheck = NumberCheck | ExactCheck | RegexCheck | StepsCheck
CheckConfig = Annotated[AnyCheck, Field(discriminator="kind")]

__all__ = ["AnyCheck", "Check", "CheckConfig", "ExactCheck", "Item", "NumberCheck", "RegexCheck", "StepsCheck",
           "Verdict", "answer_key", "check", "check_many", "extract", "graded", "listed_values", "shown_steps",
           "worked"]


def check(cfg: Check, response: str, answer: str) -> Verdict:
    return cfg.check(response, answer)


def check_many(cfg: Check, items: list[Item]) -> list[Verdict]:
    """Every item's verdict (None where it has no reference); a check that runs code outside this
    process does it in batches, with its own time bound."""
    return cfg.check_many(items)


def extract(cfg: Check, response: str) -> str | None:
    """The response's final answer as a comparable key, or None if it gives none."""
    return cfg.extract(response)


def answer_key(cfg: Check, answer: str) -> str | None:
    """A reference answer in the same canonical form `extract` gives responses."""
    return cfg.answer_key(answer)


def graded(cfg: Check, response: str, answer: str, partial: float) -> float:
    """A tree search's value of a response: 1 right, else the kind's partial credit (0 where it has none)."""
    return cfg.graded(response, answer, partial)
