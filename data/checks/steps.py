"""steps: a worked answer. The reference lists the values a derivation passes through ("6, 1,
8"), and a response is right only if its last number is the last value and it states every
value, in order, as a result ("7 - 1 = 6", "... gives us 1"), so a right last number reached
by luck is wrong.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.checks.base import NUM, Check, Verdict, canonical, to_float
from ratchet.data.checks.number import NumberCheck, last_number

_RESULT = re.compile(r"(?:=|\b(?:is|are|equals|gives(?: us)?|gets?|leaves|makes|results in)\b)\s*"
                     r"(-?\d+(?:\.\d+)?)(?!\w)(?!\.\d)")  # a stated result: "= 6", "gives us 6"


class StepsCheck(Check):
    """A worked answer: the reference lists the values a derivation reaches, in order ("6, 1,
    8"); right when the last number is the last value and every value is stated as a result."""

    reads_numbers: ClassVar[bool] = True
    kind: Literal["steps"] = "steps"
    max_numbers: int = Field(
        default=9, ge=1, description="responses with more distinct numbers than this are wrong (anti-enumeration)"
    )
    tolerance: float = Field(default=1e-6, ge=0, description="absolute tolerance for non-integer values")

    def check(self, response: str, answer: str) -> Verdict:
        values = listed_values(answer)
        if values is None:
            return Verdict(False, self.extract(response))
        return worked(self, response, values)

    def extract(self, response: str) -> str | None:
        return last_number(response, self.max_numbers)

    def answer_key(self, answer: str) -> str | None:
        """Its last value: the final answer."""
        values = listed_values(answer)
        return canonical(values[-1], NUM.findall(answer)[-1]) if values else None

    def graded(self, response: str, answer: str, partial: float) -> float:
        """1 right; else `partial` x the share of the reference's values the response states in
        order (a derivation right so far earns more than one that went wrong early)."""
        if self.check(response, answer).correct:
            return 1.0
        values = listed_values(answer)
        return partial * shown_steps(self, response, values) / len(values) if values else 0.0


def listed_values(answer: str) -> list[float] | None:
    """The values a `steps` reference lists ("6, 1, 8" -> [6.0, 1.0, 8.0]); None if it has none."""
    values = [to_float(n) for n in NUM.findall(answer)]
    return values if values and None not in values else None


def shown_steps(cfg: NumberCheck | StepsCheck, response: str, values: list[int | float]) -> int:
    """How many of a worked answer's reference values (in order: the running values, the
    last being the answer) the response states as results ("7 - 1 = 6", "... gives us 6"),
    in that order; 0 for a response listing more distinct numbers than the check allows.
    It tells a derived answer from a lucky last number: a response that reaches the answer
    without stating the values before it shows fewer than all of them."""
    nums = NUM.findall(response)
    if len({to_float(n) for n in nums}) > cfg.max_numbers:
        return 0
    shown = 0
    for got in _RESULT.findall(response):
        if shown < len(values) and abs(float(got) - float(values[shown])) <= cfg.tolerance:
            shown += 1
    return shown


def worked(cfg: NumberCheck | StepsCheck, response: str, values: list[int | float]) -> Verdict:
    """The `steps` verdict on reference values: right when the last number is the last value
    and every value is stated as a result, in order."""
    last = NumberCheck(max_numbers=cfg.max_numbers, tolerance=cfg.tolerance).check(response, str(values[-1]))
    return Verdict(last.correct and shown_steps(cfg, response, values) == len(values), last.extracted)
