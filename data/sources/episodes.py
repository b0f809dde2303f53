"""episodes: seeded starts for an environment, and nothing else: the environment writes the task.

    data: {kind: episodes, train_size: 64, eval_size: 32}
    sample:
      rollout: {kind: environment, env: "my_env.py:Maze"}

Each prompt is one start: `seed N`, with the seed among its fields, which the environment's
`reset` receives (tasks/environments/). Train seeds are `first_seed` onwards; the held-out seeds
follow them, so a held-out start is never trained on. Every episode of a start begins from the
same state (for an environment whose reset is deterministic in its seed), so two episodes of one
start can be compared, and paired for DPO. The check is the episode's return (`return`).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from ratchet.data.checkers import CheckConfig, ReturnCheck
from ratchet.data.records import Prompt
from ratchet.data.sources.base import PoolSource, Split


class EpisodesSource(PoolSource):
    """Seeded starts for an environment rollout: train seeds, then held-out seeds after them."""

    kind: Literal["episodes"] = "episodes"
    train_size: int = Field(default=64, ge=1, description="train starts: seeds first_seed .. first_seed+train_size-1")
    eval_size: int = Field(default=32, ge=1, description="held-out starts: the seeds right after the train seeds")
    first_seed: int = Field(default=0, ge=0, description="the first train seed")
    check: CheckConfig = Field(default_factory=ReturnCheck, description="how an episode is scored: its return "
                               "(`return`), or a check of the model's last turn")

    def load(self, seed: int, train_answers: bool) -> Split:
        def start(s: int) -> Prompt:
            return Prompt(id=f"seed-{s}", prompt=f"seed {s}", task="episodes", fields={"seed": s})

        end = self.first_seed + self.train_size
        return Split([start(s) for s in range(self.first_seed, end)], [start(s) for s in range(end, end + self.eval_size)])

    def eval_metrics(self, prompts: list[Prompt], rows: list) -> dict[str, float]:
        """The held-out episodes' risk beside their return: `step_cvar_05`, the mean of the worst 5%
        of their steps' rewards pooled (a trading episode's daily returns: the expected shortfall),
        and `return_worst_10`, the mean return of the worst 10% of episodes."""
        outcomes = [r.outcome for r in rows if r.outcome is not None and r.outcome.ret is not None]
        steps = sorted(x for o in outcomes for x in o.rewards)
        if not steps:
            return {}
        returns = sorted(o.ret for o in outcomes)

        def tail(xs: list[float], q: float) -> float:
            worst = xs[:max(1, math.ceil(q * len(xs)))]
            return sum(worst) / len(worst)

        return {"step_cvar_05": tail(steps, 0.05), "return_worst_10": tail(returns, 0.10)}
