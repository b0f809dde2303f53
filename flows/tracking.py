"""MLflow tracking: a parent run per pipeline run, a child run per round, and the registry.

Everything goes through MlflowClient with explicit run ids: MLflow's fluent
"active run" is thread-local, and Prefect runs tasks on worker threads.
Datasets are logged with the project's own full-file sha256 (MLflow's pandas
digest reads only the first 10,000 rows). Each round's model is registered as a
version tagged with its parent version, data digests, config hash, code version
and the digest of its files in the store.

The registry never disagrees with the store:
- a transient MLflow error (SQLite "database is locked", a dropped connection) is
  retried and then fails the stage; it is never read as "not there";
- registration, promotion, round-run creation and the run record are serialised
  across processes by a lock beside the tracking store (or in the workdir);
- a version is promoted only by beating the champion on the same eval set: each
  evaluation of a version is recorded on it per eval set, and the decision, with
  the numbers it compared, is recorded on the candidate (`ratchet.promoted`,
  `ratchet.gate`), so a resumed run reports what the registry says.

Credentials never reach a config, a record or MLflow: `user:password@` in
tracking.uri is moved to MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, the
variables MLflow's client reads, and the URI keeps only its host.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ratchet.data.digest import sha256_json, sha256_text
from ratchet.data.errors import RatchetError
from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore

log = logging.getLogger("ratchet")
CHAMPION = "champion"
LEASE_STALE_S = 300.0  # a champion gate's registry lease older than this was left by a holder that died
SECRET_QUERY = ("token", "password", "passwd", "pwd", "secret", "key", "signature", "sig", "credential", "auth")


class TrackingError(RatchetError):
    """MLflow kept failing after retries; the stage fails rather than guess."""


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(uri without userinfo, user, password). Other URIs come back unchanged."""
    parts = urlsplit(uri)
    if not parts.scheme or "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), user or None, password or None


_SCHEME = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:)?//")
_QUERY = re.compile(r"([?&;])([^=&;#]+)=([^&;#]*)")


def redact(uri: str) -> str:
    """A URI safe to print or record: the password of any userinfo (with a scheme or without:
    https://u:p@h, postgresql+psycopg2://u:p@h/db, //u:p@h, u:p@h:5000) and the values of
    query parameters whose names speak of secrets (token, password, key, signature, ...)
    replaced by ***. A URI with nothing to hide comes back as it was."""
    if not isinstance(uri, str):
        return uri
    head = m.group(0) if (m := _SCHEME.match(uri)) else ""
    rest = uri[len(head):]
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        user, sep, password = userinfo.partition(":")
        if sep and password:
            authority = f"{user}:***@{host}"
    tail = _QUERY.sub(lambda q: f"{q.group(1)}{q.group(2)}=***" if _secret_name(q.group(2)) else q.group(0), tail)
    return head + authority + tail


def _secret_name(name: str) -> bool:
    n = name.lower().replace("-", "_")
    return any(w in n for w in SECRET_QUERY)


def has_secret(text: str) -> bool:
    """Whether `text` (a URI, or any value) carries a password or a secret query value."""
    return redact(text) != text


class TrackingConfig(BaseModel):
    """Where MLflow records runs, metrics and model versions."""

    model_config = ConfigDict(extra="forbid")
    uri: str | None = Field(default=None, description="MLflow tracking URI; default sqlite:///<workdir>/mlflow.db. "
                            "user:password@ in it is moved to MLFLOW_TRACKING_USERNAME/PASSWORD and never stored")
    experiment: str | None = Field(default=None, description="experiment name; default ratchet-<name>")
    model_name: str | None = Field(default=None, description="registered model name; default ratchet-<name>")
    log_weights: bool = Field(
        default=False, description="copy full merged weights into MLflow artifacts (else adapter + digests only)"
    )

    @model_validator(mode="after")
    def _take_credentials(self) -> TrackingConfig:
        """Move credentials out of the URI into the environment MLflow's client reads, so the
        config (logged, recorded, deployed) carries none."""
        if self.uri is None:
            return self
        secrets = [k for k, _ in parse_qsl(urlsplit(self.uri).query) if _secret_name(k)]
        if secrets:
            raise ValueError(f"tracking.uri carries a secret in its query string ({', '.join(secrets)}); pass it "
                             "as MLFLOW_TRACKING_TOKEN (or user:password@host) instead, so it is never stored")
        clean, user, password = split_credentials(self.uri)
        if user:
            os.environ["MLFLOW_TRACKING_USERNAME"] = user
        if password:
            os.environ["MLFLOW_TRACKING_PASSWORD"] = password
        self.uri = clean
        return self


