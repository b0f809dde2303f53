"""reasoning_gym: problems from a reasoning-gym procedural dataset, scored by its own scorer.

    data: {kind: reasoning_gym, dataset: chain_sum, config: {min_terms: 2, max_terms: 2, max_digits: 1}}

reasoning-gym (on PyPI) has about a hundred seeded generators that need no download. The
dataset is drawn once with `dataset_seed`: the first `eval_size` distinct problems are held
out, the next `train_size` distinct ones (never a held-out question again) are the train pool.
Each prompt is the question and `instruction`; each answer is scored by the dataset's own
`score_answer` on the answer read from the response (`check.read`), in a process of its own with
a time bound (data/checks/scorer.py), and is right at `threshold` (its scorers give 1.0 for a
right answer, some give partial credit below it).

The generators ask for `<answer>` tags, which small models never write, so `check.read: auto`
reads a tag where there is one, else the last number when the reference is a number, else
what follows the last "answer is" / "Answer:", else the last line (`check.read`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, model_validator

from ratchet.data.checks.base import NUM, Check, Item, Verdict, norm, number_key
from ratchet.data.checks.scorer import shared
from ratchet.data.errors import ConfigError
from ratchet.data.records import Prompt
from ratchet.data.sources.base import PoolSource, Split

Extract = Literal["auto", "tag", "last_number", "answer_line", "last_line", "whole"]
OVERDRAW = 20  # problems drawn at most per one needed, to find distinct ones


def _datasets() -> dict:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError("data.kind='reasoning_gym' needs the reasoning-gym package: pip install reasoning-gym") \
            from None
    return DATASETS


class ReasoningGymCheck(Check):
    """The reasoning-gym dataset's own score_answer on the answer the response gives.

    A vote (label.kind consistency or vote) reads answers without their reference, so it needs a
    `read` rule that does not ask the reference what it looks like: `auto` does (the last number
    only where the reference is a number), the others do not. Voted answers are keyed as the
    number check keys them (`last_number`) or by their text, lower-cased and trimmed.
    """

    kind: Literal["reasoning_gym"] = "reasoning_gym"
    read: Extract = Field(default="auto", description="how the answer is read from a response: auto (a tag, "
                             "else the last number for numeric references, else after the last 'answer is', else "
                             "the last line), tag, last_number, answer_line, last_line, whole; a vote (label.kind "
                             "vote or consistency) needs one other than auto, which asks the reference")
    threshold: float = Field(default=1.0, gt=0, le=1, description="a score at or above this is right")
    timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False, description="seconds one score may take")
    # filled from the data source: which generator made the problems (a prompt's id is its index)
    dataset: str = Field(default="", description="filled in from data.dataset; leave unset")
    config: dict[str, Any] = Field(default_factory=dict, description="filled in from data.config; leave unset")
    dataset_seed: int = Field(default=0, description="filled in from data.dataset_seed; leave unset")
    size: int = Field(default=0, description="filled in from the source's problem count; leave unset")
    levels: dict[int, dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: v is None,
                                                     description="filled in from data.levels; leave unset")

    @property
    def extracts(self) -> bool:  # type: ignore[override]  (a class constant elsewhere: here it is `read`'s)
        return self.read != "auto"

    def vote_fix(self) -> str:
        return ("give data.check.read a rule that reads an answer without its reference: last_number for numeric "
                "answers, else tag, answer_line, last_line or whole")

    def extract(self, response: str) -> str | None:
        if not self.extracts:
            return None
        got = extract_answer(response, "", self.read)
        return None if got is None else self.answer_key(got)

    def answer_key(self, answer: str) -> str | None:
        return number_key(answer) if self.read == "last_number" else norm(answer)

    def config_at(self, level: int | None) -> dict[str, Any]:
        """The dataset's settings its problems of `level` were drawn with (None: data.config alone)."""
        return self.config if level is None else {**self.config, **(self.levels or {}).get(level, {})}

    def entry(self, prompt_id: str) -> dict:
        """The reasoning-gym entry a problem of this task came from ({question, answer, metadata}): what a
        demonstration of it carries as its `entry` column, so the dataset's scorer reads it."""
        index, level = entry_of(prompt_id)
        if index is None:
            raise ValueError(f"{prompt_id!r} is not a reasoning-gym problem's id (rg-N, or rg-N@LEVEL)")
        return open_dataset(self.dataset, self.config_at(level), self.dataset_seed, self.size)[index]

    def check(self, response: str, answer: str) -> Verdict:
        raise ConfigError([f"data.check.kind='reasoning_gym' scores a reasoning-gym problem by its prompt id; it "
                           f"cannot check a response without one (answer {answer!r})"])

    def check_many(self, items: list[Item], tally=None) -> list[Verdict]:
        scorer = shared(score_entry, batched=False, timeout_s=self.timeout_s)
        out = []
        for i in items:
            (index, level), entry = entry_of(i.id), given_entry(i)
            if index is None and entry is None:
                raise ConfigError([f"data.check.kind='reasoning_gym' scores problems of data.kind='reasoning_gym'; "
                                   f"row {i.id!r} is not one of them. A row of your own (a demonstration) is scored "
                                   "by its problem's entry: give it a column `entry`, the reasoning-gym entry the "
                                   "problem came from ({question, answer, metadata}: `reasoning_gym.create_dataset("
                                   "...)[i]`, as JSON)"])
            config = self.config_at(level)
            call = scorer.call({"completion": i.response, "dataset": self.dataset, "config": config,
                                "seed": self.dataset_seed, "size": self.size, "index": index or 0, "entry": entry,
                                "how": self.read})
            if call.failure is not None:  # its scorer broke or ran out of time on this response: not right
                out.append(Verdict(False, None, 0.0, {"rg_failed": 1.0}))
            else:
                out.append(Verdict(call.score >= self.threshold, None, call.score))
        return out


