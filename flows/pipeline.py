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
from ratchet.flows.stages import (EvalTarget, RoundResult, Session, agreement_task, base_task, cold_start_task,
                                  demonstrations_task, drop_task, eval_targets_task, evaluate_task, filter_task,
                                  label_model_task, label_task, lineage_task, online_train_task, prompts_task,
                                  register_task, report_task, retire_task, sample_task, slice_task, start_model_task,
                                  train_task, unwrap)
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


# flows ----------------------------------------------------------------------

@flow(name="round", flow_run_name="round-{k}", validate_parameters=False)
def round_flow(cfg: PipelineConfig, ctx: RunContext, k: int, policy: StageManifest, prompts: StageManifest,
               targets: list[EvalTarget], parent_version: str, first: int = 0,
               label_model: StageManifest | None = None) -> RoundResult:
    """Round k (this run's first round is first + 1); `targets`: the held-out sets; `label_model`:
    the label's fixed model, if any."""
    child = Session(cfg, ctx).tracker.child(ctx.parent_run_id, k, {"ratchet.run": ctx.run_name})
    try:
        done, train = [], prompts
        if cfg.data.prompts_per_round:  # this round's own draw from the pool
            done.append(train := unwrap(slice_task(cfg, ctx, k, first, prompts, child)))
        if cfg.train.online:  # it samples, scores and trains in its own stage: prompts -> train -> evaluate
            candidate = unwrap(online_train_task(cfg, ctx, k, policy, train, child, label_model))
            evaluations = evaluate_all(cfg, ctx, k, candidate, targets, child)
            result = register_task(cfg, ctx, k, candidate, evaluations, targets, parent_version, child,
                                   [*done, candidate, *evaluations])
            if cfg.drop_models:
                drop_task(cfg, ctx, k)
            return result.model_copy(update={"scored": candidate})
        if cfg.label.consumes == "prompts":  # e.g. a tree search: it samples its own rollouts
            done.append(labels := unwrap(label_task(cfg, ctx, k, train, policy, child, label_model)))
        else:
            samples = unwrap(sample_task(cfg, ctx, k, policy, train, child))
            done += [samples, labels := unwrap(label_task(cfg, ctx, k, samples, policy, child, label_model))]
        train_set = unwrap(filter_task(cfg, ctx, k, labels, child))
        note = agreement_task(cfg, ctx, k, labels, train_set, child)  # may stop the round before training
        candidate = unwrap(train_task(cfg, ctx, k, policy, train_set, child))
        evaluations = evaluate_all(cfg, ctx, k, candidate, targets, child)
        result = register_task(cfg, ctx, k, candidate, evaluations, targets, parent_version, child,
                               [*done, train_set, candidate, *evaluations], note)
        if cfg.drop_models:
            drop_task(cfg, ctx, k)
        return result.model_copy(update={"scored": labels if cfg.label.consumes == "samples" else None})
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
        return register_task(cfg, ctx, k, base, evaluations, targets, None, child, evaluations)
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
        candidate = unwrap(cold_start_task(cfg, ctx, k, base, demos, child))
        evaluations = evaluate_all(cfg, ctx, k, candidate, targets, child)
        result = register_task(cfg, ctx, k, candidate, evaluations, targets, parent_version, child,
                               [demos, candidate, *evaluations])
        if cfg.drop_models:
            drop_task(cfg, ctx, k)
        return result
    except BaseException:
        Session(cfg, ctx).tracker.end(child, "FAILED")
        raise


@flow(name="self_improve", flow_run_name="{cfg.name}", validate_parameters=False)
def self_improve(cfg: PipelineConfig, ctx: RunContext) -> list[RoundResult]:
    prompts = unwrap(prompts_task(cfg, ctx))
    base = unwrap(start_model_task(cfg, ctx) if ctx.start_version else base_task(cfg, ctx))
    first = base.round if ctx.start_version else 0  # rounds count generations: a continuation numbers on
    fixed = unwrap(label_model_task(cfg, ctx)) if cfg.label.fixed_model() else None
    targets = eval_targets_task(cfg, ctx, prompts)
    results = [round_zero(cfg, ctx, base, targets, first)]
    if cold_starts(cfg, ctx.start_version):  # generation 1; the rounds build on it, whatever the base scored
        demos = unwrap(demonstrations_task(cfg, ctx))
        results.append(cold_start_round(cfg, ctx, first + 1, base, demos, targets, results[0].version))
    begun, last, pool = len(results) - 1, results[-1].round, prompts
    for k in range(last + 1, last + cfg.rounds + 1):
        start = trains_from(results[begun:], cfg.evaluate)
        if start is not results[-1]:
            set_aside(k, start, results[-1])
        if cfg.data.retire_solved and results[-1].scored is not None:  # what the last round solved leaves
            pool = unwrap(retire_task(cfg, ctx, k, pool, results[-1].scored))
        results.append(round_flow(cfg, ctx, k, start.policy, pool, targets, start.version, last, fixed))
    lineage_task(cfg, ctx, results[-1])
    report_task(cfg, ctx)
    return results


def cold_starts(cfg: PipelineConfig, start_version: str | None) -> bool:
    """Whether the run begins with the cold start: it has demonstrations and starts from the base
    model (a continuation from a registered version starts past it)."""
    return cfg.cold_start is not None and not start_version


def warm_engine_wanted(cfg: PipelineConfig) -> bool:
    """A run keeps one engine (models/warm.py) when its stages sample in workers on this machine
    with one engine each."""
    return cfg.isolate and cfg.executor.lends_warm_engine()


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
