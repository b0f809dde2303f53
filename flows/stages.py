"""The stage tasks of a round: one Prefect task per stage, each a call into tasks/ and then
its tracking (metrics, datasets and artifacts on the round's MLflow run), plus the task
that registers the round's model and puts it to the champion gate.

A task gets the pipeline config, the run context and manifests, and returns a manifest:
datasets and weights never travel through Prefect. A reused stage ends its task in a
Completed state named "Cached".
"""

from __future__ import annotations

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
from ratchet.flows.inputs import resolve_model
from ratchet.flows.runs import RunContext
from ratchet.flows.tracking import Gate, Tracker, TrackingError
from ratchet.tasks import evaluate as evaluate_mod
from ratchet.tasks import filter as filter_mod
from ratchet.tasks import label as label_mod
from ratchet.tasks import prepare, sample as sample_mod, train as train_mod


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
    agreement: str = Field(default="", description="the agreement gate's note on this round's labels")


def store_of(ctx: RunContext) -> ArtifactStore:
    return ArtifactStore(Path(ctx.workdir))


def tracker_of(cfg: PipelineConfig, ctx: RunContext) -> Tracker:
    return Tracker(cfg.tracking, Path(ctx.workdir), cfg.name)


def logged(t: Tracker, child: str, store: ArtifactStore, m: StageManifest, reused: bool) -> bool:
    """Log a stage's metrics on the round's run (once), and its worker's log as `logs/<stage>.log`."""
    if not t.log_stage(child, m, reused):
        return False
    log = store.dir_of(m) / events.STAGE_LOG
    if log.exists():
        t.log_file(child, log, f"logs/{m.stage}.log")
    return True


def round_seed(cfg: PipelineConfig, k: int) -> int:
    return cfg.seed * 1000 + k


def finished(m: StageManifest, reused: bool):
    """A reused stage ends its Prefect task in a Completed state named "Cached".

    The cache is the artifact store, keyed by stage + code version + config slice +
    input digests and verified on every hit; Prefect's own cache policies (which
    include the flow run) are off. Callers unwrap the state with `unwrap`.
    """
    if not reused:
        return m
    from prefect.states import Completed

    return Completed(name="Cached", data=m, message=f"{m.stage} reused from {m.dir} (key {m.key[:16]}, verified)")


def unwrap(x):
    from prefect.client.schemas.objects import State

    return x.result() if isinstance(x, State) else x


@task(name="prompts", cache_policy=NONE, retries=0)
def prompts_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    m, reused = prepare.prompts(store_of(ctx), cfg.data.pool(), cfg.seed, ctx.sources, run=ctx.run_name)
    t = tracker_of(cfg, ctx)
    if t.log_stage(ctx.parent_run_id, m, reused):
        t.log_dataset(ctx.parent_run_id, store_of(ctx), m, "train.jsonl", "train-prompts")
        t.log_dataset(ctx.parent_run_id, store_of(ctx), m, "eval.jsonl", "eval-prompts")
    return finished(m, reused)


@task(name="slice", cache_policy=NONE, retries=0)
def slice_task(cfg: PipelineConfig, ctx: RunContext, k: int, first: int, prompts: StageManifest,
               child: str) -> StageManifest:
    """Round k's train prompts: the next data.prompts_per_round of the pool's stream (this run
    starts at ctx.pool_start; its first round is first + 1)."""
    count = cfg.data.prompts_per_round
    m, reused = prepare.round_prompts(store_of(ctx), prompts, ctx.pool_start + (k - first - 1) * count, count,
                                      cfg.seed, k, run=ctx.run_name)
    t = tracker_of(cfg, ctx)
    if t.log_stage(child, m, reused):
        t.log_dataset(child, store_of(ctx), m, "train.jsonl", "round-prompts")
        t.client.set_tag(child, "ratchet.prompts", m.info["summary"])
    return finished(m, reused)


@task(name="base-model", cache_policy=NONE, retries=0)
def base_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    return finished(*prepare.base_model(store_of(ctx), cfg.model.path, resolve_model(cfg.model.path),
                                         run=ctx.run_name))


