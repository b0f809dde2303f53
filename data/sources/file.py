"""file: the user's own prompts, from JSONL, JSON, CSV, Parquet, or a `datasets` dataset (a
`save_to_disk` directory or a name `load_dataset` can resolve), with a prompt field and an
optional reference answer field; for a check that reads them (a user's function), the row's
other columns too. Every row is checked before any model is loaded: a malformed line, a missing
or non-text prompt, an answer that cannot be compared, a duplicate id, an empty split or a
prompt in both splits is reported, all of them at once, with the file, the line, the value and
the fix. The split's digests cover every file read, so an edited file is a new stage."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from ratchet.data.checkers import CheckConfig, NumberCheck, answer_key
from ratchet.data.checks.base import to_float
from ratchet.data.digest import sha256_file, sha256_json
from ratchet.data.errors import ProblemReport, show
from ratchet.data.records import Prompt
from ratchet.data.sources.base import PoolSource, Split, prompt_key
from ratchet.data.userfiles import UserPath


class FileSource(PoolSource):
    """User prompts from JSONL, JSON, CSV, Parquet or a `datasets` dataset."""

    kind: Literal["file"] = "file"
    users_rows: ClassVar[bool] = True
    path: UserPath = Field(description="a .jsonl/.json/.csv/.parquet file, a save_to_disk directory, or a datasets name")
    split: str = Field(default="train", description="split name for datasets")
    prompt_field: str = Field(default="prompt", description="column holding the prompt text")
    answer_field: str | None = Field(default="answer", description="column with the reference answer, or null")
    eval_path: UserPath | None = Field(default=None, description="separate held-out file; else eval_size rows are split off")
    eval_size: int = Field(default=50, ge=1, description="rows held out when eval_path is not given")
    train_size: int | None = Field(default=None, ge=1, description="cap on train prompts")
    check: CheckConfig = Field(default_factory=NumberCheck, description="answer check for rows with answers")
    allow_overlap: bool = Field(default=False, description="allow the same prompt text in the train and eval "
                                "splits (normally an error: held-out accuracy on trained prompts is not held out)")
    level_field: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                    description="column holding each row's difficulty level (an integer); with "
                                    "it, data.levels says which levels to use")
    levels: list[int] | None = Field(default=None, exclude_if=lambda v: v is None, min_length=1,
                                     description="with data.level_field: the levels to use, easiest first; rows of "
                                     "other levels are left out, and eval_size rows of each level are held out (of "
                                     "eval_path's rows, where it is given)")

    @model_validator(mode="after")
    def _levels(self) -> FileSource:
        if (self.level_field is None) != (self.levels is None):
            raise ValueError("data.level_field and data.levels go together: name the column holding each row's "
                             "level and the levels to use (e.g. level_field: level, levels: [1, 2, 3]), or neither")
        if self.levels is not None and self.levels != sorted(set(self.levels)):
            raise ValueError(f"data.levels={self.levels} must rise, each once: easiest first")
        return self

    def load(self, seed: int, train_answers: bool) -> Split:
        return _file(self, seed, train_answers)

    def held_out(self, seed: int) -> Split:
        """As an extra held-out set: every row of `path` (nothing of it is trained on), or the
        eval_path file if one is given; with levels, each level's held-out rows, as the split holds them."""
        if self.eval_path or self.levels is not None:
            return super().held_out(seed)
        report = ProblemReport()
        rows, digest = _read(self.path, self.split, "path", report)
        if digest and not rows:
            report.add(self.path, "no rows", "path", "the source is empty", "give a file with at least one row")
        ev = _to_prompts(rows, self, self.path, "row-", True, report)
        _check_split(self, [], ev, False, report)
        report.raise_if_any()
        return Split([], [p for p, _ in ev], {"path": digest}, {p.id: place for p, place in ev})


# reading ----------------------------------------------------------------------

FILE_TYPES = (".jsonl", ".json", ".csv", ".parquet")


