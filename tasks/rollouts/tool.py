"""sample.rollout.kind=tool: the model runs Python while it answers, and reads what it printed (ReTool).

    sample:
      rollout: {kind: tool, max_turns: 3, episode_tokens: 256}

The loop, for every episode of a unit at once:

1. The model writes. Generation stops at a closing fence (a line of three backticks, a stop
   string), at the end of its turn, or at the episode's token budget.
2. Stopped at a fence that closes a ```python block, the block runs in the sandbox
   (data/procs/sandbox.py, the code check's settings and limits: `sandbox`, `cpu_s`, `wall_s`, ...).
   What it printed, cut to `output_chars`, goes into the episode as a tool segment, an
   ```output block, and the model writes on. A program that fails, times out or prints past
   the limit gives a tool segment that says so; the episode goes on. A fence that closes any
   other block, or opens one, is text: the model writes on in the same turn.
3. An episode ends when the model ends its turn, after `max_turns` generations (the last one
   runs no program), or when its model and tool tokens reach `episode_tokens`.

Why a fenced block and not tags: the default model writes ```python blocks by itself when told
it can run Python (greedy, 32 two-digit products: 0 calls of 32 with <code> tags in the
template). Its fences are the format it already has. A fence closes with the same backticks
that open one, so the stop string fires at both; which one it was is read from the fences of
the turn, and an opening fence just continues the generation.

Why no state across calls: every call is a fresh interpreter in a fresh sandbox. A program
that needs an earlier value defines it again. A live interpreter per episode would hold a
process and its memory across the whole unit, outlive a killed stage, and make a resumed
episode depend on replaying side effects. Fresh calls are bounded, independent, and their
output depends on their program alone, so a resumed unit equals an uninterrupted one.

The whole episode is one assistant turn: the prompt is templated once, and every later token
is appended as ids (the model's as the engine produced them, the tool's as encoded). No chat
template ever re-renders an earlier turn, so the ids trained on are the ids sampled.
"""

from __future__ import annotations

from collections.abc import Collection

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from ratchet.data.checks.base import Item
from ratchet.data.errors import show
from ratchet.data.events import Figure, Shows
from ratchet.data.records import Completion, Prompt, Segment
from ratchet.data.procs.sandbox import SandboxSettings
from ratchet.models.sampler import SamplingParams, chat_token_ids, text_ids
from ratchet.tasks.rollouts import (Rollout, demo_tokens, episode_checks, has_placeholder, model_turn, overlapped,
                                   turn_params)

STOP = "\n```\n"  # a fence line: it closes a block (or opens a bare one)
PYTHON = ("python", "py", "python3")
TEMPLATE = ("{prompt}\n\nYou can run Python: write a ```python block that prints the result, and its output appears "
            "in an ```output block. Then write the final answer.")


@dataclass
class _Episode:
    prompt: Prompt
    index: int
    context: list[int]  # the prompt's ids, then every segment's
    segments: list[Segment] = field(default_factory=list)
    used: int = 0  # tokens after the prompt, the model's and the tool's
    generated: int = 0  # the model's tokens
    calls: int = 0
    errors: int = 0
    tool_s: float = 0.0
    finish: str | None = None
    done: bool = False

    def add(self, role: str, text: str, ids: tuple[int, ...], logprobs: tuple[float, ...] | None = None) -> None:
        """Append a segment; the model's text right after the model's (a generation that went on
        past a fence that was not a program's end) joins its segment."""
        last = self.segments[-1] if self.segments else None
        if last is not None and last.role == role == "model":
            lps = (last.logprobs or ()) + logprobs if logprobs is not None else None
            self.segments[-1] = Segment(role=role, text=last.text + text, token_ids=last.token_ids + tuple(ids),
                                        logprobs=lps)
        else:
            self.segments.append(Segment(role=role, text=text, token_ids=tuple(ids), logprobs=logprobs))
        self.context.extend(ids)
        self.used += len(ids)


