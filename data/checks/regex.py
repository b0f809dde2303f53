"""regex: group 1 of the last match of the user's pattern equals the reference, normalized.

The pattern is the user's and the text is the model's, so a pattern that backtracks badly
(`(a+)+$`) meets text that makes it: every search runs under `timeout_s` (the `regex`
module's own time bound, checked inside its matcher), and a response it cannot read in that
time is wrong, a row's loss rather than a stalled stage.
"""

from __future__ import annotations

from typing import Literal

import regex as re

from pydantic import Field, field_validator

from ratchet.data.checks.base import Check, Verdict, norm


class RegexCheck(Check):
    """Group 1 of the last match of `pattern` equals the reference, normalized."""

    kind: Literal["regex"] = "regex"
    pattern: str = Field(description=r"regex with one group, e.g. 'Answer:\s*(.+)'")
    timeout_s: float = Field(default=1.0, gt=0, allow_inf_nan=False, description="a search of one response that "
                             "runs longer reads no answer (the response is wrong)")

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            groups = re.compile(v).groups
        except re.error as e:
            raise ValueError(f"not a valid regular expression ({e})") from None
        if groups < 1:
            raise ValueError("the pattern needs a group around the answer, e.g. 'Answer:\\s*(.+)'")
        return v

    def _last(self, response: str) -> str | None:
        try:
            matches = re.findall(self.pattern, response, timeout=self.timeout_s)
        except TimeoutError:
            return None
        if not matches:
            return None
        return matches[-1] if isinstance(matches[-1], str) else matches[-1][0]

    def check(self, response: str, answer: str) -> Verdict:
        last = self._last(response)
        return Verdict(False, None, form="no_match") if last is None else Verdict(norm(last) == norm(answer), last)

    def extract(self, response: str) -> str | None:
        last = self._last(response)
        return None if last is None else norm(last)
