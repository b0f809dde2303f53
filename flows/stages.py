"""What the flow tracks of the stages it runs: a stage's records on MLflow (`StoreTracker.record`,
which each stage's Prefect task hands its result to: tasks/runner/declare.py), and the tasks
that are not stages: the start of a continuation, the agreement gate, the registration of a
round's model and its champion gate, dropping merged weights, the lineage and the report.

A task gets the pipeline config, the run context and manifests, and returns a manifest:
datasets and weights never travel through Prefect. A reused stage ends its task in a
Completed state named "Cached".
"""

from __future__ import annotations

import functools
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import events
from ratchet.data.digest import sha256_json
from ratchet.data.errors import RatchetError
from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.flows.config import PipelineConfig
from ratchet.flows.runs import RunContext
from ratchet.flows.tracking import Gate, SetScore, Tracker, TrackingError
from ratchet.tasks import evaluate, registry
from ratchet.tasks.evaluate import EvalTarget
from ratchet.tasks.label_kinds.precision import said as said_precision
from ratchet.tasks.runner.declare import At, Stage, finished


class RoundResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    round: int
    policy: StageManifest
    version: str
    accuracy: float = Field(description="held-out accuracy on the gate's set (evaluate.gate)")
    eval_set: str = ""
    accuracies: dict[str, float] = Field(default={}, description="held-out accuracy on every set, by name")
    gate_set: str = Field(default="", description="the set `accuracy` is on")
    promoted: bool = Field(description="the registry's promotion decision for this version")
    gate: str = ""
    child_run_id: str
    stage_wall_s: dict[str, float] = {}
    agreement: str = Field(default="", description="the agreement gate's note on this round's labels")
    scored: StageManifest | None = Field(default=None, description="the stage holding the round's samples with "
                                         "their rewards (its label stage, or its online train stage), which "
                                         "data.retire_solved and the curriculum read")
    evaluations: dict[str, StageManifest] = Field(default={}, description="its evaluation stages by held-out "
                                                  "set (the curriculum reads its level's)")
    voters: list[StageManifest] = Field(default=[], description="the models trained beside it that a vote across "
                                        "models asks with it (label.kind=vote)")


class StoreTracker:
    """What the flow's tasks work with, opened once: the run's config and context, its store and its
    tracker (made when first used). A stage's Prefect task hands it what the stage made (`record`)."""

    def __init__(self, cfg: PipelineConfig, ctx: RunContext):
        self.cfg, self.ctx = cfg, ctx

    @functools.cached_property
    def store(self) -> ArtifactStore:
        return ArtifactStore(Path(self.ctx.workdir))

    @functools.cached_property
    def at(self) -> At:
        """Where the stages are called from: this run, its store, and what it checked of its data."""
        return At(self.cfg, self.store, self.ctx.run_name, self.ctx.pool_start, self.ctx.sources)

    @functools.cached_property
    def tracker(self) -> Tracker:
        return Tracker(self.cfg.tracking, Path(self.ctx.workdir), self.cfg.name)

    def record(self, stage: Stage, m: StageManifest, reused: bool, k: int, child: str | None) -> None:
        """What a stage's declaration says it records (its `records`), on the round's MLflow run
        (`child`) or the run's parent: its metrics once per run, its worker's log as
        `logs/<stage>.log`, its datasets, artifacts and training curve, and metrics again on the
        parent at step k."""
        rec, t, store = stage.records, self.tracker, self.store
        parent = self.ctx.parent_run_id
        on = parent if rec.on == "run" or child is None else child
        if rec.on == "none" or not t.log_stage(on, m, reused):
            return
        suffix = m.stage.partition(".")[2]  # one of several: the held-out set it is for
        if rec.log and (log := store.dir_of(m) / events.STAGE_LOG).exists():
            t.log_file(on, log, f"logs/{m.stage}.log")
        for name, context in rec.datasets:
            if name in m.outputs:
                t.log_dataset(on, store, m, name, context.format(suffix=suffix))
        for name in rec.artifacts:
            if name in m.outputs:
                t.client.log_artifact(on, str(store.path(m, name)), artifact_path=rec.artifact_path)
        if rec.curve:
            t.log_train_curve(on, store, m)
        if rec.metrics:
            t.log_metrics(parent, {x: m.metrics[x] for x in rec.metrics if x in m.metrics},
                          prefix=f"{rec.prefix}{suffix}." if suffix else rec.prefix, step=k)


