"""Answer checks: read a response's final answer and compare it with the reference.

The check must not be easy to game. `number` reads the LAST number in the response
(so "7 + 5 = 12" reads 12) and rejects responses that list more than
`max_numbers` distinct numbers, so enumerating candidates ("11 12 13 14 ...")
never scores. `steps` is stricter: the reference lists the values a derivation passes
through ("6, 1, 8"), and a response is right only if its last number is the last value
and it states every value, in order, as a result ("7 - 1 = 6", "... gives us 1"), so a
right last number reached by luck is wrong.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Annotated, Literal, assert_never

from pydantic import BaseModel, ConfigDict, Field, field_validator

_NUM = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?![\w])")


class NumberCheck(BaseModel):
    """The last number in the response equals the reference (numerically)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["number"] = "number"
    max_numbers: int = Field(
        default=4, ge=1, description="responses with more distinct numbers than this are wrong (anti-enumeration)"
    )
    tolerance: float = Field(default=1e-6, ge=0, description="absolute tolerance for non-integer answers")


class ExactCheck(BaseModel):
    """The whole response, normalized (case, spaces, trailing period), equals the reference."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["exact"] = "exact"


class RegexCheck(BaseModel):
    """Group 1 of the last match of `pattern` equals the reference, normalized."""

    model_config = ConfigDict(extra="forbid")
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


class StepsCheck(BaseModel):
    """A worked answer: the reference lists the values a derivation reaches, in order ("6, 1,
    8"); right when the last number is the last value and every value is stated as a result."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["steps"] = "steps"
    max_numbers: int = Field(
        default=9, ge=1, description="responses with more distinct numbers than this are wrong (anti-enumeration)"
    )
    tolerance: float = Field(default=1e-6, ge=0, description="absolute tolerance for non-integer values")


CheckConfig = Annotated[NumberCheck | ExactCheck | RegexCheck | StepsCheck, Field(discriminator="kind")]
AnyCheck = NumberCheck | ExactCheck | RegexCheck | StepsCheck


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: str | None


def _norm(s: str) -> str:
    s = unicodedata.normalize("NFKC", s).strip().lower()
    s = re.sub(r"\s+", " ", s)
    return s.rstrip(".").strip()


def _to_float(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def listed_values(answer: str) -> list[float] | None:
    """The values a `steps` reference lists ("6, 1, 8" -> [6.0, 1.0, 8.0]); None if it has none."""
    values = [_to_float(n) for n in _NUM.findall(answer)]
    return values if values and None not in values else None


def extract(cfg: AnyCheck, response: str) -> str | None:
    """The response's final answer as a comparable key, or None if it gives none.

    Numbers are canonicalised ("1,234" and "1234.0" both read "1234"), so answers
    that mean the same vote together.
    """
    match cfg.kind:
        case "number" | "steps":
            nums = _NUM.findall(response)
            if not nums or len({_to_float(n) for n in nums}) > cfg.max_numbers:
                return None
            value = _to_float(nums[-1])
            return None if value is None else format(value, "g") if value != int(value) else str(int(value))
        case "exact":
            return _norm(response)
        case "regex":
            matches = re.findall(cfg.pattern, response)
            if not matches:
                return None
            last = matches[-1] if isinstance(matches[-1], str) else matches[-1][0]
            return _norm(last)
        case _:
            assert_never(cfg)


def graded(cfg: AnyCheck, response: str, answer: str, partial: float) -> float:
    """1 for a correct response; for a wrong number, `partial` / (1 + its distance from the
    reference); for a `steps` check, `partial` x the share of the reference's values the
    response states in order (a derivation right so far earns more than one that went wrong
    early); 0 for anything the check cannot read (no number, or more distinct numbers than it
    allows, so listing many numbers earns nothing) and for exact and regex checks."""
    if check(cfg, response, answer).correct:
        return 1.0
    if cfg.kind == "steps":
        values = listed_values(answer)
        return partial * shown_steps(cfg, response, values) / len(values) if values else 0.0
    got, want = extract(cfg, response), _to_float(answer.strip())
    if cfg.kind != "number" or got is None or want is None:
        return 0.0
    return partial / (1.0 + abs(float(got) - want))


_RESULT = re.compile(r"(?:=|\b(?:is|are|equals|gives(?: us)?|gets?|leaves|makes|results in)\b)\s*"
                     r"(-?\d+(?:\.\d+)?)(?!\w)(?!\.\d)")  # a stated result: "= 6", "gives us 6"


def shown_steps(cfg: NumberCheck | StepsCheck, response: str, values: list[int | float]) -> int:
    """How many of a worked answer's reference values (in order: the running values, the
    last being the answer) the response states as results ("7 - 1 = 6", "... gives us 6"),
    in that order; 0 for a response listing more distinct numbers than the check allows.
    It tells a derived answer from a lucky last number: a response that reaches the answer
    without stating the values before it shows fewer than all of them."""
    nums = _NUM.findall(response)
    if len({_to_float(n) for n in nums}) > cfg.max_numbers:
        return 0
    shown = 0
    for got in _RESULT.findall(response):
        if shown < len(values) and abs(float(got) - float(values[shown])) <= cfg.tolerance:
            shown += 1
    return shown


def worked(cfg: NumberCheck | StepsCheck, response: str, values: list[int | float]) -> Verdict:
    """The `steps` verdict on reference values: right when the last number is the last value
    and every value is stated as a result, in order."""
    last = check(NumberCheck(max_numbers=cfg.max_numbers, tolerance=cfg.tolerance), response, str(values[-1]))
    return Verdict(last.correct and shown_steps(cfg, response, values) == len(values), last.extracted)


def answer_key(cfg: AnyCheck, answer: str) -> str | None:
    """A reference answer in the same canonical form `extract` gives responses (for `steps`,
    its last value: the final answer)."""
    match cfg.kind:
        case "number" | "steps":
            values = listed_values(answer) if cfg.kind == "steps" else [_to_float(answer.strip())]
            value = values[-1] if values else None
            if value is None:
                return None
            return format(value, "g") if value != int(value) else str(int(value))
        case "exact" | "regex":
            return _norm(answer)
        case _:
            assert_never(cfg)


def check(cfg: AnyCheck, response: str, answer: str) -> Verdict:
    match cfg.kind:
        case "steps":
            values = listed_values(answer)
            if values is None:
                return Verdict(False, extract(cfg, response))
            return worked(cfg, response, values)
        case "number":
            nums = _NUM.findall(response)
            if not nums:
                return Verdict(False, None)
            last = nums[-1]
            distinct = {_to_float(n) for n in nums}
            if len(distinct) > cfg.max_numbers:
                return Verdict(False, last)
            got, want = _to_float(last), _to_float(answer)
            ok = got is not None and want is not None and abs(got - want) <= cfg.tolerance
            return Verdict(ok, last)
        case "exact":
            return Verdict(_norm(response) == _norm(answer), response.strip())
        case "regex":
            matches = re.findall(cfg.pattern, response)
            if not matches:
                return Verdict(False, None)
            last = matches[-1] if isinstance(matches[-1], str) else matches[-1][0]
            return Verdict(_norm(last) == _norm(answer), last)
        case _:
            assert_never(cfg)
