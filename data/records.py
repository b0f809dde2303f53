"""Row types that travel between stages as JSONL files, and their readers/writers."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ratchet.data.errors import ArtifactError

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class _Sparse(BaseModel):
    """A row whose optional keys in `SPARSE` are written only when they hold something, so rows
    without them keep their bytes (a source's rows without other columns, a single-turn sample
    without segments)."""

    @model_serializer(mode="wrap")
    def _drop_empty(self, handler):
        out = handler(self)
        for k in SPARSE:
            if k in out and (out[k] is None or (isinstance(out[k], (dict, list, tuple)) and not out[k])):
                out.pop(k)
        return out

    def __hash__(self) -> int:  # frozen, but a dict or list field cannot be hashed: its JSON stands for it
        return hash((type(self), self.model_dump_json()))


SPARSE = ("fields", "prompt_ids", "segments", "chosen_segments", "rejected_segments", "outcome", "chosen_outcome",
          "rejected_outcome", "attempt", "logprobs", "reports", "level")


class Segment(_Sparse):
    """One turn of a trajectory: who wrote it (the model, a tool, an environment), its text, and
    the token ids it took in the episode's context. A model segment's ids are the ones the engine
    produced; any other segment's are the ones inserted after it, that the model then read.
    Training reads these ids, never a re-tokenisation of the text."""

    model_config = _FROZEN
    role: Literal["model", "tool", "env"]
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = Field(default=None, description="a model segment's tokens' log-probabilities "
                                               "as the engine sampled them, where online RL asked for them")


class Outcome(_Sparse):
    """What an environment said of one episode: the reward of each step, the final reward, the
    return (their sum: the episode's reward), how the episode ended, and, where the environment
    failed (raised, hung, answered nonsense), what went wrong; then there is no return."""

    model_config = _FROZEN
    start: str = Field(description="the environment's first observation, as the model read it")
    rewards: tuple[float, ...] = Field(default=(), description="each step's reward, in order")
    final: float | None = Field(default=None, description="the environment's final reward, if it gives one")
    ret: float | None = Field(default=None, description="the episode's return: its steps' rewards and the final "
                              "reward summed; None where the environment failed")
    ended: Literal["done", "max_turns", "length", "failed"] = Field(description="done: the environment ended it; "
                                                                    "max_turns or length: its turns or tokens ran "
                                                                    "out; failed: the environment failed")
    failure: str | None = Field(default=None, description="what the environment did wrong, with its traceback")
    attempt: tuple[Segment, ...] | None = Field(default=None, description="where the row is a reflection: the "
                                                 "attempt it was given to, whose outcome this is")
    reports: tuple[dict[str, str], ...] | None = Field(default=None, description="where roles played the episode: "
                                                       "what each analyst reported before each of the acting role's "
                                                       "turns, by role")


class _Turns(_Sparse):
    """A completion that may be a trajectory of several turns: its prompt's token ids as the
    engine read them and its segments. A single-turn completion has neither (None)."""

    prompt_ids: tuple[int, ...] | None = Field(default=None, description="the templated prompt's token ids, where "
                                                "the completion is a trajectory")
    segments: tuple[Segment, ...] | None = Field(default=None, description="the trajectory's turns, in order; "
                                                 "their texts joined are `text`")
    outcome: Outcome | None = Field(default=None, description="an environment episode's rewards and return")

    @property
    def final(self) -> str:
        """What a check scores: the model's last segment (its answer after the last tool or
        environment turn), or the whole text of a single-turn completion."""
        if not self.segments:
            return self.text  # type: ignore[attr-defined]
        return next((s.text for s in reversed(self.segments) if s.role == "model"), "")

    def turns(self) -> dict:
        """The trajectory fields, to carry onto the next stage's row."""
        return {"prompt_ids": self.prompt_ids, "segments": self.segments, "outcome": self.outcome}


class Prompt(_Sparse):
    """One prompt with an optional reference answer."""

    model_config = _FROZEN
    id: str = Field(description="stable id, unique within its source")
    prompt: str = Field(description="the user message")
    answer: str | None = Field(default=None, description="reference answer, if the source has one")
    task: str = Field(default="custom", description="which task or source produced it")
    fields: dict[str, Any] = Field(default_factory=dict, description="the source row's other columns, "
                                   "for a check that reads them")
    level: int | None = Field(default=None, description="its difficulty level, where its task has levels "
                              "(data.levels)")


class Completion(_Turns):
    """One sampled completion of one prompt (a single answer, or a trajectory's transcript)."""

    model_config = _FROZEN
    prompt_id: str
    prompt: str
    answer: str | None = None
    index: int = Field(ge=0, description="sample index within the prompt")
    text: str
    n_tokens: int = Field(ge=0)
    finish_reason: str | None = None
    level: int | None = Field(default=None, description="its prompt's difficulty level, where the task has levels")
    fields: dict[str, Any] = Field(default_factory=dict, description="the source row's other columns, "
                                   "for a check that reads them")


class LabeledCompletion(_Turns):
    """A completion with the label stage's reward."""

    model_config = _FROZEN
    prompt_id: str
    prompt: str
    answer: str | None = None
    index: int
    text: str
    n_tokens: int
    level: int | None = Field(default=None, description="its prompt's difficulty level, where the task has levels")
    reward: float | None = Field(
        description="the label's reward: 1.0/0.0 (verifier, consistency), the judge's score; None = the judge's "
        "verdict could not be read"
    )
    extracted: str | None = Field(default=None, description="what the checker read as the answer")
    correct: bool | None = Field(default=None, description="the verifier's verdict where a reference exists (audit)")
    votes: list[float | None] | None = Field(default=None, description="the judge's individual verdicts")
    flags: list[str] | None = Field(default=None, description="what the judge's guard found in the text (score, "
                                    "verdict, instruction, fence, role, obfuscation); the judge never saw it")


class PairRow(_Sparse):
    """One preference pair for DPO: two completions of the same prompt, the better one chosen;
    of trajectories, with the prompt's token ids and each one's segments."""

    model_config = _FROZEN
    prompt_id: str
    prompt: str
    chosen: str
    rejected: str
    chosen_reward: float
    rejected_reward: float
    chosen_tokens: int
    rejected_tokens: int
    chosen_correct: bool | None = None
    rejected_correct: bool | None = None
    prompt_ids: tuple[int, ...] | None = None
    chosen_segments: tuple[Segment, ...] | None = None
    rejected_segments: tuple[Segment, ...] | None = None
    chosen_outcome: Outcome | None = None
    rejected_outcome: Outcome | None = None


class SFTRow(_Turns):
    """One accepted sample for rejection-sampling fine-tuning (of a trajectory, with its turns)."""

    model_config = _FROZEN
    prompt_id: str
    prompt: str
    completion: str
    reward: float


R = TypeVar("R", bound=BaseModel)


def write_jsonl(path: Path, rows: Iterable[BaseModel]) -> int:
    """Write rows to path atomically; returns the row count."""
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w") as f:
        for row in rows:
            f.write(row.model_dump_json())
            f.write("\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return n


def read_jsonl(path: Path, kind: type[R]) -> list[R]:
    out: list[R] = []
    try:
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    out.append(kind.model_validate(json.loads(line)))
    except FileNotFoundError as e:
        raise ArtifactError(f"missing artifact {path}") from e
    except (ValueError, TypeError) as e:
        raise ArtifactError(f"{path}:{lineno}: not a valid {kind.__name__} row: {e}") from e
    return out
