"""What every prompt source shares: the per-round draw from its train pool, and the split it loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.records import Prompt


class PoolSource(BaseModel):
    """What every prompt source shares: how each round draws from its train prompts."""

    model_config = ConfigDict(extra="forbid")
    local_paths: ClassVar[tuple[str, ...]] = ()  # fields naming local files: made absolute in deployments
    prompts_per_round: int | None = Field(
        default=None, ge=1, description="each round trains on this many train prompts drawn from the pool without "
        "repeats until the pool is spent (then a new seeded order); a continuation draws on where the last run "
        "stopped. Unset: every round uses the whole pool")

    def pool(self):
        """This source without the per-round draw: what the prompt split, labels and evaluation depend on."""
        return self.model_copy(update={"prompts_per_round": None})

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
