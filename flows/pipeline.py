"""The self_improve flow: round 0 evaluates the starting model, then each round
samples -> labels -> filters -> trains -> evaluates, and registers the result. With
demonstrations (cold_start), generation 1 is the base model fine-tuned on them, and the rounds
after it build on that.

    ratchet run flows/configs/default.yaml
    ratchet run flows/configs/default.yaml --from champion   rounds on top of the champion

A run that continues from a registered model version numbers its rounds on from that
model's round (rounds count generations); `continue_improve` is the flow a scheduled
deployment runs (flows/schedule.py).

Prefect shows one subflow per round and one task per stage (flows/stages.py). Stages
exchange manifests only; heavy stages run in worker processes. Run identity and records
are in flows/runs.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from prefect import flow

from ratchet.data import events
from ratchet.data.manifest import StageManifest
from ratchet.flows.config import PipelineConfig
from ratchet.flows.inputs import run_preload
from ratchet.flows.runs import RunContext, set_state, start
from ratchet.flows.shape import EvalTarget, carries_text, round_shape, run_shape
from ratchet.flows.stages import (RoundResult, Session, agreement_task, base_task, bind_task, cold_start_task,
                                  curriculum_task, demonstrations_task, drop_task, eval_targets_task, evaluate_task,
                                  filter_task, label_model_task, label_task, optimiser_model_task, lineage_task,
                                  online_train_task, prompts_task, register_task, report_task, retire_task, sample_task,
                                  search_task, slice_task, start_model_task, train_task, unwrap)
from ratchet.flows.tracking import Tracker, verdict
from ratchet.models import warm
from ratchet.data.procs import forkserver
from ratchet.tasks.evaluate import EvaluateConfig


def trains_from(results: list[RoundResult], rule: EvaluateConfig) -> RoundResult:
    """The model the next round trains: the last round's (`next_round_from: last`), or the
    best so far (`best`): a round is built on only if it is better than the model it trained
    from by the champion gate's rule (`verdict`: more than `min_improvement` on the gate's
    held-out set, no other set down by more than `max_drop`); otherwise that model stays."""
    if rule.next_round_from == "last":
        return results[-1]
    best = results[0]
    for r in results[1:]:
        scores = r.accuracies or {rule.gate_set: r.accuracy}
        bars = best.accuracies or {rule.gate_set: best.accuracy}
        if verdict(scores, bars, rule.gate_set, rule.min_improvement, rule.max_drop, "", "")[0]:
            best = r
    return best


def evaluate_all(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, targets: list[EvalTarget],
                 child: str) -> list[StageManifest]:
    """The policy on every held-out set (evaluate.sets), in order."""
    return [unwrap(evaluate_task(cfg, ctx, k, policy, t, child)) for t in targets]


def set_aside(k: int, start: RoundResult, last: RoundResult) -> None:
    """Say on the console which model round k trains, when it is not the last round's."""
    events.emit(events.Event("note", round=k, stage="policy", data={
        "text": f"version {start.version} again (round {start.round}, {start.accuracy:.1%} held-out): round "
                f"{last.round}'s version {last.version} did not beat it (evaluate.next_round_from=best)"}))


class FlowRound:
    """A round's stages as the flow runs them (flows/shape.py `round_shape`): each a Prefect task,
    tracked on the round's MLflow run `child`."""

    def __init__(self, cfg: PipelineConfig, ctx: RunContext, child: str):
        self.cfg, self.ctx, self.child = cfg, ctx, child

    def slice(self, k, first, prompts):
        return unwrap(slice_task(self.cfg, self.ctx, k, first, prompts, self.child))

    def online_train(self, k, policy, prompts, label_model):
        return unwrap(online_train_task(self.cfg, self.ctx, k, policy, prompts, self.child, label_model))

    def sample(self, k, policy, prompts):
        return unwrap(sample_task(self.cfg, self.ctx, k, policy, prompts, self.child))

    def label(self, k, source, policy, label_model):
        return unwrap(label_task(self.cfg, self.ctx, k, source, policy, self.child, label_model))

    def filter(self, k, labels):
        return unwrap(filter_task(self.cfg, self.ctx, k, labels, self.child))

    def agreement(self, k, labels, train_set):
        return agreement_task(self.cfg, self.ctx, k, labels, train_set, self.child)  # may stop the round

    def train(self, k, policy, train_set):
        return unwrap(train_task(self.cfg, self.ctx, k, policy, train_set, self.child))

    def search(self, k, policy, prompts, optimiser):
        return unwrap(search_task(self.cfg, self.ctx, k, policy, prompts, self.child, optimiser))

    def bind(self, k, weights, carried):
        return unwrap(bind_task(self.cfg, self.ctx, k, weights, carried, self.child))


