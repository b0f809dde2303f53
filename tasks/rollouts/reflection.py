"""sample.rollout.kind=reflection: a failed episode, a reflection on it, and another attempt (Retroformer).

    sample:
      n: 4                     # reflections on each failed first attempt
      rollout: {kind: reflection, env: "my_env.py:Maze", max_turns: 6, success: 1.0}
    label: {kind: verifier}    # a reflection's reward: the return of the attempt it was given to
    filter: {kind: pairs}      # a reflection that led to success against one that did not
    train: {kind: dpo}

For every start of a unit:

1. The model plays a first attempt (an environment episode, as `kind: environment` plays it).
   A first attempt whose return reaches `success` is the start's one row, as it would be there.
2. A failed one gets a user turn in its own conversation: its last observation and
   `reflect_template`, which asks what went wrong. The model writes `n` reflections on it
   (at most `reflection_tokens` each).
3. Each reflection is given to a new attempt: the same start (reset with the same seed), its
   first message `retry_template`, with the first observation and the reflection. It is
   decoded greedily (`retry_temperature`), so the returns of two reflections on one attempt
   differ by what the reflections said, not by sampling in the attempts.

A reflection's row: the failed attempt and the request as the prompt's token ids, the reflection
as its one model segment (what RFT and DPO train), and as its outcome the return of the attempt
it was given to (the attempt's turns kept in `outcome.attempt`, for reading). The reflections of
one start share that prompt, so `filter.kind: pairs` pairs a reflection that led to success
with one that did not. `reflect: false` plays the same second attempt with no reflection: the
baseline that says whether reflecting pays.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from ratchet.data.events import Figure, Shows
from ratchet.data.records import Completion, Prompt, Segment
from ratchet.models.sampler import SamplingParams
from ratchet.tasks.rollouts import has_placeholder, turn_of, turn_params
from ratchet.tasks.rollouts.environment import _KEYS, EnvironmentRollout, _Episode, observation_ids

REFLECT = ("That attempt did not succeed. In one or two sentences, say what went wrong and what you will do "
           "differently next time.")
RETRY = "{observation}\n\nWhat you noted after your last attempt: {reflection}"
LAST_CHARS = 200  # of a failed attempt's last observation, in the request for a reflection
REQUEST_TOKENS = 256  # what the request may take in the budget: that observation and the template


class ReflectionRollout(EnvironmentRollout):
    """Episodes with a reflection after a failed attempt and another attempt with it (Retroformer)."""

    shows: ClassVar[Shows] = Shows(figures=(Figure(
        "Reflections per round", "reflections.png", "success (%)", ("first_success_frac", "first attempts (%)"),
        ("retry_success_frac", "attempts after a reflection (%)", "second attempts that succeeded (%)")),))
    kind: Literal["reflection"] = "reflection"
    offline: ClassVar[str | None] = ("trains on a reflection and the attempt after it, written across two episodes; "
                                     "an online step scores one episode")
    success: float = Field(default=1.0, allow_inf_nan=False, description="a first attempt whose return is below this "
                           "gets reflections and second attempts (set it to data.check.success)")
    reflect: bool = Field(default=True, description="false: the second attempt gets no reflection (a plain retry, "
                          "the baseline a reflection must beat)")
    reflect_template: str = Field(default=REFLECT, description="the user turn after a failed attempt that asks for a "
                                  "reflection (after the attempt's last observation)")
    retry_template: str = Field(default=RETRY, description="the second attempt's first message, with {observation} "
                                "(the first observation) and {reflection}")
    reflection_tokens: int = Field(default=64, ge=1, description="token limit of one reflection")
    retry_temperature: float | None = Field(default=0.0, ge=0, description="sampling temperature of second attempts: "
                                            "0 (greedy) makes a second attempt's return depend on its reflection "
                                            "alone, so two reflections' returns differ by what they said; unset: "
                                            "as the first attempts (sample.temperature)")

    @field_validator("retry_template")
    @classmethod
    def _has_both(cls, v: str) -> str:
        has_placeholder(v, "observation", "the environment's first observation goes")
        return has_placeholder(v, "reflection", "the model's reflection goes")

    def opening(self, observation: str, note: str | None) -> str:
        if note is None:
            return self.wrap(observation)
        return self.retry_template.replace("{observation}", observation).replace("{reflection}", note)

    def budget(self, max_tokens: int) -> int:
        """A reflection reads a whole failed attempt: the attempt, the request (its last observation
        cut to LAST_CHARS) and the reflection."""
        return self.episode_tokens + REQUEST_TOKENS + self.reflection_tokens

    def checks(self, pipeline) -> list[str]:
        out = super().checks(pipeline)
        check = pipeline.data.check
        if check.reads_return and check.success != self.success:
            out.append(f"sample.rollout.success={self.success:g} differs from data.check.success={check.success:g}: "
                       "an attempt the check calls a failure would get no reflection, or one it calls a success "
                       "would; set them equal")
        return out

    def roll(self, sampler, prompts: list[Prompt], params: SamplingParams,
             seed: int) -> tuple[list[Completion], dict[str, float]]:
        tok = sampler.tokenizer
        first = [_Episode(p, 0, next(_KEYS)) for p in prompts]
        waited = self.play(sampler, first, params.model_copy(update={"n": 1}), seed)
        self.settle(first)
        failed = [e for e in first if e.ended != "failed" and e.ret < self.success]
        asks = [self.request(tok, e) for e in failed]
        notes = [[None] * params.n for _ in failed]
        if failed and self.reflect:
            gens = sampler.generate_ids([list(e.context) + list(ids) for e, (_, ids) in zip(failed, asks)],
                                        turn_params(tok, params.model_copy(update={"max_tokens": self.reflection_tokens})),
                                        seed=(seed * 7 + 1) % (1 << 62))
            notes = [[turn_of(tok, g) + (g,) for g in row] for row in gens]
        second = [_Episode(e.prompt, i, next(_KEYS), expect_start=e.start, note=None if n is None else n[0].strip())
                  for e, row in zip(failed, notes) for i, n in enumerate(row)]
        if second:
            retry = {"n": 1} if self.retry_temperature is None else {"n": 1, "temperature": self.retry_temperature}
            waited += self.play(sampler, second, params.model_copy(update=retry), seed + 1)
            self.settle(second)
        rows, after = [], iter(second)
        by_start = {e.key: (ask, row) for e, ask, row in zip(failed, asks, notes)}
        for e in first:
            if e.key not in by_start:
                rows += self.rows([e])
                continue
            (_, asked), row = by_start[e.key]
            prompt_ids = (*e.context, *asked)
            for note in row:
                a = next(after)
                (episode,) = self.rows([a])
                if note is None:  # a plain retry: the second attempt is the row
                    rows.append(episode)
                    continue
                text, ids, g = note
                outcome = episode.outcome.model_copy(update={"attempt": episode.segments})
                rows.append(Completion(prompt_id=e.prompt.id, prompt=e.prompt.prompt, answer=e.prompt.answer,
                                       level=e.prompt.level,
                                       fields=e.prompt.fields, index=a.index, text=text, n_tokens=len(g.token_ids),
                                       finish_reason=g.finish_reason, prompt_ids=prompt_ids,
                                       segments=(Segment(role="model", text=text, token_ids=ids),),
                                       outcome=outcome))
        cost = self.cost(first + second, waited)
        cost["gen_tokens"] += sum(len(n[2].token_ids) for row in notes for n in row if n is not None)
        cost.update(starts=len(first), first_success=len(first) - len(failed) - sum(e.ended == "failed" for e in first),
                    retried=len(failed), retries=len(second),
                    retry_success=sum(a.ended != "failed" and a.ret >= self.success for a in second))
        return rows, cost

    def request(self, tok, e: _Episode) -> tuple[str, tuple[int, ...]]:
        """The user turn that asks for a reflection on a failed attempt: its last observation (the
        attempt ended before the model read it) and the request."""
        last = e.observations[-1] if e.observations and e.observations[-1] else ""
        if len(last) > LAST_CHARS:
            last = last[: LAST_CHARS // 2] + " ... " + last[-LAST_CHARS // 2:]
        message = f"{last}\n\n{self.reflect_template}" if last else self.reflect_template
        return observation_ids(tok, e.segments[-1].token_ids if e.segments else (), message)

    def metrics(self, cost: dict[str, float]) -> dict[str, float]:
        out = super().metrics(cost)
        starts = max(cost.get("starts", 0), 1)
        out.update(first_success_frac=cost.get("first_success", 0) / starts,
                   retried_frac=cost.get("retried", 0) / starts, retries=cost.get("retries", 0),
                   retry_success_frac=cost.get("retry_success", 0) / max(cost.get("retries", 0), 1))
        return out

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"first attempts {m.get('first_success_frac', 0):.0%} successful",
                f"{m.get('retries', 0):.0f} {'reflections' if self.reflect else 'plain retries'}",
                f"{m.get('retry_success_frac', 0):.0%} of second attempts successful"] + super().summary(m)[1:]
