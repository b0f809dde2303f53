"""Rollout kinds: how the sample stage (and evaluation) turns a prompt into a trajectory.

Every kind lives in one module of this package, as one class: its config model (a member of
RolloutConfig's union, `sample.rollout`), a subclass of `Rollout`, whose methods say how it
plays one unit's episodes on the engine, what it adds to the prompt, how many tokens an
episode may take, what it needs of the rest of the config, and how its counters read.

    single  one generation per completion (the default; its rows are plain completions)
    tool    the model runs Python in a sandbox mid-answer, and reads the output (ReTool)
    environment  the model plays episodes against an environment: the user's class, or a
            TextArena game (tasks/environments/)
    reflection  an environment's episodes; after a failed one the model reflects on it and
            tries again with its reflection (Retroformer)
    roles   agents in roles play an environment's episodes: analysts report on their parts of
            each observation, a manager reads the reports and acts (FinCon)

A multi-turn kind writes trajectories: each completion keeps its prompt's token ids and its
turns as segments (data/records.py: Segment), the model's with the ids the engine produced.
Training reads those ids and masks every segment that is not the model's (models/train_kinds/).
"""

from __future__ import annotations

from collections.abc import Collection

from abc import abstractmethod
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from ratchet.data.checks.base import Item
from ratchet.data.events import Shows
from ratchet.data.records import Completion, Prompt
from ratchet.models import prompt_format
from ratchet.models.sampler import SamplingParams


class Rollout(BaseModel):
    """A rollout kind: its config and what the sample and evaluate stages and the config checks ask of it."""

    model_config = ConfigDict(extra="forbid")
    multi_turn: ClassVar[bool] = False  # writes trajectories (segments and token ids), not plain completions
    plays: ClassVar[bool] = False  # its episodes carry an environment's return (what data.check.kind=return scores)
    shows: ClassVar[Shows] = Shows()  # what the report draws of its counters
    # why an online trainer (train.kind=grpo) cannot train on its rows, after "sample.rollout.kind=K"; None: it can
    offline: ClassVar[str | None] = None
    # why a text around each task prompt (prompt.template, a search's) cannot be its prompt; None: it can
    text_refused: ClassVar[str | None] = None
    has_roles: ClassVar[bool] = False  # its agents are roles with beliefs a policy's text may carry (tasks/searches/beliefs.py)
    kind: str

    @abstractmethod
    def roll(self, sampler, prompts: list[Prompt], params: SamplingParams,
             seed: int) -> tuple[list[Completion], dict[str, float]]:
        """`params.n` completions of each prompt, in order (prompt by prompt, index by index), and
        this unit's counters (summed over units), `gen_tokens` among them. Deterministic for a
        given engine, unit and seed: a resumed stage redoes a unit and gets the same rows."""

    def with_text(self, text) -> "Rollout":
        """This rollout as it plays under a policy's text (tasks/text.py: PromptText, or None): a
        kind whose agents carry beliefs takes them from it; the others are unchanged (the text
        around each task prompt is put into the prompts, not the rollout)."""
        return self

    def wrap(self, prompt: str) -> str:
        """The user message the engine is given for `prompt`."""
        return prompt

    def first_message(self, prompt: Prompt) -> str:
        """The first user message an episode of `prompt` gives the model (what `ratchet check` shows)."""
        return self.wrap(prompt.prompt)

    def budget(self, max_tokens: int) -> int:
        """The most tokens one episode adds after its prompt, when each generation may take `max_tokens`."""
        return max_tokens

    def problems(self, fields: Collection[str] = (), first: Prompt | None = None) -> list[str]:
        """Problems found by trying what it runs (a sandbox, an environment), before any model loads;
        `fields`: the other columns the prompt rows carry; `first`: the first start a stage will
        give it (an environment plays its first episode's opening on it)."""
        return []

    def model_problems(self, tokenizer) -> list[str]:
        """Problems with this rollout for the policy's tokenizer (its chat template), before the model loads."""
        return []

    def checks(self, pipeline) -> list[str]:
        """Problems with this rollout in the whole pipeline config, before any model loads."""
        return []

    def metrics(self, cost: dict[str, float]) -> dict[str, float]:
        """The stage metrics this kind derives from its units' summed counters."""
        return {}

    # demonstrations (a cold start's, data/demonstrations.py) ----------------------------------
    def demonstrations(self, demos: list, report, source: str) -> dict[str, Item]:
        """What the rows of a demonstrations file say that this kind would run, checked against it
        (a tool's output against the sandbox, an environment's observations against the
        environment), each problem into `report` (data/errors.py: ProblemReport) under `source`;
        for every row that passed, the item the run's check scores, by row id."""
        ok = {}
        for d in demos:
            if d.roles() == {"model"}:
                ok[d.id] = d.item()
            else:
                report.add(source, f"turns sample.rollout.kind={self.kind!r} does not have", d.place,
                           f"{', '.join(sorted(d.roles() - {'model'}))} turns", "give the prompt and one assistant "
                           "turn, or set sample.rollout.kind to the rollout the turns come from (tool, environment)")
        return ok

    def demo_row(self, tokenizer, demo) -> dict:
        """A demonstration as the cold start trains on it, in the context this kind gives the model:
        text that TRL templates (`prompt`, `completion`), or, for a kind of several turns, token ids
        and the loss mask (`input_ids`, `completion_mask`: 1 on the model's own tokens only)."""
        return {"prompt": self.wrap(demo.prompt), "completion": demo.final}

    def summary(self, m: dict[str, float]) -> list[str]:
        """Its counters in a few words, for the console."""
        return []


