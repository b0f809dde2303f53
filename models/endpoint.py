"""A model served elsewhere, over an OpenAI-compatible API (`vllm serve`, SGLang, TGI, or a
hosted API), called through the official `openai` client.

    label:
      kind: judge
      endpoint: {base_url: "http://127.0.0.1:8000/v1", model: judge, api_key_env: JUDGE_API_KEY}

Every call is a chat completion. Calls run `max_concurrency` at a time, and each finished
one is appended to a journal in the stage directory the moment it arrives, keyed by the
digest of its request: a stage killed, or stopped by a dead server, resumes by asking only
for what the journal lacks, so no finished call is paid for twice.

A 429, a timeout, a lost connection, a 5xx, or a reply without a choice is retried with
exponential backoff and full jitter (a 429's Retry-After is honoured); past `retries` the
stage stops with what the server said, the endpoint and the fix. A refusal of the endpoint
(401, 403, 404) stops it at once. A refusal of one request for what it asks (400, 413, 422:
a prompt longer than the server's context) leaves that row unscored, within
`max_refused_frac` of a unit's calls; before any call, the longest prompt is counted by the
server itself where it can (vLLM's /tokenize) and a stage whose prompts cannot fit its
context stops with the fix. Ctrl-C stops the calls at once, retry waits included.
A journal line cut by a kill is dropped before anything is appended. The key is read from the environment
variable the config names, at call time, and is never printed, logged or recorded: the
config holds only the variable's name.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ratchet.data.digest import sha256_json
from ratchet.data.errors import RatchetError

NOT_KEYED = {"keyed": False}  # a setting that cannot change a result: it does not key the stage


class EndpointConfig(BaseModel):
    """Where a served model is and how it is called. base_url and model key the stage (with
    the request itself); the rest decides only how the calls are made."""

    model_config = ConfigDict(extra="forbid")
    base_url: str = Field(description="the server's OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1 "
                          "(`vllm serve` and SGLang serve it at /v1); no credentials in it")
    model: str = Field(description="the model name the server serves (vllm serve --served-model-name)")
    api_key_env: str | None = Field(default=None, json_schema_extra=NOT_KEYED, description=(
        "the environment variable that holds the API key (read at call time, never recorded); unset: no key, "
        "as a local `vllm serve` needs none"))
    max_concurrency: int = Field(default=8, ge=1, le=1024, json_schema_extra=NOT_KEYED,
                                 description="calls in flight at once")
    timeout_s: float = Field(default=120.0, gt=0, le=3600, json_schema_extra=NOT_KEYED,
                             description="seconds one call may take before it is retried")
    retries: int = Field(default=6, ge=0, le=100, json_schema_extra=NOT_KEYED,
                         description="retries of one call (429, timeout, 5xx, lost connection, empty reply)")
    backoff_s: float = Field(default=1.0, ge=0, le=600, json_schema_extra=NOT_KEYED, description=(
        "the first retry's wait; each next one doubles it (at most 60 s), each drawn at random below that"))
    max_refused_frac: float = Field(default=0.05, ge=0, le=1, json_schema_extra=NOT_KEYED, description=(
        "the share of a unit's calls the server may refuse for what they ask (HTTP 400, 413, 422: e.g. a prompt "
        "longer than its context) before the stage stops; each refused row is left unscored (a resume asks it "
        "again: a refusal costs nothing, and the server may have changed)"))

    @field_validator("base_url")
    @classmethod
    def _plain_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r} is not an http(s) URL; give the API root, e.g. http://127.0.0.1:8000/v1")
        if "@" in parts.netloc or parts.query or parts.fragment:
            raise ValueError("a base URL carries no credentials, query or fragment (they would be printed and "
                             "recorded); put the key in an environment variable and name it in api_key_env")
        return v.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not (v.replace("_", "a").isalnum() and not v[0].isdigit()):
            raise ValueError(f"{v!r} is not an environment variable's name: give the variable's name "
                             "(e.g. JUDGE_API_KEY), never the key itself")
        return v

    def where(self) -> str:
        return f"{self.model!r} at {self.base_url}"

    def problems(self, field: str) -> list[str]:
        """What keeps this machine from calling the endpoint, found before any model loads: the key's
        variable unset, the server unreachable, or not serving the model."""
        if self.api_key_env and not os.environ.get(self.api_key_env):
            return [f"{field}.api_key_env={self.api_key_env!r}: the environment variable {self.api_key_env} is not "
                    f"set (or empty); export it with the key of {self.base_url} before the run"]
        try:
            served = [m.id for m in self.client(timeout=min(self.timeout_s, 10.0)).models.list()]
        except Exception as e:  # noqa: BLE001 - every way of not answering is one problem to report
            status = getattr(e, "status_code", None)
            if status in (404, 405):  # the server lists no models (not every one does): the stage will tell
                return []
            return [f"{field}.base_url={self.base_url!r}: the server did not answer ({_what(e)}); start it, or fix "
                    f"the URL" + (f" or the key in {self.api_key_env}" if status in (401, 403) else "")]
        if served and self.model not in served:
            return [f"{field}.model={self.model!r}: {self.base_url} serves {', '.join(map(repr, served[:8]))}; "
                    "give one of those (vllm serve --served-model-name sets it)"]
        return []

    def client(self, timeout: float | None = None):
        from openai import OpenAI

        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return OpenAI(base_url=self.base_url, api_key=key or "none", max_retries=0,
                      timeout=timeout or self.timeout_s)


class EndpointError(RatchetError):
    """A served model that could not be called: what it said, where, and the fix."""


@dataclass
class Reply:
    """One call's answer, as the journal keeps it: the text of each choice, each generated
    token's text and top candidates (token text -> log-probability) where asked for and given,
    and what the server counted."""

    texts: list[str]
    tokens: list[list[tuple[str, dict[str, float]]]] | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    finish: list[str | None] | None = None  # each choice's finish_reason ("stop", "length"), where given


RETRIED = (408, 409, 425, 429)  # with every 5xx: a later try may succeed
REFUSED_REQUEST = (400, 413, 422)  # the request itself (a prompt past the context): that row alone, never retried


@dataclass
class Endpoint:
    """Calls to one endpoint, journaled in `journal` (a JSON line per finished call); `reads`: other
    journals of the same stage (one per process that calls) whose calls count as finished too; `at`:
    the config field that set it up, as its errors name it."""

    cfg: EndpointConfig
    journal: Path
    reads: tuple[Path, ...] = ()
    at: str = "label.endpoint"
    done: dict[str, Reply] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=lambda: {"calls": 0.0, "calls_reused": 0.0, "retries": 0.0,
                                                             "failures": 0.0, "refused": 0.0, "input_tokens": 0.0,
                                                             "output_tokens": 0.0})
    latencies: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        self.refused: dict[str, str] = {}  # call id -> what the server said, for calls it refused (this run)
        if self.journal.exists():
            _drop_cut_line(self.journal)  # else the next call's line would be appended to it, and lost
        for journal in (self.journal, *(p for p in self.reads if p != self.journal)):
            if not journal.exists():
                continue
            for line in journal.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    row = json.loads(line)
                    self.done[row["id"]] = Reply(row["texts"], [[(t, dict(top)) for t, top in c]
                                                                for c in row["tokens"]] if row["tokens"] else None,
                                                 row["input_tokens"], row["output_tokens"], row.get("finish"))
                except (ValueError, KeyError, TypeError, AttributeError):  # not a line this code wrote
                    continue
        self._journaled, self._reused = set(self.done), set()  # what an earlier run of the stage finished
        self._tokenizes: bool | None = None  # whether the server counts tokens for us (unknown until asked)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._client = self.cfg.client()

    def chat(self, requests: list[dict[str, Any]], counted: bool = True) -> list[Reply | None]:
        """The reply to each request (a chat completion's body without the model), from the
        journal where it is already there, else from the server, `max_concurrency` at a time.
        None for a request the server refused for what it asks (HTTP 400, 413, 422), within
        `max_refused_frac` of them; past it, the stage stops (`counted`: False for a probe, whose
        requests are asked again with the rest).

        An interrupt (Ctrl-C) stops it at once: no call is started after it, and a call waiting
        to be retried stops waiting."""
        from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

        ids = [sha256_json({"model": self.cfg.model, "base_url": self.cfg.base_url, **r}) for r in requests]
        todo = {i: r for i, r in zip(ids, requests) if i not in self.done and i not in self.refused}
        if todo:
            self._check_context(list(todo.values()))
        self._reused |= set(ids) & self._journaled
        self.stats["calls_reused"] = float(len(self._reused))  # each journaled call once, however often asked
        with open(self.journal, "a", encoding="utf-8") as out:
            pool = ThreadPoolExecutor(max_workers=self.cfg.max_concurrency)
            try:
                futures = [pool.submit(self._call, i, r, out) for i, r in todo.items()]
                wait(futures, return_when=FIRST_EXCEPTION)
            except BaseException:  # an interrupt: the calls in flight end, no other starts or waits
                self._stopped.set()
                raise
            finally:  # after a call that failed for good, no other is started; those in flight are kept
                pool.shutdown(wait=True, cancel_futures=True)
            failed = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
            for e in sorted(failed, key=lambda e: isinstance(e, _Stopped)):  # the cause, not the calls it stopped
                raise e
        refused = [i for i in ids if i in self.refused]
        if counted and refused and len(refused) > self.cfg.max_refused_frac * len(ids):
            raise EndpointError(
                f"the served model {self.cfg.where()} refused {len(refused)} of {len(ids)} calls of this unit for "
                f"what they ask, more than {self.at}.max_refused_frac={self.cfg.max_refused_frac}; the first: "
                f"{self.refused[refused[0]]}. Shorten the prompts (a longer context on the server, a shorter "
                f"template), or raise {self.at}.max_refused_frac to leave them unscored. Every answered call "
                "is kept: re-run the same command to resume")
        return [self.done.get(i) for i in ids]

    def _check_context(self, requests: list[dict[str, Any]]) -> None:
        """Stop before any call if the longest request (by its text) and the tokens it asks for
        are past the server's context, both as the server counts them (vLLM's /tokenize, with
        its chat template): as a local judge's prompts are checked against the engine's context
        before it judges. A server without /tokenize is not asked again; its refusals of rows
        too long for it are budgeted (`max_refused_frac`)."""
        if self._tokenizes is False:
            return
        longest = max(requests, key=lambda r: len(json.dumps(r.get("messages"), ensure_ascii=False)))
        counted = self.count(longest.get("messages"))
        if counted is None:
            self._tokenizes = False
            return
        self._tokenizes = True
        prompt, context = counted
        asked = int(longest.get("max_tokens") or 0)
        if prompt + asked > context:
            raise EndpointError(
                f"the served model {self.cfg.where()} has a context of {context} tokens, and the longest prompt of "
                f"this stage takes {prompt} of them with {asked} more asked for its answer ({prompt + asked} in "
                f"all), as the server counts them; nothing was asked. Serve it with a longer context (vllm serve "
                f"--max-model-len {prompt + asked} or more), or " + (
                    "shorten what it reads (a lower sample.max_tokens, a shorter label.prompt) or asks "
                    "(label.max_tokens)" if self.at.startswith("label") else
                    "shorten what it reads (shorter prompts, a shorter prompt.template) or asks (a lower "
                    "evaluate.max_tokens, or the search's own token settings)"))

    def count(self, messages) -> tuple[int, int] | None:
        """(prompt tokens, context) from the server's /tokenize (the model's chat template and the
        assistant's opening included), or None where it has none."""
        import httpx

        root = self.cfg.base_url.removesuffix("/v1")
        key = os.environ.get(self.cfg.api_key_env, "") if self.cfg.api_key_env else ""
        try:
            r = httpx.post(f"{root}/tokenize", json={"model": self.cfg.model, "messages": messages,
                                                     "add_generation_prompt": True},
                           headers={"Authorization": f"Bearer {key}"} if key else {},
                           timeout=min(self.cfg.timeout_s, 30.0))
            body = r.json() if r.status_code == 200 else {}
            count, context = body.get("count"), body.get("max_model_len")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if type(count) is not int or type(context) is not int or count < 0 or context <= 0:
            return None
        return count, context

    def _call(self, id: str, request: dict, out) -> None:
        if self._stopped.is_set():  # another call failed for good: none is started after it
            return
        try:
            reply = self._with_retries(request)
        except _Refused as e:  # this request, not the server: the row is left unscored
            with self._lock:
                self.refused[id] = str(e)
                self.stats["refused"] += 1
            return
        except BaseException:
            self._stopped.set()
            raise
        row = {"id": id, "texts": reply.texts, "tokens": reply.tokens, "input_tokens": reply.input_tokens,
               "output_tokens": reply.output_tokens, **({"finish": reply.finish} if reply.finish else {})}
        with self._lock:
            out.write(json.dumps(row) + "\n")
            out.flush()  # a kill from here on loses nothing: the next run reads it back
            self.done[id] = reply
            self.stats["calls"] += 1
            self.stats["input_tokens"] += reply.input_tokens
            self.stats["output_tokens"] += reply.output_tokens

    def _with_retries(self, request: dict) -> Reply:
        last = "no answer"
        for attempt in range(self.cfg.retries + 1):
            t = time.monotonic()
            wait = None
            try:
                r = self._client.chat.completions.create(model=self.cfg.model, **request)
                reply = _read(r, request)
                with self._lock:
                    self.latencies.append(time.monotonic() - t)
                return reply
            except (_Malformed, ValueError) as e:  # a reply that is not JSON, or not a completion's
                last = f"a malformed reply ({e if isinstance(e, _Malformed) else _what(e)})"
            except Exception as e:  # noqa: BLE001 - sorted below: retried, or reported at once
                status = getattr(e, "status_code", None)
                last = _what(e)
                if status in REFUSED_REQUEST:
                    raise _Refused(last) from None
                if status is not None and status not in RETRIED and status < 500:
                    raise EndpointError(self._refused(status, last)) from None
                wait = _retry_after(e)
            with self._lock:
                self.stats["failures"] += 1
            if attempt < self.cfg.retries:
                with self._lock:
                    self.stats["retries"] += 1
                cap = min(60.0, self.cfg.backoff_s * 2 ** attempt)
                if self._stopped.wait(wait if wait is not None else random.uniform(0, cap)):
                    raise _Stopped("stopped: the stage was interrupted, or another call failed for good")
        raise EndpointError(
            f"the served model {self.cfg.where()} failed {self.cfg.retries + 1} time(s) on one call; the last: "
            f"{last}. Check that the server is up and serving {self.cfg.model!r}, or raise "
            f"{self.at}.retries / timeout_s. Every finished call is kept: re-run the same command to resume")

    def _refused(self, status: int, what: str) -> str:
        fix = {401: f"set the key in {self.cfg.api_key_env}" if self.cfg.api_key_env
               else f"the server wants a key: name its variable in {self.at}.api_key_env",
               403: f"the key in {self.cfg.api_key_env} may not use this model",
               404: f"check {self.at}.base_url (the API root, ending in /v1) and {self.at}.model"}
        return (f"the served model {self.cfg.where()} refused a call: {what}. "
                f"{fix.get(status, 'a retry would get the same answer; fix the request settings')}")

    def close(self) -> None:
        self._client.close()

    def metrics(self, prefix: str) -> dict[str, float]:
        lat = sorted(self.latencies)
        pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0  # noqa: E731
        return {**{f"{prefix}{k}": v for k, v in self.stats.items()},
                f"{prefix}latency_p50_s": pick(0.5), f"{prefix}latency_p95_s": pick(0.95)}


