"""The self_improve flow: round 0 evaluates the starting model, then each round
samples -> labels -> filters -> trains -> evaluates, and registers the result. With
demonstrations (cold_start), generation 1 is the base model fine-tuned on them, and the rounds
after it build on that.

    ratchet run flows/configs/default.yaml
    ratchet run flows/configs/default.yaml --from champion   rounds on top of the champion

A run that continues from a registered model version numbers its rounds on from that
model's round (rounds count generations); `continue_improve` is the flow a scheduled
deployment runs (flows/schedule.py).

Prefect shows one subflow per round and one task per stage (each stage's own, made from its
declaration: tasks/runner/declare.py). Stages exchange manifests only; heavy stages run in
worker processes. Run identity and records are in flows/runs.py.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

from prefect import flow

from ratchet.data import events
from ratchet.data.manifest import StageManifest
from ratchet.flows.config import PipelineConfig
from ratchet.flows.inputs import run_preload
from ratchet.flows.runs import RunContext, set_state, start
from ratchet.flows.shape import cold_start_shape, round_shape, run_shape
from ratchet.flows.stages import (RoundResult, StoreTracker, agreement_task, drop_task, lineage_task, register_task,
                                  report_task, start_model_task, unwrap)
from ratchet.flows.shape import set_aside_reason, trains_from
from ratchet.flows.tracking import Tracker
from ratchet.models import warm
from ratchet.data.procs import forkserver
from ratchet.tasks import evaluate
from ratchet.tasks.evaluate import EvalTarget
from ratchet.tasks.runner.declare import Stage


def evaluate_all(steps: FlowSteps, k: int, policy: StageManifest, targets: list[EvalTarget]) -> list[StageManifest]:
    """The policy on every held-out set (evaluate.sets), in order."""
    return [steps.run(evaluate.STAGE, k, policy, t) for t in targets]


def set_aside(k: int, start: RoundResult, last: RoundResult, rule) -> None:
    """Say on the console which model round k trains, when it is not the last round's, and why."""
    events.emit(events.Event("note", round=k, stage="policy", data={
        "text": f"version {start.version} again (round {start.round}, {start.accuracy:.1%} held-out): "
                f"{set_aside_reason(last, rule)}"}))


class FlowSteps:
    """The run's steps as the flow runs them (flows/shape.py `run_shape`, and `round_shape` for a
    round): each stage as its Prefect task, tracked on the round's MLflow run `child` (None: the
    run's parent), and one subflow per round."""

    def __init__(self, cfg: PipelineConfig, ctx: RunContext, child: str | None = None,
                 tracked: StoreTracker | None = None):
        self.cfg, self.ctx, self.child = cfg, ctx, child
        self.tracked = tracked or StoreTracker(cfg, ctx)
        self.started = bool(ctx.start_version)

    def run(self, stage: Stage, k: int, *inputs):
        return unwrap(stage.task(self.tracked, k, inputs, self.child))

    def agreement(self, k, labels, train_set):
        return agreement_task(self.cfg, self.ctx, k, labels, train_set, self.child)  # may stop the round

    def start(self):
        return unwrap(start_model_task(self.cfg, self.ctx))

    def known(self, m) -> bool:
        return True  # the flow has every stage's output before the next begins

    def round_zero(self, base, targets, k):
        return round_zero(self.cfg, self.ctx, base, targets, k)

    def cold_start_round(self, k, base, demos, targets, before):
        return cold_start_round(self.cfg, self.ctx, k, base, demos, targets, before.version)

    def begin(self, k, results):
        start = trains_from(results, self.cfg.evaluate)
        if start is not results[-1]:
            set_aside(k, start, results[-1], self.cfg.evaluate)
        return start

    def ends(self, k, curriculum):
        from ratchet.tasks.curriculum import CurriculumJob

        why = CurriculumJob.model_validate(curriculum.config).summary(curriculum.metrics)[0]
        events.emit(events.Event("note", round=k, stage="curriculum", data={"text": f"{why}; round {k} is not run"}))

    def round(self, k, start, pool, targets, first, label_model, optimiser_model, voters):
        return round_flow(self.cfg, self.ctx, k, start.policy, pool, targets, start.version, first, label_model,
                          optimiser_model, voters)

    def waits(self, k):
        raise AssertionError("the flow knows every round's result before the next begins")