def unwrap(x):
    """A task's manifest, out of the Completed "Cached" state a reused stage's task returns."""
    from prefect.client.schemas.objects import State

    return x.result() if isinstance(x, State) else x


@task(name="start-model", cache_policy=NONE, retries=0)
def start_model_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    """The registered model version this run continues from, its stage re-verified."""
    ses = StoreTracker(cfg, ctx)
    m = start_manifest(ses.store, ses.tracker, ctx.start_version)
    return finished(m, True)


def start_manifest(store: ArtifactStore, tracker: Tracker, version: str) -> StageManifest:
    """The stage behind a registered version, re-verified: what a continuation starts from."""
    from ratchet.flows.lineage import version_manifest

    m = version_manifest(store, tracker, version)
    store.verify(m)
    return m


@task(name="agreement", cache_policy=NONE, retries=0)
def agreement_task(cfg: PipelineConfig, ctx: RunContext, k: int, labels: StageManifest, train_set: StageManifest,
                   child: str) -> str:
    """The agreement gate (tasks/agreement.py), before training: raises LabelDisagreesError to stop
    the round, or returns its note, which goes on the round's MLflow run and to the console."""
    from ratchet.tasks import agreement

    ses = StoreTracker(cfg, ctx)
    t = ses.tracker
    try:
        verdict = agreement.check(cfg.agreement, cfg.label.title(), k, labels.metrics, train_set.metrics)
    except agreement.LabelDisagreesError as e:
        t.client.set_tag(child, "ratchet.agreement", str(e)[:5000])
        raise
    if verdict.note:
        t.client.set_tag(child, "ratchet.agreement", verdict.note)
        if verdict.value is not None:
            t.log_metrics(child, {"value": verdict.value, "passed": float(verdict.value >= cfg.agreement.min)},
                          prefix="agreement.", step=k)
        events.emit(events.Event("note", round=k, stage="agreement", data={"text": verdict.note}))
    return verdict.note


