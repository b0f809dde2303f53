"""Demonstrations: a user's worked examples, which a cold start trains on before round 1
(tasks/cold_start.py).

    cold_start: {demonstrations: demos.jsonl}

One JSON object a line, either text

    {"prompt": "What is 1234 * 5678?", "completion": "1234 * 5678 = 7006652", "answer": "7006652"}

or turns

    {"messages": [{"role": "user", "content": "What is 1234 * 5678?"},
                  {"role": "assistant", "content": "```python\\nprint(1234 * 5678)\\n```"},
                  {"role": "tool", "content": "7006652"},
                  {"role": "assistant", "content": "The answer is 7006652."}],
     "answer": "7006652"}

The first turn is the user's: the task's prompt, which the cold start puts in the rollout's
template as sampling does (for an environment: its first observation). After it, `assistant`
turns are the model's, `tool` turns what a program printed (the output alone: the rollout puts it
in its ```output block), and later `user` turns an environment's observations. The last turn is the
model's. `answer` is the reference the run's check compares the last turn with; `id` names the row
(else "demo-LINE"); any other column is the row's own, for a check or an environment that reads it,
as in a prompt file.

This module reads the shape only, every problem at once with its line and the fix. What the rows
say is checked where it runs: the answer by the run's check, a tool turn against the sandbox, an
environment's observations against the environment (Rollout.demo_problems).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.checks.base import Item
from ratchet.data.digest import sha256_file
from ratchet.data.errors import ProblemReport, show
from ratchet.data.records import Prompt

ROLES = {"assistant": "model", "tool": "tool", "user": "env"}  # a turn after the first, as a segment's role


class Turn(BaseModel):
    """One turn after the prompt: the model's, a tool's output, or an environment's observation."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["model", "tool", "env"]
    text: str


class Demonstration(BaseModel):
    """One checked row of a demonstrations file."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str
    place: str = Field(description="where it is in the file: 'line N'")
    prompt: str = Field(description="the first user turn: the task's prompt (an environment's first observation)")
    answer: str | None = None
    fields: dict[str, Any] = Field(default_factory=dict, description="the row's other columns")
    turns: tuple[Turn, ...]

    @property
    def final(self) -> str:
        """What a check scores: the last model turn."""
        return next(t.text for t in reversed(self.turns) if t.role == "model")

    def item(self, ret: float | None = None, ended: str | None = None) -> Item:
        return Item(self.final, self.answer, self.prompt, self.id, self.fields, ret, ended)

    def as_prompt(self) -> Prompt:
        return Prompt(id=self.id, prompt=self.prompt, answer=self.answer, task="demonstration", fields=self.fields)

    def roles(self) -> set[str]:
        return {t.role for t in self.turns}


def read(path: str, field: str = "cold_start.demonstrations") -> tuple[list[Demonstration], str, ProblemReport]:
    """The file's rows, its sha256, and every problem of shape found (the rows with problems left out)."""
    from ratchet.data.sources.file import jsonl_rows

    report = ProblemReport()
    p = Path(path).expanduser()
    if not p.is_file():
        report.add(path, "file not found" if not p.exists() else "not a regular file", field,
                   "does not exist" if not p.exists() else "is not a file",
                   f"set {field} to a JSONL file of demonstrations (relative paths start from where ratchet runs)")
        return [], "", report
    if p.suffix.lower() != ".jsonl":
        report.add(path, "not a JSONL file", field, show(p.suffix),
                   "give a .jsonl file: one demonstration, a JSON object, a line")
        return [], "", report
    out: list[Demonstration] = []
    seen: dict[str, str] = {}
    for place, row in jsonl_rows(p, path, report):
        d = _row(path, place, row, report)
        if d is None:
            continue
        if d.id in seen:
            report.add(path, "duplicate ids", place, f"id {d.id!r} is also on {seen[d.id]}", "give each row its own id")
            continue
        seen[d.id] = place
        out.append(d)
    if not out and not report:
        report.add(path, "no demonstrations", field, "the file holds no rows", "give at least one demonstration")
    return out, sha256_file(p), report