@task(name="label-model", cache_policy=NONE, retries=0)
def label_model_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    """The label's own fixed model (a judge or a reward model, label.model) as a store stage."""
    src = label_mod.kind_of(cfg.label).fixed_model(cfg.label)
    return finished(*prepare.base_model(store_of(ctx), src, resolve_model(src), run=ctx.run_name,
                                         stage="label-model", field="label.model"))


@task(name="start-model", cache_policy=NONE, retries=0)
def start_model_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    """The registered model version this run continues from, its stage re-verified."""
    m = start_manifest(store_of(ctx), tracker_of(cfg, ctx), ctx.start_version)
    return finished(m, True)


def start_manifest(store: ArtifactStore, tracker: Tracker, version: str) -> StageManifest:
    """The stage behind a registered version, re-verified: what a continuation starts from."""
    from ratchet.flows.lineage import version_manifest

    m = version_manifest(store, tracker, version)
    store.verify(m)
    return m


@task(name="sample", cache_policy=NONE, retries=0)
def sample_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
                child: str) -> StageManifest:
    m, reused = sample_mod.sample(store_of(ctx), policy, prompts, cfg.sample, cfg.sampler, round_seed(cfg, k), k,
                                  isolate=cfg.isolate, run=ctx.run_name, executor=cfg.executor)
    t = tracker_of(cfg, ctx)
    if logged(t, child, store_of(ctx), m, reused):
        t.log_dataset(child, store_of(ctx), m, "samples.jsonl", "samples")
    return finished(m, reused)


@task(name="label", cache_policy=NONE, retries=0)
def label_task(cfg: PipelineConfig, ctx: RunContext, k: int, source: StageManifest, policy: StageManifest,
               child: str, label_model: StageManifest | None = None) -> StageManifest:
    """Label the round's samples, or search from its prompts (a kind that consumes prompts);
    with the label's fixed model (`label_model`) where it has one, else the policy."""
    store = store_of(ctx)
    m, reused = label_mod.label(store, source, cfg.label, cfg.data.pool(), k, policy=label_model or policy,
                                sampler=cfg.sampler,
                                seed=round_seed(cfg, k), isolate=cfg.isolate, run=ctx.run_name,
                                executor=cfg.executor)
    t = tracker_of(cfg, ctx)
    if logged(t, child, store_of(ctx), m, reused) and "trees.jsonl" in m.outputs:  # the search trees, for inspection
        t.client.log_artifact(child, str(store.path(m, "trees.jsonl")), artifact_path="label")
    return finished(m, reused)


@task(name="filter", cache_policy=NONE, retries=0)
def filter_task(cfg: PipelineConfig, ctx: RunContext, k: int, labels: StageManifest, child: str) -> StageManifest:
    m, reused = filter_mod.filter_rows(store_of(ctx), labels, cfg.filter, round_seed(cfg, k), k, run=ctx.run_name)
    t = tracker_of(cfg, ctx)
    if logged(t, child, store_of(ctx), m, reused):
        t.log_dataset(child, store_of(ctx), m, "train_set.jsonl", "training")
    return finished(m, reused)


@task(name="agreement", cache_policy=NONE, retries=0)
def agreement_task(cfg: PipelineConfig, ctx: RunContext, k: int, labels: StageManifest, train_set: StageManifest,
                   child: str) -> str:
    """The agreement gate (tasks/agreement.py), before training: raises LabelDisagreesError to stop
    the round, or returns its note, which goes on the round's MLflow run and to the console."""
    from ratchet.tasks import agreement

    t = tracker_of(cfg, ctx)
    try:
        verdict = agreement.check(cfg.agreement, label_name(cfg), k, labels.metrics, train_set.metrics)
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


def label_name(cfg: PipelineConfig) -> str:
    """The round's label as a user configured it, in a few words."""
    return label_mod.kind_of(cfg.label).title(cfg.label)


@task(name="train", cache_policy=NONE, retries=0)
def train_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, train_set: StageManifest,
               child: str) -> StageManifest:
    store = store_of(ctx)
    m, reused = train_mod.train(store, policy, train_set, cfg.train, round_seed(cfg, k), k, isolate=cfg.isolate,
                                run=ctx.run_name)
    t = tracker_of(cfg, ctx)
    if logged(t, child, store_of(ctx), m, reused):
        t.log_train_curve(child, store, m)
    return finished(m, reused)


