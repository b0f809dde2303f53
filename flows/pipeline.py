"""The self_improve flow: round 0 evaluates the starting model, then each round
samples -> labels -> filters -> trains -> evaluates, and registers the result.

    ratchet run flows/configs/default.yaml
    ratchet run flows/configs/default.yaml --from champion   rounds on top of the champion

A run that continues from a registered model version numbers its rounds on from that
model's round (rounds count generations); `continue_improve` is the flow a scheduled
deployment runs (flows/schedule.py).

Prefect shows one subflow per round and one task per stage. Stages exchange
manifests only; heavy stages run in worker processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from prefect import flow, task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.digest import sha256_json
from ratchet.data.errors import ConfigError, RatchetError
from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.data.prompts import Split
from ratchet.flows.config import PipelineConfig
from ratchet.flows.inputs import check_inputs, resolve_model
from ratchet.flows.tracking import Gate, Tracker, TrackingError
from ratchet.tasks import evaluate as evaluate_mod
from ratchet.tasks import filter as filter_mod
from ratchet.tasks import label as label_mod
from ratchet.tasks import prepare, sample as sample_mod, train as train_mod
from ratchet.tasks.stage import code_version


class RunContext(BaseModel):
    """What every task needs to find the store and the MLflow runs; small and serialisable."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    run_name: str
    workdir: str
    parent_run_id: str
    code_version: str
    config_hash: str
    start_version: str | None = None  # continue from this registered model version instead of the base model
    sources: dict[str, str] = {}  # content digest of every data file the config reads, as checked at start


class RoundResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    round: int
    policy: StageManifest
    version: str
    accuracy: float
    eval_set: str = ""
    promoted: bool = Field(description="the registry's promotion decision for this version")
    gate: str = ""
    child_run_id: str
    stage_wall_s: dict[str, float] = {}


def code_digest() -> str:
    return code_version(*[f"ratchet.{pkg}.{p.stem}" for pkg in ("data", "models", "tasks", "flows")
                          for p in sorted((Path(__file__).parents[1] / pkg).glob("*.py")) if p.stem != "__init__"])


def git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[1], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _store(ctx: RunContext) -> ArtifactStore:
    return ArtifactStore(Path(ctx.workdir))


def _tracker(cfg: PipelineConfig, ctx: RunContext) -> Tracker:
    return Tracker(cfg.tracking, Path(ctx.workdir), cfg.name)


def _round_seed(cfg: PipelineConfig, k: int) -> int:
    return cfg.seed * 1000 + k


# tasks: one call each, then tracking ----------------------------------------

def _finished(m: StageManifest, reused: bool):
    """A reused stage ends its Prefect task in a Completed state named "Cached".

    The cache is the artifact store, keyed by stage + code version + config slice +
    input digests and verified on every hit; Prefect's own cache policies (which
    include the flow run) are off. Callers unwrap the state with `_value`.
    """
    if not reused:
        return m
    from prefect.states import Completed

    return Completed(name="Cached", data=m, message=f"{m.stage} reused from {m.dir} (key {m.key[:16]}, verified)")


def _value(x):
    from prefect.client.schemas.objects import State

    return x.result() if isinstance(x, State) else x


@task(name="prompts", cache_policy=NONE, retries=0)
def prompts_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    m, reused = prepare.prompts(_store(ctx), cfg.data.model_dump(), cfg.seed, ctx.sources, run=ctx.run_name)
    t = _tracker(cfg, ctx)
    if t.log_stage(ctx.parent_run_id, m, reused):
        t.log_dataset(ctx.parent_run_id, _store(ctx), m, "train.jsonl", "train-prompts")
        t.log_dataset(ctx.parent_run_id, _store(ctx), m, "eval.jsonl", "eval-prompts")
    return _finished(m, reused)


@task(name="base-model", cache_policy=NONE, retries=0)
def base_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    return _finished(*prepare.base_model(_store(ctx), cfg.model.path, resolve_model(cfg.model.path),
                                         run=ctx.run_name))