class ReasoningGymSource(PoolSource):
    """Problems from a reasoning-gym dataset, scored by the dataset's own score_answer."""

    kind: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str = Field(description="the dataset's name (reasoning_gym.factory.DATASETS), e.g. chain_sum")
    config: dict[str, Any] = Field(default_factory=dict, description="the dataset's own settings (its config "
                                   "class's fields: difficulty knobs such as min_terms, max_digits)")
    dataset_seed: int = Field(default=0, description="seeds the problems the dataset generates")
    eval_size: int = Field(default=100, ge=1, description="distinct problems held out for evaluation (drawn first)")
    train_size: int = Field(default=1000, ge=1, description="distinct problems in the train pool")
    instruction: str = Field(default="Give only the final answer.", description="appended to each question after "
                             "a blank line ('' for none)")
    check: ReasoningGymCheck = Field(default_factory=ReasoningGymCheck, description="how answers are read and "
                                     "scored (the dataset's own scorer)")
    levels: dict[int, dict[str, Any]] | None = Field(
        default=None, exclude_if=lambda v: v is None, min_length=1, description="difficulty levels: each level's "
        "number and the dataset settings laid over data.config there (e.g. {1: {max_digits: 1}, 2: {max_digits: "
        "2}}); each level draws eval_size held-out and train_size train problems of its own")

    @model_validator(mode="after")
    def _dataset(self) -> ReasoningGymSource:
        check_dataset(self.dataset, self.config)
        for n, settings in (self.levels or {}).items():
            if n < 1:
                raise ValueError(f"data.levels: level {n} is not a level number (1, 2, 3 ...)")
            try:
                check_dataset(self.dataset, {**self.config, **settings})
            except ValueError as e:
                raise ValueError(f"data.levels[{n}]: {e}") from None
        self.check = self.check.model_copy(update={"dataset": self.dataset, "config": self.config,
                                                   "dataset_seed": self.dataset_seed, "levels": self.levels,
                                                   "size": (self.eval_size + self.train_size) * OVERDRAW})
        return self

    def level_list(self) -> list[int]:
        return sorted(self.levels or {})

    def at_level(self, level: int) -> ReasoningGymSource:
        if level not in self.level_list():
            raise ValueError(f"data has no level {level}; its levels are {self.level_list()}")
        labeled = None if self.labeled_levels is None else [n for n in self.labeled_levels if n == level]
        return self.model_copy(update={"levels": {level: self.levels[level]}, "labeled_levels": labeled,
                                       "check": self.check.model_copy(update={"levels": {level: self.levels[level]}})})

    def load(self, seed: int, train_answers: bool) -> Split:
        if not self.levels:
            train, ev, _ = draw(self.dataset, self.config, self.dataset_seed, self.eval_size, self.train_size,
                                self.instruction)
            return Split(train, ev)
        train, ev = [], []
        for n in self.level_list():
            t, e, _ = draw(self.dataset, {**self.config, **self.levels[n]}, self.dataset_seed, self.eval_size,
                           self.train_size, self.instruction, level=n)
            train, ev = train + t, ev + e
        return Split(train, ev)


def given_entry(item: Item) -> dict | None:
    """The reasoning-gym entry a row of the user's own carries (its `entry` column), which its
    dataset's scorer reads as it reads one of its own: the reference answer and the metadata."""
    entry = item.fields.get("entry")
    if entry is None:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("answer"), (str, int, float))
            and isinstance(entry.get("metadata", {}), dict)):
        raise ConfigError([f"row {item.id!r}: its `entry` column is not a reasoning-gym entry (a mapping with "
                           f"`question`, `answer` and `metadata`; got {str(entry)[:120]!r}); give the entry its "
                           "problem came from: `reasoning_gym.create_dataset(...)[i]`, as JSON"])
    return entry