def _round_steps(cfg: PipelineConfig, ctx: RunContext, k: int, tags: dict[str, str]) -> FlowSteps:
    """Steps on round k's own MLflow run (made here: the round's child of the run's parent)."""
    ses = StoreTracker(cfg, ctx)
    return FlowSteps(cfg, ctx, ses.tracker.child(ctx.parent_run_id, k, {"ratchet.run": ctx.run_name, **tags}), ses)


# flows ----------------------------------------------------------------------

def _called_only(fn):
    """A flow that is called, never deployed, shown to Prefect without its parameters' types.
    Prefect makes a JSON schema of a flow's parameters when it declares the flow (for a
    deployment's form); a round's parameters (the whole PipelineConfig, its manifests) made it
    0.5 s of every run's start, for a schema nothing reads. Prefect reads the parameters' names
    and defaults from the signature given here; the annotations stay on the function."""
    sig = inspect.signature(fn)
    fn.__signature__ = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                               for p in sig.parameters.values()],
                                   return_annotation=inspect.Signature.empty)
    return fn


@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
@_called_only
def round_flow(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
               targets: list[EvalTarget], parent_version: str, first: int = 0,
               label_model: StageManifest | None = None, optimiser_model: StageManifest | None = None,
               voters: list[StageManifest] | None = None) -> RoundResult:
    """Round k (this run's first round is first + 1): its stages as flows/shape.py shapes them,
    then its evaluations and registration; `targets`: the held-out sets; `label_model`: the
    label's fixed model, if any; `optimiser_model`: the search's optimiser model, if any;
    `prompts`: its pool, or what its curriculum chose before it; `voters`: the models a vote
    across models asks beside the policy."""
    steps = _round_steps(cfg, ctx, k, {})
    try:
        made = round_shape(cfg, steps, k, policy, prompts, first, label_model, optimiser_model, voters or [])
        taught = [prompts] if cfg.curriculum is not None else []  # the round's prompts and level, chosen before it
        return _registered(steps, k, made.candidate, targets, parent_version, [*taught, *made.done], made.note,
                           scored=made.scored, voters=made.voters)
    except BaseException:
        steps.tracked.tracker.end(steps.child, "FAILED")
        raise


def _registered(steps: FlowSteps, k: int, candidate: StageManifest, targets: list[EvalTarget],
                parent_version: str | None, made: list[StageManifest], note: str = "", trained: bool = True,
                **result) -> RoundResult:
    """Round k's candidate evaluated on every held-out set, registered and put to the champion gate
    (its stages: `made`, the evaluations after them), and, where it `trained` a model, the merged
    weights the run drops (drop_models) dropped."""
    cfg, ctx = steps.cfg, steps.ctx
    evaluations = evaluate_all(steps, k, candidate, targets)
    trained_voters = result.get("voters", []) if trained and cfg.label.trains_voters() else []
    r = register_task(cfg, ctx, k, candidate, evaluations, targets, parent_version, steps.child,
                      [*made, *evaluations], note, trained_voters)
    if cfg.drop_models and trained:
        drop_task(cfg, ctx, k)
    return r.model_copy(update={"evaluations": {t.name: m for t, m in zip(targets, evaluations)}, **result})


@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
@_called_only
def round_zero(cfg: PipelineConfig, ctx: RunContext, base: StageManifest, targets: list[EvalTarget],
               k: int = 0) -> RoundResult:
    """The starting model's held-out accuracy: the bar the next round must clear. k is the
    starting model's generation: 0 for the base model, the round that trained it otherwise."""
    steps = _round_steps(cfg, ctx, k, {})
    try:
        return _registered(steps, k, base, targets, None, [], trained=False)
    except BaseException:
        steps.tracked.tracker.end(steps.child, "FAILED")
        raise


