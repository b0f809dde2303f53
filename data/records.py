"""Row types that travel between stages as JSONL files, and their readers/writers."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ratchet.data.errors import ArtifactError

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class _Fields(BaseModel):
    """A row that may carry its source row's other columns (`fields`, JSON values by column name),
    for a check that reads them (a user's function gets them by name). A row without any is
    written without the key, so rows of sources that carry none keep their bytes."""

    @model_serializer(mode="wrap")
    def _drop_empty_fields(self, handler):
        out = handler(self)
        if not out.get("fields"):
            out.pop("fields", None)
        return out

    def __hash__(self) -> int:  # frozen, but a dict field cannot be hashed: its JSON stands for it
        return hash((type(self), self.model_dump_json()))


class Prompt(_Fields):
    """One prompt with an optional reference answer."""

    model_config = _FROZEN
    id: str = Field(description="stable id, unique within its source")
    prompt: str = Field(description="the user message")
    answer: str | None = Field(default=None, description="reference answer, if the source has one")
    task: str = Field(default="custom", description="which task or source produced it")
    fields: dict[str, Any] = Field(default_factory=dict, description="the source row's other columns, "
                                   "for a check that reads them")


class Completion(_Fields):
    """One sampled completion of one prompt."""

    model_config = _FROZEN
    prompt_id: str
    prompt: str
    answer: str | None = None
    index: int = Field(ge=0, description="sample index within the prompt")
    text: str
    n_tokens: int = Field(ge=0)
    finish_reason: str | None = None
    fields: dict[str, Any] = Field(default_factory=dict, description="the source row's other columns, "
                                   "for a check that reads them")


class LabeledCompletion(BaseModel):
    """A completion with the label stage's reward."""

    model_config = _FROZEN
    prompt_id: str
    prompt: str
    answer: str | None = None
    index: int
    text: str
    n_tokens: int
    reward: float | None = Field(
        description="the label's reward: 1.0/0.0 (verifier, consistency), the judge's score; None = the judge's "
        "verdict could not be read"
    )
    extracted: str | None = Field(default=None, description="what the checker read as the answer")
    correct: bool | None = Field(default=None, description="the verifier's verdict where a reference exists (audit)")
    votes: list[float | None] | None = Field(default=None, description="the judge's individual verdicts")
    flags: list[str] | None = Field(default=None, description="what the judge's guard found in the text (score, "
                                    "verdict, instruction, fence, role, obfuscation); the judge never saw it")


class PairRow(BaseModel):
    """One preference pair for DPO: two completions of the same prompt, the better one chosen."""

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


class SFTRow(BaseModel):
    """One accepted sample for rejection-sampling fine-tuning."""

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
