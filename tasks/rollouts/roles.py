"""sample.rollout.kind=roles: agents in roles play an environment's episodes together (FinCon).

    sample:
      rollout:
        kind: roles
        env: "examples/environments/trading.py:Trading"
        roles:
          - {name: trend, reads: "Last \\d+ closes: [-\\d., ]+", instructions: "Closes: {observation}\\nSay in one
             sentence whether the stock is rising or falling."}
          - {name: manager, acts: true, instructions: "{observation}\\n\\nYour analysts report:\\n{reports}\\n
             Answer buy, sell or hold."}

Every role is an agent with its own text: its `instructions` and its `beliefs` (what it has
learned; the config's are version 1, and a beliefs search, tasks/searches/beliefs.py, writes the next,
kept as the policy's text, tasks/text.py). The analysts (every role that does not act) each read
their part of every observation (`reads`, a pattern: every match, one per line; unset: all of
it) and report in a turn of their own, each from a fresh conversation. The one role that acts
(the manager) reads the observation and the reports, and its turn is the action the environment
steps on. The roles may be one model (the run's policy, each in its own conversation).

The episode's row is the manager's conversation, as `kind: environment` writes it: its first
message (its instructions, the observation and the reports), then its turns, each user turn
after one the next observation with the next reports. Training trains the manager's turns, with
the reports masked as the observations are; the reports are also kept by turn in the outcome
(`outcome.reports`), which the beliefs search reads. A report is the model's text read as plain
text (a turn marker in it cannot open a turn), and bounded by `report_tokens`.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ratchet.models.sampler import SamplingParams
from ratchet.tasks.rollouts import turn_of, turn_params
from ratchet.tasks.rollouts.environment import EnvironmentRollout, _Episode, first_ids

NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
LEARNED = "What you have learned so far:\n"
NO_REPORTS = "(no analyst reports)"


class Role(BaseModel):
    """An agent of the episode: what it is told, what it reads of each observation, whether it acts."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="the role's name (letters, digits, _ and -; it names the role to a beliefs search "
                      "and in the reports the manager reads)")
    instructions: str = Field(description="the role's message, with {observation} where its part of the observation "
                              "goes; the acting role's also with {reports} where the analysts' reports go")
    reads: str | None = Field(default=None, description="a regular expression: the parts of each observation this "
                              "role reads (every match, one per line); unset: the whole observation")
    acts: bool = Field(default=False, description="whether this role's turn is the action (exactly one role acts)")
    beliefs: str = Field(default="", description="what the role has learned, given before its instructions: "
                         "version 1 of its beliefs (a beliefs search writes the next)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.fullmatch(v):
            raise ValueError(f"role name {v!r} is not a name: use letters, digits, _ and - (at most 32, a letter first)")
        return v

    @field_validator("reads")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"reads={v!r} is not a regular expression ({e}); write a Python re pattern") from None
        return v

    @model_validator(mode="after")
    def _slots(self) -> "Role":
        if "{observation}" not in self.instructions:
            raise ValueError(f"role {self.name!r}: instructions have no {{observation}}; put {{observation}} where "
                             "its part of the observation goes")
        return self

    def view(self, observation: str) -> str:
        """What this role reads of `observation`."""
        if self.reads is None:
            return observation
        found = [m.group(0) for m in re.finditer(self.reads, observation)]
        return "\n".join(found) if found else "(nothing this role reads in this observation)"

    def message(self, observation: str, reports: str, beliefs: str | None = None) -> str:
        """The role's user message: its beliefs, then its instructions around its view (and the reports)."""
        b = self.beliefs if beliefs is None else beliefs
        body = self.instructions.replace("{observation}", self.view(observation)).replace("{reports}", reports)
        return f"{LEARNED}{b.strip()}\n\n{body}" if b.strip() else body


