"""Run identity: which pipeline run a command is, where its record lives, how it ended.

A pipeline run is its config (run_name_for): the same command is the same run, so running it
again continues it, also after the user fixed a file it reads. The files' contents key the
stages that read them, not the run. Its record
(`<workdir>/runs/<run>.json`) holds the context every stage task gets and the exact
resolved config, so `ratchet resume RUN` needs nothing else.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr

from ratchet.data.digest import fsync_dir, sha256_json
from ratchet.data.errors import ConfigError
from ratchet.data.prompts import Split
from ratchet.flows.config import PipelineConfig
from ratchet.flows.inputs import check_inputs, sources_of
from ratchet.flows.tracking import Tracker
from ratchet.tasks.runner.code_reach import code_digest


class RunContext(BaseModel):
    """What every task needs to find the store and the MLflow runs; small and serialisable.
    Fields it does not know (a newer Ratchet's) are kept, not refused: records are read
    forward-compatibly."""

    model_config = ConfigDict(extra="allow", frozen=True)
    run_name: str
    workdir: str
    parent_run_id: str
    code_version: str
    config_hash: str
    start_version: str | None = None  # continue from this registered model version instead of the base model
    sources: dict[str, str] = {}  # content digest of every data file the config reads, as checked at start
    pool_start: int = 0  # data.prompts_per_round: where in the pool's stream this run's first round draws
    _live: Liveness | None = PrivateAttr(default=None)  # the attempt's liveness lock (`start`), not recorded


def git_commit() -> str | None:
    import subprocess

    from ratchet.data.procs.spawn import run_program

    try:
        out = run_program(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[1], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class RunRecord(BaseModel):
    """What `ratchet resume` needs: the context and the exact config of a pipeline run, and
    how its last attempt ended (running while an attempt is alive or was killed). Written
    atomically and durably (write_record); read forward-compatibly: a field a newer Ratchet
    added is kept when this one rewrites the record."""

    model_config = ConfigDict(extra="allow")
    ctx: RunContext
    config: dict
    state: Literal["running", "finished", "failed", "interrupted"] = "running"
    host: str | None = None  # where the last attempt ran, and its process: a "running" record whose
    pid: int | None = None  # process is gone was interrupted (killed, or its machine lost)
    # what its last finished attempt printed, for a run of the same command that finds every stage
    # reused: each stage's and round's line (the events), and the round table (flows/cli.py)
    said: dict | None = None


def run_name_for(cfg: PipelineConfig) -> str:
    """A pipeline run is its config, with the paths of the files it reads but not their contents:
    the same command names the same run, so it continues it, also after the user fixed a reward
    function, an environment or a data file. Each file's digest keys the stages that read it
    (they run again) and stands in the lineage, not in the run's name. The workdir is not in it
    either: the run's record lives there, so it is found under any spelling of the folder
    (relative, absolute, ./runs, a symlink)."""
    from ratchet.data.userfiles import without_digests

    # where units run and which weights are kept on disk change no result; where the run lives holds it
    same = without_digests(cfg).model_dump(mode="json", exclude={"executor", "drop_models", "workdir"})
    return f"{cfg.name}-{sha256_json(same)[:10]}"


def _name_before(cfg: PipelineConfig) -> str:
    """The name a run was given before its workdir left the name (2026-11-29): with the workdir
    as the config wrote it."""
    from ratchet.data.userfiles import without_digests

    same = without_digests(cfg).model_dump(mode="json", exclude={"executor", "drop_models"})
    return f"{cfg.name}-{sha256_json(same)[:10]}"


def recorded_name(cfg: PipelineConfig, workdir: Path) -> str:
    """The name of the run `cfg` names in `workdir`: `run_name_for(cfg)`, or, where only a run
    recorded under the older naming is there (its config's workdir as written then in the name),
    that run's name, so it continues under it."""
    named, runs = run_name_for(cfg), workdir / "runs"
    if not runs.is_dir() or _recorded(runs, named):
        return named
    for path in sorted(runs.glob(f"{cfg.name}-*.json")):
        try:
            written = json.loads(path.read_bytes())["config"]["workdir"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(written, str):
            continue
        before = _name_before(cfg.model_copy(update={"workdir": written}))
        if path.stem == before or path.stem.startswith(f"{before}-from-v"):
            return before
    return named


def _recorded(runs: Path, name: str) -> bool:
    return (runs / f"{name}.json").exists() or any(runs.glob(f"{name}-from-v*.json"))


def load_record(workdir: Path, run_name: str) -> RunRecord:
    p = workdir / "runs" / f"{run_name}.json"
    if not p.exists():
        known = sorted(x.stem for x in (workdir / "runs").glob("*.json")) if (workdir / "runs").is_dir() else []
        raise ConfigError([f"no pipeline run {run_name!r} in {workdir / 'runs'}; known runs: {known or 'none'}"])
    return read_record(p)


class UnreadableRecordError(ConfigError):
    """A run record that is not a run record (cut short, edited, another program's file)."""


def read_record(path: Path) -> RunRecord:
    try:
        return RunRecord.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as e:
        raise UnreadableRecordError([f"the run record {path} cannot be read ({type(e).__name__}: {str(e)[:200]}); "
                                     "restore it from a backup, or move it aside to start that run afresh (its "
                                     "finished stages are reused)"]) from None


def records(workdir: Path) -> tuple[dict[str, RunRecord], dict[str, str]]:
    """Every run record in the workdir by run name, and those that cannot be read, with why."""
    good, bad = {}, {}
    for p in sorted((workdir / "runs").glob("*.json")) if (workdir / "runs").is_dir() else []:
        try:
            good[p.stem] = read_record(p)
        except UnreadableRecordError as e:
            bad[p.stem] = e.problems[0]
    return good, bad


def start_version(tracker: Tracker, start_from: str | None) -> str | None:
    """Which registered model version a run starts from: None for the base model.

    "champion" is the version the `champion` alias points at (the base model if there is
    none yet), a number is that version, "base" or None is the configured base model.
    """
    if start_from in (None, "base"):
        return None
    if start_from == "champion":
        return tracker.champion()
    if not str(start_from).isdigit():
        raise ConfigError([f"start_from={start_from!r} is not 'champion', 'base' or a model version number"])
    from mlflow.exceptions import MlflowException

    try:
        tracker.client.get_model_version(tracker.model_name, str(start_from))
    except MlflowException:
        known = sorted(int(v.version) for v in tracker.client.search_model_versions(f"name='{tracker.model_name}'"))
        raise ConfigError([f"start_from={start_from!r}: {tracker.model_name} has no such version in {tracker.uri}; "
                           f"registered versions: {known or 'none'}"]) from None
    return str(start_from)


def start(cfg: PipelineConfig, start_from: str | None = None, split: Split | None = None, say=None,
          run_name: str | None = None) -> tuple[RunContext, Tracker]:
    """The run's context: continue the MLflow parent run of an earlier attempt of the same
    config and data (and the same starting model version) in this workdir, or create one.
    Finished stages are reused either way. The data is checked first (`split`, if the caller
    already checked it): a problem stops the run before anything is written. While another
    attempt of the same run is alive in the workdir, this one waits, saying so (`say`, a line;
    standard error by default). `run_name`: the run `ratchet resume` names (its record's), which
    keeps its name whatever a newer Ratchet would name its config."""
    if split is None:
        split = check_inputs(cfg)
    workdir = Path(cfg.workdir).resolve()
    (workdir / "runs").mkdir(parents=True, exist_ok=True)
    tracker = Tracker(cfg.tracking, workdir, cfg.name)
    version = start_version(tracker, start_from)
    run_name = run_name or recorded_name(cfg, workdir) + (f"-from-v{version}" if version else "")
    resolved = cfg.model_dump(mode="json")
    code, commit = code_digest(), git_commit()
    tags = {"ratchet.run": run_name, "ratchet.code_version": code, "ratchet.config_hash": sha256_json(resolved)[:16]}
    if version:
        tags["ratchet.start_version"] = version
    if commit:
        tags["mlflow.source.git.commit"] = commit
    live = hold_liveness(workdir, run_name, say)  # before the tracker's lock, which a live attempt needs to end
    try:
        ctx = _started(cfg, tracker, run_name, version=version, split=split, resolved=resolved, code=code, tags=tags)
    except BaseException:
        live.release()
        raise
    ctx._live = live  # the context owns it: set_state releases it
    return ctx, tracker


def _started(cfg: PipelineConfig, tracker: Tracker, run_name: str, *, version: str | None, split: Split,
             resolved: dict, code: str, tags: dict[str, str]) -> RunContext:
    """The run's context and its record, written as "running" (the caller holds the run's lock)."""
    workdir = Path(cfg.workdir).resolve()
    record = workdir / "runs" / f"{run_name}.json"
    with tracker.lock():  # two processes starting the same run continue one parent run, never two
        parent, pool_start = None, 0
        if record.exists():
            old = read_record(record).ctx
            parent, pool_start = old.parent_run_id, old.pool_start
            if not tracker.reopen(parent, tags):
                parent = None  # the tracking store was reset: start a fresh parent run
        elif version and cfg.data.prompts_per_round:
            pool_start = pool_drawn(workdir, cfg, split.digests)
        if parent is None:
            parent = tracker.start_parent(run_name, resolved, tags)
        ctx = RunContext(run_name=run_name, workdir=str(workdir), parent_run_id=parent, code_version=code,
                         config_hash=tags["ratchet.config_hash"], start_version=version, sources=split.digests,
                         pool_start=pool_start)
        write_record(workdir, RunRecord(ctx=ctx, config=resolved, state="running", host=socket.gethostname(),
                                        pid=os.getpid()))
    return ctx


class Liveness:
    """The liveness lock of one run, held by the attempt that runs it: the descriptor of
    runs/<run>.lock under an exclusive flock, until `release` or the process's end (however it
    ends: the kernel drops it). Owned by the run's context (`RunContext`), which `start` gives it
    to and `set_state` releases it from; not a table of the process's, so a second attempt of the
    same run in another thread of this process waits for the first as one in another process
    does. A copy in another process (a pickled context) holds nothing."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def release(self) -> None:
        import fcntl

        fd, self.fd = self.fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __getstate__(self):
        return {"fd": None}


def _lock_path(workdir: Path, run_name: str) -> Path:
    return workdir / "runs" / f"{run_name}.lock"


def hold_liveness(workdir: Path, run_name: str, say=None) -> Liveness:
    """Hold the run's liveness lock while this process runs it: a record says "running" while an
    attempt lives, and whether one does is whether someone holds this lock (the kernel drops it
    when the process dies, however it dies), never a guess from process ids or command lines.

    A second attempt of a run that is alive in this workdir (a cron tick that overlaps a manual
    run) never runs beside it: it says which process holds the run (`say`, a line) and waits for
    that one to end, then goes on and reuses every stage it finished."""
    import fcntl

    fd = os.open(_lock_path(workdir, run_name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            rec = load_record(workdir, run_name)
            who = f"pid {rec.pid} on {rec.host}" if rec.pid else "another process"
        except Exception:  # the live attempt has not written its record yet
            who = "another process"
        (say or _stderr)(f"run {run_name} is already running in {workdir} ({who}); waiting for it to end, then "
                         "this attempt reuses what it finished (Ctrl-C stops waiting)")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
    return Liveness(fd)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def pool_drawn(workdir: Path, cfg: PipelineConfig, sources: dict[str, str]) -> int:
    """How far into the pool's stream this experiment's runs have drawn: where a continuation
    starts, so its rounds train on prompts no earlier round of this pool has seen (until
    the pool is spent). Runs of other experiments, pools or seeds do not count."""
    pool = cfg.data.pool().model_dump(mode="json")
    end = 0
    for rec in records(workdir)[0].values():
        data = dict(rec.config.get("data") or {})
        per = data.pop("prompts_per_round", None)
        data.pop("retire_solved", None)
        same = (rec.config.get("name") == cfg.name and rec.config.get("seed") == cfg.seed and per
                and pool == {**data, "prompts_per_round": None, "retire_solved": False}
                and sources_of(rec.ctx.sources) == sources_of(sources))
        if same:
            end = max(end, rec.ctx.pool_start + int(rec.config.get("rounds", 0)) * int(per))
    return end


def write_record(workdir: Path, record: RunRecord) -> None:
    """Atomically and durably: the new record is on disk before it replaces the old one, and the
    rename is, before this returns (a crash leaves the old record or the new, never half of one)."""
    path = workdir / "runs" / f"{record.ctx.run_name}.json"
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(record.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def set_state(ctx: RunContext, tracker: Tracker, state: str) -> None:
    """Record how the pipeline run ended (finished or failed) in its run record."""
    workdir = Path(ctx.workdir)
    with tracker.lock():
        rec = load_record(workdir, ctx.run_name)
        write_record(workdir, rec.model_copy(update={"state": state, "said": None}))
    if ctx._live is not None:
        ctx._live.release()


def record_said(workdir: Path, run: str, said: dict) -> None:
    """Keep in a finished run's record what it printed (its stages' and rounds' lines, its round
    table): a run of the same command that finds every stage reused prints it again, reading no
    other store (flows/cli.py)."""
    rec = load_record(workdir, run)
    if rec.state == "finished":
        write_record(workdir, rec.model_copy(update={"said": said}))


class RoundEntry(BaseModel):
    round: int
    version: str
    accuracy: float | None
    promoted: bool


class RunSummary(BaseModel):
    """One pipeline run as `ratchet runs` lists it."""

    run: str
    state: Literal["running", "finished", "failed", "interrupted", "unreadable"]
    rounds_done: int
    rounds: int
    start_version: str | None
    started: float | None  # the MLflow parent run's start, seconds since the epoch
    entries: list[RoundEntry]
    resume: str | None  # the command that continues an unfinished run
    problem: str | None = None  # why its record cannot be read


def _alive(workdir: Path, record: RunRecord) -> bool | None:
    """Whether an attempt of the run still lives: someone holds its liveness lock. None when the
    last attempt ran on another host and the lock is free here (a lock over a network filesystem
    may not reach this host)."""
    import fcntl

    path = _lock_path(workdir, record.ctx.run_name)
    if not path.exists():
        return False if record.host in (None, socket.gethostname()) else None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False if record.host in (None, socket.gethostname()) else None


def list_runs(workdir: Path, tracker: Tracker) -> list[RunSummary]:
    """Every pipeline run recorded in `workdir`, oldest first: its state, its rounds as MLflow
    holds them (each round's registered version, accuracy and promotion), how to resume it."""
    out = []
    good, bad = records(workdir)
    for name, why in bad.items():
        out.append(RunSummary(run=name, state="unreadable", rounds_done=0, rounds=0, start_version=None, started=None,
                              entries=[], resume=None, problem=why))
    for rec in good.values():
        state = rec.state
        if state == "running" and _alive(workdir, rec) is False:
            state = "interrupted"
        started, entries = None, []
        try:
            parent = tracker.client.get_run(rec.ctx.parent_run_id)
            started = parent.info.start_time / 1000 if parent.info.start_time else None
            children = tracker.client.search_runs(
                [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{rec.ctx.parent_run_id}'")
        except Exception:  # the tracking store was reset or moved: the record alone
            children = []
        for c in children:
            v = c.data.tags.get("ratchet.model_version")
            if v is None or not str(c.data.tags.get("ratchet.round", "")).isdigit():
                continue
            entries.append(RoundEntry(round=int(c.data.tags["ratchet.round"]), version=v,
                                      accuracy=c.data.metrics.get("round.accuracy"),
                                      promoted=bool(c.data.metrics.get("round.promoted"))))
        entries.sort(key=lambda e: e.round)
        first = entries[0].round if entries else 0
        done = len([e for e in entries if e.round > first])
        rounds = int(rec.config.get("rounds", 0))
        resume = None if state in ("finished", "running") else \
            f"ratchet resume --run {rec.ctx.run_name} --workdir {workdir}"
        try:
            resumed_config(rec, workdir)
            problem = None
        except ConfigError as e:  # listed with why, as a record that cannot be read is
            problem = f"its recorded config does not read back: {'; '.join(e.problems)}"
        out.append(RunSummary(run=rec.ctx.run_name, state=state, rounds_done=done, rounds=rounds,
                              start_version=rec.ctx.start_version, started=started, entries=entries, resume=resume,
                              problem=problem))
    return sorted(out, key=lambda r: (r.started or 0, r.run))


def resumed_config(record: RunRecord, workdir: Path, overrides: list[str] = ()) -> PipelineConfig:
    """A recorded run's config as its resume runs it: in `workdir`, each file it reads digested
    again as it is now (the stored digests are what the last attempt read), `overrides` on top."""
    from pydantic import ValidationError

    from ratchet.data.userfiles import without_digests
    from ratchet.flows.config import config_from_dict, validation_problems

    source = f"run {record.ctx.run_name}'s record"
    try:
        stored = PipelineConfig.model_validate(record.config)
    except ValidationError as e:  # a record this Ratchet cannot read (edited, or a field's meaning changed)
        raise ConfigError(validation_problems(e), source=source) from None
    data = without_digests(stored).model_dump(mode="json")
    if Path(data["workdir"]).resolve() != workdir.resolve():
        data["workdir"] = str(workdir.resolve())
    return config_from_dict(data, list(overrides), source, resolved=True)


class Chosen(BaseModel):
    """The run a command reads (`ratchet resume`, `report`, `runs`, `lineage`, `export`, `gc`,
    `plan`), found the same way for each, and how it was found, which the command says."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    cfg: PipelineConfig
    workdir: Path
    run: str | None  # None: a command about the whole workdir, in which no run was named
    how: str  # e.g. "named by --run", "the run flows/configs/default.yaml names"

    def line(self) -> str:
        if self.run is None:
            return f"every run in {self.how}"
        return f"run {self.run} ({self.how}) · workdir {self.workdir}"


def _by_age(workdir: Path, prefix: str = "") -> list[str]:
    """The runs recorded in `workdir` (named `prefix`...), the one whose record changed last first
    (each attempt and each end rewrites it)."""
    found = [p for p in (workdir / "runs").glob(f"{prefix}*.json")] if (workdir / "runs").is_dir() else []
    return [p.stem for p in sorted(found, key=lambda p: (p.stat().st_mtime, p.stem), reverse=True)]


def _newest(workdir: Path, prefix: str = "") -> str | None:
    return next(iter(_by_age(workdir, prefix)), None)


def _workdir_config(where: Path, overrides: list[str]) -> tuple[PipelineConfig, str]:
    """The config a command about every run of a workdir reads (for its tracking store and model
    name): the newest run's whose record reads back, and which run that was. One run's record that
    does not read back stops no such command: `ratchet runs` lists that run with the reason."""
    from ratchet.flows.config import config_from_dict

    for run in _by_age(where):
        try:
            return resumed_config(load_record(where, run), where, overrides), f"with run {run}'s config"
        except ConfigError:
            continue
    cfg = config_from_dict({"workdir": str(where)}, list(overrides), "--workdir")
    return cfg, "no run's recorded config reads back: the default config's tracking store"


def choose_run(config: str | None, overrides: list[str] = (), workdir: str | None = None, run: str | None = None,
               *, need: bool = True, own: bool = False) -> Chosen:
    """One way to name a run, for every command that reads one.

    - The workdir: `--workdir`, else the config's `workdir` (after its overrides), else `runs`.
    - The run: `--run RUN`; else the run the config names (the one `ratchet run CONFIG` continues,
      also one started `--from` a version); else, unless `own`, the newest run recorded under
      the config's name; with no config, the newest run in the workdir.
    - The config: CONFIG with its overrides; with no CONFIG, the run's own recorded config.
    `need`: a run must be found (else None is allowed: a command about the whole workdir)."""
    if config is not None:
        from ratchet.flows.config import load_config

        cfg = load_config(config, list(overrides))
        if workdir is not None:
            cfg = cfg.model_copy(update={"workdir": str(Path(workdir).resolve())})
        where = Path(cfg.workdir).resolve()
        if run is not None:
            load_record(where, run)  # one that is not there is named, with the runs that are
            return Chosen(cfg=cfg, workdir=where, run=run, how="named by --run")
        if not need:
            return Chosen(cfg=cfg, workdir=where, run=None, how=f"{where / 'runs'}")
        named = recorded_name(cfg, where)
        if (where / "runs" / f"{named}.json").exists():
            return Chosen(cfg=cfg, workdir=where, run=named, how=f"the run {config} names")
        if (started := _newest(where, f"{named}-from-v")) is not None:
            return Chosen(cfg=cfg, workdir=where, run=started, how=f"the run {config} names, started from a version")
        if not own and (newest := _newest(where, f"{cfg.name}-")) is not None:
            return Chosen(cfg=cfg, workdir=where, run=newest,
                          how=f"the newest named {cfg.name}; {config} as given names {named}, which has not run here")
        raise ConfigError([f"no run of {config} is recorded in {where / 'runs'} (it would be {named}); "
                           f"`ratchet run {config}` starts it, `ratchet runs {config}` lists the runs there, "
                           "`--run RUN` names one"])
    where = Path(workdir or "runs").resolve()
    how = "named by --run"
    if run is None:
        run, how = _newest(where), f"the newest in {where / 'runs'}"
        if run is None and not need:  # e.g. gc or a code version of a store no recorded run used
            from ratchet.flows.config import config_from_dict

            cfg = config_from_dict({"workdir": str(where)}, list(overrides), "--workdir")
            return Chosen(cfg=cfg, workdir=where, run=None, how=f"{where / 'runs'}: none is recorded")
        if run is None:
            raise ConfigError([f"no pipeline run is recorded in {where / 'runs'}, so there is no config to read; "
                               "name the run's CONFIG, or its workdir with --workdir W"])
        if not need:  # about every run: the newest one's config gives the tracking store and model name
            cfg, which = _workdir_config(where, list(overrides))
            return Chosen(cfg=cfg, workdir=where, run=None, how=f"{where / 'runs'}, {which}")
    record = load_record(where, run)
    return Chosen(cfg=resumed_config(record, where, overrides), workdir=where, run=run, how=how)
