"""sample.rollout.kind=environment: the model plays episodes against an environment, turn by turn.

    data: {kind: episodes, train_size: 64, eval_size: 32}       # seeded starts; the check is the return
    sample:
      rollout: {kind: environment, env: "my_env.py:Maze", max_turns: 8}
      # or a TextArena game:   rollout: {kind: environment, env: {kind: textarena, game: GuessTheNumber-v0}}
      # (what `env` can be: tasks/environments/kinds.py)

An episode, for every episode of a unit at once:

1. The environment starts (`reset`, from the start's seed and row) and gives the first
   observation: the user's message (in `template`), chat-templated once.
2. The model writes one turn (at most `sample.max_tokens`, within the episode's `episode_tokens`);
   the whole turn is its action. The environment steps on it: the next observation, the step's
   reward, whether the episode is done.
3. Not done, the observation becomes the next user turn, appended as token ids (the chat
   template's turn markers around it), and the model writes again. The episode ends when the
   environment says done, after `max_turns` model turns, or when its tokens run out.
4. The environment's optional final reward is asked for; the return is every step's reward and
   the final one, summed. It is the episode's reward (`data.check.kind: return`).

Token in, token out: the model's segments keep the ids the engine produced, each observation's
segment the ids inserted after it, so training (models/train_kinds/) trains on exactly what was
sampled and masks every environment token. The template's turn markers are read once from the
model's chat template (a template that re-renders earlier turns is refused before any model
loads: an appended turn would not be what the model reads on the next call).

The environment runs in processes of its own (tasks/environments/): one per episode, forked
from a host that imported it once, each call bounded by `step_s`. A call that raises, hangs,
returns NaN or a wrong type, or a process that dies, fails that episode (its record says why,
with the environment's traceback) and the unit goes on; past `max_failed_frac` of a unit's
episodes the stage stops with the first failure, its finished units kept. While one half of a
unit's episodes generates, the other half's environment steps run (`overlap`).
"""

from __future__ import annotations

from collections.abc import Collection

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ratchet.data.checks.base import Item
from ratchet.data.errors import RatchetError
from ratchet.data.events import Figure, Shows
from ratchet.data.records import Completion, Outcome, Prompt, Segment
from ratchet.models.sampler import SamplingParams, text_ids
from ratchet.tasks import environments
from ratchet.tasks.environments import EPISODE_KEYS as _KEYS, row_of, seed_of
from ratchet.tasks.environments.kinds import EnvKind, shorthand
from ratchet.tasks.rollouts import (Rollout, demo_tokens, episode_checks, has_placeholder, model_turn, overlapped,
                                   turn_params)

REPLAY = ("A tree search over turns rebuilds a state by replaying its actions from reset(seed), and a second attempt "
          "after a reflection starts from the same seed: make reset and step depend on the seed and the actions only")
SENTINELS = ("Ratchet-user-sentinel", "Ratchet-model-sentinel", "Ratchet-observation-sentinel")


class EnvironmentFailedError(RatchetError):
    """More of a unit's episodes failed in the environment than sample.rollout.max_failed_frac allows."""


_PIECES: dict[str, tuple[str, str, str]] = {}  # by chat template