class RolesRollout(EnvironmentRollout):
    """Analysts report on their parts of each observation; a manager reads the reports and acts (FinCon)."""

    has_roles: ClassVar[bool] = True
    text_refused: ClassVar[str | None] = ("gives each role its own instructions (sample.rollout.roles), not a text "
                                          "around task prompts: put the instructions in the roles, and improve their "
                                          "beliefs with prompt.search.kind=beliefs")
    kind: Literal["roles"] = "roles"
    roles: tuple[Role, ...] = Field(description="the agents: analysts, each reading its part of every observation and "
                                    "reporting, and exactly one role with acts: true (the manager), whose turn is the "
                                    "action")
    report_tokens: int = Field(default=48, ge=1, description="token limit of one analyst's report")
    turn_template: str = Field(default="{observation}\n\nYour analysts report:\n{reports}",
                               description="the acting role's user turn after its first: the next observation and "
                               "the next reports")

    @model_validator(mode="after")
    def _roles(self) -> "RolesRollout":
        names = [r.name for r in self.roles]
        acting = [r.name for r in self.roles if r.acts]
        if len(acting) != 1:
            fix = ("set acts: true on the role whose turn is the action (the manager)" if not acting else
                   f"set acts: true on one of them only ({', '.join(acting)}); the others report")
            raise ValueError(f"sample.rollout.roles has {len(acting)} roles that act; {fix}")
        if len(set(names)) != len(names):
            raise ValueError(f"sample.rollout.roles names a role twice ({', '.join(names)}); give each its own name")
        if len(self.roles) > 1 and "{reports}" not in self.manager.instructions:
            raise ValueError(f"role {self.manager.name!r} acts and has analysts, and its instructions have no "
                             "{reports}; put {reports} where the analysts' reports go")
        if self.template != "{observation}":
            raise ValueError("sample.rollout.template is the first message of kind environment; a roles rollout's "
                             "messages are its roles' instructions: remove template and write them there")
        if "{observation}" not in self.turn_template or "{reports}" not in self.turn_template:
            raise ValueError("sample.rollout.turn_template needs {observation} and {reports}: where the next "
                             "observation and the analysts' next reports go")
        return self

    @property
    def manager(self) -> Role:
        return next(r for r in self.roles if r.acts)

    @property
    def analysts(self) -> list[Role]:
        return [r for r in self.roles if not r.acts]

    def with_text(self, text) -> "RolesRollout":
        """The roles with the beliefs of a policy's text (a role it names none of keeps its own)."""
        if text is None or not text.beliefs:
            return self
        roles = tuple(r.model_copy(update={"beliefs": text.beliefs.get(r.name, r.beliefs)}) for r in self.roles)
        return self.model_copy(update={"roles": roles})

    def beliefs(self) -> dict[str, str]:
        """Each role's beliefs as this rollout plays them."""
        return {r.name: r.beliefs for r in self.roles}

    def wrap(self, prompt: str) -> str:
        return self.manager.message(prompt, "(the analysts' reports on it)" if self.analysts else NO_REPORTS)

    def opening(self, observation: str, note: str | None) -> str:
        return observation  # composed in `brief`: the manager's message with the reports

    def checks(self, pipeline) -> list[str]:
        out = super().checks(pipeline)
        if pipeline.label.plays_rollout:
            out.append(f"label.kind={pipeline.label.kind!r} replays an episode's turns to search from its states, and "
                       "a roles rollout's reports are written afresh each turn, so a replayed state is not the one "
                       "searched; use label.kind=verifier with sample.rollout.kind=roles")
        return out

    def demonstrations(self, demos: list, report, source: str) -> dict:
        for d in demos:
            report.add(source, "a demonstration sample.rollout.kind='roles' cannot replay", d.place, "its turns",
                       "a roles episode's user turns carry its analysts' reports, which a demonstration does not "
                       "have: set sample.rollout.kind=environment for the cold start (its demonstrations are the "
                       "acting role's turns), or no cold_start")
        return {}

    # the episodes -----------------------------------------------------------------------------
    def arrive(self, tok, e: _Episode, observation: str, first: bool) -> None:
        e.pending, e.first = observation, first  # the analysts read it first (`brief`)

    def brief(self, sampler, eps: list[_Episode], params: SamplingParams, seed: int) -> None:
        """Each analyst's report on its part of each pending observation (one batch for all of
        them), then the manager's message with the reports."""
        tok = sampler.tokenizer
        waiting = [e for e in eps if e.pending is not None]
        asked = [(e, r) for e in waiting for r in self.analysts]
        said: dict[tuple[int, str], str] = {}
        if asked:
            contexts = [list(first_ids(tok, r.message(e.pending, ""))) for e, r in asked]
            step = turn_params(tok, params.model_copy(update={"n": 1, "max_tokens": self.report_tokens,
                                                              "logprobs": False}))
            for (e, r), (g,) in zip(asked, sampler.generate_ids(contexts, step, seed=(seed * 31 + 17) % (1 << 62))):
                said[e.key, r.name] = turn_of(tok, g)[0].strip() or "(nothing)"
                e.reported += len(g.token_ids)
        for e in waiting:
            reports = {r.name: said[e.key, r.name] for r in self.analysts}
            e.reports.append(reports)
            lines = "\n".join(f"- {name}: {text}" for name, text in reports.items()) or NO_REPORTS
            observation, e.pending = e.pending, None
            message = (self.manager.message(observation, lines) if e.first else
                       self.turn_template.replace("{observation}", observation).replace("{reports}", lines))
            super().arrive(tok, e, message, e.first)

    def cost(self, eps: list[_Episode], waited: float) -> dict[str, float]:
        out = super().cost(eps, waited)
        reported = sum(e.reported for e in eps)
        return {**out, "gen_tokens": out["gen_tokens"] + reported, "report_tokens": reported,
                "reports": sum(len(r) for e in eps for r in e.reports)}

    def metrics(self, cost: dict[str, float]) -> dict[str, float]:
        out = super().metrics(cost)
        out["reports_per_episode"] = cost.get("reports", 0) / max(cost.get("episodes", 0), 1)
        return out

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"{len(self.analysts)} analyst(s) reporting to {self.manager.name}"] + super().summary(m)
