"""math: the response's final answer equals the reference mathematically, read and compared by
`math-verify`: LaTeX or plain, fractions and decimals, sets, intervals, equivalent
expressions ("$(x+1)^2$" is "$x^2+2x+1$").

math-verify bounds its parsing and comparison with signal alarms, which work only on a
process's main thread (a stage's work runs on others). So the check runs in a process of its
own (data/checks/scorer.py), where math-verify's own time limits hold, and this side bounds
every call again: a response whose parse runs away is wrong, never a stalled or killed stage.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.checks.base import Check, Item, Verdict
from ratchet.data.checks.scorer import shared

LONGEST = 8192  # characters of a response read (its end, where the final answer is)


class MathCheck(Check):
    """The final answer equals the reference mathematically (math-verify: LaTeX, fractions, sets,
    intervals, equivalent expressions)."""

    kind: Literal["math"] = "math"
    timeout_s: float = Field(default=5.0, gt=0, allow_inf_nan=False, description="seconds math-verify may spend "
                             "parsing, and again comparing, one response; past them the response is wrong")
    float_rounding: int = Field(default=6, ge=0, le=15, description="decimal places numbers are compared to")

    extracts: ClassVar[bool] = False  # its answers are expressions: equal ones need not look alike

    def check(self, response: str, answer: str) -> Verdict:
        return self.check_many([Item(response, answer)])[0]

    def check_many(self, items: list[Item], tally=None) -> list[Verdict]:
        scorer = shared(verify_answer, batched=False, timeout_s=2 * self.timeout_s + 10)
        out = []
        for i in items:
            if i.answer is None:
                out.append(Verdict(None, None))
                continue
            call = scorer.call({"completion": i.response[-LONGEST:], "answer": i.answer,
                                "timeout_s": self.timeout_s, "float_rounding": self.float_rounding})
            if call.failure is not None:  # this side's bound, or math-verify itself broke: not a right answer
                out.append(Verdict(False, None, metrics={"math_failed": 1.0}))
            else:
                out.append(Verdict(call.score == 1.0, None))
        return out

    def problems(self, fields=()) -> list[str]:
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:
            return [f"{self.place}.kind='math' needs the math-verify package: pip install math-verify"]
        return []


def verify_answer(completion: str, answer=None, prompt=None, timeout_s: float = 5.0, float_rounding: int = 6,
                  **fields) -> float:
    """In the checking process, on its main thread: 1.0 if the completion's final answer equals
    the reference, else 0.0."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a timed-out parse is a verdict, not news
    seconds = max(1, math.ceil(timeout_s))  # its alarms take whole seconds
    gold = parse(answer if "$" in answer else f"${answer}$", parsing_timeout=seconds)
    pred = parse(completion, parsing_timeout=seconds)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, float_rounding=float_rounding, timeout_seconds=seconds))
