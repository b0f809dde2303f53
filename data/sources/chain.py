"""chain: a built-in multi-step task. A start number and `steps` additions and subtractions
applied in turn ("Start with 7. Subtract 1, then subtract 5, then add 7. What number do you end
with?"), so the answer takes several dependent steps. Problems are drawn by seed, every one
distinct; the held-out problems are drawn first, so the eval set does not move when the train
pool grows. Its evaluation also reports `worked_accuracy`: right answers that state every
running value in order."""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ratchet.data.checkers import CheckConfig, NumberCheck
from ratchet.data.digest import sha256_json
from ratchet.data.records import Prompt
from ratchet.data.sources.base import PoolSource, Split, check_placeholders


class ChainSource(PoolSource):
    """Built-in: a number carried through several additions and subtractions (multi-step)."""

    kind: Literal["chain"] = "chain"
    steps: int = Field(default=3, ge=1, le=8, description="operations applied in turn to the start number")
    start_max: int = Field(default=10, ge=2, description="the start number ranges over 1..start_max-1")
    operand_max: int = Field(default=10, ge=2, description="each operand ranges over 1..operand_max-1")
    ops: str = Field(default="+-", pattern=r"^(\+|-|\+-|-\+)$", description="'+', '-' or '+-'; a subtraction "
                     "never takes the running value below zero")
    template: str = Field(default="Start with {start}. {steps}. What number do you end with? Work step by step.",
                          description="prompt text with {start} and {steps} ('Subtract 1, then add 7')")
    eval_size: int = Field(default=100, ge=1, description="problems held out for evaluation (drawn first)")
    train_size: int = Field(default=2000, ge=1, description="problems in the train pool")
    check: CheckConfig = Field(default_factory=NumberCheck, description="answer check; unset: the last number, "
                               "with room for the 2 x steps + 1 numbers a worked answer names (start, operands, "
                               "running values) and two more. kind 'steps': the reference answer lists the "
                               "running values ('6, 1, 8') and a right answer must state each of them in order")

    @field_validator("template")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        return check_placeholders(v, {"start", "steps"})

    def load(self, seed: int, train_answers: bool) -> Split:
        return _chain(self, seed)

    def eval_metrics(self, prompts: list[Prompt], rows: list) -> dict[str, float]:
        """worked_accuracy: the share of held-out answers that are right AND state every running
        value in order, so a right last number reached by luck does not count. Next to `accuracy`
        it tells learning the steps from learning to guess. (Under the `steps` check it is the
        accuracy itself.)"""
        from ratchet.data.checks.steps import worked

        if not isinstance(self.check, NumberCheck):
            return {}
        values = {p.id: chain_values(p.id) for p in prompts}
        scored = [r for r in rows if r.correct is not None and values.get(r.prompt_id)]
        if not scored:
            return {}
        return {"worked_accuracy": sum(worked(self.check, r.text, values[r.prompt_id]).correct
                                       for r in scored) / len(scored)}

    @model_validator(mode="after")
    def _fits(self) -> "ChainSource":
        need = 2 * self.steps + 1
        if "check" not in self.model_fields_set:
            self.check = NumberCheck(max_numbers=need + 2)
        elif self.check.kind in ("number", "steps") and "max_numbers" not in self.check.model_fields_set:
            self.check = self.check.model_copy(update={"max_numbers": need + 2})  # room for a worked answer
        if self.check.kind in ("number", "steps") and self.check.max_numbers < need:
            raise ValueError(f"check.max_numbers={self.check.max_numbers} is below the {need} distinct numbers a "
                             f"worked answer to {self.steps} steps can name, so right answers would be marked wrong; "
                             f"set data.check.max_numbers to at least {need}")
        ops = len(self.ops)
        space = (self.start_max - 1) * (ops * (self.operand_max - 1)) ** self.steps
        if self.eval_size + self.train_size > space // 2:
            raise ValueError(f"eval_size + train_size = {self.eval_size + self.train_size} distinct problems from "
                             f"about {space} possible ones; lower data.train_size or raise data.steps, "
                             "data.start_max or data.operand_max")
        return self


def chain_problem(rng: random.Random, cfg: ChainSource) -> tuple[int, tuple[tuple[str, int], ...], int]:
    """(start, ((op, operand), ...), answer): one problem, drawn from rng."""
    value = start = rng.randrange(1, cfg.start_max)
    ops = []
    for _ in range(cfg.steps):
        op = rng.choice(cfg.ops)
        if op == "-" and value < 1 and "+" in cfg.ops:  # nothing left to take away
            op = "+"
        if op == "+":
            b = rng.randrange(1, cfg.operand_max)
        else:  # subtraction only and nothing left: the problem stays at 0
            b = rng.randrange(1, min(cfg.operand_max - 1, value) + 1) if value else 0
        value = value + b if op == "+" else value - b
        ops.append((op, b))
    return start, tuple(ops), value


def chain_text(cfg: ChainSource, start: int, ops: tuple[tuple[str, int], ...]) -> str:
    words = ", then ".join(f"{'add' if op == '+' else 'subtract'} {b}" for op, b in ops)
    return cfg.template.format(start=start, steps=words[:1].upper() + words[1:])


def _chain(cfg: ChainSource, seed: int) -> Split:
    rng = random.Random(sha256_json(["chain", seed]))
    seen: set = set()
    rows: list[Prompt] = []
    while len(rows) < cfg.eval_size + cfg.train_size:
        start, ops, answer = chain_problem(rng, cfg)
        if (start, ops) in seen:
            continue
        seen.add((start, ops))
        pid = f"chain-{start}" + "".join(f"{'p' if op == '+' else 'm'}{b}" for op, b in ops)
        if cfg.check.kind == "steps":  # the reference names every running value, the last being the answer
            answer = ", ".join(str(v) for v in chain_values(pid))
        rows.append(Prompt(id=pid, prompt=chain_text(cfg, start, ops), answer=str(answer), task="chain"))
    return Split(rows[cfg.eval_size :], rows[: cfg.eval_size])


def chain_values(prompt_id: str) -> list[int] | None:
    """The running values of a built-in chain problem (after each step, the last being the
    answer), read back from its id ("chain-7m1m5p7" -> [6, 1, 8]); None for other ids."""
    m = re.fullmatch(r"chain-(\d+)((?:[pm]\d+)+)", prompt_id)
    if m is None:
        return None
    value, out = int(m.group(1)), []
    for op, b in re.findall(r"([pm])(\d+)", m.group(2)):
        value = value + int(b) if op == "p" else value - int(b)
        out.append(value)
    return out
