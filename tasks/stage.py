"""Running a stage: key it, reuse it if finished, else compute it (optionally in a worker process).

A stage body is a module-level function ``body(req: StageRequest[Job], store) -> StageManifest``
whose annotation names its job: the pydantic model of the config slice the stage reads
(``SampleJob``, ``TrainJob``, ...). The flow builds the job, ``run_stage`` keys the stage
by it, and the body gets it back typed, in this process or in a worker (which re-reads it
from JSON through the same annotation). The body writes files into
``store.stage_dir(req.stage, req.key)`` and ends with ``req.finish(store, ...)``, which
writes the manifest last.

Heavy stages run in a process of their own (``worker(REQUEST.json)``), so all memory a
stage took (optimizer state, activations) is returned to the OS before the next stage
starts: a child forked from the run's fork server, which imported the heavy libraries once
(tasks/forkserver.py), or a fresh interpreter (WORKER) without one. A sampling stage's
engine is the run's warm engine where it has one (models/warm.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from ratchet.data import events
from ratchet.data.errors import ConfigError, EmptyStageError, RatchetError, StageFailedError, out_of_space
from ratchet.data.lifetime import die_with_parent
from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore, stage_key
from ratchet.tasks.units import ExecutorConfig

log = logging.getLogger("ratchet")
# The worker's entry point. `python -c` puts the current directory first on sys.path; it is
# dropped before anything is imported, so a `data.py` or a second checkout in the directory
# the user runs from can never stand in for the installed code.
WORKER = "import sys; sys.path.pop(0); from ratchet.tasks.stage import worker; sys.exit(worker(sys.argv[1]))"
ERROR_FILE = "worker-error.json"
MODEL_STAGES = ("base", "train", "label-model")


@functools.lru_cache(maxsize=512)
def syntax_tree(text: str, path: str) -> str:
    import ast

    tree = ast.parse(text, path)
    for node in ast.walk(tree):  # docstrings: no stage reads them (the config reference does, outside stages)
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def keyed(config: BaseModel) -> dict:
    """A stage's config as it keys the stage: all of it but the settings that cannot change a
    result (marked `json_schema_extra={"keyed": False}`: how many calls run at once, their
    timeouts and retries), so changing one of those resumes the stage instead of redoing it."""

    def drop(model, dumped):
        if isinstance(model, BaseModel) and isinstance(dumped, dict):
            for name, f in type(model).model_fields.items():
                if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("keyed") is False:
                    dumped.pop(f.serialization_alias or f.alias or name, None)
                elif name in dumped:
                    drop(getattr(model, name), dumped[name])
        elif isinstance(model, (list, tuple)) and isinstance(dumped, list):
            for m, d in zip(model, dumped):
                drop(m, d)
        elif isinstance(model, dict) and isinstance(dumped, dict):
            for k, m in model.items():
                if str(k) in dumped:
                    drop(m, dumped[str(k)])
        return dumped

    return drop(config, config.model_dump(mode="json"))


def body_code(body: Body, *extra: str, config: BaseModel | None = None) -> str:
    """The code version of a stage body: the definitions it can run (tasks/code_reach.py), from
    the body, the classes of its job's values (`config`: the kinds it holds) and `extra` modules
    it reaches through a registry rather than an import."""
    from ratchet.tasks.code_reach import digest, roots_of

    return digest(roots_of(body, config, extra))


Job = TypeVar("Job", bound=BaseModel)


class StageRequest(BaseModel, Generic[Job]):
    """Everything a stage body needs; small and JSON-serialisable. `config` is the stage's
    typed job, the exact slice of the pipeline config (and seed) its key is made of."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: str
    round: int
    key: str
    code_version: str
    config: Job
    parents: list[StageManifest]
    started: float = 0.0
    executor: ExecutorConfig | None = None  # where fan-out units run; not part of the key


    def parent(self, stage: str) -> StageManifest:
        for p in self.parents:
            if p.stage == stage:
                return p
        raise KeyError(f"{self.stage} stage was given no {stage!r} parent")

    @property
    def parent_model(self) -> StageManifest:
        """The policy this stage works with: the base model or a round's trained model."""
        for p in self.parents:
            if p.stage in MODEL_STAGES:
                return p
        raise KeyError(f"{self.stage} stage was given no model parent")

    @property
    def seed(self) -> int:
        return int(getattr(self.config, "seed", 0) or 0)

    def finish(self, store: ArtifactStore, *, outputs: dict[str, int | None], metrics: dict[str, float] | None = None,
               info: dict[str, Any] | None = None, parents: list[StageManifest] | None = None,
               scratch: tuple[str, ...] = ()) -> StageManifest:
        """Digest the outputs and write this stage's manifest (store.finish), last."""
        return store.finish(stage=self.stage, round=self.round, key=self.key, code_version=self.code_version,
                            config=self.config.model_dump(mode="json"),
                            parents=self.parents if parents is None else parents, outputs=outputs, metrics=metrics,
                            info=info, started=self.started, scratch=scratch)