@task(name="start-model", cache_policy=NONE, retries=0)
def start_model_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    """The registered model version this run continues from, its stage re-verified."""
    m = start_manifest(_store(ctx), _tracker(cfg, ctx), ctx.start_version)
    return _finished(m, True)


def start_manifest(store: ArtifactStore, tracker: Tracker, version: str) -> StageManifest:
    """The stage behind a registered version, re-verified: what a continuation starts from."""
    from ratchet.flows.lineage import version_manifest

    m = version_manifest(store, tracker, version)
    store.verify(m)
    return m


@task(name="sample", cache_policy=NONE, retries=0)
def sample_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
                child: str) -> StageManifest:
    m, reused = sample_mod.sample(_store(ctx), policy, prompts, cfg.sample, cfg.sampler, _round_seed(cfg, k), k,
                                  isolate=cfg.isolate, run=ctx.run_name)
    t = _tracker(cfg, ctx)
    if t.log_stage(child, m, reused):
        t.log_dataset(child, _store(ctx), m, "samples.jsonl", "samples")
    return _finished(m, reused)


@task(name="label", cache_policy=NONE, retries=0)
def label_task(cfg: PipelineConfig, ctx: RunContext, k: int, samples: StageManifest, policy: StageManifest,
               child: str) -> StageManifest:
    store = _store(ctx)
    m, reused = label_mod.label(store, samples, cfg.label, cfg.data.model_dump(), k, policy=policy,
                                sampler=cfg.sampler.model_dump(), seed=_round_seed(cfg, k), isolate=cfg.isolate,
                                run=ctx.run_name)
    t = _tracker(cfg, ctx)
    if t.log_stage(child, m, reused) and "trees.jsonl" in m.outputs:  # the search trees, for inspection
        t.client.log_artifact(child, str(store.path(m, "trees.jsonl")), artifact_path="label")
    return _finished(m, reused)


@task(name="filter", cache_policy=NONE, retries=0)
def filter_task(cfg: PipelineConfig, ctx: RunContext, k: int, labels: StageManifest, child: str) -> StageManifest:
    m, reused = filter_mod.filter_rows(_store(ctx), labels, cfg.filter, _round_seed(cfg, k), k, run=ctx.run_name)
    t = _tracker(cfg, ctx)
    if t.log_stage(child, m, reused):
        t.log_dataset(child, _store(ctx), m, "train_set.jsonl", "training")
    return _finished(m, reused)


@task(name="train", cache_policy=NONE, retries=0)
def train_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, train_set: StageManifest,
               child: str) -> StageManifest:
    store = _store(ctx)
    m, reused = train_mod.train(store, policy, train_set, cfg.train, _round_seed(cfg, k), k, isolate=cfg.isolate,
                                run=ctx.run_name)
    t = _tracker(cfg, ctx)
    if t.log_stage(child, m, reused):
        t.log_train_curve(child, store, m)
    return _finished(m, reused)


@task(name="evaluate", cache_policy=NONE, retries=0)
def evaluate_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
                  child: str) -> StageManifest:
    m, reused = evaluate_mod.evaluate(_store(ctx), policy, prompts, cfg.evaluate, cfg.sampler, cfg.data.model_dump(),
                                      cfg.seed, k, isolate=cfg.isolate, run=ctx.run_name)
    t = _tracker(cfg, ctx)
    if t.log_stage(child, m, reused):
        t.log_metrics(ctx.parent_run_id, {"accuracy": m.metrics["accuracy"]}, prefix="eval.", step=k)
    return _finished(m, reused)


