"""Running a stage: key it, reuse it if finished, else compute it (optionally in a worker process).

A stage body is a module-level function ``body(req: StageRequest[Job], store) -> StageManifest``
whose annotation names its job: the pydantic model of the config slice the stage reads
(``SampleJob``, ``TrainJob``, ...). The flow builds the job, ``run_stage`` keys the stage
by it, and the body gets it back typed, in this process or in a worker (which re-reads it
from JSON through the same annotation). The body writes files into
``store.stage_dir(req.stage, req.key)`` and ends with ``req.finish(store, ...)``, which
writes the manifest last.

Heavy stages run in a process of their own (the entry ``worker(REQUEST.json)``), so all
memory a stage took (optimizer state, activations) is returned to the OS before the next
stage starts: a child forked from the run's fork server, which imported the heavy libraries
once (data/procs/forkserver.py), or a fresh interpreter without one (data/procs/spawn.py). A
sampling stage's engine is the run's warm engine where it has one (models/warm.py).

The worker reports through files in the stage's directory: its manifest when it finished, or
its error report (ERROR_FILE). A worker forked from the fork server is the server's child, not
this process's, so it holds no channel to the process that waits for it; and a stage's result
is its manifest on disk in any case.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
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
from ratchet.data.manifest import Role, StageManifest
from ratchet.data.procs import forkserver, spawn
from ratchet.data.procs.entry import EntryError, entry, load_target, target_of
from ratchet.data.procs.lifetime import die_with_parent
from ratchet.data.store import ArtifactStore, stage_key
from ratchet.tasks.runner.units import ExecutorConfig

log = logging.getLogger("ratchet")
# what a call that reads a model's config or tokenizer waits for (a fork-server call's `after`):
# loading any config imports transformers' auto model classes (its docstrings name them), 2 s of
# CPU on 2 cores, which a child forked before the server had them imported again beside it
READS_MODELS = ("torch", "transformers", "transformers.models.auto.modeling_auto")
# the libraries a stage worker imports before its work, those first; importing them in the run's
# fork server is what a fork saves
WORKER_LIBRARIES = (*READS_MODELS, "peft", "trl", "datasets", "accelerate")
ERROR_FILE = "worker-error.json"


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


def resolved(config: BaseModel) -> BaseModel:
    """The job with each setting that resolves on the machine (`auto` dtype and precision, fields
    marked `json_schema_extra={"resolves": ...}`) replaced by what it resolves to here: the key,
    the worker and the manifest all see the dtype that runs, so two machines that resolve `auto`
    differently never share a key."""
    from ratchet.models import dtype

    how = {"dtype": dtype.resolve_dtype, "precision": dtype.resolve_precision}

    def walk(v):
        if isinstance(v, BaseModel):
            update = {}
            for name, f in type(v).model_fields.items():
                value = getattr(v, name, None)
                extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
                if extra.get("resolves") in how and value == "auto":
                    update[name] = how[extra["resolves"]]("auto")
                elif (new := walk(value)) is not value:
                    update[name] = new
            return v.model_copy(update=update) if update else v
        if isinstance(v, list) and any(isinstance(x, BaseModel) for x in v):
            new = [walk(x) for x in v]
            return v if all(a is b for a, b in zip(new, v)) else new
        return v

    return walk(config)


def body_code(body: Body, config: BaseModel | None = None) -> str:
    """The code version of a stage body: the definitions it can run (tasks/runner/code_reach.py), from
    the body and the classes of its job's values (`config`: the kinds it holds), in its own
    process and in the children it starts, and the versions of the libraries they import."""
    from ratchet.tasks.runner.code_reach import digest, roots_of

    return digest(roots_of(body, config))


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
    role: Role | None = None  # what its outputs are (tasks/runner/declare.py), written into its manifest
    started: float = 0.0
    source: dict[str, Any] | None = None  # the commit, tree state and version that ran it (code_reach.source)
    executor: ExecutorConfig | None = None  # where fan-out units run; not part of the key
    engine: str | None = None  # the run's warm engine lent to this stage's worker (models/warm.py); not keyed
    # what the key took from files, taken again before the manifest is written (`input_digests`)
    inputs: list[tuple[str, str, str]] = []


    def parent(self, stage: str) -> StageManifest:
        """The parent this stage was given under that stage name."""
        if (p := self.find(stage)) is not None:
            return p
        raise KeyError(f"{self.stage} stage was given no {stage!r} parent")

    def find(self, stage: str) -> StageManifest | None:
        """The parent given under that stage name, if one was."""
        return next((p for p in self.parents if p.stage == stage), None)

    def holding(self, output: str) -> StageManifest:
        """The parent whose outputs include `output` (a stage reads its input by the file it needs,
        whichever stage made it: a stage placed after another stands in for it)."""
        for p in self.parents:
            if output in p.outputs:
                return p
        raise KeyError(f"{self.stage} stage was given no parent holding {output!r}")

    @property
    def parent_model(self) -> StageManifest:
        """The policy this stage works with: the base model, a round's trained model, or a pair of
        weights and text (tasks/text.py: its weights are `weights_of` it)."""
        for p in self.parents:
            if p.role in ("model", "text"):
                return p
        raise KeyError(f"{self.stage} stage was given no model parent")

    @property
    def seed(self) -> int:
        return int(getattr(self.config, "seed", 0) or 0)

    def finish(self, store: ArtifactStore, *, outputs: dict[str, int | None], metrics: dict[str, float] | None = None,
               info: dict[str, Any] | None = None, parents: list[StageManifest] | None = None,
               scratch: tuple[str, ...] = ()) -> StageManifest:
        """Digest the outputs and write this stage's manifest (store.finish), last: only where every
        file its key was made from holds what it held when the stage started."""
        if changed := changed_inputs(self.inputs):
            raise StageFailedError(
                f"{self.stage} stage (round {self.round}): {'; '.join(changed)} while the stage ran, so its outputs "
                "are not recorded under the key the older content made. Run the same command again when the file "
                "is as you want it: the stage runs again, keyed by it as it is then")
        return store.finish(stage=self.stage, role=self.role, round=self.round, key=self.key,
                            code_version=self.code_version, config=self.config.model_dump(mode="json"),
                            parents=self.parents if parents is None else parents, outputs=outputs, metrics=metrics,
                            info=info, started=self.started, scratch=scratch, ran_by=self.source)


Body = Callable[[Any, ArtifactStore], StageManifest]


def input_digests(config: BaseModel, code: dict | None = None) -> list[tuple[str, str, str]]:
    """What a stage's key took from files, as (kind, what, digest): its code version ("code": the
    definitions its roots reach, `code_reach.opened`) with each file of code it parsed ("text": the
    digest of its text), each user function with the helpers its file imports ("source": the
    digest its config keeps beside it), and each other user file its config names ("file": its
    bytes; a model directory is keyed by its weights' digests in the base stage, not here)."""
    from ratchet.data.digest import sha256_file
    from ratchet.data.userfiles import config_fields, marker, source_digest

    out = []
    if code is not None:
        out.append(("code", json.dumps(code["roots"]), code["digest"]))
        out += [("text", path, digest) for path, digest in sorted(code["texts"].items())]
    for _, owner, name, value in config_fields(config):
        m = marker(type(owner), name) if isinstance(value, str) else None
        if m is None or (path := m.path_of(value)) is None:
            continue
        if m.digest is not None:
            out.append(("source", value, getattr(owner, m.digest, None) or source_digest(value)))
        elif path.is_file():
            out.append(("file", str(path.resolve()), sha256_file(path)))
    return out


def changed_inputs(inputs: list[tuple[str, str, str]]) -> list[str]:
    """Which of `input_digests` no longer hold, each said with both digests. A file of code whose
    text changed counts only where the code version did (not a comment or the layout)."""
    from ratchet.data.digest import sha256_file, sha256_text
    from ratchet.data.userfiles import source_digest

    def now(kind: str, what: str) -> str | None:
        try:
            if kind == "text":
                return sha256_text(Path(what).read_text())
            if kind == "code":
                from ratchet.tasks.runner import code_reach

                return code_reach.opened([tuple(r) for r in json.loads(what)])["digest"]
            return source_digest(what) if kind == "source" else sha256_file(Path(what))
        except (OSError, UnicodeDecodeError, ValueError, SyntaxError):
            return None

    def said(what: str, was: str, is_now: str | None) -> str:
        return f"{what} is gone" if is_now is None else f"{what} changed (sha256 {was[:12]} when it started, " \
            f"{is_now[:12]} now)"

    out, texts = [], [(what, was, now("text", what)) for kind, what, was in inputs if kind == "text"]
    edited = [said(what, was, is_now) for what, was, is_now in texts if is_now != was]
    for kind, what, was in inputs:
        if kind == "code" and edited and (is_now := now(kind, what)) != was:
            out.append(f"its code version changed ({was} when it started, {is_now} now): {', '.join(edited)}")
        elif kind in ("source", "file") and (is_now := now(kind, what)) != was:
            out.append(said(what.rpartition(":")[0] if kind == "source" else what, was, is_now))
    return out


def _target_or_none(body: Body) -> str | None:
    """`module:function` of a body, which `ratchet verify` runs again; None for one defined inside
    a function (a test's), which runs only in this process."""
    try:
        return target_of(body)
    except EntryError:
        return None


def body_name(body: Body) -> str:
    """`module:function`, how a worker process finds the body again."""
    try:
        return target_of(body)
    except EntryError:
        raise RatchetError(f"stage body {body.__module__}:{body.__qualname__} must be a module-level function so a "
                           "worker process can import it") from None


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
    role: Role | None = None,
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
    config = resolved(config)
    if store.planner is not None:  # `ratchet plan`: keyed and looked up, never run
        return store.planner.stage(stage, round, body, config, keyed(config), code, parents, role)
    source, opened = None, None
    if code is None:  # worked out from the body; what it covers is kept in the store, once per digest
        from ratchet.tasks.runner import code_reach

        roots = code_reach.roots_of(body, config)
        opened = {**code_reach.opened(roots), "roots": roots}
        code, source = opened["digest"], {**code_reach.source(), "body": _target_or_none(body)}
        store.keep_code({k: v for k, v in opened.items() if k != "roots"})
    key = stage_key(stage, code, keyed(config), parents)
    with store.claim(stage, key, keep_partial=keep_partial, run=run) as claim:
        if claim.found is not None:
            log.info("%s (round %d): finished %s at %s, reused", stage, round,
                     "by another run" if claim.by_another else "earlier", claim.found.dir)
            return _reused(store, claim.found, config), True
        d = claim.dir
        req = request(stage=stage, round=round, key=key, code_version=code, config=config, parents=parents,
                      role=role, started=time.time(), source=source, executor=executor, inputs=input_digests(config, opened))
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


def _run_in_worker(store: ArtifactStore, d: Path, body: str, req: StageRequest) -> StageManifest:
    spec = d / "worker-request.json"
    spec.write_text(json.dumps({"body": body, "store": str(store.root), "request": req.model_dump(mode="json")}))
    (d / ERROR_FILE).unlink(missing_ok=True)
    stage_log = d / events.STAGE_LOG
    from ratchet.models import warm

    env = warm.worker_env()
    returncode = None
    if (server := forkserver.current()) is not None:  # a warm worker, forked from the run's fork server
        with spawn.following(stage_log, verbose()):
            returncode = server.run(worker, [str(spec)], stage_log, env)
    if returncode is None:
        returncode = spawn.run_logged(worker, [str(spec)], stage_log, env, follow=verbose())
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


@entry
def worker(spec_path: str) -> int:
    """A worker process's main: run one stage body from its request file."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    die_with_parent()  # a killed orchestrator takes its worker along (data/procs/lifetime.py)
    from ratchet.models import warm

    engine = warm.take_address()  # the run's warm engine, if it has one: this process's alone
    spec = json.loads(Path(spec_path).read_text())
    body = load_target(spec["body"])
    req = request_type(body).model_validate({**spec["request"], "engine": engine})
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