Body = Callable[[Any, ArtifactStore], StageManifest]


def body_name(body: Body) -> str:
    """`module:function`, how a worker process finds the body again."""
    name = f"{body.__module__}:{body.__qualname__}"
    if "<" in body.__qualname__ or _resolve(name) is not body:
        raise RatchetError(f"stage body {name} must be a module-level function so a worker process can import it")
    return name


def request_type(body: Body) -> type[StageRequest]:
    """The StageRequest[Job] the body's first parameter is annotated with."""
    first = next(iter(inspect.signature(body).parameters))
    t = typing.get_type_hints(body).get(first)
    if not (isinstance(t, type) and issubclass(t, StageRequest)):
        raise RatchetError(f"stage body {body.__qualname__} must annotate its first parameter as StageRequest[Job]")
    return t


def run_stage(
    store: ArtifactStore,
    *,
    stage: str,
    round: int,
    body: Body,
    config: BaseModel,
    code: str | None = None,
    parents: list[StageManifest],
    isolate: bool = False,
    keep_partial: bool = False,
    run: str | None = None,
    executor: ExecutorConfig | None = None,
) -> tuple[StageManifest, bool]:
    """(manifest, reused). Reuses a finished stage with the same key; verifies its digests.

    An exclusive lock per key means two pipelines that reach the same work at once
    compute it once: the second waits, then finds it finished. `run` (the pipeline run)
    is recorded in an unfinished stage's directory, so `ratchet gc` can tell whether a
    recorded run would still resume it.
    """

    request = request_type(body)  # a body that cannot run is an error before anything is written
    name = body_name(body) if isolate else None
    code = code or body_code(body, config=config)
    key = stage_key(stage, code, keyed(config), parents)
    found = store.find(stage, key)
    if found is not None:
        log.info("%s (round %d): finished earlier at %s, reused", stage, round, found.dir)
        store.drop_scratch(found)
        return _reused(store, found, config), True
    with store.lock(stage, key):
        found = store.find(stage, key)
        if found is not None:
            log.info("%s (round %d): finished by another run at %s, reused", stage, round, found.dir)
            return _reused(store, found, config), True
        d = store.prepare(stage, key, keep_partial=keep_partial)
        if run is not None:
            store.add_owner(d, run)
        req = request(stage=stage, round=round, key=key, code_version=code, config=config, parents=parents,
                      started=time.time(), executor=executor)
        events.emit(events.Event("start", stage, round, d))
        try:
            try:
                m = _run_in_worker(store, d, name, req) if name is not None else body(req, store)
            except OSError as e:
                if (full := out_of_space(e, d)) is None:
                    raise
                raise StageFailedError(f"{stage} stage (round {round}): {full}", clear=True) from e
        except BaseException as e:
            events.emit(events.Event("failed", stage, round, d, error=f"{type(e).__name__}: {e}"))
            raise
        (d / events.PROGRESS).unlink(missing_ok=True)  # the console's, for the running stage only
        events.emit(events.Event("done", stage, round, d, metrics=dict(m.metrics), wall_s=m.wall_s,
                                 summary=events.summary_of(config, m.metrics)))
        return m, False


def _reused(store: ArtifactStore, m: StageManifest, config: BaseModel) -> StageManifest:
    events.emit(events.Event("reused", m.stage, m.round, store.dir_of(m), metrics=dict(m.metrics), wall_s=m.wall_s,
                             summary=events.summary_of(config, m.metrics)))
    return m