class FlowRun:
    """The run's steps as the flow runs them (flows/shape.py `run_shape`): Prefect tasks on the
    run's MLflow parent, and one subflow per round."""

    def __init__(self, cfg: PipelineConfig, ctx: RunContext):
        self.cfg, self.ctx = cfg, ctx
        self.started = bool(ctx.start_version)

    def prompts(self):
        return unwrap(prompts_task(self.cfg, self.ctx))

    def base(self):
        return unwrap(start_model_task(self.cfg, self.ctx) if self.started else base_task(self.cfg, self.ctx))

    def bind(self, k, weights, carried):
        return unwrap(bind_task(self.cfg, self.ctx, k, weights, carried, self.ctx.parent_run_id))

    def label_model(self):
        return unwrap(label_model_task(self.cfg, self.ctx))

    def optimiser_model(self):
        return unwrap(optimiser_model_task(self.cfg, self.ctx))

    def targets(self, prompts):
        return eval_targets_task(self.cfg, self.ctx, prompts)

    def round_zero(self, base, targets, k):
        return round_zero(self.cfg, self.ctx, base, targets, k)

    def demonstrations(self):
        return unwrap(demonstrations_task(self.cfg, self.ctx))

    def cold_start_round(self, k, base, demos, targets, before):
        return cold_start_round(self.cfg, self.ctx, k, base, demos, targets, before.version)

    def begin(self, k, results):
        start = trains_from(results, self.cfg.evaluate)
        if start is not results[-1]:
            set_aside(k, start, results[-1])
        return start

    def retire(self, k, pool, scored):
        return unwrap(retire_task(self.cfg, self.ctx, k, pool, scored))

    def curriculum(self, k, prompts, before, last):
        return unwrap(curriculum_task(self.cfg, self.ctx, k, prompts, before, last))

    def ends(self, k, curriculum):
        from ratchet.tasks.curriculum import CurriculumJob

        why = CurriculumJob.model_validate(curriculum.config).summary(curriculum.metrics)[0]
        events.emit(events.Event("note", round=k, stage="curriculum", data={"text": f"{why}; round {k} is not run"}))

    def round(self, k, start, pool, targets, first, label_model, optimiser_model):
        return round_flow(self.cfg, self.ctx, k, start.policy, pool, targets, start.version, first, label_model,
                          optimiser_model)

    def waits(self, k):
        raise AssertionError("the flow knows every round's result before the next begins")


# flows ----------------------------------------------------------------------

@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
def round_flow(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
               targets: list[EvalTarget], parent_version: str, first: int = 0,
               label_model: StageManifest | None = None,
               optimiser_model: StageManifest | None = None) -> RoundResult:
    """Round k (this run's first round is first + 1): its stages as flows/shape.py shapes them,
    then its evaluations and registration; `targets`: the held-out sets; `label_model`: the
    label's fixed model, if any; `optimiser_model`: the search's optimiser model, if any."""
    child = Session(cfg, ctx).tracker.child(ctx.parent_run_id, k, {"ratchet.run": ctx.run_name})
    try:
        made = round_shape(cfg, FlowRound(cfg, ctx, child), k, policy, prompts, first, label_model, optimiser_model)
        evaluations = evaluate_all(cfg, ctx, k, made.candidate, targets, child)
        taught = [prompts] if prompts.stage == "curriculum" else []  # the round's prompts and level, chosen before it
        result = register_task(cfg, ctx, k, made.candidate, evaluations, targets, parent_version, child,
                               [*taught, *made.done, *evaluations], made.note)
        if cfg.drop_models:
            drop_task(cfg, ctx, k)
        return result.model_copy(update={"scored": made.scored, "evaluations": evaluations})
    except BaseException:
        Session(cfg, ctx).tracker.end(child, "FAILED")
        raise


