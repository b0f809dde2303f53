"""python: the user's own scoring function is the check.

    data:
      check: {kind: python, function: "rewards.py:score", threshold: 1.0}

`function` is a file and a function ('path/to/rewards.py:score', relative to where `ratchet`
runs) or an installed module ('package.module:score'). Its row fields come by name:

    def score(completion, answer=None, prompt=None, **fields) -> float | bool | None | dict

where `fields` are a file row's other columns (besides its id, prompt and answer), by name,
returning a float, a bool, None (unscored: the row is left out, never guessed) or
{"score": x, **metrics}; with `batched: true`, lists in (completions, prompts=, answer=), a
list out; `async def` either way. The reward is the score; the verdict is score >= threshold,
so RFT accepts, DPO pairs and evaluation's accuracy counts by it, and the mean score and the
returned metrics are logged per round. A function written for TRL (`completions` among its
parameters: keyword lists in, a list out) or verl (`compute_score(data_source, solution_str,
ground_truth, extra_info)`) is called as those libraries call it (`convention`, found from the
signature unless named); a TRL function written for a conversational dataset gets each completion
and prompt as a list of chat messages (`messages`, found from its `completions` annotation
unless named).

It runs in processes of its own (data/checks/scorer.py), `workers` calls at once, every call
bounded by `timeout_s` (a timeout ends the processes the function started too). A call that
raises, outlives its bound, or returns NaN, inf or a wrong type is a failure; up to
`max_failed_frac` of a batch of rows may fail (and stay unscored). The budget is read as calls
finish: once it is spent no other call starts, and the stage stops with the first failure's
row and the function's own traceback. The digest of the function's
file (with the modules it imports from its folder) is part of this config (`source`), so it
keys every stage that scores with it and the eval set, and stands in the lineage; it does not
name the run: an edited or fixed file continues the same run, re-runs label and evaluate and
reuses the samples.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from ratchet.data.checks.base import Check, Item, Tally, Verdict
from ratchet.data.checks.scorer import Call, Scorer, ScorerError, shared
from ratchet.data.procs.entry import split_spec
from ratchet.data.errors import RatchetError
from ratchet.data.userfiles import UserFile, source_digest  # noqa: F401 - the digest that keys a user's file


class CheckFailedError(RatchetError):
    """The user's check failed on more rows than its budget allows (or cannot be used at all)."""


