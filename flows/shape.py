"""The shape of a run, written once: which stages a round runs, in what order, on what.

Two walks read it. The flow (flows/pipeline.py) runs each stage as its Prefect task and tracks what
it made; `ratchet plan` (flows/plan.py) makes the same call on a store that keys the stage and notes
whether it would run. Each stage is declared in its own module (tasks/runner/declare.py) with the
call both make, so a walk needs one step for every stage: `steps.run(STAGE, k, *inputs)`. A new
shape of round is added here, once, and both follow it; a stage that places itself after another
(its `after`) is run by the walk with no line here.

    run_shape(cfg, steps)                        round 0, the cold start, then each round (RunSteps)
    round_shape(cfg, steps, k, policy, ...)      one round's stages, up to its candidate (RoundSteps)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from ratchet.flows.config import PipelineConfig
from ratchet.tasks import cold_start, curriculum, filter, label, prepare, registry, sample, text, text_search, train
from ratchet.tasks.evaluate import EvalTarget, EvaluateConfig, level_set
from ratchet.tasks.runner.declare import Stage
from ratchet.tasks.text import SLOT


@dataclass
class Trained:
    """What a round's stages made, before it is evaluated: its candidate model, the stages it ran
    (in order), the stage holding its samples with their rewards (which data.retire_solved and the
    curriculum read), and the agreement gate's note."""

    candidate: Any
    done: list = field(default_factory=list)
    scored: Any = None
    note: str = ""
    voters: list = field(default_factory=list)  # the models beside the candidate the next round's vote asks


class RoundSteps(Protocol):
    """What a walk does at each stage of a round: `run` makes the stage (its manifest); `agreement`
    is the gate between the training set and training, which raises to stop the round."""

    def run(self, stage: Stage, k: int, *inputs): ...
    def agreement(self, k: int, labels, train_set) -> str: ...


class _Round:
    """A round's walk: each stage run, then the stages placed after it (`after`) on its output,
    each kept in `done` in the order they ran; what a stage made itself is `own(stage)`."""

    def __init__(self, cfg: PipelineConfig, steps: RoundSteps, k: int):
        self.cfg, self.steps, self.k, self.done, self._own = cfg, steps, k, [], {}

    def __call__(self, stage: Stage, *inputs):
        m = self._own[id(stage)] = self.steps.run(stage, self.k, *inputs)
        self.done.append(m)
        for then in registry.following(stage.name, self.cfg):
            self.done.append(m := self.steps.run(then, self.k, m))
        return m

    def own(self, stage: Stage):
        return self._own[id(stage)]


def carries_text(policy) -> bool:
    """Whether a policy is a pair whose text the weights a round trains under it keep."""
    return getattr(policy, "role", None) == "text"


def round_shape(cfg: PipelineConfig, steps: RoundSteps, k: int, policy, prompts, first: int,
                label_model=None, optimiser_model=None, voters: list = ()) -> Trained:
    """Round k's stages up to its candidate (its evaluations follow): its own draw of the pool
    (data.prompts_per_round); a prompt search (improve: prompt or both), whose pair is the
    candidate where the round improves the prompt alone; then sample, label, filter, the agreement
    gate and train; or an online train kind's one stage, which samples and scores inside it; or a
    label kind that consumes prompts (a tree search), which samples its own rollouts. Weights
    trained under a text keep it: the candidate is their pair with it. A vote across models
    (label.voters) samples each of `voters` too, and trains each beside the policy, with its own
    seed (label.trains_voters), or passes the policy on as the next round's newest voter."""
    run = _Round(cfg, steps, k)
    train_prompts = prompts
    if cfg.data.prompts_per_round:
        train_prompts = run(prepare.SLICE, first, prompts)
    if cfg.improve != "weights":
        policy = run(text_search.STAGE, policy, train_prompts, optimiser_model)
        if cfg.improve == "prompt":
            return Trained(policy, run.done)
    if cfg.train.online:
        trained = run(train.ONLINE, policy, train_prompts, label_model)
        return _kept(run, trained, policy, scored=trained)
    source = train_prompts if cfg.label.consumes == "prompts" else run(sample.STAGE, policy, train_prompts)
    voted = tuple(run(sample.STAGE, v, train_prompts) for v in voters)  # each voter's answers to the same prompts
    labels = run(label.STAGE, source, policy, label_model, voted)
    train_set = run(filter.STAGE, labels)
    note = steps.agreement(k, labels, run.own(filter.STAGE))  # the gate reads the filter's measures
    trained = run(train.STAGE, policy, train_set)
    if cfg.label.trains_voters():  # each voter trained on the same rows, with a seed of its own
        voters = [run(train.STAGE, v, train_set, m) for m, v in enumerate(voters, 1)]
    else:  # the versions before the next round's policy: this round's, then the older ones
        voters = [policy, *voters][: len(voters)]
    return _kept(run, trained, policy, scored=labels if cfg.label.consumes == "samples" else None, note=note or "",
                 voters=voters)


