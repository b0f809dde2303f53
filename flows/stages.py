"""The stage tasks of a round: one Prefect task per stage, each a call into tasks/ and then
its tracking (metrics, datasets and artifacts on the round's MLflow run), plus the task
that registers the round's model and puts it to the champion gate.

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
from ratchet.flows.inputs import resolve_model, sources_of
from ratchet.flows.runs import RunContext
from ratchet.flows.shape import Calls, EvalTarget
from ratchet.flows.tracking import Gate, SetScore, Tracker, TrackingError
from ratchet.models.prompt_format import written_template
from ratchet.data.procs import forkserver
from ratchet.tasks import prepare
from ratchet.tasks.runner.stage import READS_MODELS


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
    evaluations: list[StageManifest] = Field(default=[], description="its evaluation stages (the curriculum reads "
                                             "its level's)")


class Session:
    """What one task works with, opened once: the run's config and context, its store and its
    tracker (made when first used)."""

    def __init__(self, cfg: PipelineConfig, ctx: RunContext):
        self.cfg, self.ctx = cfg, ctx

    @functools.cached_property
    def store(self) -> ArtifactStore:
        return ArtifactStore(Path(self.ctx.workdir))

    @functools.cached_property
    def calls(self) -> Calls:
        """Each stage's call into tasks/ (flows/shape.py), recorded for this run."""
        return Calls(self.cfg, self.store, self.ctx.run_name)

    @functools.cached_property
    def tracker(self) -> Tracker:
        return Tracker(self.cfg.tracking, Path(self.ctx.workdir), self.cfg.name)

    def logged(self, child: str, m: StageManifest, reused: bool) -> bool:
        """Log a stage's metrics on the round's run (once), and its worker's log as `logs/<stage>.log`."""
        if not self.tracker.log_stage(child, m, reused):
            return False
        log = self.store.dir_of(m) / events.STAGE_LOG
        if log.exists():
            self.tracker.log_file(child, log, f"logs/{m.stage}.log")
        return True


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
    ses = Session(cfg, ctx)
    m, reused = ses.calls.prompts(sources_of(ctx.sources))
    t = ses.tracker
    if t.log_stage(ctx.parent_run_id, m, reused):
        t.log_dataset(ctx.parent_run_id, ses.store, m, "train.jsonl", "train-prompts")
        t.log_dataset(ctx.parent_run_id, ses.store, m, "eval.jsonl", "eval-prompts")
    return finished(m, reused)


@task(name="slice", cache_policy=NONE, retries=0)
def slice_task(cfg: PipelineConfig, ctx: RunContext, k: int, first: int, prompts: StageManifest,
               child: str) -> StageManifest:
    """Round k's train prompts: the next data.prompts_per_round of the pool's stream (this run
    starts at ctx.pool_start; its first round is first + 1)."""
    ses = Session(cfg, ctx)
    m, reused = ses.calls.slice(k, first, ctx.pool_start, prompts)
    t = ses.tracker
    if t.log_stage(child, m, reused):
        t.log_dataset(child, ses.store, m, "train.jsonl", "round-prompts")
        t.client.set_tag(child, "ratchet.prompts", m.info["summary"])
    return finished(m, reused)


def _written_template(path: Path, fmt: str, layout: str) -> str | None:
    """prompt_format.written_template; for `auto`, which reads the model's tokenizer, in a child of
    the run's fork server: transformers imports torch, which the run's own process otherwise never does."""
    if fmt != "auto":  # no tokenizer read: nothing to fork for
        return written_template(path, fmt, layout)
    return forkserver.call(written_template, path, fmt, layout, after=READS_MODELS)


@task(name="base-model", cache_policy=NONE, retries=0)
def base_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    ses = Session(cfg, ctx)
    if (served := cfg.sampler.endpoint) is not None:  # the policy is served elsewhere: its identity, no weights
        return finished(*prepare.served_model(ses.store, served.base_url, served.model, run=ctx.run_name))
    path = resolve_model(cfg.model.path)
    template = _written_template(path, cfg.model.prompt_format, cfg.model.plain_layout)
    return finished(*prepare.base_model(ses.store, cfg.model.path, path, run=ctx.run_name, template=template))


@task(name="label-model", cache_policy=NONE, retries=0)
def label_model_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    """The label's own fixed model (a judge or a reward model, label.model) as a store stage."""
    ses = Session(cfg, ctx)
    src = cfg.label.fixed_model()
    path = resolve_model(src)
    template = _written_template(path, "auto", cfg.model.plain_layout) if cfg.label.chats else None
    return finished(*prepare.base_model(ses.store, src, path, run=ctx.run_name, stage="label-model",
                                         field="label.model", template=template))