@task(name="register", cache_policy=NONE, retries=0)
def register_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest,
                  evaluations: list[StageManifest], targets: list[EvalTarget], parent_version: str | None,
                  child: str, stages: list[StageManifest], agreement: str = "",
                  voters: list[StageManifest] = ()) -> RoundResult:
    """Register the round's model, record its accuracy on every held-out set (`evaluations`, one
    per target), and put it to the champion gate; the round table reports the decision the
    registry holds. `voters`: the models trained beside it for a vote across models, each
    registered too, as a version that votes beside it (no gate: only the policy is evaluated)."""
    ses = StoreTracker(cfg, ctx)
    store, t = ses.store, ses.tracker
    scores = [SetScore(name=x.name, eval_set=m.info["eval_set"], accuracy=m.metrics["accuracy"])
              for x, m in zip(targets, evaluations, strict=True)]
    gated = next(s for s in scores if s.name == cfg.evaluate.gate_set)
    acc, eval_set = gated.accuracy, gated.eval_set
    data_digests = {p.stage: p.content for p in policy.parents}
    tags = {
        "ratchet.round": str(k), "ratchet.run": ctx.run_name, "ratchet.accuracy": f"{acc:.6f}",
        "ratchet.eval_set": eval_set, "ratchet.parent_version": parent_version or "",
        "ratchet.config_hash": ctx.config_hash, "ratchet.code_version": ctx.code_version,
        "ratchet.data_digests": sha256_json(data_digests), **{f"ratchet.digest.{s}": d for s, d in data_digests.items()},
    }
    gated_eval = next(m for x, m in zip(targets, evaluations) if x.name == gated.name)
    if dtype := gated_eval.info.get("dtype"):  # what the held-out answers were generated in, beside the figure
        tags["ratchet.eval_dtype"] = dtype
    if len(scores) > 1:  # which eval set each name stood for, so a table of accuracies can be read later
        tags["ratchet.eval_sets"] = ", ".join(f"{s.name}={s.eval_set}" for s in scores)
        tags["ratchet.gate_set"] = gated.name
    said = {k_: v for m in stages if (st := registry.of(m.stage)) is not None for k_, v in st.tags(m).items()}
    tags.update(said)  # what the round's stages say of its model: its prompts, its level
    level = int(said["ratchet.level"]) if "ratchet.level" in said else None
    if agreement:
        tags["ratchet.agreement"] = agreement
    if measured := label_precision(cfg, store, stages):  # of the labels it made itself, by references it never read
        t.log_metrics(child, measured, prefix="label.", step=k)
        events.emit(events.Event("note", round=k, stage="label", data={"text": said_precision(measured)}))
    version = t.register(child, store, policy, tags)
    for m, voter in enumerate(voters, 1):
        t.register(child, store, voter, {"ratchet.round": str(k), "ratchet.run": ctx.run_name,
                                         "ratchet.voter": str(m), "ratchet.voter_of": version,
                                         "ratchet.config_hash": ctx.config_hash, "ratchet.code_version": ctx.code_version})
    for s in scores:
        t.record_accuracy(version, s.eval_set, s.accuracy)
    gate = champion_gate(ses, version, scores, targets)
    per_set = {f"accuracy.{s.name}": s.accuracy for s in scores} if len(scores) > 1 else {}
    if per_set:  # the report reads which of round.accuracy.<set> is the gate's
        t.client.set_tag(child, "ratchet.gate_set", gated.name)
    for tag, value in {**said, **({"ratchet.eval_dtype": dtype} if dtype else {})}.items():
        t.client.set_tag(child, tag, value)  # and on the round's run: the level the curriculum trained it at, ...
    t.log_once(child, "ratchet.model_version", version, {"accuracy": acc, "promoted": float(gate.promoted), **per_set},
               prefix="round.")
    accuracies = {s.name: s.accuracy for s in scores}
    events.emit(events.Event("round", round=k, data={"version": version, "accuracy": acc, "promoted": gate.promoted,
                                                     "gate": gate.reason, "parent_version": parent_version,
                                                     "sets": accuracies if len(scores) > 1 else {},
                                                     "gate_set": gated.name, "level": level, "dtype": dtype}))
    t.end(child)
    walls = {m.stage: m.wall_s for m in stages}
    return RoundResult(round=k, policy=policy, version=version, accuracy=acc, eval_set=eval_set,
                       accuracies=accuracies, gate_set=gated.name, promoted=gate.promoted, gate=gate.reason, child_run_id=child,
                       stage_wall_s=walls, agreement=agreement)


def label_precision(cfg: PipelineConfig, store: ArtifactStore, stages: list[StageManifest]) -> dict[str, float]:
    """Of the labels a round made itself at levels above data.labeled_levels, the share the hidden
    references call right, by level (tasks/label_kinds/precision.py); empty where every level is
    labeled or the round labeled nothing. Read from the source here, after the round: no stage
    sees the references."""
    if not cfg.data.unlabeled_levels():
        return {}
    from ratchet.data.prompts import references
    from ratchet.data.records import LabeledCompletion, read_jsonl
    from ratchet.tasks.label_kinds.precision import precision

    made = next((m for m in stages if "labels.jsonl" in m.outputs), None)
    if made is None:
        return {}
    rows = read_jsonl(store.path(made, "labels.jsonl"), LabeledCompletion)
    refs = references(cfg.data.pool(), cfg.seed)
    return precision(rows, refs, cfg.label.scores_with(cfg.data.check), cfg.label.reward_range()[1])


