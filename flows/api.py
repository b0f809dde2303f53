"""Ratchet from Python: what the commands do, as functions that return data; the CLI prints it.

    from ratchet.flows import api

    cfg = api.load("flows/configs/default.yaml", ["rounds=1", "workdir=runs"])
    api.check(cfg)              # what `ratchet check` checks; raises ConfigError, nothing loaded
    result = api.run(cfg)       # what `ratchet run` runs, without its console
    print(result.champion, result.model_dir(result.champion))

    api.plan("flows/configs/default.yaml").steps             # `ratchet plan`: each stage's state and why
    api.runs(workdir="runs").runs                            # `ratchet runs`: every run, its versions
    api.lineage("flows/configs/default.yaml", "3").links     # `ratchet lineage`: the verified chain
    api.verify("flows/configs/default.yaml", "3").counts     # `ratchet verify`: its stages run again
    api.export("flows/configs/default.yaml", "champion", "out").path   # `ratchet export`

`run` is `ratchet run`: the same stages, keys and store, so calling it again with the same
config continues the same run, and the CLI sees what it made (`ratchet runs`, `ratchet
report`). Its output goes to the process's own streams and logging. The reading functions
choose their run as the commands do (`find_run`: a config's run, `run=` by name, `workdir=`);
each takes a run `find_run` chose already in its first argument's place.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.flows.config import PipelineConfig


@dataclass(frozen=True)
class RoundOutcome:
    """One round as the run recorded it."""

    round: int
    version: str | None  # its registered model version
    accuracy: float | None  # held-out accuracy on the gate's set
    accuracies: dict[str, float]  # on every held-out set, by name
    promoted: bool  # whether it became the champion


@dataclass(frozen=True)
class RunResult:
    run: str  # the run's name (`ratchet runs`, `ratchet resume RUN`)
    workdir: Path
    model_name: str  # the MLflow registered model
    rounds: list[RoundOutcome]
    champion: str | None  # the version the champion alias names after the run
    _tracker: Any = field(repr=False, compare=False, default=None)

    def model_dir(self, version: str | None) -> Path:
        """The Hugging Face model directory of a registered version (in the store; read it, do not
        write it): `AutoModelForCausalLM.from_pretrained(result.model_dir(v))`."""
        from ratchet.data.store import ArtifactStore
        from ratchet.flows.lineage import version_manifest
        from ratchet.tasks.prepare import model_dir

        if version is None:
            raise ValueError("no version: the run registered none (result.champion is None before any round)")
        store = ArtifactStore(self.workdir)
        return model_dir(store, version_manifest(store, self._tracker, str(version)), remake_here=False)


def load(config: str | Path | dict, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """A pipeline config from a YAML file (or a dict of the same shape) and `key=value` overrides,
    validated: a ConfigError names every bad field."""
    from ratchet.flows.config import config_from_dict, load_config

    if isinstance(config, dict):
        return config_from_dict(config, list(overrides))
    return load_config(config, list(overrides))


def check(cfg: PipelineConfig) -> None:
    """Every check `ratchet check` makes: the data's rows, the answer check, the model directory,
    its prompt format and every prompt against the token budgets. Raises ConfigError."""
    from ratchet.flows.inputs import check_task

    check_task(cfg)


def run(cfg: PipelineConfig, start_from: str | None = None) -> RunResult:
    """Run (or continue) the pipeline: `start_from` None for the base model, "champion" or a
    version number to add `cfg.rounds` rounds on top of it (`ratchet run --from`).

    Prefect: the server PREFECT_API_URL names, else a temporary one started for this process. A
    failed stage raises its error; every finished stage is kept, and calling `run` again with the
    same config resumes from the first unfinished one. The start is `ratchet run`'s
    (flows/launch.py), without its console."""
    from ratchet.flows.inputs import checked_run
    from ratchet.flows.launch import launcher, library_env, prepare_env

    if "prefect" not in sys.modules:  # Prefect reads its settings once, when first imported
        library_env()  # for the fork server started first; Prefect's home once the checks pass
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with checked_run(cfg) as split:  # before anything is written
        if "prefect" not in sys.modules:
            prepare_env(Path(cfg.workdir).resolve())
        with launcher(cfg, time.strftime("%Y%m%dT%H%M%S")) as launch:
            ctx, _ = launch.start(start_from, split)
            ctx, results, tracker = launch.execute(ctx)
    return RunResult(run=ctx.run_name, workdir=Path(ctx.workdir), model_name=tracker.model_name,
                     rounds=[RoundOutcome(r.round, r.version, r.accuracy, dict(r.accuracies), r.promoted)
                             for r in results],
                     champion=tracker.champion(), _tracker=tracker)


# reading a run: what `ratchet plan`, `runs`, `lineage`, `verify` and `export` print -------------------

Where = Any  # a run as find_run chose it (flows/runs.py Chosen), or a config file's path, or None


def find_run(config: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), workdir: str | Path | None = None,
             run: str | None = None, *, need: bool = True):
    """The run a reading function reads, chosen as every command chooses it (flows/runs.py
    `choose_run`): `run` by name; else the run `config` names (with its overrides), or its
    newest; with no config, the newest run in `workdir`. `need` False: none is needed (a question
    about the whole workdir). Its `.line()` says which it is and how it was found."""
    from ratchet.flows.runs import choose_run

    return choose_run(None if config is None else str(config), list(overrides),
                      None if workdir is None else str(workdir), run, need=need)


def _chosen(where: Where, overrides, workdir, run, need: bool = True):
    from ratchet.flows.runs import Chosen

    return where if isinstance(where, Chosen) else find_run(where, overrides, workdir, run, need=need)


def _tracker(chosen):
    from ratchet.flows.tracking import Tracker

    return Tracker(chosen.cfg.tracking, chosen.workdir, chosen.cfg.name)


def _reading(chosen):
    """The tracker for a command that only reads: the store read with sqlite3 where it is a local
    SQLite store (flows/tracking_read.py: no MLflow import), the full Tracker otherwise."""
    from ratchet.flows.tracking import store_uri
    from ratchet.flows.tracking_read import reader

    cfg = chosen.cfg.tracking
    return reader(store_uri(cfg, chosen.workdir), cfg.model_name or f"ratchet-{chosen.cfg.name}") or _tracker(chosen)


def _store(chosen):
    from ratchet.data.errors import RatchetError
    from ratchet.data.store import ArtifactStore

    if not (chosen.workdir / "stages").is_dir():
        raise RatchetError(f"no artifact store at {chosen.workdir}/stages; run the pipeline first or pass --workdir W")
    return ArtifactStore(chosen.workdir)


def plan(where: Where = None, overrides: list[str] | tuple[str, ...] = (), *, workdir: str | Path | None = None,
         run: str | None = None):
    """`ratchet plan`: what the run would do if it started now, each stage reused, stale (and why),
    to run, or waiting (flows/plan.py `Plan`: `.steps`, `.counts()`, `.render()`, `.as_json()`).
    Loads no model and writes nothing."""
    from ratchet.flows.plan import plan as plan_of, start_of
    from ratchet.flows.runs import read_record, recorded_name

    chosen = _chosen(where, overrides, workdir, run, need=where is None)
    name = chosen.run or recorded_name(chosen.cfg, chosen.workdir)
    record = chosen.workdir / "runs" / f"{name}.json"
    ctx = read_record(record).ctx if record.is_file() else None
    start = start_of(chosen.cfg, chosen.workdir, ctx.start_version) if ctx and ctx.start_version else None
    return plan_of(chosen.cfg, run=name, start=start, pool_start=ctx.pool_start if ctx else None)


@dataclass(frozen=True)
class Runs:
    """The runs recorded in a workdir (`ratchet runs`): each a flows/runs.py RunSummary (state,
    rounds, versions with their accuracy, how to resume it)."""

    workdir: Path
    model: str  # the MLflow registered model
    tracking: str  # the MLflow store, its secrets hidden
    champion: str | None
    runs: list


def runs(where: Where = None, overrides: list[str] | tuple[str, ...] = (), *, workdir: str | Path | None = None,
         run: str | None = None) -> Runs:
    """`ratchet runs`: every pipeline run recorded in the workdir (`run`: that one alone)."""
    from ratchet.data.errors import RatchetError
    from ratchet.flows.runs import list_runs
    from ratchet.flows.tracking import redact

    chosen = _chosen(where, overrides, workdir, None, need=False)
    if not (chosen.workdir / "runs").is_dir():
        raise RatchetError(f"no pipeline runs recorded in {chosen.workdir}/runs; run the pipeline first or pass "
                           "--workdir W")
    tracker = _reading(chosen)
    found = list_runs(chosen.workdir, tracker)
    if run is not None:
        found = [r for r in found if r.run == run]
        if not found:
            raise RatchetError(f"no pipeline run {run!r} in {chosen.workdir}/runs; `ratchet runs` without --run lists "
                               "them")
    return Runs(chosen.workdir, tracker.model_name, redact(tracker.uri), tracker.champion(), found)


def _versions(chosen, tracker) -> list[str]:
    """The versions the chosen run registered, oldest first."""
    from ratchet.flows.runs import list_runs

    return next(([e.version for e in r.entries] for r in list_runs(chosen.workdir, tracker) if r.run == chosen.run),
                [])


def version_number(tracker, target: str) -> str:
    """The registered version a command names: N, models:/NAME/N (this run's model's) or 'champion'."""
    from ratchet.data.errors import RatchetError
    from ratchet.flows.lineage import own_model

    own_model(target, tracker)
    version = tracker.champion() if target == "champion" else target.rsplit("/", 1)[-1]
    if version is None:
        raise RatchetError(f"{tracker.model_name} has no champion yet; name a version (see `ratchet runs`)")
    return version


def made_by(tracker, version: str, run: str | None) -> str:
    """Which run and round made a registered version (its `ratchet.run` and `ratchet.round` tags),
    refused when `run` names another run."""
    from ratchet.data.errors import RatchetError

    tags = tracker.version(version).tags
    made = tags.get("ratchet.run")
    if run is not None and made is not None and made != run:
        raise RatchetError(f"{tracker.model_name} version {version} was made by run {made}, not {run}; leave out "
                           "--run (a version names its run) or name that run's version")
    where = f"run {made}, round {tags.get('ratchet.round', '?')}" if made else "a run that left no ratchet.run tag"
    return f"{tracker.model_name} version {version}: made by {where}"


def _newest_version(chosen, tracker, how: str) -> str:
    from ratchet.data.errors import RatchetError

    versions = _versions(chosen, tracker)
    if not versions:
        raise RatchetError(f"run {chosen.run} has registered no model version yet; {how}")
    return versions[-1]


@dataclass(frozen=True)
class Lineage:
    """The chain behind a version (`ratchet lineage`): its links, the model's own stage first, each
    verified against its manifest (flows/lineage.py Link)."""

    version: str | None  # the registered version, where the target was one
    made_by: str | None  # which run and round made it
    links: list

    @property
    def verified(self) -> bool:
        return all(x.verified for x in self.links)


def lineage(where: Where = None, version: str | None = None, overrides: list[str] | tuple[str, ...] = (), *,
            workdir: str | Path | None = None, run: str | None = None) -> Lineage:
    """`ratchet lineage`: the verified chain behind `version` (N, 'champion', models:/NAME/N, a round's
    MLflow run id or a stage directory; None: the chosen run's newest version)."""
    from ratchet.flows.lineage import annotate, resolve, walk

    chosen = _chosen(where, overrides, workdir, run, need=version is None)
    store, tracker = _store(chosen), _reading(chosen)
    target = version if version is not None else _newest_version(
        chosen, tracker, "name a VERSION, 'champion', a round's MLflow run id or a stage dir")
    number = tracker.champion() if target == "champion" else target.rsplit("/", 1)[-1]
    said = made_by(tracker, number, run) if number is not None and number.isdigit() else None
    links = walk(store, resolve(target, store, tracker))
    annotate(links, tracker)
    return Lineage(number if said else None, said, links)


def code_version(where: Where = None, digest: str = "", *, workdir: str | Path | None = None,
                 run: str | None = None) -> dict:
    """`ratchet lineage --code DIGEST`: the definitions and libraries a stage's code version covers."""
    return _store(_chosen(where, (), workdir, run, need=False)).code(digest)


@dataclass(frozen=True)
class Verification:
    """`ratchet verify`: each stage behind a version run again in a scratch store, with its verdict
    (flows/verify.py StageVerdict: identical, differs, not re-runnable) and the file that holds them."""

    version: str
    made_by: str
    path: Path  # the verdicts, also logged to the run's MLflow parent run where it could be
    verdicts: list
    logged: str  # where the verdicts were logged, or why not

    @property
    def counts(self) -> dict[str, int]:
        return {k: sum(v.verdict == k for v in self.verdicts) for k in ("identical", "differs", "not re-runnable")}


def verify(where: Where = None, version: str | None = None, stages: list[str] | tuple[str, ...] = (),
           overrides: list[str] | tuple[str, ...] = (), *, workdir: str | Path | None = None,
           run: str | None = None) -> Verification:
    """`ratchet verify`: run the stages behind `version` (None: the chosen run's newest) again and
    compare every output's bytes; `stages`: only these (`train`, `label@2`, ...)."""
    from ratchet.flows.lineage import version_manifest
    from ratchet.flows.runs import load_record
    from ratchet.flows.verify import chosen_stages, verify as verify_stages

    chosen = _chosen(where, overrides, workdir, run, need=version is None)
    store, tracker = _store(chosen), _tracker(chosen)
    number = version_number(tracker, version or _newest_version(chosen, tracker, "name one with --version N"))
    said = made_by(tracker, number, run)
    owner = tracker.version(number).tags.get("ratchet.run") or chosen.run or "unknown-run"
    from ratchet.data.digest import hashing_everything

    with hashing_everything():  # every file read, whatever the stat cache says
        picked, upstream = chosen_stages(store, version_manifest(store, tracker, number), list(stages))
        path, verdicts = verify_stages(store, picked, chosen.workdir / "verify" / owner, upstream=upstream)
    try:
        tracker.client.log_artifact(load_record(chosen.workdir, owner).ctx.parent_run_id, str(path), "verify")
        logged = " and the run's MLflow parent run (verify/)"
    except Exception as e:  # noqa: BLE001 - the file holds the verdicts either way
        logged = f" (not logged to MLflow: {type(e).__name__}: {str(e)[:200]})"
    return Verification(number, said, path, verdicts, logged)


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share `p` of `n` (95% at z = 1.96): what a held-out accuracy
    on n prompts can say."""
    import math

    if n == 0:
        return 0.0, 0.0
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


@dataclass(frozen=True)
class SetAccuracy:
    """A version's accuracy on one held-out set, and the evaluate stage that holds its answers."""

    name: str
    accuracy: float
    prompts: int
    stage_dir: str
    reused: bool  # the stage was in the store already (a round of a run, or an earlier `evaluate`)
    wall_s: float  # what the stage took when it was made

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.accuracy, self.prompts)