@task(name="optimiser-model", cache_policy=NONE, retries=0)
def optimiser_model_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    """The search's optimiser model (prompt.search.optimiser.kind=model) as a store stage."""
    ses = Session(cfg, ctx)
    src = cfg.prompt.optimiser_model()
    path = resolve_model(src)
    return finished(*prepare.base_model(ses.store, src, path, run=ctx.run_name, stage="optimiser-model",
                                         field="prompt.search.optimiser.path",
                                         template=_written_template(path, "auto", cfg.model.plain_layout)))


@task(name="start-model", cache_policy=NONE, retries=0)
def start_model_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    """The registered model version this run continues from, its stage re-verified."""
    ses = Session(cfg, ctx)
    m = start_manifest(ses.store, ses.tracker, ctx.start_version)
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
    ses = Session(cfg, ctx)
    m, reused = ses.calls.sample(k, policy, prompts)
    t = ses.tracker
    if ses.logged(child, m, reused):
        t.log_dataset(child, ses.store, m, "samples.jsonl", "samples")
    return finished(m, reused)


@task(name="label", cache_policy=NONE, retries=0)
def label_task(cfg: PipelineConfig, ctx: RunContext, k: int, source: StageManifest, policy: StageManifest,
               child: str, label_model: StageManifest | None = None) -> StageManifest:
    """Label the round's samples, or search from its prompts (a kind that consumes prompts);
    with the label's fixed model (`label_model`) where it has one, else the policy."""
    ses = Session(cfg, ctx)
    store = ses.store
    m, reused = ses.calls.label(k, source, policy, label_model)
    t = ses.tracker
    if ses.logged(child, m, reused):
        for name in cfg.label.outputs:  # a kind's own files (the search trees), for inspection
            if name in m.outputs:
                t.client.log_artifact(child, str(store.path(m, name)), artifact_path="label")
    return finished(m, reused)


@task(name="filter", cache_policy=NONE, retries=0)
def filter_task(cfg: PipelineConfig, ctx: RunContext, k: int, labels: StageManifest, child: str) -> StageManifest:
    ses = Session(cfg, ctx)
    m, reused = ses.calls.filter(k, labels)
    t = ses.tracker
    if ses.logged(child, m, reused):
        t.log_dataset(child, ses.store, m, "train_set.jsonl", "training")
    return finished(m, reused)


@task(name="agreement", cache_policy=NONE, retries=0)
def agreement_task(cfg: PipelineConfig, ctx: RunContext, k: int, labels: StageManifest, train_set: StageManifest,
                   child: str) -> str:
    """The agreement gate (tasks/agreement.py), before training: raises LabelDisagreesError to stop
    the round, or returns its note, which goes on the round's MLflow run and to the console."""
    from ratchet.tasks import agreement

    ses = Session(cfg, ctx)
    t = ses.tracker
    try:
        verdict = ses.calls.agreement(k, labels, train_set)
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


@task(name="train", cache_policy=NONE, retries=0)
def train_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, train_set: StageManifest,
               child: str) -> StageManifest:
    ses = Session(cfg, ctx)
    store = ses.store
    m, reused = ses.calls.train(k, policy, train_set)
    t = ses.tracker
    if ses.logged(child, m, reused):
        t.log_train_curve(child, store, m)
    return finished(m, reused)


@task(name="train", cache_policy=NONE, retries=0)
def online_train_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
                      child: str, label_model: StageManifest | None = None) -> StageManifest:
    """An online train kind's stage (train.kind=grpo): it samples the round's prompts on the run's
    engine, scores them with the label kind (on its fixed model, `label_model`, if any) and trains,
    in one stage."""
    ses = Session(cfg, ctx)
    store = ses.store
    m, reused = ses.calls.online_train(k, policy, prompts, label_model)
    t = ses.tracker
    if ses.logged(child, m, reused):
        t.log_train_curve(child, store, m)
    return finished(m, reused)


@task(name="pool", cache_policy=NONE, retries=0)
def retire_task(cfg: PipelineConfig, ctx: RunContext, k: int, pool: StageManifest, scored: StageManifest) -> StageManifest:
    """Round k's pool (data.retire_solved): `pool` without the prompts every sample of the round
    before solved (`scored`); its counts on the run's MLflow parent, at step k."""
    ses = Session(cfg, ctx)
    m, reused = ses.calls.retire(k, pool, scored)
    if ses.tracker.log_stage(ctx.parent_run_id, m, reused):
        ses.tracker.log_metrics(ctx.parent_run_id, {k_: m.metrics[k_] for k_ in ("retired", "left")}, prefix="pool.",
                                step=k)
    return finished(m, reused)


