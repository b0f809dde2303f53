"""return: an environment episode's return is its score; a return at or above `success` is a success.

    data:
      check: {kind: return, success: 1.0}

For rollouts that play episodes against an environment (sample.rollout.kind=environment): the
reward every label, filter and trainer sees is the episode's return (its steps' rewards and the
final reward, summed), and what RFT accepts, DPO's correct side and evaluation's accuracy count
is a success (return >= success). Held-out accuracy is then the success rate; the mean return is
logged beside it (`score_mean`). An episode whose environment failed has no return: it is
unscored, never guessed, and left out of both.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.checks.base import Check, Item, Tally, Verdict


class ReturnCheck(Check):
    """The episode's return is the score; return >= success is a success."""

    extracts: ClassVar[bool] = False  # a return, not an answer that episodes could vote with
    needs_answer: ClassVar[bool] = False
    reads_return: ClassVar[bool] = True
    kind: Literal["return"] = "return"
    success: float = Field(default=1.0, allow_inf_nan=False, description="an episode whose return is at least this "
                           "is a success: what RFT accepts and what the held-out success rate counts")
    needs_done: bool = Field(default=False, description="a success must also be an episode the environment ended "
                             "(done), not one its turns or tokens cut short: for games whose return alone does not "
                             "say the goal was reached (step costs, as in CliffWalking)")

    def check(self, response: str, answer: str) -> Verdict:
        return Verdict(None, None)  # a text alone has no return: only check_many's items carry one

    def check_many(self, items: list[Item], tally: Tally | None = None) -> list[Verdict]:
        return [Verdict(None, None) if i.ret is None else
                Verdict(i.ret >= self.success and (i.ended == "done" or not self.needs_done), f"{i.ret:g}", i.ret)
                for i in items]

    def graded(self, response: str, answer: str, partial: float) -> float:
        raise ValueError(f"{self.place}.kind='return' scores episodes, not texts; a tree search over texts cannot "
                         "use it")