def _kept(run: _Round, trained, policy, **made) -> Trained:
    """The round's candidate: the trained weights, with the text they were trained under."""
    if carries_text(policy):
        trained = run(text.STAGE, trained, policy)
    return Trained(trained, run.done, **made)


def cold_start_shape(cfg: PipelineConfig, steps: RoundSteps, k: int, base, demos) -> Trained:
    """Generation k, the run's first: the base model fine-tuned on the demonstrations, with the
    base's text where it has one; with a vote's voters trained beside it, each fine-tuned too, with
    a seed of its own."""
    run = _Round(cfg, steps, k)
    trained = run(cold_start.COLD_START, base, demos)
    voters = [run(cold_start.COLD_START, base, demos, m) for m in range(1, cfg.label.voters() + 1)] \
        if cfg.label.trains_voters() else [base] * cfg.label.voters()
    return _kept(run, trained, base, voters=voters)


class RunSteps(RoundSteps, Protocol):
    """What a walk does at each step of the run, beside its stages (`run`). A round's result (R) has
    `.round`, `.policy`, `.scored`, `.evaluations` (by set name) and `.voters` (the models a vote
    asks beside it; none where nothing was trained beside it: copies of it); `begin` returns the result round
    k trains from, or None where that is not known yet (the plan, before the rounds it depends on
    are evaluated): the rounds from there wait, as they do where a stage's output is not `known`."""

    started: bool  # the run continues from a registered version (not the base model)

    def start(self): ...  # the registered version's stage it continues from
    def known(self, m) -> bool: ...  # whether a stage's output is known (the plan: not while it waits)
    def round_zero(self, base, targets: list[EvalTarget], k: int): ...
    def cold_start_round(self, k: int, base, demos, targets: list[EvalTarget], before): ...
    def begin(self, k: int, results: list): ...
    def ends(self, k: int, curriculum) -> None: ...  # the curriculum ends the run before round k
    def round(self, k: int, start, pool, targets: list[EvalTarget], first: int, label_model, optimiser_model,
              voters: list): ...
    def waits(self, k: int) -> None: ...


def run_shape(cfg: PipelineConfig, steps: RunSteps) -> list:
    """The run: its prompts and starting model, the held-out sets, round 0 (the starting model's
    accuracy: the bar), generation 1 from the demonstrations where there is a cold start, then
    cfg.rounds rounds, each training the model `begin` picks (evaluate.next_round_from) on the
    pool, less what the round before solved (data.retire_solved), or on what the curriculum chose.
    Returns every round's result."""
    prompts = steps.run(prepare.PROMPTS, 0)
    base = steps.start() if steps.started else steps.run(prepare.BASE, 0)
    if not steps.started and cfg.prompt.template != SLOT:  # version 1: the base weights with the config's text
        base = steps.run(text.STAGE, 0, base, None)
    first = base.round if steps.started else 0  # rounds count generations: a continuation numbers on
    fixed = steps.run(prepare.LABEL_MODEL, 0) if cfg.label.fixed_model() else None
    optimiser = steps.run(prepare.OPTIMISER_MODEL, 0) if cfg.prompt.optimiser_model() else None
    targets = held_out(cfg, steps, prompts)
    first_targets = reached(cfg, targets, None)
    results = [steps.round_zero(base, first_targets, first)]
    if cold_starts(cfg, steps.started):  # generation 1; the rounds build on it, whatever the base scored
        demos = steps.run(cold_start.DEMONSTRATIONS, 0)
        results.append(steps.cold_start_round(first + 1, base, demos, first_targets, results[0]))
    begun, last, pool, taught = len(results) - 1, results[-1].round, prompts, None
    for k in range(last + 1, last + cfg.rounds + 1):
        start = steps.begin(k, results[begun:])
        if start is not None and cfg.curriculum is not None:  # the round's prompts and level, from the last's labels
            taught = steps.run(curriculum.STAGE, k, prompts, taught, results[-1])
            start = start if steps.known(taught) else None
        if start is None:
            for j in range(k, last + cfg.rounds + 1):
                steps.waits(j)
            break
        if cfg.curriculum is not None:
            if curriculum.ends(taught):
                steps.ends(k, taught)
                break
            pool = taught
        elif cfg.data.retire_solved and results[-1].scored is not None:  # what the last round solved leaves
            pool = steps.run(prepare.POOL, k, pool, results[-1].scored)
        round_targets = targets if taught is None else reached(cfg, targets, curriculum.level_of(taught, cfg.curriculum, []))
        voters = list(start.voters) or [start.policy] * cfg.label.voters()  # a vote's: those trained beside it
        results.append(steps.round(k, start, pool, round_targets, last, fixed, optimiser, voters))
    return results