@task(name="curriculum", cache_policy=NONE, retries=0)
def curriculum_task(cfg: PipelineConfig, ctx: RunContext, k: int, prompts: StageManifest,
                    before: StageManifest | None, last: RoundResult) -> StageManifest:
    """Round k's prompts and level (curriculum:), from the round before's; its level, band and
    choice on the run's MLflow parent, at step k."""
    ses = Session(cfg, ctx)
    m, reused = ses.calls.curriculum(k, prompts, before, last)
    if ses.tracker.log_stage(ctx.parent_run_id, m, reused):
        shown = ("level", "band", "unseen", "retried", "review", "advanced")
        ses.tracker.log_metrics(ctx.parent_run_id, {k_: v for k_, v in m.metrics.items() if k_ in shown},
                                prefix="curriculum.", step=k)
    return finished(m, reused)


@task(name="demonstrations", cache_policy=NONE, retries=0)
def demonstrations_task(cfg: PipelineConfig, ctx: RunContext) -> StageManifest:
    """The cold start's demonstrations (cold_start.demonstrations), as the run checked them."""
    from ratchet.flows.inputs import DEMOS

    ses = Session(cfg, ctx)
    m, reused = ses.calls.demonstrations(ctx.sources[DEMOS])
    if ses.tracker.log_stage(ctx.parent_run_id, m, reused):
        ses.tracker.log_dataset(ctx.parent_run_id, ses.store, m, "demonstrations.jsonl", "demonstrations")
    return finished(m, reused)


@task(name="search", cache_policy=NONE, retries=0)
def search_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
                child: str, optimiser: StageManifest | None = None) -> StageManifest:
    """Round k's search (prompt.search): the pair of the policy's weights and the text it chose."""
    ses = Session(cfg, ctx)
    m, reused = ses.calls.search(k, policy, prompts, optimiser)
    if ses.logged(child, m, reused):
        for name in ("nodes.jsonl", "refused.json", "versions.jsonl", "prompt.json"):  # the tree, or the beliefs
            if name in m.outputs:
                ses.tracker.client.log_artifact(child, str(ses.store.path(m, name)), artifact_path="search")
    return finished(m, reused)


@task(name="template", cache_policy=NONE, retries=0)
def bind_task(cfg: PipelineConfig, ctx: RunContext, k: int, weights: StageManifest, carried: StageManifest | None,
              child: str) -> StageManifest:
    """The pair of `weights` and a text: the config's prompt.template (version 1), or the text of
    `carried`, the pair the round trained under."""
    ses = Session(cfg, ctx)
    m, reused = ses.calls.bind(k, weights, carried)
    ses.logged(child, m, reused)
    return finished(m, reused)


@task(name="train", cache_policy=NONE, retries=0)
def cold_start_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, demos: StageManifest,
                    child: str) -> StageManifest:
    """Generation k's model (the first of the run): `policy` fine-tuned on the demonstrations."""
    ses = Session(cfg, ctx)
    m, reused = ses.calls.cold_start(k, policy, demos)
    if ses.logged(child, m, reused):
        ses.tracker.log_train_curve(child, ses.store, m)
    return finished(m, reused)


@task(name="held-out-sets", cache_policy=NONE, retries=0)
def eval_targets_task(cfg: PipelineConfig, ctx: RunContext, prompts: StageManifest) -> list[EvalTarget]:
    """Every held-out set of evaluate.sets: the task's own split (`prompts`), or a set's own
    prompts stage (`prompts.<name>`), logged on the parent run beside the task's."""
    ses = Session(cfg, ctx)
    t, out = ses.tracker, []
    for target, reused in ses.calls.held_out(prompts, ctx.sources):
        if reused is not None and t.log_stage(ctx.parent_run_id, target.prompts, reused):
            t.log_dataset(ctx.parent_run_id, ses.store, target.prompts, "eval.jsonl", f"eval-prompts-{target.name}")
        out.append(target)
    return out


@task(name="evaluate", cache_policy=NONE, retries=0, task_run_name="{target.stage}-r{k}")
def evaluate_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, target: EvalTarget,
                  child: str) -> StageManifest:
    ses = Session(cfg, ctx)
    m, reused = evaluate_on(ses, policy, target, k)
    t = ses.tracker
    if ses.logged(child, m, reused):
        prefix = "eval." if target.stage == "evaluate" else f"eval.{target.name}."
        t.log_metrics(ctx.parent_run_id, {"accuracy": m.metrics["accuracy"]}, prefix=prefix, step=k)
    return finished(m, reused)