def champion_gate(ses: StoreTracker, version: str, scores: list[SetScore], targets: list[EvalTarget]) -> Gate:
    """The registry's promotion decision for `version`. A champion never evaluated on a set the
    gate reads (another split, another scoring) is evaluated there first, each as a stage."""
    from prefect import get_run_logger

    e, t, store = ses.cfg.evaluate, ses.tracker, ses.store
    for _ in range(5):  # the champion can move while it is being evaluated
        gate = t.promote_if_better(version, scores, e.gate_set, e.min_improvement, e.max_drop)
        if gate.needs_eval is None:
            return gate
        try:
            champ = start_manifest(store, t, gate.needs_eval)
        except RatchetError as err:
            get_run_logger().warning("version %s is not compared with the champion: %s", version, err)
            return Gate(promoted=False, reason=f"not decided: the champion (version {gate.needs_eval}) has no "
                        f"accuracy on held-out set(s) {', '.join(gate.needs_sets)} and cannot be evaluated here ({err})")
        for target in (x for x in targets if x.name in gate.needs_sets):
            get_run_logger().info("re-evaluating champion version %s on held-out set %s before comparing",
                                  gate.needs_eval, target.name)
            m, _ = evaluate.STAGE.call(ses.at, champ.round, champ, target)
            t.record_accuracy(gate.needs_eval, m.info["eval_set"], m.metrics["accuracy"])
    raise TrackingError(f"the champion of {t.model_name} moved five times while version {version} was being "
                        "compared with it; re-run the same command to decide")


@task(name="drop-models", cache_policy=NONE, retries=0)
def drop_task(cfg: PipelineConfig, ctx: RunContext, k: int) -> int:
    """`drop_models`: after round k is registered, drop the merged weights `ratchet gc --models`
    would (flows/gc.py drop_models); returns the bytes freed, also on the console."""
    from ratchet.flows.gc import drop_models

    ses = StoreTracker(cfg, ctx)
    freed = sum(x.bytes for x in drop_models(Path(ctx.workdir), ses.tracker) if x.remove)
    if freed:
        events.emit(events.Event("note", round=k, stage="drop", data={
            "text": f"{freed / 2**20:,.0f} MiB of merged weights dropped (drop_models), re-makeable from their adapters"}))
    return freed


@task(name="lineage", cache_policy=NONE, retries=0)
def lineage_task(cfg: PipelineConfig, ctx: RunContext, final: RoundResult) -> bool:
    """Write the final model's verified lineage to MLflow and as a Prefect artifact; True if all verified."""
    ses = StoreTracker(cfg, ctx)
    import json
    import re

    from prefect.artifacts import create_markdown_artifact

    from ratchet.flows.lineage import annotate, as_json, render_mermaid, render_text, walk

    store, t = ses.store, ses.tracker
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


@task(name="report", cache_policy=NONE, retries=0)
def report_task(cfg: PipelineConfig, ctx: RunContext) -> str | None:
    """The run's report (flows/report.py): PNGs and one HTML page under workdir/reports/RUN, on
    the MLflow parent run under `report/`, and its round table as a Prefect artifact. A report
    that cannot be drawn is a warning, not a failed run: every model is registered by now."""
    ses = StoreTracker(cfg, ctx)
    import re

    from prefect import get_run_logger
    from prefect.artifacts import create_markdown_artifact

    from ratchet.flows.report import build, markdown

    try:
        report = build(Path(ctx.workdir), ses.tracker, ctx.run_name, state="finished")
    except Exception as e:  # noqa: BLE001 - reported, and the run's results stand
        get_run_logger().warning("the run's report could not be written: %s: %s", type(e).__name__, e)
        return None
    key = re.sub(r"[^a-z0-9-]+", "-", f"report-{cfg.name}".lower()).strip("-")
    create_markdown_artifact(markdown=markdown(report), key=key, description=f"{ctx.run_name}: rounds and report")
    events.emit(events.Event("report", data={"html": str(report.html)}))
    return str(report.html)