def turn_pieces(tokenizer) -> tuple[str, str, str]:
    """The chat template's text around an observation turn: (what closes a model turn after its
    text, what opens the user turn, what closes it and opens the model's next). Raises ValueError
    where the template does not grow a conversation by appending to it."""
    key = str(getattr(tokenizer, "chat_template", None))
    if key in _PIECES:
        return _PIECES[key]
    user, model, obs = SENTINELS

    def render(messages, gen: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    one = [{"role": "user", "content": user}, {"role": "assistant", "content": model}]
    a = render(one, False)
    b = render([*one, {"role": "user", "content": obs}], True)
    if model not in a or not b.startswith(a) or b[len(a):].count(obs) != 1:
        raise ValueError("the model's chat template re-renders earlier turns when a turn is added (a conversation "
                         "of two turns does not begin with the text of its first), so an episode's appended turns "
                         "would not be what the model reads; use a model whose template appends turns, or "
                         "model.prompt_format: plain")
    closing = a[a.rindex(model) + len(model):]
    opening, after = b[len(a):].split(obs)
    _PIECES[key] = (closing, opening, after)
    return closing, opening, after


def observation_ids(tokenizer, model_ids: tuple[int, ...], observation: str) -> tuple[str, tuple[int, ...]]:
    """An observation as the next user turn, after a model turn that produced `model_ids`: its text
    (with the template's turn markers) and its ids. A model turn that ended with its end-of-turn
    token has that token already; one cut short gets the template's whole closing."""
    closing, opening, after = turn_pieces(tokenizer)
    eos = tokenizer.eos_token
    if model_ids and model_ids[-1] == tokenizer.eos_token_id and eos and closing.startswith(eos):
        closing = closing[len(eos):]
    return closing + opening + observation + after, marked_ids(tokenizer, closing + opening, observation, after)


def marked_ids(tokenizer, before: str, text: str, after: str) -> tuple[int, ...]:
    """The ids of `text` between the template's turn markers `before` and `after`: the markers
    read as the special tokens they are, the text (the environment's, untrusted) as plain text, so
    an observation that spells out a turn marker cannot open a turn of its own."""
    def marker(t: str) -> list[int]:
        return tokenizer.encode(t, add_special_tokens=False) if t else []

    return tuple(marker(before) + text_ids(tokenizer, text) + marker(after))


def first_ids(tokenizer, message: str) -> tuple[int, ...]:
    """The templated ids of an episode's first user message, ready for the model's turn; the
    message (the environment's first observation) read as plain text, as `marked_ids` reads it."""
    sentinel = SENTINELS[2]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False,
                                             add_generation_prompt=True)
    before, after = rendered.split(sentinel)
    return marked_ids(tokenizer, before, message, after)


def _said(observation: str | None, reward: float | None = None, done: bool | None = None) -> str:
    obs = observation if observation is None or len(observation) <= 80 else observation[:77] + "..."
    return f"(observation {obs!r}" + ("" if reward is None else f", reward {reward:g}, done {done}") + ")"


@dataclass
class _Episode:
    prompt: Prompt
    index: int
    key: int  # its number at the environment's host
    context: list[int] = field(default_factory=list)
    prompt_ids: tuple[int, ...] = ()
    segments: list[Segment] = field(default_factory=list)
    start: str = ""
    rewards: list[float] = field(default_factory=list)
    final: float | None = None
    used: int = 0  # tokens after the prompt, the model's and the environment's
    generated: int = 0
    waiting: str | None = None  # the call in flight
    ended: str | None = None
    failure: str | None = None
    forced: tuple[Segment, ...] = ()  # model turns to replay before the model plays (a tree search's path)
    expect: tuple[tuple[str | None, float, bool], ...] = ()  # what the replayed steps answered before
    expect_start: str | None = None  # the first observation a replayed episode gave before
    note: str | None = None  # a reflection on an earlier attempt, given with the first observation
    pending: str | None = None  # an observation its other agents read before the model's turn (roles)
    first: bool = False  # whether `pending` is the episode's first observation
    reports: list[dict[str, str]] = field(default_factory=list)  # each turn's reports by role (roles)
    reported: int = 0  # tokens its analysts generated (roles)
    turns: int = 0  # model turns taken
    observations: list[str | None] = field(default_factory=list)  # each step's observation as the environment gave it

    def add(self, role: str, text: str, ids: tuple[int, ...], logprobs: tuple[float, ...] | None = None) -> None:
        self.segments.append(Segment(role=role, text=text, token_ids=tuple(ids), logprobs=logprobs))
        self.context.extend(ids)
        self.used += len(ids)
        self.turns += role == "model"

    @property
    def ret(self) -> float:
        """The return so far: every step's reward and the final reward."""
        return sum(self.rewards) + (self.final or 0.0)

    def fail(self, op: str, why: str) -> None:
        self.ended, self.failure, self.waiting = "failed", f"{op}: {why}" if not why.startswith(op) else why, None




def turn_seed_of(seed: int, cohort: int, turn: int) -> int:
    return (seed * 1_000_003 + cohort * 7_919 + turn * 8_191) % (1 << 61)


