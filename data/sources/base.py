"""What every prompt source shares: the per-round draw from its train pool, and the split it loads."""

from __future__ import annotations

import string
import unicodedata
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ratchet.data.records import Prompt


class PoolSource(BaseModel):
    """What every prompt source shares: how each round draws from its train prompts."""

    model_config = ConfigDict(extra="forbid")
    # its prompts are rows a user wrote and can shorten or drop (a generated task's or a start's are not)
    users_rows: ClassVar[bool] = False
    prompts_per_round: int | None = Field(
        default=None, ge=1, description="each round trains on this many train prompts drawn from the pool without "
        "repeats until the pool is spent (then a new seeded order); a continuation draws on where the last run "
        "stopped. Unset: every round uses the whole pool")
    retire_solved: bool = Field(
        default=False, description="after each round, a train prompt whose every sample that round earned the "
        "label's top reward leaves the pool for the rounds after it (a `pool` stage keyed by that round's labels, or "
        "its GRPO rollouts); the console and MLflow count them")
    labeled_levels: list[int] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the levels (data.levels) whose train prompts keep their reference answers; every other "
        "level's train prompts reach no stage with one (the prompts stage writes them without), so a round labels "
        "them itself (label.kind: vote or consistency), and each round says how often the references it never saw "
        "agree (label precision). Held-out prompts keep theirs: they are for evaluation. Unset: every level; "
        "[]: none (a run taught by demonstrations alone)")

    @model_validator(mode="after")
    def _labeled_levels_are_levels(self) -> "PoolSource":
        if self.labeled_levels is None:
            return self
        levels = self.level_list()
        if not levels:
            raise ValueError(f"data.labeled_levels={self.labeled_levels}: data.kind={getattr(self, 'kind', '?')!r} "
                             "has no levels here; give data.levels (the addition task: digit counts), or drop "
                             "labeled_levels")
        if bad := [n for n in self.labeled_levels if n not in levels]:
            raise ValueError(f"data.labeled_levels names level(s) {bad} the task does not have (data.levels={levels}); "
                             "name levels among them")
        if self.labeled_levels != sorted(set(self.labeled_levels)):
            raise ValueError(f"data.labeled_levels={self.labeled_levels} must rise, each once")
        return self

    def unlabeled_levels(self) -> list[int]:
        """The levels whose train prompts carry no reference answer on the train path."""
        if self.labeled_levels is None:
            return []
        return [n for n in self.level_list() if n not in self.labeled_levels]

    @abstractmethod
    def load(self, seed: int, train_answers: bool) -> "Split":
        """(train, eval), deterministic in seed, disjoint, every row checked; `train_answers`: every
        train prompt needs a reference answer. Raises one ConfigError listing every problem."""

    def pool(self):
        """This source without the per-round draw and retirement: what the prompt split, labels and
        evaluation depend on."""
        return self.model_copy(update={"prompts_per_round": None, "retire_solved": False})

    def level_list(self) -> list[int]:
        """Its difficulty levels, easiest first (a source's `levels`); none for a task without levels."""
        return list(getattr(self, "levels", None) or [])

    def at_level(self, level: int) -> "PoolSource":
        """This source with one of its levels only: that level's train and held-out prompts, the
        same rows the whole source holds at that level."""
        if level not in self.level_list():
            raise ValueError(f"data has no level {level}; its levels are {self.level_list()}")
        labeled = None if self.labeled_levels is None else [n for n in self.labeled_levels if n == level]
        return self.model_copy(update={"levels": [level], "labeled_levels": labeled})

    def eval_metrics(self, prompts: list[Prompt], rows: list) -> dict[str, float]:
        """What a source measures of an evaluation beyond its accuracy (`rows`: the checked
        answers to `prompts`); none by default."""
        return {}

    def held_out(self, seed: int) -> "Split":
        """This source as an extra held-out set (evaluate.sets): its eval prompts, every one answered.
        A source none of whose prompts are trained on may hold out more (a file: every row)."""
        split = self.load(seed, False)
        return Split([], split.eval, split.digests, {p.id: split.places[p.id] for p in split.eval
                                                      if p.id in split.places})


@dataclass(frozen=True)
class Split:
    """The train and eval prompts, where each came from, and the digest of every file read."""

    train: list[Prompt]
    eval: list[Prompt]
    digests: dict[str, str] = field(default_factory=dict)  # config field (path, eval_path) -> rows digest
    places: dict[str, tuple[str, str]] = field(default_factory=dict)  # prompt id -> (file, "line N"), for messages


def check_placeholders(template: str, names: set[str]) -> str:
    """`template` if its {placeholders} are exactly `names`; else a ValueError that says so."""
    try:
        found = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"not a valid template ({e}); write literal braces as {{{{ and }}}}") from None
    if found != names:
        want = " and ".join(f"{{{n}}}" for n in sorted(names))
        raise ValueError(f"the template needs exactly the placeholders {want}, found {sorted(found) or 'none'}; "
                         "write literal braces as {{ and }}")
    return template


def prompt_key(text: str) -> str:
    """A prompt as two prompts are compared for being the same: NFKC, case-folded, spaces collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())
