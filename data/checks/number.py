"""number: the last number in the response equals the reference, numerically.

It reads the LAST number ("7 + 5 = 12" reads 12) and refuses responses that list more than
`max_numbers` distinct numbers, so enumerating candidates ("11 12 13 14 ...") never scores.
A worked answer states numbers too ("3 x 4 = 12, 12 - 2 = 10" has four): such refusals are
counted per stage (`form_too_many_numbers`) and said on the console, so a limit too low for
the task shows; raise `max_numbers` for tasks whose answers show their work.
"""

from __future__ import annotations

import math
import re
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.checks.base import NUM, Check, Verdict, canonical, number_key, to_float


_INT = re.compile(r"-?\d+")


class NumberCheck(Check):
    """The last number in the response equals the reference (numerically)."""

    reads_numbers: ClassVar[bool] = True
    kind: Literal["number"] = "number"
    max_numbers: int = Field(
        default=4, ge=1, description="responses with more distinct numbers than this are wrong (anti-enumeration)"
    )
    tolerance: float = Field(default=1e-6, ge=0, description="absolute tolerance for non-integer answers")

    def check(self, response: str, answer: str) -> Verdict:
        nums = NUM.findall(response)
        if not nums:
            return Verdict(False, None, form="no_number")
        last = nums[-1]
        if len({to_float(n) for n in nums}) > self.max_numbers:
            return Verdict(False, last, form="too_many_numbers")
        return Verdict(same_number(last, answer, self.tolerance), last)

    def extract(self, response: str) -> str | None:
        """Numbers are canonicalised ("1,234" and "1234.0" both read "1234"), so answers that mean
        the same vote together."""
        return last_number(response, self.max_numbers)

    def answer_key(self, answer: str) -> str | None:
        return number_key(answer)

    def graded(self, response: str, answer: str, partial: float) -> float:
        """1 right; a wrong number `partial` / (1 + its distance from the reference); 0 for no number
        or more distinct numbers than allowed, so listing many numbers earns nothing."""
        if self.check(response, answer).correct:
            return 1.0
        got, want = self.extract(response), to_float(answer.strip())
        if got is None or want is None or (g := to_float(got)) is None or not math.isfinite(want):
            return 0.0
        return partial / (1.0 + abs(g - want))


def same_number(got: str, want: str, tolerance: float) -> bool:
    """Two numbers as written, equal within `tolerance`; integers compare exactly, however long
    (a float reads a 400-digit integer as inf, and inf is no answer)."""
    a, b = got.replace(",", "").strip(), want.replace(",", "").strip()
    if _INT.fullmatch(a) and _INT.fullmatch(b) and max(len(a), len(b)) <= 4000:  # Python's int parsing limit
        return abs(int(a) - int(b)) <= tolerance
    x, y = to_float(a), to_float(b)
    return x is not None and y is not None and math.isfinite(x) and math.isfinite(y) and abs(x - y) <= tolerance


def last_number(response: str, max_numbers: int) -> str | None:
    nums = NUM.findall(response)
    if not nums or len({to_float(n) for n in nums}) > max_numbers:
        return None
    value = to_float(nums[-1])
    return None if value is None else canonical(value, nums[-1])