def _row(path: str, place: str, row: Any, report: ProblemReport) -> Demonstration | None:
    def bad(kind: str, detail: str, fix: str) -> None:
        report.add(path, kind, place, detail, fix)

    if not isinstance(row, dict):
        bad("rows that are not JSON objects", show(row, 40), "make each line one JSON object")
        return None
    has_text, has_turns = "prompt" in row or "completion" in row, "messages" in row
    if has_text == has_turns:
        bad("rows with neither form, or both", f"keys {sorted(row)[:6]}",
            "give either `prompt` and `completion` (text) or `messages` (turns), not both")
        return None
    if has_text:
        prompt, completion = row.get("prompt"), row.get("completion")
        for name, v in (("prompt", prompt), ("completion", completion)):
            if not isinstance(v, str) or not v.strip():
                bad(f"rows without a {name}", f"{name}={show(v, 40)}", f"give `{name}` as non-empty text")
                return None
        turns = [Turn(role="model", text=completion)]
    else:
        got = _turns(row["messages"], bad)
        if got is None:
            return None
        prompt, turns = got
    rid = row.get("id", f"demo-{place.split()[-1]}")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or not str(rid).strip():
        bad("rows with a bad id", f"id={show(rid, 40)}", "give `id` as text or a whole number, or leave it out")
        return None
    answer = row.get("answer")
    if isinstance(answer, bool) or not (answer is None or isinstance(answer, (str, int, float))):
        bad("rows with an answer that is not text or a number", f"answer={show(answer, 40)}",
            "give `answer` as text or a number: the reference the run's check compares the last turn with")
        return None
    others = {k: v for k, v in row.items() if k not in ("prompt", "completion", "messages", "id", "answer")}
    return Demonstration(id=str(rid), place=place, prompt=prompt, answer=None if answer is None else str(answer),
                         fields=others, turns=tuple(turns))


def _turns(messages: Any, bad) -> tuple[str, list[Turn]] | None:
    """The prompt and the turns after it, or None (reported)."""
    if not isinstance(messages, list) or len(messages) < 2:
        bad("messages that are not a list of turns", show(messages, 40),
            "give `messages` as a list: the user's prompt, then the turns, the last one the assistant's")
        return None
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
            bad("turns that are not {role, content}", f"messages[{i}]={show(m, 40)}",
                "write each turn as {\"role\": ..., \"content\": \"text\"}")
            return None
        role = m.get("role")
        if role == "system":
            bad("system turns", f"messages[{i}]", "leave the system turn out: the rollouts give the model none, so "
                "it would train on a context it never reads; put what it says in the first user turn")
            return None
        if role not in ROLES:
            bad("turns of an unknown role", f"messages[{i}].role={show(role)}",
                "use user (the prompt, an environment's observation), assistant (the model) or tool (a program's "
                "output)")
            return None
        if not m["content"].strip():
            bad("empty turns", f"messages[{i}] ({role})", "give every turn its text, or drop the turn")
            return None
    if messages[0]["role"] != "user":
        bad("rows that do not start with the user", f"messages[0].role={messages[0]['role']!r}",
            "put the user's prompt first")
        return None
    if messages[-1]["role"] != "assistant":
        bad("rows that do not end with the assistant", f"messages[-1].role={messages[-1]['role']!r}",
            "end with the model's answer: it is what the check reads and what the model learns to finish with")
        return None
    turns = [Turn(role=ROLES[m["role"]], text=m["content"]) for m in messages[1:]]
    for i, (a, b) in enumerate(zip(turns, turns[1:]), 2):
        if a.role == b.role == "model":
            bad("two assistant turns in a row", f"messages[{i - 1}] and messages[{i}]", "join them into one turn")
            return None
        if a.role != "model" and b.role != "model":
            bad("turns that do not follow the model's", f"messages[{i}] ({b.role}) after messages[{i - 1}] ({a.role})",
                "a tool's output or an environment's observation answers the assistant turn before it")
            return None
    if turns[0].role != "model":
        bad("turns that do not follow the model's", "messages[1]", "the assistant answers the user's prompt first")
        return None
    if {"tool", "env"} <= {t.role for t in turns}:
        bad("rows with both tool and environment turns", "messages",
            "a rollout runs a tool or plays an environment, not both: keep one kind of turn")
        return None
    return messages[0]["content"], turns