def evaluate_on(ses: Session, policy: StageManifest, target: EvalTarget, k: int) -> tuple[StageManifest, bool]:
    return ses.calls.evaluate(k, policy, target)


@task(name="register", cache_policy=NONE, retries=0)
def register_task(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest,
                  evaluations: list[StageManifest], targets: list[EvalTarget], parent_version: str | None,
                  child: str, stages: list[StageManifest], agreement: str = "") -> RoundResult:
    """Register the round's model, record its accuracy on every held-out set (`evaluations`, one
    per target), and put it to the champion gate; the round table reports the decision the
    registry holds."""
    ses = Session(cfg, ctx)
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
    if len(scores) > 1:  # which eval set each name stood for, so a table of accuracies can be read later
        tags["ratchet.eval_sets"] = ", ".join(f"{s.name}={s.eval_set}" for s in scores)
        tags["ratchet.gate_set"] = gated.name
    drawn = next((m for m in stages if m.stage == "slice"), None)
    if drawn is not None:
        tags["ratchet.prompts"] = drawn.info["summary"]
    taught = next((m for m in stages if m.stage == "curriculum"), None)
    level = None if taught is None else int(taught.metrics["level"])
    if level is not None:
        tags["ratchet.level"] = str(level)
    if agreement:
        tags["ratchet.agreement"] = agreement
    version = t.register(child, store, policy, tags)
    for s in scores:
        t.record_accuracy(version, s.eval_set, s.accuracy)
    gate = champion_gate(ses, version, scores, targets)
    per_set = {f"accuracy.{s.name}": s.accuracy for s in scores} if len(scores) > 1 else {}
    if per_set:  # the report reads which of round.accuracy.<set> is the gate's
        t.client.set_tag(child, "ratchet.gate_set", gated.name)
    if level is not None:  # and the level the curriculum trained the round at
        t.client.set_tag(child, "ratchet.level", str(level))
    t.log_once(child, "ratchet.model_version", version, {"accuracy": acc, "promoted": float(gate.promoted), **per_set},
               prefix="round.")
    accuracies = {s.name: s.accuracy for s in scores}
    events.emit(events.Event("round", round=k, data={"version": version, "accuracy": acc, "promoted": gate.promoted,
                                                     "gate": gate.reason, "parent_version": parent_version,
                                                     "sets": accuracies if len(scores) > 1 else {},
                                                     "gate_set": gated.name, "level": level}))
    t.end(child)
    walls = {m.stage: m.wall_s for m in stages}
    return RoundResult(round=k, policy=policy, version=version, accuracy=acc, eval_set=eval_set,
                       accuracies=accuracies, gate_set=gated.name, promoted=gate.promoted, gate=gate.reason, child_run_id=child,
                       stage_wall_s=walls, agreement=agreement)


def champion_gate(ses: Session, version: str, scores: list[SetScore], targets: list[EvalTarget]) -> Gate:
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
            m, _ = evaluate_on(ses, champ, target, champ.round)
            t.record_accuracy(gate.needs_eval, m.info["eval_set"], m.metrics["accuracy"])
    raise TrackingError(f"the champion of {t.model_name} moved five times while version {version} was being "
                        "compared with it; re-run the same command to decide")


@task(name="drop-models", cache_policy=NONE, retries=0)
def drop_task(cfg: PipelineConfig, ctx: RunContext, k: int) -> int:
    """`drop_models`: after round k is registered, drop the merged weights `ratchet gc --models`
    would (flows/gc.py drop_models); returns the bytes freed, also on the console."""
    from ratchet.flows.gc import drop_models

    ses = Session(cfg, ctx)
    freed = sum(x.bytes for x in drop_models(Path(ctx.workdir), ses.tracker) if x.remove)
    if freed:
        events.emit(events.Event("note", round=k, stage="drop", data={
            "text": f"{freed / 2**20:,.0f} MiB of merged weights dropped (drop_models), re-makeable from their adapters"}))
    return freed


@task(name="lineage", cache_policy=NONE, retries=0)
def lineage_task(cfg: PipelineConfig, ctx: RunContext, final: RoundResult) -> bool:
    """Write the final model's verified lineage to MLflow and as a Prefect artifact; True if all verified."""
    ses = Session(cfg, ctx)
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
    ses = Session(cfg, ctx)
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