class PythonCheck(Check):
    """The user's scoring function: score(completion, answer=None, prompt=None, **fields)."""

    extracts: ClassVar[bool] = False  # a score, not an answer that samples could vote with
    needs_answer: ClassVar[bool] = False  # the function gets answer=None where a row has none
    reads_fields: ClassVar[bool] = True  # a file row's other columns come as keyword arguments
    kind: Literal["python"] = "python"
    function: Annotated[str, UserFile(spec=True, digest="source")] = Field(description="'path/to/rewards.py:score' (a file; relative paths from where ratchet runs) "
                          "or 'package.module:score' (an installed module)")
    threshold: float = Field(default=1.0, allow_inf_nan=False, description="a score at or above this is right: "
                             "what RFT accepts and what held-out accuracy counts")
    batched: bool = Field(default=False, description="call with lists (completions, prompts=, answer=) and take a "
                          "list back, batch_size rows a call")
    batch_size: int = Field(default=64, ge=1, description="rows per call when batched")
    convention: Literal["auto", "ratchet", "trl", "verl"] = Field(default="auto", description=(
        "how the function is called: ratchet (a row's fields by name, or lists with batched), trl (TRL's reward "
        "functions: completions, prompts and every column as keyword lists, a list back), verl (verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info)); auto: from its signature (verl's "
        "names, else a `completions` parameter for trl, else ratchet)"))
    messages: Literal["auto", True, False] = Field(default="auto", description=(
        "trl convention: pass each completion and prompt as a list of chat messages ([{'role': 'assistant', "
        "'content': ...}]), as TRL does for a conversational dataset, instead of text; auto: when the function's "
        "`completions` annotation says so (TRL's own reward functions: list[list[dict[str, str]]])"))
    timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False, description="a call that runs longer fails "
                             "(its process is ended and a new one takes the next call)")
    max_failed_frac: float = Field(default=0.0, ge=0, le=1, description="share of a batch of rows whose calls may "
                                   "fail (raise, time out, return NaN or a wrong type) and stay unscored; past it the "
                                   "stage stops with the first failure")
    workers: int = Field(default=1, ge=1, le=64, json_schema_extra={"keyed": False}, description="calls run at "
                         "once, each in a process of its own (the function is loaded in each)")
    source: str | None = Field(default=None, description="sha256 of the function's file and the modules it imports "
                               "from its folder, filled in when the config is read: it keys every stage that scores "
                               "with it (not the run's name); a stage that finds the file changed meanwhile stops "
                               "instead of mixing versions")

    _called_as: str | None = PrivateAttr(default=None)  # how problems() found the function is called

    @field_validator("function")
    @classmethod
    def _spec(cls, v: str) -> str:
        split_spec(v)  # raises ValueError with the expected forms
        return v

    @model_validator(mode="after")
    def _digest(self) -> PythonCheck:
        if self.source is None:
            self.source = source_digest(self.function)
        return self

    def problems(self, fields=()) -> list[str]:
        """Load the function in its own process, as a stage will: an import error, a missing
        function or a signature that cannot take a row's fields (`fields`: the rows' other
        columns, passed by name), before any model loads."""
        s = Scorer(self.function, batched=self.batched, timeout_s=self.timeout_s, fields=tuple(sorted(fields)),
                   convention=self.convention, messages=self.messages)
        try:
            s.start()
        except ScorerError as e:
            return [f"{self.place}.function={self.function!r}: {e}"]
        finally:
            s.close()
        shape = {"ratchet": "with a row's fields by name" + (", a list of rows a call" if s.batched else ""),
                 "trl": "as TRL calls a reward function, with keyword lists" + (
                     ", each completion a list of chat messages" if s.messages else ""),
                 "verl": "as verl calls compute_score"}[s.convention]
        why = ": from its signature" if self.convention == "auto" else ""
        self._called_as = f"called {shape} ({self.place}.convention={self.convention}{why})"
        return []

    def called_as(self) -> str | None:
        """How the function is called, once problems() has loaded it: what `ratchet check` shows."""
        return self._called_as

    def check(self, response: str, answer: str) -> Verdict:
        return self.check_many([Item(response, answer)])[0]

    def check_many(self, items: list[Item], tally: Tally | None = None) -> list[Verdict]:
        """Verdicts for a batch of rows. The failure budget is read as calls finish: once more rows
        have failed than `max_failed_frac` of the batch allows, no further call starts, so a
        function that hangs costs the budget's timeouts, not one per row. (With a `tally`, the
        caller holds the budget over several batches and settles it at the end.)"""
        if not items:
            return []
        calls = self._calls(items, budget=None if tally is not None else self.max_failed_frac * len(items))
        t = Tally() if tally is None else tally
        t.rows += len(items)
        t.failed += [(i.id or "?", c.failure) for i, c in zip(items, calls) if c is not None and c.failure is not None]
        if tally is None:
            self.settle(t, stopped=any(c is None for c in calls))
        return [self._verdict(c) for c in calls]

    def settle(self, tally: Tally, stopped: bool = False) -> None:
        if tally.failed and len(tally.failed) > self.max_failed_frac * tally.rows:
            row, failure = tally.failed[0]
            raise CheckFailedError(
                f"{self.place}.function={self.function!r} failed on row {row!r}: {failure}\n"
                f"({len(tally.failed)} of {tally.rows} rows failed"
                f"{', and the rest were not called' if stopped else ''}; {self.place}.max_failed_frac="
                f"{self.max_failed_frac:g}). Fix the function (or raise {self.place}.timeout_s / max_failed_frac) and "
                "re-run the same command: finished stages are kept")

    def _verdict(self, c: Call) -> Verdict:
        if c.failure is not None:
            return Verdict(None, None, None, {"failed": 1.0})
        if c.score is None:
            return Verdict(None, None, None, {"unscored": 1.0})
        return Verdict(c.score >= self.threshold, None, c.score, c.metrics)

    def _calls(self, items: list[Item], budget: float | None) -> list[Call | None]:
        """Each row's Call, `workers` calls at a time; None for the rows never called because
        more than `budget` rows had failed by then."""
        import queue
        import threading
        from concurrent.futures import ThreadPoolExecutor

        cols = tuple(sorted({k for i in items for k in i.fields}))  # what the signature must take by name
        batched = _scorer(self, 0, cols).batched  # with `auto`, what the function's signature asks for
        if not batched:
            jobs = [([k], {"completion": i.response, "answer": i.answer, "prompt": i.prompt, **i.fields})
                    for k, i in enumerate(items)]
        else:
            jobs = []
            for at in range(0, len(items), self.batch_size):
                chunk = items[at:at + self.batch_size]
                fields = {k: [i.fields.get(k) for i in chunk] for k in sorted({k for i in chunk for k in i.fields})}
                jobs.append((list(range(at, at + len(chunk))), {
                    "completions": [i.response for i in chunk], "prompts": [i.prompt for i in chunk],
                    "answer": [i.answer for i in chunk], **fields}))
        out: list[Call | None] = [None] * len(items)
        free: queue.SimpleQueue[Scorer] = queue.SimpleQueue()
        for s in _scorers(self, min(self.workers, len(jobs)), cols):
            free.put(s)
        lock, spent, failed = threading.Lock(), threading.Event(), [0]

        def run(job) -> None:
            rows, kwargs = job
            if spent.is_set():
                return
            scorer = free.get()
            try:
                got = scorer.call(kwargs)
            finally:
                free.put(scorer)
            got = got if batched else [got]
            with lock:
                for k, c in zip(rows, got):
                    out[k] = c
                failed[0] += sum(c.failure is not None for c in got)
                if budget is not None and failed[0] > budget:
                    spent.set()

        with ThreadPoolExecutor(max_workers=min(self.workers, len(jobs))) as pool:
            list(pool.map(run, jobs))
        return out