@task(name="register", cache_policy=NONE, retries=0)
def register_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, evaluation: StageManifest,
                  prompts: StageManifest, parent_version: str | None, child: str,
                  stages: list[StageManifest]) -> RoundResult:
    """Register the round's model, record its accuracy on this eval set, and put it to the
    champion gate; the round table reports the decision the registry holds."""
    store, t = _store(ctx), _tracker(cfg, ctx)
    acc, eval_set = evaluation.metrics["accuracy"], evaluation.info["eval_set"]
    data_digests = {p.stage: p.content for p in policy.parents}
    tags = {
        "ratchet.round": str(k), "ratchet.run": ctx.run_name, "ratchet.accuracy": f"{acc:.6f}",
        "ratchet.eval_set": eval_set, "ratchet.parent_version": parent_version or "",
        "ratchet.config_hash": ctx.config_hash, "ratchet.code_version": ctx.code_version,
        "ratchet.data_digests": sha256_json(data_digests), **{f"ratchet.digest.{s}": d for s, d in data_digests.items()},
    }
    version = t.register(child, store, policy, tags)
    t.record_accuracy(version, eval_set, acc)
    gate = champion_gate(cfg, ctx, t, store, version, acc, eval_set, prompts)
    t.log_once(child, "ratchet.model_version", version, {"accuracy": acc, "promoted": float(gate.promoted)},
               prefix="round.")
    t.end(child)
    walls = {m.stage: m.wall_s for m in stages}
    return RoundResult(round=k, policy=policy, version=version, accuracy=acc, eval_set=eval_set,
                       promoted=gate.promoted, gate=gate.reason, child_run_id=child, stage_wall_s=walls)


def champion_gate(cfg: PipelineConfig, ctx: RunContext, t: Tracker, store: ArtifactStore, version: str, acc: float,
                  eval_set: str, prompts: StageManifest) -> Gate:
    """The registry's promotion decision for `version`. A champion never evaluated on this
    eval set (another split, another scoring) is evaluated here first, as a stage of its own."""
    from prefect import get_run_logger

    for _ in range(5):  # the champion can move while it is being evaluated
        gate = t.promote_if_better(version, acc, eval_set, cfg.evaluate.min_improvement)
        if gate.needs_eval is None:
            return gate
        try:
            champ = start_manifest(store, t, gate.needs_eval)
        except RatchetError as e:
            get_run_logger().warning("version %s is not compared with the champion: %s", version, e)
            return Gate(promoted=False, reason=f"not decided: the champion (version {gate.needs_eval}) has no "
                        f"accuracy on eval set {eval_set} and cannot be evaluated here ({e})")
        get_run_logger().info("re-evaluating champion version %s on eval set %s before comparing", gate.needs_eval,
                              eval_set)
        m, _ = evaluate_mod.evaluate(store, champ, prompts, cfg.evaluate, cfg.sampler, cfg.data.model_dump(),
                                     cfg.seed, champ.round, isolate=cfg.isolate, run=ctx.run_name)
        t.record_accuracy(gate.needs_eval, m.info["eval_set"], m.metrics["accuracy"])
    raise TrackingError(f"the champion of {t.model_name} moved five times while version {version} was being "
                        "compared with it; re-run the same command to decide")


@task(name="lineage", cache_policy=NONE, retries=0)
def lineage_task(cfg: PipelineConfig, ctx: RunContext, final: RoundResult) -> bool:
    """Write the final model's verified lineage to MLflow and as a Prefect artifact; True if all verified."""
    import json
    import re

    from prefect.artifacts import create_markdown_artifact

    from ratchet.flows.lineage import annotate, as_json, render_mermaid, render_text, walk

    store, t = _store(ctx), _tracker(cfg, ctx)
    links = walk(store, final.policy)
    annotate(links, t)
    text, mermaid = render_text(links), render_mermaid(links)
    origin = f"continued from version {ctx.start_version}" if ctx.start_version else "from the base model"
    md = (f"# Lineage of {t.model_name} version {final.version}\n\n{ctx.run_name}: {cfg.rounds} round(s) "
          f"{origin}.\n\n```mermaid\n{mermaid}\n```\n\n```\n{text}\n```\n")
    t.log_text(ctx.parent_run_id, md, "lineage/lineage.md")
    t.log_text(ctx.parent_run_id, json.dumps(as_json(links), indent=2), "lineage/lineage.json")
    key = re.sub(r"[^a-z0-9-]+", "-", f"lineage-{cfg.name}".lower()).strip("-")
    create_markdown_artifact(markdown=md, key=key, description=f"{ctx.run_name}: lineage of the final model")
    return all(x.verified for x in links)


