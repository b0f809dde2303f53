"""Filter kinds: how a round's labeled completions become its training set.

Every kind lives in one module of this package, as one class: its config model, a subclass of
`Filter`, whose methods say what it builds (accepted samples or preference pairs, which a
train kind consumes), what it reads beyond the labels (a file a label kind writes), how it
builds the set, and how its result reads on the console. The filter stage (tasks/filter.py)
and the config checks ask the kind; none of them has a special case for one.

    rft         accepted samples for rejection-sampling fine-tuning
    length      rft's, of the outputs whose length fits what their level implies
    pairs       best-vs-worst preference pairs per prompt for DPO
    step_pairs  step-level preference pairs from the tree search's trees (label.kind='mcts')

A training set smaller than its minimum stops the round with the knobs to turn: training on
nothing would silently copy the parent model forward.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from ratchet.data import events
from ratchet.data.events import Shows
from ratchet.data.records import LabeledCompletion, PairRow, read_jsonl

# What a filter kind writes and a train kind reads: accepted samples for fine-tuning, or preference pairs
Rows = Literal["rft", "pairs"]
ROWS: dict[str, str] = {"rft": "accepted samples", "pairs": "preference pairs"}


class Filter(BaseModel):
    """A filter kind: its config (a member of FilterConfig's union) and what the stage and the
    config checks ask of it."""

    model_config = ConfigDict(extra="forbid")
    builds: ClassVar[Rows]  # the rows it writes, as a train kind consumes them
    reads: ClassVar[tuple[str, str] | None] = None  # (file, what it holds): a label kind's extra output it needs
    shows: ClassVar[Shows] = Shows()  # what the report draws of its metrics
    kind: str

    @abstractmethod
    def build(self, req, store) -> tuple[list[BaseModel], dict[str, float]]:
        """The training set from the label stage (`req.parent("label")`) and its metrics; fewer rows
        than the kind's minimum raise EmptyStageError with the knobs to turn."""

    def reward_checks(self, lo: float, hi: float, label: str) -> list[str]:
        """Problems with this filter for a label whose rewards lie in [lo, hi] (`label`: its setting)."""
        return []

    def checks(self, pipeline) -> list[str]:
        """Problems across sections (`pipeline`: the whole config), each with its fix."""
        return []

    def ceiling_checks(self, prompts: int, n: int) -> list[str]:
        """Problems with a minimum this filter can never reach in a round of at most `prompts`
        prompts with `n` completions each (sample.n)."""
        return []

    @abstractmethod
    def summary(self, m: dict[str, float]) -> list[str]:
        """Its result in a few words, for the console."""


def labeled(req, store) -> list[LabeledCompletion]:
    """The label stage's rows."""
    return read_jsonl(store.path(req.parent("label"), "labels.jsonl"), LabeledCompletion)


def norm(text: str) -> str:
    """A completion's text for duplicate detection: case and whitespace aside."""
    return " ".join(text.lower().split())


# What the report draws of a pair-building kind's metrics (pair_summary, verifier_view)
PAIRS_SHOWN = Shows(rows=("pairs", "preference pairs"),
                    agreement=(("pair_accuracy", "pair accuracy (chosen right, rejected wrong)"),))


def pair_summary(m: dict[str, float]) -> list[str]:
    out = [f"{events.count(m.get('pairs', 0))} pairs"]
    return out + ([f"pair accuracy {m['pair_accuracy']:.0%}"] if "pair_accuracy" in m else [])


def verifier_view(pairs: list[PairRow]) -> dict[str, float]:
    """What the verifier thinks of the pairs the label built: right over wrong, and the reverse."""
    known = [p for p in pairs if p.chosen_correct is not None and p.rejected_correct is not None]
    if not known:
        return {}
    return {"pair_accuracy": sum(p.chosen_correct and not p.rejected_correct for p in known) / len(known),
            "pair_inverted": sum(p.rejected_correct and not p.chosen_correct for p in known) / len(known),
            "chosen_correct_frac": sum(p.chosen_correct for p in known) / len(known)}