def _scorers(cfg: PythonCheck, n: int, fields: tuple[str, ...] = ()) -> list[Scorer]:
    """This process's first `n` scorers for the function (one per call that runs at once), for rows
    whose other columns are `fields`."""
    return [_scorer(cfg, k, fields) for k in range(n)]


def _scorer(cfg: PythonCheck, k: int = 0, fields: tuple[str, ...] = ()) -> Scorer:
    """This process's scorer number `k` for the function. The file is checked against the digest
    the stage was keyed with each time it is loaded (at start, and when a timeout or a crash
    restarts it): a running process keeps the code it loaded, so that is when a changed file would
    slip in."""

    def same_source() -> None:
        now = source_digest(cfg.function)
        if now != cfg.source:
            raise CheckFailedError(f"{cfg.place}.function={cfg.function!r}: the file (or a module it imports from "
                                   f"its folder) changed while this run used it (sha256 {cfg.source[:12]} then, "
                                   f"{now[:12]} now); the stage stops rather than score with two versions. Run the "
                                   "same command again: it continues with the file as it is now, and the stages "
                                   "that read it run again")

    try:
        return shared(cfg.function, batched=cfg.batched, timeout_s=cfg.timeout_s, tag=f"{cfg.source or ''}#{k}",
                      before_load=same_source, convention=cfg.convention, messages=cfg.messages, fields=fields)
    except ScorerError as e:
        raise CheckFailedError(f"{cfg.place}.function={cfg.function!r}: {e}") from None