def program_of(text: str) -> str | None:
    """The program a model turn asks to run: the ```python block its last fence line closes; None
    where that fence opens a block or closes one in another language (text, not a call)."""
    lines = text.split("\n")
    fences = [i for i, line in enumerate(lines) if line.strip().startswith("```")]
    if len(fences) % 2 or not fences:
        return None
    start, end = fences[-2], fences[-1]
    if lines[start].strip()[3:].strip().lower() not in PYTHON or lines[end].strip() != "```":
        return None
    return "\n".join(lines[start + 1 : end])


class ToolRollout(Rollout, SandboxSettings):
    """The model runs ```python blocks mid-answer in a sandbox and reads what they print."""

    multi_turn: ClassVar[bool] = True
    shows: ClassVar[Shows] = Shows(figures=(Figure(
        "Tool use per round", "tool_use.png", "tool calls per episode", ("tool_calls_per_episode", "calls per episode"),
        ("tool_used_frac", "answers that used the tool (%)", "episodes with a call (%)")),))
    kind: Literal["tool"] = "tool"
    max_turns: int = Field(default=4, ge=1, le=64, description="generations per episode; each but the last may "
                           "end in a program")
    episode_tokens: int = Field(default=256, ge=1, description="tokens one episode may add after its prompt, the "
                                "model's and the tool output's together")
    output_chars: int = Field(default=400, ge=16, le=1 << 16, description="a call's output past this many characters "
                              "is cut (its head and its tail are kept)")
    template: str = Field(default=TEMPLATE, description="the user message, with {prompt} where the task's prompt goes: "
                          "it tells the model that the tool exists and how to call it")
    wall_s: float = Field(default=5.0, gt=0, le=3600, description="seconds one call may take")
    overlap: bool | None = Field(default=None, description="a unit's episodes in two halves that take turns: one "
                                 "half's programs run while the other half generates; false: all episodes generate "
                                 "together, then all their programs run; unset: overlap where the engine is on a GPU "
                                 "(on a CPU the programs and the engine share its cores, and halves make smaller "
                                 "batches: 70% of single-answer tokens/s overlapped against 87% in lockstep on 2 "
                                 "cores, bench/tool_bench.py)")

    @field_validator("template")
    @classmethod
    def _has_prompt(cls, v: str) -> str:
        return has_placeholder(v, "prompt", "the task's prompt goes")

    def wrap(self, prompt: str) -> str:
        return self.template.replace("{prompt}", prompt)

    def budget(self, max_tokens: int) -> int:
        return self.episode_tokens

    def checks(self, pipeline) -> list[str]:
        return episode_checks(pipeline, self.kind, self.episode_tokens)

    def problems(self, fields: Collection[str] = (), first: Prompt | None = None) -> list[str]:
        return self.probe("sample.rollout")

    def roll(self, sampler, prompts: list[Prompt], params: SamplingParams,
             seed: int) -> tuple[list[Completion], dict[str, float]]:
        """The unit's episodes in two halves that take turns on the engine: while one half
        generates, the other half's programs run, so a tool call holds no episode but its own."""
        base = chat_token_ids(sampler.tokenizer, [self.wrap(p.prompt) for p in prompts])
        eps = [_Episode(p, i, list(ids)) for p, ids in zip(prompts, base) for i in range(params.n)]
        half = (len(eps) + 1) // 2 if overlapped(self.overlap) else len(eps)
        cohorts = [c for c in (eps[:half], eps[half:]) if c]
        pending: list[list[tuple[_Episode, Future]]] = [[] for _ in cohorts]
        waited = 0.0
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for turn in range(self.max_turns + 1):
                for c, cohort in enumerate(cohorts):
                    t = time.time()
                    for e, call in pending[c]:  # its programs ran while the other half generated
                        self.read(sampler, e, *call.result())
                    waited += time.time() - t
                    pending[c] = []
                    if turn == self.max_turns or not (live := [e for e in cohort if not e.done]):
                        continue
                    for e, program in self.generate(sampler, live, params, turn,
                                                    (seed * 1_000_003 + c * 7_919 + turn * 8_191) % (1 << 61)):
                        pending[c].append((e, pool.submit(self.call, program)))
        rows = [Completion(prompt_id=e.prompt.id, prompt=e.prompt.prompt, answer=e.prompt.answer,
                           level=e.prompt.level,
                           fields=e.prompt.fields, index=e.index, text="".join(s.text for s in e.segments),
                           n_tokens=e.generated, finish_reason=e.finish, prompt_ids=tuple(ids),
                           segments=tuple(e.segments))
                for e, ids in zip(eps, (b for b in base for _ in range(params.n)))]
        return rows, {"gen_tokens": sum(e.generated for e in eps), "episodes": len(eps),
                      "turns": sum(sum(s.role == "model" for s in e.segments) for e in eps),
                      "tool_calls": sum(e.calls for e in eps), "tool_errors": sum(e.errors for e in eps),
                      "tool_used": sum(e.calls > 0 for e in eps), "tool_s": sum(e.tool_s for e in eps),
                      "tool_wait_s": waited}

    def generate(self, sampler, live: list[_Episode], params: SamplingParams, turn: int,
                 seed: int) -> list[tuple[_Episode, str]]:
        """One generation for each live episode; the programs they ask to run."""
        rooms: dict[int, list[_Episode]] = {}
        for e in live:  # a generation may take what is left of the episode's budget, at most max_tokens
            rooms.setdefault(min(params.max_tokens, self.episode_tokens - e.used), []).append(e)
        calls: list[tuple[_Episode, str]] = []
        for room, group in sorted(rooms.items()):
            step = turn_params(sampler.tokenizer, params.model_copy(update={"n": 1, "max_tokens": room,
                                                                            "stop": (STOP,)}))
            gens = sampler.generate_ids([e.context for e in group], step, seed=(seed + room) % (1 << 62))
            for e, (g,) in zip(group, gens):
                e.add("model", *model_turn(sampler.tokenizer, g))
                e.generated += len(g.token_ids)
                if g.stop != STOP:  # the end of its turn, or of its tokens
                    e.done, e.finish = True, g.finish_reason
                elif turn + 1 == self.max_turns or e.used >= self.episode_tokens:
                    e.done, e.finish = True, "length"  # no generation or token left to go on with
                elif (program := program_of(e.segments[-1].text)) is not None:
                    calls.append((e, program))
        return calls

    def read(self, sampler, e: _Episode, text: str, failed: bool, took: float) -> None:
        """A finished call into its episode: its output as a tool segment, if the episode has room."""
        e.calls += 1
        e.errors += failed
        e.tool_s += took
        ids = tuple(text_ids(sampler.tokenizer, text))  # the model's program printed it: it cannot forge a turn
        if e.used + len(ids) >= self.episode_tokens:  # no room left to read it and answer
            e.done, e.finish = True, "length"
        else:
            e.add("tool", text, ids)

    def call(self, program: str) -> tuple[str, bool, float]:
        """One call: the tool segment's text, whether the call failed, and its seconds."""
        t = time.time()
        ran = self.run({"program.py": program}, ["{box}/program.py"])
        said = ran.stdout
        if ran.status != 0 and ran.stderr.strip():
            said += ("\n" if said and not said.endswith("\n") else "") + ran.stderr
        if ran.timed_out:
            said += f"\n[stopped: the program ran past {self.wall_s:g} s]"
        elif ran.cut:
            said += f"\n[stopped: the program printed past {self.output_kb} KiB]"
        elif ran.status != 0:
            said += f"\n[exit status {ran.status}]"
        return self.segment(said), ran.status != 0 or ran.timed_out or ran.cut, time.time() - t

    def segment(self, said: str) -> str:
        """A call's output as the model reads it: cut to output_chars, head and tail kept."""
        if len(said) > self.output_chars:
            half = self.output_chars // 2
            said = f"{said[:half]}\n[... {len(said) - 2 * half} characters cut ...]\n{said[-half:]}"
        return f"```output\n{said.strip(chr(10))}\n```\n"

    # demonstrations ---------------------------------------------------------------------------
    def demonstrations(self, demos: list, report, source: str) -> dict[str, Item]:
        """Each row's turns as an episode has them: at most max_turns model turns, a tool turn only
        after a model turn that ends with a ```python block, and each tool turn what the sandbox
        prints for that program (run here, with this rollout's limits, as an episode runs it)."""
        calls: list[tuple[object, list[tuple[int, str, str]]]] = []
        for d in demos:
            if extra := d.roles() - {"model", "tool"}:
                report.add(source, "turns a tool episode does not have", d.place, f"{', '.join(sorted(extra))} turns "
                           "(a user turn after the prompt is an environment's)", "give the program's output as a "
                           "tool turn, or set sample.rollout.kind=environment for an environment's episodes")
                continue
            if (n := sum(t.role == "model" for t in d.turns)) > self.max_turns:
                report.add(source, "rows of more model turns than an episode has", d.place,
                           f"{n} assistant turns > sample.rollout.max_turns={self.max_turns}",
                           "raise sample.rollout.max_turns, or shorten the row")
                continue
            programs = []
            for i, (said, out) in enumerate(zip(d.turns, d.turns[1:]), 1):
                if out.role != "tool":
                    continue
                text = said.text.rstrip()
                program = program_of(text + "\n") if text.endswith("```") else None
                if program is None:
                    report.add(source, "tool turns after a turn that runs no program", f"{d.place} messages[{i + 1}]",
                               f"messages[{i}] ends {said.text.rstrip()[-40:]!r}", "end the assistant turn before a "
                               "tool turn with its ```python block (the fence closing it last): an episode runs "
                               "the program there, and stops the model's turn at the fence")
                    break
                programs.append((i + 1, program, out.text))
            else:
                calls.append((d, programs))
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            ran = [(d, at, text, pool.submit(self.call, program)) for d, ps in calls for at, program, text in ps]
            wrong = set()
            for d, at, text, call in ran:
                printed = call.result()[0]
                if printed != self.segment(text):
                    report.add(source, "tool turns that are not what their program prints", f"{d.place} messages[{at}]",
                               f"the sandbox printed {show(printed, 80)}; the row gives {show(self.segment(text), 80)}",
                               "give the program's output as it prints it (the output alone: the rollout puts it in "
                               "its ```output block), or fix the program")
                    wrong.add(d.id)
        return {d.id: d.item() for d, _ in calls if d.id not in wrong}

    def demo_row(self, tokenizer, demo) -> dict:
        """The episode's ids as a sampled one has them: the templated prompt, each model turn (one
        before a call ends at its fence line; the last ends with the end-of-turn token), each tool
        output in its ```output block."""
        pieces = []
        for i, t in enumerate(demo.turns):
            last = i == len(demo.turns) - 1
            if t.role == "model":
                text = t.text if last else t.text.rstrip() + "\n"
                pieces.append(("model", text_ids(tokenizer, text) + ([tokenizer.eos_token_id] if last else [])))
            else:
                pieces.append(("tool", text_ids(tokenizer, self.segment(t.text))))
        return demo_tokens(chat_token_ids(tokenizer, [self.wrap(demo.prompt)])[0], pieces)

    def metrics(self, cost: dict[str, float]) -> dict[str, float]:
        n = max(cost.get("episodes", 0), 1)
        return {"turns_per_episode": cost.get("turns", 0) / n, "tool_calls_per_episode": cost.get("tool_calls", 0) / n,
                "tool_error_frac": cost.get("tool_errors", 0) / max(cost.get("tool_calls", 0), 1),
                "tool_used_frac": cost.get("tool_used", 0) / n, "tool_calls": cost.get("tool_calls", 0),
                "tool_errors": cost.get("tool_errors", 0), "tool_s": cost.get("tool_s", 0.0),
                "tool_wait_s": cost.get("tool_wait_s", 0.0)}

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"{m.get('tool_calls_per_episode', 0):.2f} tool calls/episode",
                f"{m.get('tool_used_frac', 0):.0%} used the tool", f"{m.get('tool_error_frac', 0):.0%} of calls failed"]