def _read(path: str, split: str, field_name: str, report: ProblemReport) -> tuple[list[tuple[str, Any]], str]:
    """(place, row) for every row of a source, and a digest of what was read.

    Unreadable rows go to `report` and are left out; the digest covers the file's bytes
    (a directory: every file's), or the rows of a dataset resolved by name. A source that
    cannot be read at all gives no rows and an empty digest.
    """
    p = Path(path).expanduser()
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix not in FILE_TYPES:
            report.add(path, "unsupported file type", field_name, show(p.suffix),
                       f"give a {', '.join(FILE_TYPES)} file, a save_to_disk directory or a datasets name")
            return [], ""
        reader = {".jsonl": jsonl_rows, ".json": _json, ".csv": _csv, ".parquet": _parquet}[suffix]
        rows = reader(p, path, report)
        return (rows, sha256_file(p)) if rows or not report.about(path) else ([], "")  # unread: not "empty"
    if p.is_dir():
        rows = _dataset(path, split, report, local=True)
        if rows is None:
            return [], ""
        files = sorted(f for f in p.rglob("*") if f.is_file())
        return rows, sha256_json({f.relative_to(p).as_posix(): sha256_file(f) for f in files})
    if p.exists():  # a named pipe, a device, a socket: it has no end, or cannot be read twice
        report.add(path, "not a regular file", field_name, f"is {_kind_of(p)}",
                   f"set data.{field_name} to a regular file (or a directory a dataset was saved to): rows are read "
                   "twice, once to check them and once to use them, and their bytes are digested")
        return [], ""
    if p.suffix.lower() in FILE_TYPES or "/" in path and Path(path).parent.exists():
        report.add(path, "file not found", field_name, "does not exist",
                   f"set data.{field_name} to an existing file (relative paths start from where ratchet runs)")
        return [], ""
    rows = _dataset(path, split, report, local=False)
    return ([], "") if rows is None else (rows, sha256_json([r for _, r in rows]))


def _kind_of(p: Path) -> str:
    """What a path that exists is, when it is neither a regular file nor a directory."""
    import stat

    mode = p.stat().st_mode
    for test, what in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def jsonl_rows(p: Path, path: str, report: ProblemReport) -> list[tuple[str, Any]]:
    rows = []
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                report.add(path, "lines that are not UTF-8 text", f"line {n}", str(e), "save the file as UTF-8")
                continue
            if not line.strip():
                continue
            line = line.rstrip("\r\n")
            try:
                rows.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                report.add(path, "malformed JSON lines", f"line {n}", f"{e.msg} (column {e.colno}) in "
                           f"{show(line.strip(), 50)}", "make every line one complete JSON object, or delete it")
            except (ValueError, RecursionError) as e:  # valid JSON that Python's reader refuses
                report.add(path, *_beyond_reader(e, f"line {n}"))
    return rows


def _beyond_reader(e: Exception, place: str) -> tuple[str, str, str, str]:
    """(kind, place, value, fix) for JSON that is well formed but beyond what Python reads: an
    integer of more than sys.get_int_max_str_digits() digits (4,300: reading one takes time
    quadratic in its length), or nesting deeper than the interpreter's recursion limit."""
    import sys

    if isinstance(e, RecursionError):
        return ("values nested too deep to read", place, f"deeper than {sys.getrecursionlimit()} levels",
                "flatten the value, or remove the row")
    return ("numbers too long to read", place, f"an integer of more than {sys.get_int_max_str_digits():,} digits",
            "write it as a JSON string (\"123...\"), or remove the row")


