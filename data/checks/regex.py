"""regex: group 1 of the last match of the user's pattern equals the reference, normalized."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from ratchet.data.checks.base import Check, Verdict, norm


class RegexCheck(Check):
    """Group 1 of the last match of `pattern` equals the reference, normalized."""

    kind: Literal["regex"] = "regex"
    pattern: str = Field(description=r"regex with one group, e.g. 'Answer:\s*(.+)'")

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
        matches = re.findall(self.pattern, response)
        if not matches:
            return None
        return matches[-1] if isinstance(matches[-1], str) else matches[-1][0]

    def check(self, response: str, answer: str) -> Verdict:
        last = self._last(response)
        return Verdict(False, None) if last is None else Verdict(norm(last) == norm(answer), last)

    def extract(self, response: str) -> str | None:
        last = self._last(response)
        return None if last is None else norm(last)