@dataclass(frozen=True)
class Evaluation:
    """`ratchet evaluate`: a registered version on held-out sets."""

    version: str
    made_by: str
    policy: str  # the stage directory of the version's model
    sets: list[SetAccuracy]


def evaluate(where: Where = None, version: str = "champion", sets: list[str] | tuple[str, ...] = (),
             overrides: list[str] | tuple[str, ...] = (), *, workdir: str | Path | None = None,
             run: str | None = None, say=lambda line: None) -> Evaluation:
    """`ratchet evaluate`: `version`'s held-out accuracy on the config's sets (evaluate.sets and each
    level's; `sets`: only these), each an evaluate stage keyed as a round's is: where a round (or an
    earlier call) evaluated this model on the same set, that stage is read, not run again; a set
    the config adds (evaluate.sets=[...]) is evaluated and kept in the store. The names, the version
    and every set's data are checked before a model is loaded. Nothing is logged to MLflow: the
    version's round stays as its run recorded it."""
    from ratchet.data.errors import RatchetError
    from ratchet.flows.inputs import check_data, with_sets
    from ratchet.flows.lineage import version_manifest
    from ratchet.flows.shape import held_out
    from ratchet.tasks import evaluate as evaluating, prepare
    from ratchet.tasks.runner.declare import At

    chosen = _chosen(where, overrides, workdir, run, need=False)
    cfg = chosen.cfg
    names = [s.name for s, _ in cfg.eval_stages()]
    if unknown := [s for s in sets if s not in names]:
        raise RatchetError(f"--set {' '.join(unknown)}: not a held-out set of this config, which has "
                           f"{', '.join(names)}; add one with evaluate.sets=[..., {{name: NAME, data: {{kind: file, "
                           "path: FILE}}]")
    store, tracker = _store(chosen), _reading(chosen)
    number = version_number(tracker, version)
    said = made_by(tracker, number, run)
    say(said)
    policy = version_manifest(store, tracker, number)
    store.verify(policy)
    split, held = check_data(cfg)
    at = At(cfg, store, None, 0, with_sets(split, held).digests)

    class Steps:  # flows/shape.py held_out's steps: each stage made (or read) here, recorded for no run
        @staticmethod
        def run(stage, k, *inputs):
            return stage.call(at, k, *inputs)[0]

    prompts = Steps.run(prepare.PROMPTS, 0)
    out = []
    for target in held_out(cfg, Steps, prompts, set(sets)):  # the sets asked for: no other set's prompts made
        say(f"evaluating version {number} on {target.name} ...")
        m, reused = evaluating.STAGE.call(at, policy.round, policy, target)
        out.append(SetAccuracy(target.name, m.metrics["accuracy"], int(m.metrics.get("eval_prompts", 0)), m.dir,
                               reused, m.wall_s))
    return Evaluation(number, said, policy.dir, out)


@dataclass(frozen=True)
class Exported:
    model: str  # the MLflow registered model
    version: str
    made_by: str
    path: Path  # a plain Hugging Face model directory, with a lineage card


def export(where: Where, version: str, out: str | Path, overrides: list[str] | tuple[str, ...] = (), *,
           workdir: str | Path | None = None, run: str | None = None) -> Exported:
    """`ratchet export`: a registered version (N, 'champion', models:/NAME/N) as a plain Hugging
    Face model directory `out`, with a card that gives its lineage."""
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.lineage import export as export_version

    chosen = _chosen(where, overrides, workdir, run, need=False)
    tracker = _tracker(chosen)
    number = version_number(tracker, version)
    said = made_by(tracker, number, run)
    return Exported(tracker.model_name, number, said,
                    export_version(ArtifactStore(chosen.workdir), tracker, number, Path(out)))