# retries ----------------------------------------------------------------------

RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0)
_TRANSIENT_CODES = {"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "INTERNAL_ERROR"}


def transient(e: BaseException) -> bool:
    """An error worth retrying: a locked SQLite store, an unavailable or overloaded server."""
    from mlflow.exceptions import MlflowException

    if isinstance(e, MlflowException):
        return e.error_code in _TRANSIENT_CODES or "database is locked" in str(e)
    try:
        import requests

        if isinstance(e, (requests.ConnectionError, requests.Timeout)):
            return True
    except ImportError:
        pass
    return "database is locked" in str(e)


# Setting a tag or alias is an upsert, so repeating one is safe. An MLflow server's SQL store
# implements it as read-then-insert, so two clients setting the same new tag at once can lose
# the race with a UNIQUE constraint error; the retry finds the row and updates it.
_UPSERTS = {"set_tag", "set_model_version_tag", "set_registered_model_tag", "set_registered_model_alias"}


def lost_upsert_race(e: BaseException, what: str) -> bool:
    return what in _UPSERTS and "UNIQUE constraint failed" in str(e)


def retrying(fn, what: str):
    """`fn` with transient errors retried (RETRY_DELAYS), then raised as TrackingError."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for delay in (*RETRY_DELAYS, None):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if not (transient(e) or lost_upsert_race(e, what)):
                    raise
                if delay is None:
                    raise TrackingError(f"MLflow {what} failed {len(RETRY_DELAYS) + 1} times ({type(e).__name__}: "
                                        f"{str(e).splitlines()[0][:200]}); the stage stops here and can be resumed "
                                        "with the same command once the tracking store answers") from e
                log.warning("MLflow %s failed (%s); retrying in %.1f s", what, str(e).splitlines()[0][:120], delay)
                time.sleep(delay)

    return call


class RetryingClient:
    """An MlflowClient whose every call retries transient errors instead of failing or guessing."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        return retrying(attr, name) if callable(attr) else attr


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


class Gate(BaseModel):
    """A promotion decision, as recorded on the candidate version."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    promoted: bool
    reason: str
    needs_eval: str | None = None  # the champion version to evaluate first, on these held-out sets:
    needs_sets: tuple[str, ...] = ()


class SetScore(BaseModel):
    """A version's held-out accuracy on one set (evaluate.sets), and the eval set it was measured on."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    eval_set: str
    accuracy: float


def beats(accuracy: float, bar: float, min_improvement: float) -> bool:
    """"Better" on one eval set: above the bar by more than min_improvement."""
    return accuracy > bar + min_improvement


def verdict(scores: dict[str, float], bars: dict[str, float], gate: str, min_improvement: float,
            max_drop: float | None, against: str, on: str) -> tuple[bool, str]:
    """The one rule for "better", by held-out set name: the gate's set beats its bar by more than
    min_improvement, and (max_drop set) no other set falls more than max_drop below its bar.
    The champion gate and `evaluate.next_round_from: best` both decide by it. Returns (better,
    the reason in words); `against` names the bar's model, `on` the gate's set."""
    acc, bar = scores[gate], bars[gate]
    won = beats(acc, bar, min_improvement)
    reason = (f"accuracy {acc:.4f} {'>' if won else '<='} {against}'s {bar:.4f}"
              + (f" + {min_improvement:g}" if min_improvement else "") + f" on {on}")
    if max_drop is not None:
        drops = {n: bars[n] - a for n, a in scores.items() if n != gate and n in bars and bars[n] - a > max_drop + 1e-9}
        if drops:
            won = False
            reason += "; refused: " + ", ".join(f"{n} dropped {100 * d:.1f} points ({scores[n]:.4f} < {bars[n]:.4f})"
                                               for n, d in sorted(drops.items())) + f", more than max_drop {max_drop:g}"
    return won, reason


def _token(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:120]


def _tombstone(lease: str, holder: str) -> str:
    """Where `holder`'s lease is moved when it leaves: a name no other holder's lease can take."""
    return f"{lease}.gone-{_token(holder)}"


def _sqlite_path(uri: str) -> Path | None:
    """The file of a plain local SQLite store URI (no query string), else None."""
    if not uri.startswith("sqlite:///") or "?" in uri:
        return None
    return Path(uri[len("sqlite:///"):])


def copy_new(template: Path, dst: Path) -> None:
    """`dst` as a copy of `template`, appearing whole or not at all (a hard link of a finished copy,
    which fails where a file is there already: that one is kept, so processes racing to a new store
    open one). The copy gets the mode a new file of this process gets (0666 less the umask)."""
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        shutil.copyfile(template, tmp)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _fresh_sqlite_store(db: Path) -> None:
    """A new local SQLite store starts as a copy of an empty one that MLflow's own migrations
    built, once per MLflow version and schema revision, in the user cache: creating a store runs
    MLflow's ~60 schema migrations, 3 s of every new workdir's start on 2 cores, to reach the
    same tables each time. The copy holds tables only (MLflow adds its default experiment, with
    this store's artifact root, when it opens it) and appears whole or not at all (a hard link
    that fails if a store is already there), so runs racing to a new shared store open one
    store. Where anything of this fails, MLflow creates the store itself, as without it."""
    if db.exists():
        return
    try:
        import mlflow
        from mlflow.store.db.utils import _get_latest_schema_revision, _initialize_tables, _verify_schema
        from mlflow.store.db.utils import create_sqlalchemy_engine_with_retry as engine_for

        from ratchet.models.default_model import default_cache_dir

        cache = default_cache_dir() / "mlflow-schema"
        template = cache / f"empty-{mlflow.__version__}-{_get_latest_schema_revision()}.db"
        if not template.exists():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache / f".{uuid.uuid4().hex[:8]}.db.tmp"  # SQLite creates it
            engine = engine_for(f"sqlite:///{tmp}")
            try:
                _initialize_tables(engine)
                _verify_schema(engine)
            finally:
                engine.dispose()
            os.replace(tmp, template)
        db.parent.mkdir(parents=True, exist_ok=True)
        copy_new(template, db)
    except Exception as e:  # noqa: BLE001 - MLflow's own start-up creates the store, as it would anyway
        logging.getLogger("ratchet").info("no copy of an empty MLflow store for %s (%s: %s); MLflow creates it",
                                          db, type(e).__name__, e)


def _local_artifacts(artifact_uri: str) -> Path | None:
    """The directory of a run's artifacts where they are local files (a `file:` URI, MLflow's
    default beside a SQLite store); None for any other store (a server's, object storage)."""
    from urllib.parse import unquote, urlparse

    if not artifact_uri.startswith("file:"):
        return None
    parsed = urlparse(artifact_uri)
    return Path(unquote(parsed.path)) if parsed.netloc in ("", "localhost") else None


def store_uri(cfg: TrackingConfig, workdir: Path) -> str:
    """The tracking store a run in `workdir` uses: tracking.uri, else the workdir's SQLite file."""
    return cfg.uri or f"sqlite:///{workdir / 'mlflow.db'}"


def sqlite_champion(uri: str, model: str) -> str | None:
    """The version the `champion` alias names in a SQLite MLflow store, read with sqlite3 alone (MLflow
    takes seconds to import; `ratchet run` with nothing to run reads this). Its schema's alias
    table (registered_model_aliases: name, alias, version); None where there is none, and an error
    where the store cannot be read."""
    import sqlite3

    path = uri.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT version FROM registered_model_aliases WHERE name = ? AND alias = ?",
                         (model, CHAMPION)).fetchone()
    return None if row is None else str(row[0])