def _resolve(body: str):
    mod, _, fn = body.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _run_in_worker(store: ArtifactStore, d: Path, body: str, req: StageRequest) -> StageManifest:
    spec = d / "worker-request.json"
    spec.write_text(json.dumps({"body": body, "store": str(store.root), "request": req.model_dump(mode="json")}))
    (d / ERROR_FILE).unlink(missing_ok=True)
    stage_log = d / events.STAGE_LOG
    from ratchet.models import warm
    from ratchet.tasks import forkserver

    env = warm.worker_env()
    returncode = None
    if (server := forkserver.current()) is not None:  # a warm worker, forked from the run's fork server
        with _following(stage_log):
            returncode = server.run(spec, stage_log, env)
    if returncode is None:
        returncode = _run_logged([sys.executable, "-c", WORKER, str(spec)], stage_log, env)
    if returncode == 0:
        m = store.find(req.stage, req.key, verify=False)
        if m is None:
            raise StageFailedError(f"{req.stage} worker exited 0 but wrote no manifest in {d}")
        return m
    err = d / ERROR_FILE
    if err.exists():
        e = json.loads(err.read_text())
        if e["type"] == "EmptyStageError":
            raise EmptyStageError(e["message"])
        if e["type"] == "ConfigError":
            raise ConfigError(e.get("problems") or [e["message"]], source=f"{req.stage} stage")
        raise StageFailedError(f"{req.stage} stage (round {req.round}) failed in its worker: {e['type']}: "
                               f"{e['message']} (its log: {stage_log})", clear=bool(e.get("ratchet")))
    if (full := _disk_nearly_full(d)) is not None:  # its report could not be written: say why that likely was
        raise StageFailedError(f"{req.stage} stage (round {req.round}) worker failed (exit code {returncode}) "
                               f"and left no report: {full}. Its log: {stage_log}", clear=True)
    raise StageFailedError(
        f"{req.stage} stage (round {req.round}) worker died with exit code {returncode} "
        f"(negative = killed by signal; -9 is often the kernel's out-of-memory killer). "
        f"Its partial files are kept in {d}; re-run the same command to resume. Its log: {stage_log}"
    )


def _disk_nearly_full(d: Path) -> str | None:
    import errno
    import shutil

    try:
        free = shutil.disk_usage(d).free
    except OSError:
        return None
    if free >= 64 * 2**20:
        return None
    return out_of_space(OSError(errno.ENOSPC, "No space left on device", str(d)), d)


def verbose() -> bool:
    """`ratchet run --verbose` (RATCHET_VERBOSE=1): stage workers stream to the terminal too."""
    return os.environ.get("RATCHET_VERBOSE", "") not in ("", "0")


@contextlib.contextmanager
def _following(path: Path):
    """With RATCHET_VERBOSE, copy what is appended to `path` to this process's stdout meanwhile."""
    import threading

    if not verbose():
        yield
        return
    stop = threading.Event()

    def copy(start: int) -> None:
        with open(path, "rb") as f:
            f.seek(start)
            while True:
                line = f.readline()
                if line:
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()
                elif stop.is_set():
                    return
                else:
                    time.sleep(0.1)

    path.touch()
    t = threading.Thread(target=copy, args=(path.stat().st_size,), daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)


def _run_logged(cmd: list[str], stage_log: Path, extra_env: dict[str, str] | None = None) -> int:
    """Run a worker with its output (the engine's, the trainer's, every library's) appended to
    the stage's log; with RATCHET_VERBOSE also copied to this process's stdout as it comes."""
    import threading

    env = {**os.environ, **(extra_env or {})}
    with open(stage_log, "ab") as f:
        if not verbose():
            return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        def copy() -> None:
            for line in iter(proc.stdout.readline, b""):
                f.write(line)
                f.flush()
                sys.stdout.buffer.write(line)
                sys.stdout.flush()

        t = threading.Thread(target=copy, daemon=True)
        t.start()
        code = proc.wait()
        t.join(timeout=5)  # a holder the worker started may keep the pipe open; never wait on it
        return code


def worker(spec_path: str) -> int:
    """A worker process's main: run one stage body from its request file."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    die_with_parent()  # a killed orchestrator takes its worker along (data/lifetime.py)
    from ratchet.models import warm

    warm.take_address()  # the run's warm engine, if it has one: this process's alone
    spec = json.loads(Path(spec_path).read_text())
    body = _resolve(spec["body"])
    req = request_type(body).model_validate(spec["request"])
    store = ArtifactStore(Path(spec["store"]))
    try:
        body(req, store)
        return 0
    except BaseException as e:  # report every failure to the orchestrator, then re-raise for the log
        full = out_of_space(e, Path(spec_path).parent)
        payload = {"type": type(e).__name__, "message": full or str(e), "traceback": traceback.format_exc(),
                   "ratchet": isinstance(e, RatchetError) or full is not None}
        if isinstance(e, ConfigError):
            payload["problems"] = e.problems
        try:
            (Path(spec_path).parent / ERROR_FILE).write_text(json.dumps(payload, indent=2))
        except OSError:  # no room even for the report: the orchestrator finds the disk full itself
            print(full or payload["message"], file=sys.stderr)
        raise

