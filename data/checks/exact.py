"""exact: the whole response, normalized (case, spaces, trailing period), equals the reference."""

from __future__ import annotations

from typing import Literal

from ratchet.data.checks.base import Check, Verdict, norm


class ExactCheck(Check):
    """The whole response, normalized (case, spaces, trailing period), equals the reference."""

    kind: Literal["exact"] = "exact"

    def check(self, response: str, answer: str) -> Verdict:
        return Verdict(norm(response) == norm(answer), response.strip())

    def extract(self, response: str) -> str | None:
        return norm(response)
