"""The run's tracking store read without MLflow: what `ratchet runs`, `lineage` and `report` read
of it (the round runs, their tags and metrics, the registered versions and their tags, the
champion alias), answered from a local SQLite store with sqlite3 alone, read-only. MLflow takes
3-5 s to import on 2 cores; these commands read a few rows.

`reader(uri, model_name)` gives a `ReadTracker` for a local SQLite store whose tables are MLflow's
(3.x: runs, tags, metrics, latest_metrics, model_versions, model_version_tags,
registered_model_aliases), one that reads nothing where the file is not there yet (a read creates
no store), and None for any other store (a server, another database): the caller then opens the
full Tracker. It answers the calls those commands make of a Tracker and its client with the same
values (tests/test_doc_commands.py compares each with MLflow's own answer on a finished run's
store), and refuses any other.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ratchet.data.errors import RatchetError
from ratchet.flows.tracking import CHAMPION

TABLES = {"runs", "tags", "metrics", "latest_metrics", "model_versions", "model_version_tags", "registered_model_aliases"}


@dataclass(frozen=True)
class Version:
    """A registered version as the commands read it (MLflow's ModelVersion: these fields)."""

    name: str
    version: str
    run_id: str | None
    source: str | None
    tags: dict[str, str] = field(default_factory=dict)


def reader(uri: str, model_name: str) -> "ReadTracker | None":
    """A reader of the store at `uri`, or None where it is not a local SQLite store with MLflow's tables."""
    if not uri.startswith("sqlite:///") or "?" in uri:
        return None
    path = Path(uri.removeprefix("sqlite:///"))
    if not path.exists():  # nothing tracked yet: nothing to read, and a read creates no store
        return ReadTracker(uri, None, model_name)
    try:
        with contextlib.closing(_connect(path)) as db:
            names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error:
        return None
    return ReadTracker(uri, path, model_name) if TABLES <= names else None


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


class ReadTracker:
    """The reading half of flows/tracking.py's Tracker, over a SQLite store: `model_name`,
    `prompt_name`, `uri`, `champion()`, `version(v)`, `version_of(key)`, and `client` with
    `get_run`, `search_runs` (by parent run), `get_metric_history`, `get_model_version` and
    `get_prompt_version`."""

    read_only = True
    experiment_id = None  # runs are found by their parent run, whatever experiment holds them

    def __init__(self, uri: str, path: Path | None, model_name: str):
        self.uri, self.path, self.model_name = uri, path, model_name
        self.prompt_name = f"{model_name}-prompt"
        self.client = _Client(self)

    def rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        if self.path is None:
            return []
        with contextlib.closing(_connect(self.path)) as db:
            return db.execute(sql, args).fetchall()

    def champion(self) -> str | None:
        found = self.rows("SELECT version FROM registered_model_aliases WHERE name = ? AND alias = ?",
                          (self.model_name, CHAMPION))
        return str(found[0][0]) if found else None

    def version(self, version: str) -> Version:
        return self.client.get_model_version(self.model_name, version)

    def version_of(self, stage_key: str) -> str | None:
        found = self.rows("SELECT version FROM model_version_tags WHERE name = ? AND key = 'ratchet.stage_key' "
                          "AND value = ?", (self.model_name, stage_key))
        return str(min(int(v) for (v,) in found)) if found else None


class _Client:
    """MlflowClient's reads that the commands make, with MLflow's answers' shapes."""

    def __init__(self, tracker: ReadTracker):
        self.t = tracker

    def get_run(self, run_id: str):
        found = self.t.rows("SELECT run_uuid, experiment_id, start_time, end_time, status FROM runs "
                            "WHERE run_uuid = ?", (run_id,))
        if not found:
            raise RatchetError(f"no MLflow run {run_id!r} in {self.t.uri}")
        return self._run(*found[0])

    def search_runs(self, experiment_ids: list[str], filter_string: str):
        """Only the search the commands make: the runs whose parent is a given run."""
        head, quote, rest = filter_string.partition("'")
        if head.strip() != "tags.mlflow.parentRunId =" or not rest.endswith("'"):
            raise NotImplementedError(f"ReadTracker searches runs by parent only, not {filter_string!r}")
        parent = rest[:-1]
        found = self.t.rows("SELECT r.run_uuid, r.experiment_id, r.start_time, r.end_time, r.status FROM runs r "
                            "JOIN tags t ON t.run_uuid = r.run_uuid WHERE t.key = 'mlflow.parentRunId' AND "
                            "t.value = ? AND r.lifecycle_stage = 'active' %s ORDER BY r.start_time DESC, r.run_uuid"
                            % ("" if None in experiment_ids else
                               "AND r.experiment_id IN (%s)" % ",".join("?" * len(experiment_ids))),
                            (parent, *(() if None in experiment_ids else map(str, experiment_ids))))
        return [self._run(*row) for row in found]

    def _run(self, run_id, experiment_id, start_time, end_time, status):
        tags = dict(self.t.rows("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)))
        metrics = {k: float("nan") if nan else v
                   for k, v, nan in self.t.rows("SELECT key, value, is_nan FROM latest_metrics WHERE run_uuid = ?",
                                                (run_id,))}
        info = SimpleNamespace(run_id=run_id, experiment_id=str(experiment_id), start_time=start_time,
                               end_time=end_time, status=status)
        return SimpleNamespace(info=info, data=SimpleNamespace(tags=tags, metrics=metrics))

    def get_metric_history(self, run_id: str, key: str):
        rows = self.t.rows("SELECT step, value, timestamp, is_nan FROM metrics WHERE run_uuid = ? AND key = ? "
                           "ORDER BY timestamp, step", (run_id, key))
        return [SimpleNamespace(key=key, step=step, value=float("nan") if nan else value, timestamp=ts)
                for step, value, ts, nan in rows]

    def get_model_version(self, name: str, version: str) -> Version:
        if not str(version).isdigit():
            raise RatchetError(f"{name} has no version {version!r}; give a number (`ratchet runs` lists them)")
        found = self.t.rows("SELECT run_id, source FROM model_versions WHERE name = ? AND version = ?",
                            (name, int(version)))
        if not found:
            raise RatchetError(f"{name} has no version {version}; `ratchet runs` lists the versions")
        tags = dict(self.t.rows("SELECT key, value FROM model_version_tags WHERE name = ? AND version = ?",
                                (name, int(version))))
        return Version(name, str(version), found[0][0], found[0][1], tags)

    def get_prompt_version(self, name: str, version: str) -> Version:
        """A prompt version is a version of the prompt's registered model (MLflow's prompt registry),
        its tags without the registry's own (`mlflow.*`, `_mlflow*`), as MLflow gives them."""
        v = self.get_model_version(name, version)
        return Version(v.name, v.version, v.run_id, v.source,
                       {k: x for k, x in v.tags.items() if not k.startswith(("mlflow.", "_mlflow"))})