def entry_of(item_id: str) -> tuple[int | None, int | None]:
    """(its index in the dataset, its level) of a problem's id: `rg-12`, or `rg-12@3` at level 3."""
    m = re.fullmatch(r"rg-(\d+)(?:@(\d+))?(?:#\d+)?", item_id or "")
    return (int(m.group(1)), int(m.group(2)) if m.group(2) else None) if m else (None, None)


def entry_index(item_id: str) -> int | None:
    return entry_of(item_id)[0]


@lru_cache(maxsize=8)
def _cached(name: str, config_json: str, seed: int, size: int):
    import json

    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config_json))


def open_dataset(name: str, config: dict, seed: int, size: int):
    """The dataset the problems were drawn from (cached: every score reads one of its entries)."""
    import json

    return _cached(name, json.dumps(config, sort_keys=True), seed, size)


def extract_answer(text: str, reference: str, how: str) -> str | None:
    """The answer a response gives, read as `how` says (see ReasoningGymCheck.read)."""
    text = text.strip()
    if how in ("auto", "tag"):
        tags = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
        if tags:
            return tags[-1].strip()
        if how == "tag":
            return None
    if how == "last_number" or (how == "auto" and NUM.fullmatch(reference.strip().replace(" ", ""))):
        nums = NUM.findall(text)
        return nums[-1].replace(",", "") if nums else None
    if how in ("auto", "answer_line"):
        said = re.findall(r"(?:answer is|answer:)[ \t]*([^\n]+)", text, flags=re.I)
        if said:
            return said[-1].strip().rstrip(".").strip()
        if how == "answer_line":
            return None
    if how == "whole":
        return text
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1].strip().rstrip(".").strip() if lines else None


def score_entry(completion: str, dataset: str = "", config: dict | None = None, seed: int = 0, size: int = 0,
                index: int = 0, how: str = "auto", entry: dict | None = None, **fields) -> float:
    """In the checking process: the dataset's own score of the answer the completion gives, to
    its problem `index`, or to the problem `entry` (a row of the user's own)."""
    ds = open_dataset(dataset, config or {}, seed, size)
    entry = ds[index] if entry is None else {"metadata": {}, **entry}
    return float(ds.score_answer(answer=extract_answer(completion, str(entry["answer"]), how), entry=entry))


def draw(name: str, config: dict, seed: int, eval_size: int, train_size: int, instruction: str,
         level: int | None = None) -> tuple[list[Prompt], list[Prompt], int]:
    """(train, eval, size): distinct problems in the dataset's own order, the first eval_size held
    out; `size` is the dataset size they were drawn from (a prompt's id is its index there)."""
    need = eval_size + train_size
    size = need * OVERDRAW
    ds = open_dataset(name, config, seed, size)
    seen: set[str] = set()
    rows: list[Prompt] = []
    for i in range(size):
        e = ds[i]
        if e["question"] in seen:
            continue
        seen.add(e["question"])
        text = f"{e['question']}\n\n{instruction}" if instruction else e["question"]
        rows.append(Prompt(id=f"rg-{i}" if level is None else f"rg-{i}@{level}", prompt=text, answer=str(e["answer"]),
                           task=f"reasoning_gym:{name}", level=level))
        if len(rows) == need:
            return rows[eval_size:], rows[:eval_size], size
    raise ConfigError([f"data.dataset={name!r} with data.config={config} gave {len(rows)} distinct problems in "
                       f"{size} draws, fewer than data.eval_size + data.train_size = {need}; lower them or widen "
                       "the dataset's config"])


def check_dataset(name: str, config: dict) -> None:
    """The dataset exists and takes this config (its own config class checks the values)."""
    found = _datasets()
    if name not in found:
        import difflib

        near = difflib.get_close_matches(name, found, n=3)
        raise ValueError(f"no reasoning-gym dataset {name!r}" + (f"; did you mean {near}?" if near else "") +
                         f" ({len(found)} exist: reasoning_gym.factory.DATASETS)")
    _, cfg_cls = found[name]
    import dataclasses

    known = {f.name for f in dataclasses.fields(cfg_cls)} - {"seed", "size"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"data.config has {unknown}, which dataset {name!r} does not take; its settings: "
                         f"{sorted(known)}")
    try:
        cfg_cls(**config, size=1, seed=0).validate()
        import reasoning_gym

        reasoning_gym.create_dataset(name, size=1, seed=0, **config)[0]  # settings it accepts but cannot generate with
    except Exception as e:  # noqa: BLE001 - the library's own words on its settings
        raise ValueError(f"data.config={config} is not a valid {name} config: {type(e).__name__}: {e}") from None