def overlapped(overlap: bool | None) -> bool:
    """Whether a unit's episodes run in two halves that take turns (one half's outside calls while
    the other half generates): as set, or where unset, where the engine is on a GPU (on a CPU the
    calls and the engine share the cores, and halves make smaller batches)."""
    if overlap is not None:
        return overlap
    import torch

    return torch.cuda.is_available()


def has_placeholder(template: str, name: str, goes: str) -> str:
    """`template` if it has `{name}`; else a ValueError that says where it goes."""
    if f"{{{name}}}" not in template:
        raise ValueError(f"sample.rollout.template={template[:60]!r} has no {{{name}}}; put {{{name}}} where {goes}")
    return template


def episode_checks(pipeline, kind: str, episode_tokens: int) -> list[str]:
    """What a multi-turn rollout needs of the pipeline: a label that reads the samples, and room
    for one model turn within an episode."""
    label = pipeline.label
    if label.consumes != "samples" and not label.plays_rollout:
        return [f"sample.rollout.kind={kind!r} is not used by {label.setting()}: it searches from the prompts with its "
                "own single-turn rollouts and never reads the sample stage; set sample.rollout.kind=single, a "
                "label kind that reads the samples, or label.kind='turn_mcts' (a search over an environment's turns)"]
    if pipeline.sample.max_tokens > episode_tokens:
        return [f"sample.max_tokens={pipeline.sample.max_tokens} (one model turn) is more than "
                f"sample.rollout.episode_tokens={episode_tokens} (the whole episode); raise episode_tokens or lower "
                "sample.max_tokens"]
    return []


def turn_params(tokenizer, params: SamplingParams) -> SamplingParams:
    """`params` for one model turn: where the model reads a plain layout (a base model), the
    turn also stops where the layout's next question would begin (`turn_of` cuts it off)."""
    end = prompt_format.turn_end(tokenizer)
    return params.model_copy(update={"stop": (*params.stop, end)}) if end and end not in params.stop else params


def turn_of(tokenizer, g) -> tuple[str, tuple[int, ...]]:
    """A generated turn's text and ids, cut before the plain layout's turn end where it ran into it."""
    end = prompt_format.turn_end(tokenizer)
    return before_end(tokenizer, g.token_ids, end) if end and g.stop == end else (g.text, tuple(g.token_ids))


def model_turn(tokenizer, g) -> tuple[str, tuple[int, ...], tuple[float, ...] | None]:
    """`turn_of`, and the kept ids' log-probabilities where the engine returned them (online RL)."""
    text, ids = turn_of(tokenizer, g)
    return text, ids, (tuple(g.logprobs[: len(ids)]) if g.logprobs else None)


def before_end(tokenizer, ids: tuple[int, ...], end: str) -> tuple[str, tuple[int, ...]]:
    """A turn that ran into the plain layout's turn end ("\nQuestion:", the next question a base
    model writes itself): the ids before the token where the end begins, and their text. The
    ids the model goes on to read are these, so the turn is what was trained on and read."""
    def text(k: int) -> str:
        return tokenizer.decode(ids[:k], skip_special_tokens=True)

    at, k = text(len(ids)).find(end), len(ids)
    while k and at >= 0 and len(text(k)) > at:
        k -= 1
    return text(k), tuple(ids[:k])


def demo_tokens(prompt_ids, pieces: list[tuple[str, list[int]]]) -> dict:
    """A demonstration's trajectory as the trainer reads a sampled one: the prompt's ids, then each
    turn's (role, ids), the loss mask 1 on the model's own tokens only."""
    ids, mask = list(prompt_ids), [0] * len(prompt_ids)
    for role, piece in pieces:
        ids += piece
        mask += [int(role == "model")] * len(piece)
    return {"input_ids": ids, "completion_mask": mask}