@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
def round_zero(cfg: PipelineConfig, ctx: RunContext, base: StageManifest, targets: list[EvalTarget],
               k: int = 0) -> RoundResult:
    """The starting model's held-out accuracy: the bar the next round must clear. k is the
    starting model's generation: 0 for the base model, the round that trained it otherwise."""
    child = Session(cfg, ctx).tracker.child(ctx.parent_run_id, k, {"ratchet.run": ctx.run_name})
    try:
        evaluations = evaluate_all(cfg, ctx, k, base, targets, child)
        result = register_task(cfg, ctx, k, base, evaluations, targets, None, child, evaluations)
        return result.model_copy(update={"evaluations": evaluations})
    except BaseException:
        Session(cfg, ctx).tracker.end(child, "FAILED")
        raise


@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
def cold_start_round(cfg: PipelineConfig, ctx: RunContext, k: int, base: StageManifest, demos: StageManifest,
                     targets: list[EvalTarget], parent_version: str) -> RoundResult:
    """Generation k (the run's first): the base model fine-tuned on the demonstrations
    (cold_start), evaluated and registered as a round's model is."""
    child = Session(cfg, ctx).tracker.child(ctx.parent_run_id, k, {"ratchet.run": ctx.run_name,
                                                                   "ratchet.cold_start": "true"})
    try:
        trained = unwrap(cold_start_task(cfg, ctx, k, base, demos, child))
        candidate = unwrap(bind_task(cfg, ctx, k, trained, base, child)) if carries_text(base) else trained
        evaluations = evaluate_all(cfg, ctx, k, candidate, targets, child)
        result = register_task(cfg, ctx, k, candidate, evaluations, targets, parent_version, child,
                               [demos, trained, *([candidate] if candidate is not trained else []), *evaluations])
        if cfg.drop_models:
            drop_task(cfg, ctx, k)
        return result.model_copy(update={"evaluations": evaluations})
    except BaseException:
        Session(cfg, ctx).tracker.end(child, "FAILED")
        raise


@flow(name="self_improve", flow_run_name="{cfg.name}", validate_parameters=False)
def self_improve(cfg: PipelineConfig, ctx: RunContext) -> list[RoundResult]:
    """The run as flows/shape.py shapes it, then its lineage and report."""
    results = run_shape(cfg, FlowRun(cfg, ctx))
    lineage_task(cfg, ctx, results[-1])
    report_task(cfg, ctx)
    return results


def warm_engine_wanted(cfg: PipelineConfig) -> bool:
    """A run keeps one engine (models/warm.py) when its stages sample in workers on this machine
    with one engine each (a served policy is sampled on its server)."""
    return cfg.isolate and cfg.executor.lends_warm_engine() and cfg.sampler.backend != "served"


@contextlib.contextmanager
def helpers(cfg: PipelineConfig, logs: Path, name: str):
    """The run's helper processes while the run lasts, each where the config wants one: the fork
    server its stage workers start from (data/procs/forkserver.py) and its warm engine
    (models/warm.py), with their own output in logs/NAME.forkserver.log and logs/NAME.engine.log.
    Helpers already running (`ratchet run` starts them before the run's records, so that their
    imports overlap with the run's start) are kept."""
    with forkserver.for_run(cfg.isolate and cfg.executor.warm_workers, logs / f"{name}.forkserver.log",
                            run_preload()), \
            warm.for_run(warm_engine_wanted(cfg), logs / f"{name}.engine.log", cfg.sampler.backend):
        yield


def name_helper_logs(logs: Path, name: str) -> None:
    """The running helpers' logs renamed to NAME.forkserver.log and NAME.engine.log: helpers start
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
        with helpers(cfg, Path(ctx.workdir) / "logs", ctx.run_name):
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
