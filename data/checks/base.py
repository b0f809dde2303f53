"""What every answer check is: a `Check` (its config model, its behaviour) and its `Verdict`."""

from __future__ import annotations

import math
import re
import unicodedata
from abc import abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr

NUM = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?![\w])")


@dataclass(frozen=True)
class Verdict:
    """A check's judgement of one response. `score` is the reward it gives (default: 1 right,
    0 wrong; None: unscored, never guessed); `metrics` anything else a user's check returned;
    `form` names the rule of form a wrong response broke (too many numbers, no match), so those
    zeroes are counted and said, never silent."""

    correct: bool | None
    extracted: str | None
    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    form: str | None = None  # why the check read no answer from its form, not its content ("no_number", ...)

    @property
    def reward(self) -> float | None:
        if self.score is not None:
            return self.score
        return None if self.correct is None else float(self.correct)


@dataclass
class Tally:
    """A check's failed rows over many calls (a unit of work that checks in several batches,
    such as a tree search), held against the check's failure budget once, at the end (`settle`)."""

    rows: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (row id, what went wrong)


@dataclass(frozen=True)
class Item:
    """One response to check, with what a check may read beside it."""

    response: str
    answer: str | None
    prompt: str | None = None
    id: str = ""  # the row, for messages
    fields: dict[str, Any] = field(default_factory=dict)
    ret: float | None = None  # an environment episode's return (None: no episode, or its environment failed)
    ended: str | None = None  # how an environment episode ended (done, max_turns, length, failed)


class Check(BaseModel):
    """An answer check. Subclasses set `kind` and implement `check`; the rest have defaults.

    reads_numbers: its verdict reads numbers, so a wrong number's distance means something
      (the MCTS 'graded' value needs it).
    extracts: `extract` gives an answer key that answers can vote with (majority vote needs it).
    needs_answer: it compares with a reference answer, so every row it checks needs one.
    reads_fields: it reads a row's other columns (Item.fields), so a file source carries them
      through its prompts and samples.
    reads_return: it scores an environment episode's return (Item.ret), not a text, so every
      rollout it scores must play episodes against an environment.
    """

    model_config = ConfigDict(extra="forbid")
    reads_numbers: ClassVar[bool] = False
    extracts: ClassVar[bool] = True
    needs_answer: ClassVar[bool] = True
    reads_fields: ClassVar[bool] = False
    reads_return: ClassVar[bool] = False
    _place: str = PrivateAttr(default="data.check")  # where it sits in the config; not part of any key

    @property
    def place(self) -> str:
        """Where this check sits in the config, as its messages name it: data.check unless the section
        that holds it placed it elsewhere (label.check, evaluate.sets[1].check)."""
        return self._place

    def placed(self, place: str) -> Check:
        """This check, named `place` in every message it gives from now on."""
        self._place = place
        return self

    @abstractmethod
    def check(self, response: str, answer: str) -> Verdict: ...

    def extract(self, response: str) -> str | None:
        """The response's final answer as a comparable key, or None if it gives none."""
        return None

    def answer_key(self, answer: str) -> str | None:
        """A reference answer in the form `extract` gives responses."""
        return norm(answer)

    def vote_fix(self) -> str:
        """What to change where a vote needs answers this check does not read (`extracts` is False)."""
        return "use a check that extracts an answer (number, exact, regex, steps) or another label kind"

    def graded(self, response: str, answer: str, partial: float) -> float:
        """A value in [0, 1] for a tree search: 1 right; partial credit where the kind can give it."""
        return 1.0 if self.check(response, answer).correct else 0.0

    def check_many(self, items: list[Item], tally: Tally | None = None) -> list[Verdict]:
        """Every item's verdict; a kind that runs code outside this process does it in batches.
        A kind whose calls may fail holds them against its budget here, or, given a `tally`,
        counts them there for `settle`."""
        return [self.check(i.response, i.answer) if i.answer is not None else Verdict(None, self.extract(i.response))
                for i in items]

    def settle(self, tally: Tally) -> None:
        """Raise if the failures a tally counted exceed this check's budget (none for a kind whose
        calls cannot fail)."""

    def problems(self, fields: Collection[str] = ()) -> list[str]:
        """What is wrong with this check before anything runs (an import, a signature), each with its fix;
        `fields`: the names of the other columns the rows carry (for a check that reads them)."""
        return []


def norm(s: str) -> str:
    s = unicodedata.normalize("NFKC", s).strip().lower()
    s = re.sub(r"\s+", " ", s)
    return s.rstrip(".").strip()


def to_float(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


_INTEGER = re.compile(r"-?\d+")


def number_key(answer: str) -> str | None:
    """A number as written, as an answer key (`canonical`); None where it is no number."""
    value = to_float(answer.strip())
    return None if value is None else canonical(value, answer.strip())


def canonical(value: float, literal: str) -> str:
    """A number as an answer key: '12' for 12.0, '0.5' for 0.5; an integer keeps every digit ('007'
    reads '7'), so two sums of 17 digits that differ in the last, which a float rounds alike, never
    vote together; a number too large for a float (a 400-digit run of digits reads as inf) keeps its
    own digits."""
    digits = literal.replace(",", "").strip()
    if _INTEGER.fullmatch(digits):
        body = digits.lstrip("-").lstrip("0")
        return f"-{body}" if body and digits.startswith("-") else body or "0"
    if not math.isfinite(value):
        return digits
    return format(value, "g") if value != int(value) else str(int(value))