@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
@_called_only
def cold_start_round(cfg: PipelineConfig, ctx: RunContext, k: int, base: StageManifest, demos: StageManifest,
                     targets: list[EvalTarget], parent_version: str) -> RoundResult:
    """Generation k (the run's first): the base model fine-tuned on the demonstrations
    (cold_start), evaluated and registered as a round's model is."""
    steps = _round_steps(cfg, ctx, k, {"ratchet.cold_start": "true"})
    try:
        made = cold_start_shape(cfg, steps, k, base, demos)
        return _registered(steps, k, made.candidate, targets, parent_version, [demos, *made.done],
                           voters=made.voters)
    except BaseException:
        steps.tracked.tracker.end(steps.child, "FAILED")
        raise


@flow(name="self_improve", flow_run_name="{cfg.name}", validate_parameters=False)
@_called_only
def self_improve(cfg: PipelineConfig, ctx: RunContext) -> list[RoundResult]:
    """The run as flows/shape.py shapes it, then its lineage and report."""
    results = run_shape(cfg, FlowSteps(cfg, ctx))
    lineage_task(cfg, ctx, results[-1])
    report_task(cfg, ctx)
    return results


def warm_engine_wanted(cfg: PipelineConfig) -> bool:
    """A run keeps one engine (models/warm.py) when its stages sample in workers on this machine
    with one engine each (a served policy is sampled on its server)."""
    return cfg.isolate and cfg.executor.lends_warm_engine() and cfg.sampler.backend_kind.local


@contextlib.contextmanager
def services(cfg: PipelineConfig, logs: Path, name: str):
    """The run's helper processes while the run lasts, each where the config wants one: the fork
    server its stage workers start from (data/procs/forkserver.py) and its warm engine
    (models/warm.py), with their own output in logs/NAME.forkserver.log and logs/NAME.engine.log.
    Helpers already running (`ratchet run` starts them before the run's records, so that their
    imports overlap with the run's start) are kept."""
    with forkserver.for_run(cfg.isolate and cfg.executor.warm_workers, logs / f"{name}.forkserver.log",
                            run_preload(cfg)), \
            warm.for_run(warm_engine_wanted(cfg), logs / f"{name}.engine.log", cfg.sampler.backend,
                         cfg.executor.warm_engine_shapes):
        yield


def name_helper_logs(logs: Path, name: str) -> None:
    """The running services' logs renamed to NAME.forkserver.log and NAME.engine.log: services start
    before the run has a name."""
    for helper, kind in ((forkserver.current(), "forkserver"), (warm.current(), "engine")):
        if helper is not None:
            helper.rename_log(logs / f"{name}.{kind}.log")


def execute(cfg: PipelineConfig, start_from: str | None = None,
            ctx: RunContext | None = None) -> tuple[RunContext, list[RoundResult], Tracker]:
    """Run (or continue) a pipeline run to the end; the MLflow parent run ends FINISHED or FAILED."""
    if ctx is None:
        ctx, tracker = start(cfg, start_from)
    else:
        tracker = Tracker(cfg.tracking, Path(ctx.workdir), cfg.name)
    try:
        with services(cfg, Path(ctx.workdir) / "logs", ctx.run_name):
            results = self_improve(cfg, ctx)
    except BaseException as e:
        tracker.end(ctx.parent_run_id, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        set_state(ctx, tracker, "interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
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

    cfg = config_from_dict(config, overrides or [], source="deployment parameters", resolved=True)
    ctx, results, tracker = execute(cfg, start_from)
    champ = tracker.champion()
    summary = {
        "run": ctx.run_name, "start_version": ctx.start_version,
        "rounds": [{"round": r.round, "version": r.version, "accuracy": r.accuracy, "accuracies": r.accuracies,
                    "promoted": r.promoted} for r in results],
        "champion": champ,
    }
    get_run_logger().info("%s from %s: %s", ctx.run_name, f"version {ctx.start_version}" if ctx.start_version
                          else "the base model", summary)
    return summary