class Tracker:
    def __init__(self, cfg: TrackingConfig, workdir: Path, name: str):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        self.uri = store_uri(cfg, workdir)
        if (db := _sqlite_path(self.uri)) is not None:
            _fresh_sqlite_store(db)
        self.client = RetryingClient(MlflowClient(tracking_uri=self.uri, registry_uri=self.uri))
        # the gate's lease lives in the registry unless a file lock beside a local SQLite store spans every workdir
        self.lease_in_registry = not self.uri.startswith("sqlite:///")
        self.cfg = cfg
        self.workdir = workdir
        self.model_name = cfg.model_name or f"ratchet-{name}"
        self.prompt_name = f"{self.model_name}-prompt"  # its versions' texts (MLflow's Prompt Registry)
        with self.lock():
            exp_name = cfg.experiment or f"ratchet-{name}"
            exp = self.client.get_experiment_by_name(exp_name)
            if exp is None:
                art = None if cfg.uri else (workdir / "mlartifacts").resolve().as_uri()
                self.experiment_id = self.client.create_experiment(exp_name, artifact_location=art)
            else:
                self.experiment_id = exp.experiment_id

    # one writer at a time ---------------------------------------------------
    _held = threading.local()

    def lock_path(self) -> Path:
        """Beside a SQLite store (every workdir sharing it shares the lock), else in the workdir."""
        if self.uri.startswith("sqlite:///"):
            db = Path(self.uri[len("sqlite:///"):])
            return db.with_name(db.name + ".ratchet-lock")
        return self.workdir / "locks" / f"tracking-{sha256_text(self.uri)[:12]}.lock"

    @contextlib.contextmanager
    def lock(self):
        """Serialise a check-then-write on the tracking store across processes (re-entrant
        within a thread; the kernel drops it if the holder dies)."""
        import fcntl

        path = self.lock_path()
        held = getattr(self._held, "paths", None)
        if held is None:
            held = self._held.paths = set()
        if path in held:
            yield
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            held.add(path)
            try:
                yield
            finally:
                held.discard(path)
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def registry_lease(self, wait_s: float = 600.0):
        """The champion gate's read-compare-set, made atomic against the registry itself, so runs
        in different workdirs that share one tracking server and one model name never both
        become champion. The lease is a registered model of its own (`<model>.gate-lease`):
        creating a name that exists fails in every MLflow store (a UNIQUE key on a server's
        database), so exactly one creator holds it. A SQLite store needs none: the file lock
        beside it already spans every workdir.

        A lease leaves only by a rename to `<model>.gate-lease.gone-<holder>`, whoever moves it:
        its holder on release, or a run taking it over once it is older than LEASE_STALE_S (its
        holder died inside the gate, which takes seconds). A rename is one statement against the
        registry's database, and that name is its holder's alone, so the move succeeds once: two
        runs that both saw a stale lease cannot both take it (the second finds the name taken and
        waits), and a holder whose lease was taken over cannot release the next holder's."""
        from mlflow.exceptions import MlflowException

        if not self.lease_in_registry:
            yield
            return
        name, me = f"{self.model_name}.gate-lease", _token(f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        deadline, start = time.time() + wait_s, time.time()
        while True:
            try:
                self.client.create_registered_model(name, tags={"ratchet.holder": me, "ratchet.since": str(time.time())},
                                                    description="held while a Ratchet run decides the champion")
                break
            except MlflowException as e:
                if e.error_code == "RESOURCE_DOES_NOT_EXIST":  # the store found the name taken, then gone when it
                    continue  # read it back for its message (released or moved between): try again at once
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            try:
                held = self.client.get_registered_model(name)
            except MlflowException:  # released between the two calls: try again at once
                continue
            # A lease is created with its tags in one transaction, but a store reads a model's row
            # and its tags in two queries: a lease moved in between reads with no tags (or with
            # the next lease's). A lease without its holder is such a torn read, never stale:
            # taking it over would move whichever lease holds the name now, a live one.
            holder, since = held.tags.get("ratchet.holder"), held.tags.get("ratchet.since")
            try:
                since = float(since) if holder else None
            except (TypeError, ValueError):
                since = None
            if since is None:
                created = held.creation_timestamp  # for the message alone: the row's, read apart from its tags
                holder, since = holder or "a run that left no holder tag", created / 1000 if created else time.time()
            elif time.time() - since > LEASE_STALE_S:
                if self._move_lease(name, holder):
                    log.warning("took over the champion gate's lease %s, held by %s since %.0f s ago", name, holder,
                                time.time() - since)
                continue
            if time.time() > deadline:
                raise TrackingError(f"the champion gate's lease {name} on {redact(self.uri)} has been held by "
                                    f"{holder} for {time.time() - since:.0f} s; if no run is deciding a champion, "
                                    "delete that registered model and resume")
            time.sleep(0.2 + random.random() * 0.3)
        try:
            yield
        finally:
            if self._move_lease(name, me) and time.time() - start < LEASE_STALE_S / 2:
                # a lease no one could have thought stale: its tombstone has no other reader
                self._delete(_tombstone(name, me))
            self._sweep(name)

    def _move_lease(self, name: str, holder: str) -> bool:
        """Move `holder`'s lease out of the way; False if it was not there to move (already moved,
        by its holder or a taker, or never `holder`'s)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.rename_registered_model(name, _tombstone(name, holder))
            return True
        except MlflowException as e:
            if e.error_code in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                return False
            if e.error_code == "BAD_REQUEST" and "0 were matched" in str(e):  # SQLAlchemy: another run renamed it
                return False  # first, between this one's read and its update (nothing was changed)
            raise

    def _sweep(self, name: str) -> None:
        """Remove tombstones of leases moved more than a day ago (no run still reads them)."""
        from mlflow.exceptions import MlflowException

        try:
            old = [m.name for m in self.client.search_registered_models(filter_string=f"name LIKE '{name}.gone-%'")
                   if time.time() - (m.last_updated_timestamp or 0) / 1000 > 86400]
        except MlflowException:
            return
        for n in old:
            self._delete(n)

    def _delete(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise

    # runs -----------------------------------------------------------------
    def start_parent(self, run_name: str, config: dict, tags: dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        rid = run.info.run_id
        params = flat(config)
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(rid, params=items[i : i + 100])
        self.log_text(rid, json.dumps(config, indent=2), "config/resolved.json")
        return rid

    def reopen(self, run_id: str, tags: dict[str, str]) -> bool:
        """Mark an earlier attempt's run as running again; False if the store no longer has it."""
        found = self.client.search_runs([self.experiment_id], f"attributes.run_id = '{run_id}'")
        if not found:
            return False
        self.client.update_run(run_id, status="RUNNING")
        for k, v in tags.items():
            self.client.set_tag(run_id, k, v)
        return True

    def child(self, parent_id: str, round: int, tags: dict[str, str]) -> str:
        """The round's child run: the one an earlier attempt created, or a new one (never two)."""
        with self.lock():
            found = self.client.search_runs(
                [self.experiment_id],
                f"tags.mlflow.parentRunId = '{parent_id}' and tags.`ratchet.round` = '{round}'",
            )
            if found:
                rid = found[0].info.run_id
                self.client.update_run(rid, status="RUNNING")
                return rid
            tags = {"mlflow.parentRunId": parent_id, "ratchet.round": str(round), **tags}
            return self.client.create_run(self.experiment_id, run_name=f"round-{round}", tags=tags).info.run_id

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    # metrics and artifacts --------------------------------------------------
    def log_metrics(self, run_id: str, metrics: dict[str, float], prefix: str = "", step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(f"{prefix}{k}", float(v), ts, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not math.isnan(float(v))]
        if items:
            self.client.log_batch(run_id, metrics=items)

    def log_stage(self, run_id: str, m: StageManifest, reused: bool) -> bool:
        """Log a stage's metrics once per run: a resumed run that reuses a stage it already
        logged adds nothing. Returns whether anything was logged."""
        return self.log_once(run_id, f"ratchet.stage.{m.stage}", m.dir,
                             {**m.metrics, "wall_s": m.wall_s, "reused": float(reused)}, prefix=f"{m.stage}.")

    def log_once(self, run_id: str, tag: str, value: str, metrics: dict[str, float], prefix: str = "") -> bool:
        """Log `metrics` and set `tag` = `value` on a run, unless the tag already says so: one
        entry per fact, however many times (or by however many processes) a step runs."""
        with self.lock():
            if self.client.get_run(run_id).data.tags.get(tag) == value:
                return False
            self.log_metrics(run_id, metrics, prefix=prefix)
            self.client.set_tag(run_id, tag, value)
        return True

    def log_text(self, run_id: str, text: str, path: str) -> None:
        with tempfile.TemporaryDirectory() as t:
            p = Path(t) / Path(path).name
            p.write_text(text)
            self.client.log_artifact(run_id, str(p), artifact_path=str(Path(path).parent) or None)

    def log_file(self, run_id: str, path: Path, name: str) -> None:
        """A local file as the run's artifact `name` (a folder and a file name)."""
        import shutil

        with tempfile.TemporaryDirectory() as t:
            p = Path(t) / Path(name).name
            shutil.copyfile(path, p)
            self.client.log_artifact(run_id, str(p), artifact_path=str(Path(name).parent) or None)

    def log_train_curve(self, run_id: str, store: ArtifactStore, m: StageManifest) -> None:
        """The trainer's per-step log as stepped metrics: loss, grad norm, learning rate, and for
        DPO the implicit rewards, margins, accuracies and log-probs of chosen and rejected."""
        from ratchet.models.trainer import read_steps

        rows = [json.loads(x) for x in store.path(m, "train_log.jsonl").read_text().splitlines() if x.strip()]
        keys = sorted({k for r in rows for k, v in r.items()
                       if isinstance(v, (int, float)) and k not in ("step", "epoch", "num_tokens")})
        self.log_curve(run_id, rows, tuple(keys), prefix="train/")
        # an online trainer's own figures by step (reward mean, groups kept, generated tok/s, seconds)
        steps = read_steps(store.root / m.dir)
        self.log_curve(run_id, steps, ("reward", "groups_kept", "gen_tokens_per_s", "sync_s", "step_s"),
                       prefix="online/")

    def log_curve(self, run_id: str, rows: list[dict], keys: tuple[str, ...], prefix: str) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(f"{prefix}{k}", float(r[k]), ts, int(r.get("step", i))) for i, r in enumerate(rows)
                 for k in keys if isinstance(r.get(k), (int, float))]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i : i + 500])

    def log_dataset(self, run_id: str, store: ArtifactStore, m: StageManifest, name: str, context: str) -> None:
        """Log a JSONL artifact as a run input, digest = our full-file sha256."""
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        import warnings

        ref = m.outputs[name]
        with warnings.catch_warnings():
            # MLflow registers its local-file source class twice and warns that a path is ambiguous
            # between the two; both are the same class, so the warning carries no information
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(str(store.path(m, name)))
        ds = MetaDataset(source,
                         name=f"{m.stage}-r{m.round}-{Path(name).stem}", digest=ref.sha256[:20])
        tags = [InputTag("mlflow.data.context", context), InputTag("ratchet.sha256", ref.sha256),
                InputTag("ratchet.rows", str(ref.rows)), InputTag("ratchet.stage_dir", m.dir)]
        self.client.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(), tags)])

    # registry -------------------------------------------------------------
    def version_of(self, stage_key: str) -> str | None:
        """The registered version of the model a stage produced, if it was registered before."""
        found = self.client.search_model_versions(
            f"name='{self.model_name}' and tags.`ratchet.stage_key` = '{stage_key}'"
        )
        return str(min(int(v.version) for v in found)) if found else None

    def version(self, version: str):
        return self.client.get_model_version(self.model_name, version)

    def register(self, run_id: str, store: ArtifactStore, model: StageManifest, tags: dict[str, str]) -> str:
        """Log the model's artifacts to the round's run and register them as a version.

        The same model (same stage key) is registered once, also by two runs at once: a
        re-run gets the existing version.
        """
        with self.lock():
            if (existing := self.version_of(model.key)) is not None:
                return existing
            from ratchet.tasks.text import FILE, weights_of

            weights = weights_of(store, model)  # a pair's weights; a model's are its own
            d = store.dir_of(weights)
            card = {"stage_dir": str(store.dir_of(model)), "key": model.key, "content": model.content,
                    "files": {k: v.sha256 for k, v in model.outputs.items()}}
            if weights is not model:
                card["weights"] = {"stage_dir": str(d), "key": weights.key, "content": weights.content}
                self.client.log_artifact(run_id, str(store.path(model, FILE)), artifact_path="model")
            self.log_text(run_id, json.dumps(card, indent=2), "model/ratchet-model.json")
            if (d / "adapter").is_dir():
                self.client.log_artifacts(run_id, str(d / "adapter"), artifact_path="model/adapter")
            artifact_uri = self.client.get_run(run_id).info.artifact_uri
            self._log_mlflow_model(run_id, artifact_uri, d)
            if self.cfg.log_weights and (d / "model").is_dir():  # a served policy has none here
                self.client.log_artifacts(run_id, str(d / "model"), artifact_path="model/weights")
            if not self.client.search_registered_models(f"name='{self.model_name}'"):
                self.client.create_registered_model(self.model_name)
            source = f"{artifact_uri}/model"
            tags = {**tags, "ratchet.stage_key": model.key, "ratchet.stage_dir": model.dir,
                    "ratchet.content": model.content, "ratchet.workdir": str(store.root)}
            tags.update(self._register_prompt(store, model, run_id))
            # not retried blindly: a retry after a failure that did register would register twice
            for delay in (*RETRY_DELAYS, None):
                try:
                    v = self.client._client.create_model_version(self.model_name, source=source, run_id=run_id,
                                                                 tags=tags)
                    return str(v.version)
                except Exception as e:
                    if delay is None or not transient(e):
                        raise
                    time.sleep(delay)
                    if (existing := self.version_of(model.key)) is not None:
                        return existing
            raise AssertionError("unreachable")

    def _register_prompt(self, store: ArtifactStore, pair: StageManifest, run_id: str) -> dict[str, str]:
        """A version's text as a version of the run's prompt in MLflow's Prompt Registry (once per
        text: the same text over new weights is the same prompt version; a model alone reads each
        prompt as it is, the text `{prompt}`), named on the round's run; the model version's tags
        that name it. MLflow's slot is {{task_prompt}}."""
        from ratchet.tasks.text import SLOT, PromptText, text_of

        text = text_of(store, pair) or PromptText(template=SLOT)
        digest = sha256_json(text.dump())
        name = self.prompt_name
        version = None
        if self.client.get_prompt(name) is not None:
            version = next((str(v.version) for v in self.client.search_prompt_versions(name, max_results=1000)
                            if v.tags.get("ratchet.text") == digest), None)
        if version is None:
            v = self.client.register_prompt(
                name=name, template=text.shown().replace("{prompt}", "{{task_prompt}}"),
                commit_message=f"{pair.stage} stage {pair.dir}",
                tags={"ratchet.text": digest, "ratchet.stage_dir": pair.dir, "ratchet.run_id": run_id})
            version = str(v.version)
        # the round's run names it (MLflow's own link reads the process's global tracking store, not this client's)
        self.client.set_tag(run_id, "ratchet.prompt", f"prompts:/{name}/{version}")
        return {"ratchet.prompt": f"prompts:/{name}/{version}", "ratchet.prompt_text": digest}

    def _champion_prompt(self, version: str) -> None:
        """The prompt registry's `champion` alias follows the champion's text."""
        uri = self.version(version).tags.get("ratchet.prompt")
        if uri:  # a version registered before texts were kept has none: the alias stays
            self.client.set_prompt_alias(self.prompt_name, CHAMPION, int(uri.rsplit("/", 1)[1]))

    def _log_mlflow_model(self, run_id: str, artifact_uri: str, d: Path) -> None:
        """Make the version loadable by MLflow's API: the MLflow model the train stage wrote
        (a LoRA adapter against its local base), or, for the base model and full fine-tunes,
        the weights saved as one (models/mlflow_model.py)."""
        from ratchet.models.mlflow_model import FOLDER
        from ratchet.data.procs import forkserver
        from ratchet.models.mlflow_model import save_full

        if (d / FOLDER / "MLmodel").exists():
            self.client.log_artifacts(run_id, str(d / FOLDER), artifact_path="model")
        elif (d / "model" / "config.json").exists():
            if (local := _local_artifacts(artifact_uri)) is not None:
                # a local store: saved in place beside the run's artifacts, then moved in, its weights
                # linked to the store's (no copy of them, no space taken twice)
                saved = forkserver.call(save_full, d / "model", local / f".model-{uuid.uuid4().hex[:8]}")
                try:
                    (local / "model").mkdir(parents=True, exist_ok=True)
                    for f in saved.iterdir():
                        os.replace(f, local / "model" / f.name)
                finally:
                    shutil.rmtree(saved, ignore_errors=True)
                return
            with tempfile.TemporaryDirectory() as t:  # saved where torch and transformers are imported already
                saved = forkserver.call(save_full, d / "model", Path(t) / "m")
                self.client.log_artifacts(run_id, str(saved), artifact_path="model")

    def record_accuracy(self, version: str, eval_set: str, accuracy: float) -> None:
        """Record a version's held-out accuracy on one eval set (a version can have several)."""
        with self.lock():
            self.client.set_model_version_tag(self.model_name, version, f"ratchet.accuracy.{eval_set}",
                                              f"{accuracy:.6f}")

    def accuracy(self, version: str, eval_set: str) -> float | None:
        value = self.version(version).tags.get(f"ratchet.accuracy.{eval_set}")
        return None if value is None else float(value)

    def champion(self) -> str | None:
        """The version the `champion` alias points at, if any. An error is raised, never read as none."""
        found = self.client.search_registered_models(f"name='{self.model_name}'")
        if not found:
            return None
        v = found[0].aliases.get(CHAMPION)
        return None if v is None else str(v)

    def decided(self, version: str) -> Gate | None:
        """The promotion decision recorded on a version, if one was made."""
        tags = self.version(version).tags
        if "ratchet.promoted" not in tags:
            return None
        return Gate(promoted=tags["ratchet.promoted"] == "true", reason=tags.get("ratchet.gate", ""))

    def promote_if_better(self, version: str, scores: list[SetScore], gate_set: str, min_improvement: float,
                          max_drop: float | None = None) -> Gate:
        """Move `champion` to this version only if it is better than the champion (`verdict`),
        each set compared on the same eval set.

        Decided once per version, under the lock, and recorded on it. When the champion has no
        accuracy on an eval set the rule reads, the answer is `needs_eval` and `needs_sets`:
        evaluate it on those sets, record them (record_accuracy), and ask again.
        """
        gated = next(s for s in scores if s.name == gate_set)
        on = f"eval set {gated.eval_set}" if len(scores) == 1 else f"{gate_set} (eval set {gated.eval_set})"
        with self.lock(), self.registry_lease():
            if (done := self.decided(version)) is not None:
                return done
            champ = self.champion()
            if champ is None:
                gate = Gate(promoted=True, reason=f"first champion: accuracy {gated.accuracy:.4f} on {on}")
            elif champ == version:
                gate = Gate(promoted=True, reason="already the champion")
            else:
                read = [s for s in scores if s.name == gate_set or max_drop is not None]
                bars = {s.name: self.accuracy(champ, s.eval_set) for s in read}
                if missing := tuple(n for n, b in bars.items() if b is None):
                    return Gate(promoted=False, reason=f"champion version {champ} has no accuracy on "
                                f"{', '.join(missing)}", needs_eval=champ, needs_sets=missing)
                won, reason = verdict({s.name: s.accuracy for s in scores}, bars, gate_set, min_improvement,
                                      max_drop, against=f"champion version {champ}", on=on)
                gate = Gate(promoted=won, reason=reason)
            if gate.promoted:
                self.client.set_registered_model_alias(self.model_name, CHAMPION, version)
                self._champion_prompt(version)
            self.client.set_model_version_tag(self.model_name, version, "ratchet.promoted",
                                              "true" if gate.promoted else "false")
            self.client.set_model_version_tag(self.model_name, version, "ratchet.gate", gate.reason)
            return gate