class EnvironmentRollout(Rollout):
    """The model plays episodes against an environment: the user's class or a library's game (`env`,
    a kind of tasks/environments/kinds.py)."""

    multi_turn: ClassVar[bool] = True
    plays: ClassVar[bool] = True
    text_refused: ClassVar[str | None] = ("gives the model the environment's observations, not the prompt rows "
                                          "(sample.rollout.template is the text around its first observation)")
    shows: ClassVar[Shows] = Shows(figures=(Figure(
        "Episodes per round", "episodes.png", "mean return", ("return_mean", "mean return"),
        ("done_frac", "episodes the environment ended (%)", "ended by the environment (%)")),))
    kind: Literal["environment"] = "environment"
    env: EnvKind = Field(description="what the model plays: 'path/to/env.py:Env' (a class of your own; "
                         "'package.module:Env' for an installed module), or {kind: textarena, game: "
                         "GuessTheNumber-v0}, or {kind: gymnasium, game: FrozenLake-v1}. A class defines reset(self, "
                         "seed, **row) -> str and step(self, action) -> (observation, reward, done), optionally "
                         "final_reward(self)")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the environment's "
                                 "constructor (for a library's game, its make's: textarena.make, gymnasium.make)")
    max_turns: int = Field(default=8, ge=1, le=256, description="model turns per episode")
    episode_tokens: int = Field(default=512, ge=1, description="tokens one episode may add after its first "
                                "observation, the model's and the environment's together")
    template: str = Field(default="{observation}", description="the first user message, with {observation} where "
                          "the environment's first observation goes (instructions around it, if any)")
    step_s: float = Field(default=10.0, gt=0, le=3600, description="seconds one call (start, step, final reward) may "
                          "take; past it the episode's process is ended and the episode fails")
    obs_chars: int = Field(default=2000, ge=16, le=1 << 20, description="an observation past this many characters is "
                           "cut (its head and tail kept)")
    memory_mb: int = Field(default=2048, ge=64, description="address space one episode's process may add to what "
                           "the environment's imports took (MiB); past it, its allocations fail")
    max_failed_frac: float = Field(default=0.25, ge=0, le=1, description="share of a unit's episodes that may fail "
                                   "in the environment (raise, hang, return nonsense) and stay unscored; past it the "
                                   "stage stops with the first failure")
    workers: int = Field(default=8, ge=1, le=1024, json_schema_extra={"keyed": False}, description="environment "
                         "calls in flight at once (each episode's in its own process); the others wait their turn, and "
                         "a call's step_s starts when it is sent")
    overlap: bool | None = Field(default=None, description="a unit's episodes in two halves that take turns: one "
                                 "half's environment steps run while the other half generates; false: all "
                                 "episodes generate together, then all step; unset: overlap where the engine is "
                                 "on a GPU")

    @field_validator("template")
    @classmethod
    def _has_observation(cls, v: str) -> str:
        return has_placeholder(v, "observation", "the environment's first observation goes")

    @model_validator(mode="before")
    @classmethod
    def _env_in_long_form(cls, data: Any) -> Any:
        return shorthand(data)

    @property
    def source(self) -> str | None:
        """What keys the environment (its kind's digest)."""
        return self.env.source

    @property
    def spec(self) -> str | type:
        """What the host loads: the user's 'file.py:Class', or the adapter class itself (a stage that
        plays it reaches its code: tasks/runner/code_reach.py)."""
        return self.env.target

    @property
    def env_args(self) -> dict[str, Any]:
        return self.env.args(self.args)

    @property
    def name(self) -> str:
        return self.env.name

    def wrap(self, prompt: str) -> str:
        return self.template.replace("{observation}", prompt)

    def opening(self, observation: str, note: str | None) -> str:
        """An episode's first user message: the first observation in the template (a kind that
        retries with a note puts the note in too)."""
        return self.wrap(observation)

    def first_message(self, prompt: Prompt) -> str:
        """The environment's first observation for `prompt`, in the template: an episode started and
        ended in a host of its own."""
        host = self.host(shared=False, fields=tuple(sorted(prompt.fields)))
        try:
            host.send(0, "open", seed=seed_of(prompt), row=row_of(prompt))
            reply = host.collect([0])[0]
        except environments.EnvError as e:
            return f"[{self.name}: {e}]"
        finally:
            host.close()
        return self.wrap(reply.observation or "") if reply.failure is None else f"[the episode failed: {reply.failure}]"

    def budget(self, max_tokens: int) -> int:
        return self.episode_tokens

    def checks(self, pipeline) -> list[str]:
        return episode_checks(pipeline, self.kind, self.episode_tokens)

    def problems(self, fields: Collection[str] = (), first: Prompt | None = None) -> list[str]:
        """Import the environment in its host process, as a stage will, and start its first episode
        (on `first`, the first start a stage will give it; a game of a library's: on seed 0): an
        import error, a missing class or method, a signature it cannot be called with, a `reset`
        that raises or returns what is not an observation."""
        if said := self.env.problems():
            return said
        host = self.host(shared=False, fields=tuple(sorted(fields)))
        try:
            host.start()
            rows = self.env.starts_on_rows
            if not rows or first is not None:  # an episode that cannot start here says so now
                seed, row = (seed_of(first), row_of(first)) if first is not None and rows else (0, {})
                host.send(0, "open", seed=seed, row=row)
                reply = host.collect([0])[0]
                if reply.failure is not None:
                    said = reply.failure.strip().splitlines()
                    what = reply.failure.strip() if rows else said[-1]
                    where = f" (start {first.id!r})" if first is not None and rows else ""
                    return [f"{self.name}: its first episode could not start{where}: {what}{self.env.start_hint()}"]
        except environments.EnvError as e:
            return [f"{self.name}: {e}"]
        finally:
            host.close()
        return []

    def model_problems(self, tokenizer) -> list[str]:
        try:
            turn_pieces(tokenizer)
        except ValueError as e:
            return [f"{self.name}: {e}"]
        return []

    def host(self, shared: bool = True, fields: tuple[str, ...] = ()) -> environments.EnvHost:
        kw = dict(step_s=self.step_s, obs_chars=self.obs_chars, memory_mb=self.memory_mb, fields=fields,
                  workers=self.workers)
        if not shared:
            return environments.EnvHost(self.spec, self.env_args, **kw)

        def same_source() -> None:
            if (now := self.env.changed()) is not None:
                raise EnvironmentFailedError(
                    f"{self.name}: the file (or a module it imports from its folder) changed while this run used it "
                    f"(sha256 {self.source[:12]} then, {now[:12]} now); the stage stops rather than play two "
                    "versions. Run the same command again: it continues with the file as it is now, and the stages "
                    "that play it run again")

        try:
            return environments.shared(self.spec, self.env_args, tag=self.source or "", before_load=same_source, **kw)
        except environments.EnvError as e:
            raise EnvironmentFailedError(f"{self.name}: {e}") from None

    # the episodes -----------------------------------------------------------------------------
    def roll(self, sampler, prompts: list[Prompt], params: SamplingParams,
             seed: int) -> tuple[list[Completion], dict[str, float]]:
        eps = [_Episode(p, i, next(_KEYS)) for p in prompts for i in range(params.n)]
        waited = self.play(sampler, eps, params, seed)
        self.settle(eps)
        return self.rows(eps), self.cost(eps, waited)

    def play(self, sampler, eps: list[_Episode], params: SamplingParams, seed: int) -> float:
        """Play `eps` to their ends, every episode's turns together (an episode with `forced` turns
        replays those before the model writes); the seconds spent waiting on the environment."""
        tok = sampler.tokenizer
        turn_pieces(tok)  # a template that cannot append turns stops here, before any episode starts
        host = self.host(fields=tuple(sorted({k for e in eps for k in e.prompt.fields})))
        try:
            for e in eps:
                host.send(e.key, "open", seed=seed_of(e.prompt), row=row_of(e.prompt))
                e.waiting = "open"
            half = (len(eps) + 1) // 2 if overlapped(self.overlap) else len(eps)
            cohorts = [c for c in (eps[:half], eps[half:]) if c]
            waited = 0.0
            for turn in range(self.max_turns + 1):
                for c, cohort in enumerate(cohorts):
                    t = time.time()
                    asked = [e for e in cohort if e.waiting]
                    replies = host.collect([e.key for e in asked])
                    waited += time.time() - t
                    for e in asked:
                        self.read(tok, e, replies[e.key], last=turn == self.max_turns)
                    self.brief(sampler, [e for e in asked if e.ended is None], params, turn_seed_of(seed, c, turn))
                    live = [e for e in cohort if e.ended is None]
                    if turn == self.max_turns or not live:
                        continue
                    for e in self.generate(sampler, live, params, turn_seed_of(seed, c, turn)):
                        host.send(e.key, "step", action=e.segments[-1].text)
                        e.waiting = "step"
            t = time.time()
            closing = [e for e in eps if e.ended != "failed"]
            for e in closing:
                host.send(e.key, "finish")
            for e, reply in zip(closing, host.collect([e.key for e in closing]).values()):
                if reply.failure is not None:
                    e.fail("finish", reply.failure)
                else:
                    e.final = reply.final
            waited += time.time() - t
        finally:  # a unit that stops half way (the engine failed) leaves no episode running
            host.drop([e.key for e in eps])
        return waited

    def replay(self, prompt: Prompt, turns: list[Segment], answers: list[tuple[str | None, float, bool]],
               start: str | None) -> _Episode:
        """An episode of `prompt` that replays the model's `turns` before the model plays on; the
        environment must answer the first len(answers) of them as it did (`answers`), and begin
        with `start`, or the episode fails as nondeterministic."""
        return _Episode(prompt, 0, next(_KEYS), forced=tuple(s for s in turns if s.role == "model"),
                        expect=tuple(answers), expect_start=start)

    def starts(self, prompts: list[Prompt]) -> list[environments.Reply]:
        """Each start's first observation, its episode opened and dropped: where a tree search over
        turns begins."""
        host = self.host(fields=tuple(sorted({k for p in prompts for k in p.fields})))
        keys = [next(_KEYS) for _ in prompts]
        try:
            for k, p in zip(keys, prompts):
                host.send(k, "open", seed=seed_of(p), row=row_of(p))
            replies = host.collect(keys)
        finally:
            host.drop(keys)
        return [replies[k] for k in keys]

    def read(self, tok, e: _Episode, reply: environments.Reply, last: bool) -> None:
        """A call's answer into its episode: the first observation, or a step's reward and the next observation."""
        op, e.waiting = e.waiting, None
        if reply.failure is not None:
            e.fail(op, reply.failure)
        elif op == "open":
            if e.expect_start is not None and reply.observation != e.expect_start:
                e.fail("replay", f"the environment is not deterministic: reset with the same seed and row began "
                       f"{_said(reply.observation)}, where it began {_said(e.expect_start)} before. {REPLAY}")
                return
            e.start = reply.observation or ""
            self.arrive(tok, e, e.start, first=True)
        else:
            if e.turns <= len(e.expect) and (was := e.expect[e.turns - 1]) != (reply.observation, reply.reward,
                                                                                  reply.done):
                e.fail("replay", f"the environment is not deterministic: replaying the same seed and the same {e.turns} "
                       f"action(s) answered {_said(reply.observation, reply.reward, reply.done)}, where it answered "
                       f"{_said(*was)} before. {REPLAY}")
                return
            e.rewards.append(reply.reward)
            e.observations.append(reply.observation)
            if reply.done:
                e.ended = "done"
            elif last:
                e.ended = "max_turns"
            else:
                self.arrive(tok, e, reply.observation or "", first=False)

    def arrive(self, tok, e: _Episode, observation: str, first: bool) -> None:
        """An observation the model is to read next: the episode's first message (`first`), or the
        next user turn, where the episode has room to read it and answer (else it ends)."""
        if first:
            e.context = list(first_ids(tok, self.opening(observation, e.note)))
            e.prompt_ids = tuple(e.context)
            return
        text, ids = observation_ids(tok, e.segments[-1].token_ids, observation)
        if e.used + len(ids) >= self.episode_tokens:  # no room to read it and answer
            e.ended = "length"
        else:
            e.add("env", text, ids)

    def brief(self, sampler, eps: list[_Episode], params: SamplingParams, seed: int) -> None:
        """Before the model's turn in `eps` (the live episodes of a cohort): nothing here; a kind
        whose other agents speak first (roles) has them speak."""

    def generate(self, sampler, live: list[_Episode], params: SamplingParams, seed: int) -> list[_Episode]:
        """One model turn for each live episode (an episode replaying a path takes its next turn
        from there, the ids the model wrote then); those whose turn is an action to step on."""
        replayed = [e for e in live if e.turns < len(e.forced)]
        for e in replayed:
            seg = e.forced[e.turns]
            e.add("model", seg.text, seg.token_ids)
        rooms: dict[int, list[_Episode]] = {}
        keys = {e.key for e in replayed}
        for e in live:
            if e.key not in keys:
                rooms.setdefault(min(params.max_tokens, self.episode_tokens - e.used), []).append(e)
        acted = list(replayed)
        tok = sampler.tokenizer
        for room, group in sorted(rooms.items()):
            step = turn_params(tok, params.model_copy(update={"n": 1, "max_tokens": room}))
            gens = sampler.generate_ids([e.context for e in group], step, seed=(seed + room) % (1 << 62))
            for e, (g,) in zip(group, gens):
                e.add("model", *model_turn(tok, g))
                e.generated += len(g.token_ids)
                acted.append(e)
        return acted

    def settle(self, eps: list[_Episode]) -> None:
        failed = [e for e in eps if e.ended == "failed"]
        if failed and len(failed) > self.max_failed_frac * len(eps):
            e = failed[0]
            raise EnvironmentFailedError(
                f"{self.name} failed in episode {e.prompt.id!r} #{e.index}: {e.failure}\n({len(failed)} of {len(eps)} "
                f"episodes of the unit failed; sample.rollout.max_failed_frac={self.max_failed_frac:g}). Fix the "
                "environment (or raise sample.rollout.step_s / max_failed_frac) and re-run the same command: finished "
                "units are kept")

    def rows(self, eps: list[_Episode]) -> list[Completion]:
        out = []
        for e in eps:
            ret = None if e.ended == "failed" else e.ret
            outcome = Outcome(start=e.start, rewards=tuple(e.rewards), final=e.final, ret=ret, ended=e.ended,
                              failure=e.failure, reports=tuple(e.reports) or None)
            out.append(Completion(prompt_id=e.prompt.id, prompt=e.prompt.prompt, answer=e.prompt.answer,
                                  level=e.prompt.level,
                                  fields=e.prompt.fields, index=e.index, text="".join(s.text for s in e.segments),
                                  n_tokens=e.generated, finish_reason=e.ended, prompt_ids=e.prompt_ids,
                                  segments=tuple(e.segments), outcome=outcome))
        return out

    def cost(self, eps: list[_Episode], waited: float) -> dict[str, float]:
        scored = [e for e in eps if e.ended != "failed"]
        return {"gen_tokens": sum(e.generated for e in eps), "episodes": len(eps),
                "turns": sum(sum(s.role == "model" for s in e.segments) for e in eps),
                "env_steps": sum(len(e.rewards) for e in eps), "env_failed": len(eps) - len(scored),
                "env_done": sum(e.ended == "done" for e in eps),
                "return_sum": sum(e.ret for e in scored), "env_wait_s": waited}

    # demonstrations ---------------------------------------------------------------------------
    def demonstrations(self, demos: list, report, source: str) -> dict[str, Item]:
        """Each row replayed in the environment (tasks/rollouts/replay.py)."""
        from ratchet.tasks.rollouts.replay import replay_demonstrations

        return replay_demonstrations(self, demos, report, source)

    def demo_row(self, tokenizer, demo) -> dict:
        """The episode's ids as a sampled one has them: the first observation in the template, each
        model turn ended by the end-of-turn token, each observation a user turn after it."""
        pieces: list[tuple[str, list[int]]] = []
        for t in demo.turns:
            if t.role == "model":
                pieces.append(("model", text_ids(tokenizer, t.text) + [tokenizer.eos_token_id]))
            else:
                pieces.append(("env", list(observation_ids(tokenizer, tuple(pieces[-1][1]), t.text)[1])))
        return demo_tokens(first_ids(tokenizer, self.opening(demo.prompt, None)), pieces)

    def metrics(self, cost: dict[str, float]) -> dict[str, float]:
        n = max(cost.get("episodes", 0), 1)
        scored = max(n - cost.get("env_failed", 0), 1)
        return {"turns_per_episode": cost.get("turns", 0) / n, "return_mean": cost.get("return_sum", 0.0) / scored,
                "done_frac": cost.get("env_done", 0) / n, "env_failed_frac": cost.get("env_failed", 0) / n,
                "env_failed": cost.get("env_failed", 0), "env_steps": cost.get("env_steps", 0),
                "env_wait_s": cost.get("env_wait_s", 0.0)}

    def summary(self, m: dict[str, float]) -> list[str]:
        out = [f"{m.get('turns_per_episode', 0):.1f} turns/episode", f"mean return {m.get('return_mean', 0):.3g}",
               f"{m.get('done_frac', 0):.0%} ended by the environment"]
        return out + ([f"{m['env_failed']:.0f} episodes failed in the environment"] if m.get("env_failed") else [])