class _Malformed(Exception):
    pass


class _Stopped(EndpointError):
    """A call that stopped waiting to be retried: another failed for good, or an interrupt came."""


class _Refused(Exception):
    """The server refused this request for what it asks: asking again gets the same answer."""


def _drop_cut_line(path: Path) -> None:
    """Cut the journal back to its last whole line: a kill mid-write leaves a line without its
    newline, and the next call's line appended to it would be unreadable with it."""
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        block, end = 1 << 16, size
        while end > 0:  # the last newline, searched from the end
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            if (k := chunk.rfind(b"\n")) >= 0:
                f.truncate(start + k + 1)
                return
            end = start
        f.truncate(0)


def _read(r, request: dict) -> Reply:
    """A reply as the journal keeps it; one without its choices or text is malformed (retried)."""
    choices = getattr(r, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise _Malformed("no choices")
    texts, tokens, finish = [], [], []
    for c in choices:
        content = getattr(getattr(c, "message", None), "content", None)
        if not isinstance(content, str):
            raise _Malformed("a choice without text")
        texts.append(content)
        reason = getattr(c, "finish_reason", None)
        finish.append(reason if isinstance(reason, str) else None)
        if request.get("logprobs"):
            lp = getattr(getattr(c, "logprobs", None), "content", None)
            tokens.append(None if lp is None else [
                (t.token, {x.token: float(x.logprob) for x in (t.top_logprobs or [])}) for t in lp])
    usage = getattr(r, "usage", None)
    given = [t for t in tokens if t is not None]
    return Reply(texts, given if request.get("logprobs") and len(given) == len(tokens) else None,
                 int(getattr(usage, "prompt_tokens", 0) or 0), int(getattr(usage, "completion_tokens", 0) or 0),
                 finish if any(f is not None for f in finish) else None)


def _what(e: BaseException) -> str:
    """What went wrong with a call, in a line: the status and the server's own words (cut short)."""
    status = getattr(e, "status_code", None)
    body = getattr(e, "message", None) or str(e)
    body = " ".join(str(body).split())[:300]
    return f"HTTP {status}: {body}" if status is not None else f"{type(e).__name__}: {body}"


def _retry_after(e: BaseException) -> float | None:
    response = getattr(e, "response", None)
    value = getattr(response, "headers", {}).get("retry-after") if response is not None else None
    try:
        return min(60.0, max(0.0, float(value))) if value is not None else None
    except ValueError:
        return None