# flows ----------------------------------------------------------------------

@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
def round_flow(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
               parent_version: str) -> RoundResult:
    child = _tracker(cfg, ctx).child(ctx.parent_run_id, k, {"ratchet.run": ctx.run_name})
    try:
        if cfg.label.kind == "mcts":  # the tree search samples its own rollouts from the prompts
            done = [labels := _value(label_task(cfg, ctx, k, prompts, policy, child))]
        else:
            samples = _value(sample_task(cfg, ctx, k, policy, prompts, child))
            done = [samples, labels := _value(label_task(cfg, ctx, k, samples, policy, child))]
        train_set = _value(filter_task(cfg, ctx, k, labels, child))
        candidate = _value(train_task(cfg, ctx, k, policy, train_set, child))
        evaluation = _value(evaluate_task(cfg, ctx, k, candidate, prompts, child))
        return register_task(cfg, ctx, k, candidate, evaluation, prompts, parent_version, child,
                             [*done, train_set, candidate, evaluation])
    except BaseException:
        _tracker(cfg, ctx).end(child, "FAILED")
        raise


@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
def round_zero(cfg: PipelineConfig, ctx: RunContext, base: StageManifest, prompts: StageManifest,
               k: int = 0) -> RoundResult:
    """The starting model's held-out accuracy: the bar the next round must clear. k is the
    starting model's generation: 0 for the base model, the round that trained it otherwise."""
    child = _tracker(cfg, ctx).child(ctx.parent_run_id, k, {"ratchet.run": ctx.run_name})
    try:
        evaluation = _value(evaluate_task(cfg, ctx, k, base, prompts, child))
        return register_task(cfg, ctx, k, base, evaluation, prompts, None, child, [evaluation])
    except BaseException:
        _tracker(cfg, ctx).end(child, "FAILED")
        raise


@flow(name="self_improve", flow_run_name="{cfg.name}", validate_parameters=False)
def self_improve(cfg: PipelineConfig, ctx: RunContext) -> list[RoundResult]:
    prompts = _value(prompts_task(cfg, ctx))
    base = _value(start_model_task(cfg, ctx) if ctx.start_version else base_task(cfg, ctx))
    first = base.round if ctx.start_version else 0  # rounds count generations: a continuation numbers on
    results = [round_zero(cfg, ctx, base, prompts, first)]
    for k in range(first + 1, first + cfg.rounds + 1):
        last = results[-1]
        results.append(round_flow(cfg, ctx, k, last.policy, prompts, last.version))
    lineage_task(cfg, ctx, results[-1])
    return results


class RunRecord(BaseModel):
    """What `ratchet resume` needs: the context and the exact config of a pipeline run, and
    how its last attempt ended (running while an attempt is alive or was killed)."""

    model_config = ConfigDict(extra="forbid")
    ctx: RunContext
    config: dict
    state: Literal["running", "finished", "failed"] = "running"


def run_name_for(cfg: PipelineConfig, sources: dict[str, str]) -> str:
    """A pipeline run is its config and its data: the same command on the same files names the
    same run, so it continues it; an edited data file starts a new one."""
    return f"{cfg.name}-{sha256_json([cfg.model_dump(mode='json'), sources])[:10]}"


def load_record(workdir: Path, run_name: str) -> RunRecord:
    p = workdir / "runs" / f"{run_name}.json"
    if not p.exists():
        known = sorted(x.stem for x in (workdir / "runs").glob("*.json")) if (workdir / "runs").is_dir() else []
        raise ConfigError([f"no pipeline run {run_name!r} in {workdir / 'runs'}; known runs: {known or 'none'}"])
    return RunRecord.model_validate_json(p.read_text())


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