@task(name="evaluate", cache_policy=NONE, retries=0)
def evaluate_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
                  child: str) -> StageManifest:
    m, reused = evaluate_mod.evaluate(store_of(ctx), policy, prompts, cfg.evaluate, cfg.sampler, cfg.data.pool(), cfg.seed, k,
                                      isolate=cfg.isolate, run=ctx.run_name, executor=cfg.executor)
    t = tracker_of(cfg, ctx)
    if logged(t, child, store_of(ctx), m, reused):
        t.log_metrics(ctx.parent_run_id, {"accuracy": m.metrics["accuracy"]}, prefix="eval.", step=k)
    return finished(m, reused)


@task(name="register", cache_policy=NONE, retries=0)
def register_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, evaluation: StageManifest,
                  prompts: StageManifest, parent_version: str | None, child: str,
                  stages: list[StageManifest], agreement: str = "") -> RoundResult:
    """Register the round's model, record its accuracy on this eval set, and put it to the
    champion gate; the round table reports the decision the registry holds."""
    store, t = store_of(ctx), tracker_of(cfg, ctx)
    acc, eval_set = evaluation.metrics["accuracy"], evaluation.info["eval_set"]
    data_digests = {p.stage: p.content for p in policy.parents}
    tags = {
        "ratchet.round": str(k), "ratchet.run": ctx.run_name, "ratchet.accuracy": f"{acc:.6f}",
        "ratchet.eval_set": eval_set, "ratchet.parent_version": parent_version or "",
        "ratchet.config_hash": ctx.config_hash, "ratchet.code_version": ctx.code_version,
        "ratchet.data_digests": sha256_json(data_digests), **{f"ratchet.digest.{s}": d for s, d in data_digests.items()},
    }
    drawn = next((m for m in stages if m.stage == "slice"), None)
    if drawn is not None:
        tags["ratchet.prompts"] = drawn.info["summary"]
    if agreement:
        tags["ratchet.agreement"] = agreement
    version = t.register(child, store, policy, tags)
    t.record_accuracy(version, eval_set, acc)
    gate = champion_gate(cfg, ctx, t, store, version, acc, eval_set, prompts)
    t.log_once(child, "ratchet.model_version", version, {"accuracy": acc, "promoted": float(gate.promoted)},
               prefix="round.")
    events.emit(events.Event("round", round=k, data={"version": version, "accuracy": acc, "promoted": gate.promoted,
                                                     "gate": gate.reason, "parent_version": parent_version}))
    t.end(child)
    walls = {m.stage: m.wall_s for m in stages}
    return RoundResult(round=k, policy=policy, version=version, accuracy=acc, eval_set=eval_set,
                       promoted=gate.promoted, gate=gate.reason, child_run_id=child, stage_wall_s=walls,
                       agreement=agreement)


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
        m, _ = evaluate_mod.evaluate(store, champ, prompts, cfg.evaluate, cfg.sampler, cfg.data.pool(), cfg.seed,
                                     champ.round, isolate=cfg.isolate, run=ctx.run_name, executor=cfg.executor)
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

    store, t = store_of(ctx), tracker_of(cfg, ctx)
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
    import re

    from prefect import get_run_logger
    from prefect.artifacts import create_markdown_artifact

    from ratchet.flows.report import build, markdown

    try:
        report = build(Path(ctx.workdir), tracker_of(cfg, ctx), ctx.run_name, state="finished")
    except Exception as e:  # noqa: BLE001 - reported, and the run's results stand
        get_run_logger().warning("the run's report could not be written: %s: %s", type(e).__name__, e)
        return None
    key = re.sub(r"[^a-z0-9-]+", "-", f"report-{cfg.name}".lower()).strip("-")
    create_markdown_artifact(markdown=markdown(report), key=key, description=f"{ctx.run_name}: rounds and report")
    events.emit(events.Event("report", data={"html": str(report.html)}))
    return str(report.html)