def scores_of(result, rule: EvaluateConfig) -> dict[str, float]:
    """A round's accuracy on each held-out set (a round measured on one set: that set's, as the gate's)."""
    return result.accuracies or {rule.gate_set: result.accuracy}


def gate_accuracy(result, rule: EvaluateConfig) -> float:
    """A round's accuracy on the gate's held-out set."""
    return scores_of(result, rule)[rule.gate_set]


def holds_floor(result, rule: EvaluateConfig) -> bool:
    """Whether a round may be trained on under `evaluate.floor` (none set: every round)."""
    floor = getattr(rule, "floor", None)
    return floor is None or gate_accuracy(result, rule) >= floor


def trains_from(results: list, rule: EvaluateConfig):
    """The model the next round trains: the last round's (`next_round_from: last`), or the
    best so far (`best`): a round is built on only if it is better than the model it trained
    from by the champion gate's rule (`verdict`: more than `min_improvement` on the gate's
    held-out set, no other set down by more than `max_drop`); otherwise that model stays. Under
    either, a round below `evaluate.floor` on the gate's set is passed over (the first, the run's
    start, never is: there is nothing before it). The flow's and the plan's `begin` both ask this
    (`rule`: evaluate: as the config sets it)."""
    from ratchet.flows.tracking import verdict

    held = [results[0], *(r for r in results[1:] if holds_floor(r, rule))]
    if rule.next_round_from == "last":
        return held[-1]
    best = held[0]
    for r in held[1:]:
        if verdict(scores_of(r, rule), scores_of(best, rule), rule.gate_set, rule.min_improvement, rule.max_drop,
                   "", "")[0]:
            best = r
    return best


def set_aside_reason(last, rule: EvaluateConfig) -> str:
    """Why the last round is not the one the next trains from (trains_from passed it over)."""
    if not holds_floor(last, rule):
        return (f"round {last.round}'s version {last.version} fell below evaluate.floor={rule.floor:g} on "
                f"{rule.gate_set} ({gate_accuracy(last, rule):.1%})")
    return f"round {last.round}'s version {last.version} did not beat it (evaluate.next_round_from=best)"


def held_out(cfg: PipelineConfig, steps: RoundSteps, prompts, only: set[str] | None = None) -> list[EvalTarget]:
    """Every held-out set (cfg.eval_stages; `only`: these names): the task's own split, held out of
    `prompts`, or a set's own prompts stage (`prompts.<name>`); each level's (data.levels) says which
    level it is."""
    levels = {level_set(n): n for n in cfg.data.level_list()}
    out = []
    for s, stage in cfg.eval_stages():
        if only and s.name not in only:
            continue
        source = s.source(cfg.data)
        held = prompts if s.data is None else steps.run(prepare.HELD_OUT, 0, s.name, source)
        out.append(EvalTarget(name=s.name, stage=stage, prompts=held, source=source,
                              rollout=s.rollout or cfg.sample.rollout, level=levels.get(s.name)))
    return out


def reached(cfg: PipelineConfig, targets: list[EvalTarget], level: int | None) -> list[EvalTarget]:
    """The held-out sets a round evaluates: every set of evaluate.sets and every level's; under a
    curriculum at `level` (None: its start), the levels up to the next one only, so that each
    round shows what it kept of the levels before and how ready it is for the next."""
    if cfg.curriculum is None:
        return targets
    levels = cfg.data.level_list()
    at = levels.index(level if level is not None else curriculum.level_of(None, cfg.curriculum, levels))
    shown = set(levels[: at + 2])
    return [t for t in targets if t.level is None or t.level in shown]


def cold_starts(cfg: PipelineConfig, started: bool) -> bool:
    """Whether the run begins with the cold start: it has demonstrations and starts from the base
    model (a continuation from a registered version starts past it)."""
    return cfg.cold_start is not None and not started


class _Names:
    """RoundSteps that record the stages' names (what `ratchet plan` lists for a round that waits)."""

    def __init__(self):
        self.names: list[str] = []

    def run(self, stage: Stage, k: int, *inputs):
        self.names.append(stage.name)
        return SimpleNamespace(stage=stage.name, role=stage.role)

    def agreement(self, k, labels, train_set) -> str:
        return ""


def round_stage_names(cfg: PipelineConfig) -> list[str]:
    """The stages a round runs, in order, as the shape walks them: its curriculum, or its pool
    (data.retire_solved), the round_shape's stages, then one evaluation per held-out set."""
    names = _Names()
    policy = SimpleNamespace(role="text") if cfg.prompt.has_text() else None
    round_shape(cfg, names, 1, policy, None, 0, voters=[policy] * cfg.label.voters())
    drawn = [curriculum.STAGE.name] if cfg.curriculum is not None else \
        [prepare.POOL.name] if cfg.data.retire_solved else []
    return drawn + names.names + [stage for _, stage in cfg.eval_stages()]