def start(cfg: PipelineConfig, start_from: str | None = None, split: Split | None = None
          ) -> tuple[RunContext, Tracker]:
    """The run's context: continue the MLflow parent run of an earlier attempt of the same
    config and data (and the same starting model version) in this workdir, or create one.
    Finished stages are reused either way. The data is checked first (`split`, if the caller
    already checked it): a problem stops the run before anything is written."""
    if split is None:
        split = check_inputs(cfg)
    workdir = Path(cfg.workdir).resolve()
    (workdir / "runs").mkdir(parents=True, exist_ok=True)
    tracker = Tracker(cfg.tracking, workdir, cfg.name)
    version = start_version(tracker, start_from)
    run_name = run_name_for(cfg, split.digests) + (f"-from-v{version}" if version else "")
    resolved = cfg.model_dump(mode="json")
    code, commit = code_digest(), git_commit()
    tags = {"ratchet.run": run_name, "ratchet.code_version": code, "ratchet.config_hash": sha256_json(resolved)[:16]}
    if version:
        tags["ratchet.start_version"] = version
    if commit:
        tags["mlflow.source.git.commit"] = commit
    record = workdir / "runs" / f"{run_name}.json"
    with tracker.lock():  # two processes starting the same run continue one parent run, never two
        parent = None
        if record.exists():
            parent = RunRecord.model_validate_json(record.read_text()).ctx.parent_run_id
            if not tracker.reopen(parent, tags):
                parent = None  # the tracking store was reset: start a fresh parent run
        if parent is None:
            parent = tracker.start_parent(run_name, resolved, tags)
        ctx = RunContext(run_name=run_name, workdir=str(workdir), parent_run_id=parent, code_version=code,
                         config_hash=tags["ratchet.config_hash"], start_version=version, sources=split.digests)
        write_record(workdir, RunRecord(ctx=ctx, config=resolved, state="running"))
    return ctx, tracker


def write_record(workdir: Path, record: RunRecord) -> None:
    path = workdir / "runs" / f"{record.ctx.run_name}.json"
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(path)


def set_state(ctx: RunContext, tracker: Tracker, state: str) -> None:
    """Record how the pipeline run ended (finished or failed) in its run record."""
    workdir = Path(ctx.workdir)
    with tracker.lock():
        rec = load_record(workdir, ctx.run_name)
        write_record(workdir, rec.model_copy(update={"state": state}))


def execute(cfg: PipelineConfig, start_from: str | None = None,
            ctx: RunContext | None = None) -> tuple[RunContext, list[RoundResult], Tracker]:
    """Run (or continue) a pipeline run to the end; the MLflow parent run ends FINISHED or FAILED."""
    if ctx is None:
        ctx, tracker = start(cfg, start_from)
    else:
        tracker = Tracker(cfg.tracking, Path(ctx.workdir), cfg.name)
    try:
        results = self_improve(cfg, ctx)
    except BaseException:
        tracker.end(ctx.parent_run_id, "FAILED")
        set_state(ctx, tracker, "failed")
        raise
    tracker.end(ctx.parent_run_id)
    set_state(ctx, tracker, "finished")
    return ctx, results, tracker


@flow(name="ratchet-continue", flow_run_name="continue-{start_from}", validate_parameters=False)
def continue_improve(config: dict, start_from: str = "champion", overrides: list[str] | None = None) -> dict:
    """What a scheduled deployment runs: `rounds` more rounds on top of the MLflow champion.

    `config` is the resolved pipeline config (absolute paths); `overrides` are dotted
    key=value changes for this run only (e.g. ["seed=7"] to draw fresh samples).
    A tick whose champion, data and config have not changed is the same pipeline run
    as the last one and reuses all of its work.
    """
    from prefect import get_run_logger

    from ratchet.flows.config import config_from_dict

    cfg = config_from_dict(config, overrides or [], source="deployment parameters")
    ctx, results, tracker = execute(cfg, start_from)
    champ = tracker.champion()
    summary = {
        "run": ctx.run_name, "start_version": ctx.start_version,
        "rounds": [{"round": r.round, "version": r.version, "accuracy": r.accuracy, "promoted": r.promoted}
                   for r in results],
        "champion": champ,
    }
    get_run_logger().info("%s from %s: %s", ctx.run_name, f"version {ctx.start_version}" if ctx.start_version
                          else "the base model", summary)
    return summary