def _text(p: Path, path: str, report: ProblemReport) -> str | None:
    """A whole file as UTF-8 text, or None with the first byte that is not (its line) reported:
    never read with replacement characters, as a JSONL line that is not UTF-8 is refused."""
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        report.add(path, "a file that is not UTF-8 text", f"line {line}", f"byte {raw[e.start:e.start + 1]!r} at "
                   f"offset {e.start}", "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
        return None


def _json(p: Path, path: str, report: ProblemReport) -> list[tuple[str, Any]]:
    text = _text(p, path, report)
    if text is None:
        return []
    if not text.lstrip().startswith("["):
        return jsonl_rows(p, path, report)  # JSON lines saved as .json
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        report.add(path, "malformed JSON", f"line {e.lineno}", f"{e.msg} (column {e.colno})",
                   "fix the JSON array, or write one JSON object per line (.jsonl)")
        return []
    except (ValueError, RecursionError) as e:  # valid JSON that Python's reader refuses
        report.add(path, *_beyond_reader(e, "file"))
        return []
    return [(f"item {i}", r) for i, r in enumerate(items, 1)]


def _csv(p: Path, path: str, report: ProblemReport) -> list[tuple[str, Any]]:
    import csv

    import io

    text = _text(p, path, report)
    if text is None:
        return []
    extra = object()  # where DictReader puts the values of a row longer than the header
    reader = csv.DictReader(io.StringIO(text, newline=""), restkey=extra)  # type: ignore[arg-type]
    rows = []
    try:
        for r in reader:
            if extra in r:
                report.add(path, "rows with more fields than the header", f"line {reader.line_num}",
                           show(r[extra]), "quote fields that hold commas, or remove the extra values")
                continue
            rows.append((f"line {reader.line_num}", dict(r)))
    except csv.Error as e:
        report.add(path, "malformed CSV", f"line {reader.line_num}", str(e), "fix the line's quoting")
    return rows


def _parquet(p: Path, path: str, report: ProblemReport) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a broken file
        report.add(path, "unreadable Parquet file", "file", f"{type(e).__name__}: {e}",
                   "write it again with pandas/pyarrow, or give a .jsonl file")
        return []
    return [(f"row {i}", r) for i, r in enumerate(table.to_pylist(), 1)]


def _dataset(path: str, split: str, report: ProblemReport, local: bool) -> list[tuple[str, Any]] | None:
    import datasets

    try:
        if local and any((Path(path) / m).exists() for m in ("dataset_info.json", "dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(path)
        else:
            ds = datasets.load_dataset(path, split=split) if not local else datasets.load_dataset(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                report.add(path, "missing split", "data.split", show(split),
                           f"set data.split to one of {sorted(ds)}")
                return None
            ds = ds[split]
    except Exception as e:  # offline, unknown name, not a dataset: one message for the user
        where = "a local directory" if local else "a datasets name"
        report.add(path, "dataset that cannot be loaded", where, f"{type(e).__name__}: {str(e)[:200]}",
                   "give a .jsonl/.parquet file, a save_to_disk directory, or a dataset in the local Hugging Face "
                   "cache (no hub is needed when it is cached)")
        return None
    return [(f"row {i}", r) for i, r in enumerate(ds.to_list(), 1)]


# checking rows ------------------------------------------------------------------

def _answer(value: Any, check, source: str, place: str, report: ProblemReport) -> str | None:
    """A row's reference answer as text, or None (missing); bad values go to the report."""
    if value is None:
        return None
    fix = "give a text or number answer, or null for none"
    if isinstance(value, bool) or isinstance(value, (list, dict)):
        report.add(source, "answers that are not text or a number", place, show(value), fix)
        return None
    not_finite = ("answers that are not finite numbers, or too large for one",
                  "give a finite number (below 1e308), or set data.check.kind to 'exact' to compare it as text")
    if isinstance(value, float) and not math.isfinite(value):
        report.add(source, not_finite[0], place, show(value), not_finite[1])
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value)
    if not text.strip():
        report.add(source, "empty answers", place, show(value), "give the reference answer, or null for none")
        return None
    if check.reads_numbers and (x := to_float(text.strip())) is not None and not math.isfinite(x):
        report.add(source, not_finite[0], place, show(value, 40), not_finite[1])
        return None
    if answer_key(check, text) is None:
        report.add(source, f"answers the {check.kind!r} check cannot compare", place, show(value),
                   "fix the answer, or set data.check.kind to 'exact' or 'regex'")
        return None
    return text


def _to_prompts(rows: list[tuple[str, Any]], cfg: FileSource, source: str, id_prefix: str, need_answers: bool,
                report: ProblemReport) -> list[tuple[Prompt, tuple[str, str]]]:
    dicts = [(place, r) for place, r in rows if isinstance(r, dict)]
    for place, r in rows:
        if not isinstance(r, dict):
            report.add(source, "rows that are not objects", place, show(r),
                       'make every row an object such as {"prompt": "...", "answer": "..."}')
    columns = sorted({k for _, r in dicts for k in r})
    if dicts and cfg.prompt_field not in columns:
        report.add(source, f"data.prompt_field={cfg.prompt_field!r} is not a column", "columns", str(columns),
                   "set data.prompt_field to the column holding the prompt")
        return []
    named = cfg.answer_field not in (None, "answer")  # a column named other than the default: it must be there
    if dicts and (need_answers or named) and cfg.answer_field not in columns:
        report.add(source, f"data.answer_field={cfg.answer_field!r} is not a column", "columns", str(columns),
                   "set data.answer_field to the column holding the reference answers"
                   + ("" if need_answers else ", or to null: this check needs none"))
    out = []
    for place, r in dicts:
        text = r.get(cfg.prompt_field)
        if cfg.prompt_field not in r:
            report.add(source, f"rows without the prompt field {cfg.prompt_field!r}", place, f"keys {sorted(r)}",
                       f"add {cfg.prompt_field!r} to every row, or remove the row")
            continue
        if not isinstance(text, str):
            kind = "null prompts" if text is None else "prompts that are not text"
            report.add(source, kind, place, show(text), "give every row its prompt as a JSON string")
            continue
        if not text.strip():
            report.add(source, "empty prompts", place, show(text), "give every row a prompt, or remove the row")
            continue
        pid = r.get("id", f"{id_prefix}{place.split()[-1]}")
        if isinstance(pid, bool) or not isinstance(pid, (str, int)) or not str(pid).strip():
            report.add(source, "ids that are not text or an integer", place, show(pid),
                       "give every row a unique text id, or drop the id field to number rows by line")
            continue
        answer = _answer(r.get(cfg.answer_field), cfg.check, source, place, report) if cfg.answer_field else None
        # a check that reads the other columns gets them, and so does an environment's reset (a return check)
        fields = _fields(r, cfg, source, place, report) if cfg.check.reads_fields or cfg.check.reads_return else {}
        level = None
        if cfg.level_field is not None:
            level = r.get(cfg.level_field)
            if isinstance(level, float) and level.is_integer():
                level = int(level)
            if isinstance(level, bool) or not isinstance(level, int):
                report.add(source, f"levels that are not integers (data.level_field={cfg.level_field!r})", place,
                           show(level), f"give every row its level in {cfg.level_field!r} as a whole number "
                           "(1, 2, 3 ...)")
                continue
            if level not in cfg.levels:
                continue  # a level this config does not use
        out.append((Prompt(id=str(pid), prompt=text, answer=answer, task="file", fields=fields, level=level),
                    (source, place)))
    return out


# what a check's call names itself, so no column may take one of these names
RESERVED = ("completion", "completions", "prompt", "prompts", "answer")


def _fields(r: dict, cfg: FileSource, source: str, place: str, report: ProblemReport) -> dict[str, Any]:
    """A row's other columns (not its id, prompt or answer), for a check that reads them by name:
    JSON values only, and no column named like an argument the call already passes."""
    out = {}
    for k, v in r.items():
        if k in ("id", cfg.prompt_field, cfg.answer_field):
            continue
        if k in RESERVED:
            report.add(source, "columns named like an argument the check already gets", place, show(k),
                       f"rename the column (the call passes {', '.join(RESERVED)} itself), or point "
                       "data.prompt_field / data.answer_field at it")
            continue
        if not k.isidentifier():
            report.add(source, "column names that cannot be keyword arguments", place, show(k),
                       "rename the column to a Python identifier (letters, digits, _)")
            continue
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as e:
            report.add(source, "column values that are not JSON", f"{place}, column {k!r}", show(v, 40),
                       f"convert the column to text, numbers, lists or objects ({e})")
            continue
        out[k] = v
    return out


Placed = tuple[Prompt, tuple[str, str]]


def _at(place: tuple[str, str]) -> str:
    return f"{place[0]} {place[1]}"


def _check_split(cfg: FileSource, train: list[Placed], ev: list[Placed], train_answers: bool,
                 report: ProblemReport) -> None:
    seen: dict[str, tuple[str, str]] = {}
    for p, place in train + ev:
        if p.id in seen:
            report.add("data", "duplicate ids", f"{p.id!r}", f"{_at(seen[p.id])} and {_at(place)}",
                       "make ids unique (they key each prompt's samples, votes and pairs), or drop the id field "
                       "to number rows by line")
        else:
            seen[p.id] = place
    for p, (source, place) in ev:
        if p.answer is None and cfg.check.needs_answer:  # a python check or an episode's return scores without one
            report.add(source, "eval rows without a reference answer", place, f"id {p.id!r}",
                       f"give every eval row its {cfg.answer_field!r} (held-out accuracy is computed from them)"
                       if cfg.answer_field else "set data.answer_field to the column holding the reference answers "
                       f"(data.check.kind={cfg.check.kind!r} compares with them)")
    if train_answers:
        for p, (source, place) in train:
            if p.answer is None:
                report.add(source, "train rows without a reference answer", place, f"id {p.id!r}",
                           (f"give every row its {cfg.answer_field!r}" if cfg.answer_field else
                            "set data.answer_field to the column holding the reference answers")
                           + ": the verifier label needs one per prompt "
                           "(or use label.kind='consistency' or 'judge', which need none)")
    if not cfg.allow_overlap:
        trained = {prompt_key(p.prompt): place for p, place in train}
        for p, place in ev:
            if (other := trained.get(prompt_key(p.prompt))) is not None:
                report.add("data", "prompts in both the train and the eval split", f"{_at(other)} and {_at(place)}",
                           show(p.prompt, 50), "remove them from one side (accuracy on trained prompts is not "
                           "held out), or set data.allow_overlap=true if that is what you want")


def _file(cfg: FileSource, seed: int, train_answers: bool) -> Split:
    report = ProblemReport()
    rows, digest = _read(cfg.path, cfg.split, "path", report)
    if digest and not rows:
        report.add(cfg.path, "no rows", "data.path", "the source is empty", "give a file with at least one row")
    held_out_answers = cfg.check.needs_answer  # a check that scores without a reference (python, return) needs none
    train = _to_prompts(rows, cfg, cfg.path, "row-", train_answers or (held_out_answers and not cfg.eval_path), report)
    digests = {"path": digest}
    if cfg.eval_path:
        ev_rows, digests["eval_path"] = _read(cfg.eval_path, cfg.split, "eval_path", report)
        if digests["eval_path"] and not ev_rows:
            report.add(cfg.eval_path, "no rows", "data.eval_path", "the file is empty",
                       "held-out accuracy (and the champion gate) needs at least one answered row")
        ev = _to_prompts(ev_rows, cfg, cfg.eval_path, "eval-row-", held_out_answers, report)
    elif cfg.levels is not None:  # each level's own held-out rows, drawn apart
        by_level = {n: [x for x in train if x[0].level == n] for n in cfg.levels}
        train, ev = [], []
        for n, rows_n in by_level.items():
            if cfg.eval_size >= len(rows_n):
                report.add(cfg.path, "levels with too few rows to hold some out", f"level {n}",
                           f"{len(rows_n)} row(s), data.eval_size={cfg.eval_size}",
                           "give the level more rows, lower data.eval_size, or drop the level from data.levels")
            random.Random(f"{seed}-level-{n}").shuffle(rows_n)
            ev += rows_n[: cfg.eval_size]
            train += rows_n[cfg.eval_size :]
    else:
        if train and cfg.eval_size >= len(train):
            report.add(cfg.path, "too few rows to split", "data.eval_size", f"{cfg.eval_size} >= {len(train)} rows",
                       "lower data.eval_size or give data.eval_path")
        random.Random(seed).shuffle(train)
        ev, train = train[: cfg.eval_size], train[cfg.eval_size :]
    _check_split(cfg, train, ev, train_answers, report)
    report.raise_if_any()
    train = train[: cfg.train_size] if cfg.train_size else train
    places = {p.id: place for p, place in train + ev}
    return Split([p for p, _ in train], [p for p, _ in ev], digests, places)
