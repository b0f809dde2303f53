"""The shape of a run, written once: which stages a round runs, in what order, on what, and each
stage's call into tasks/ with the settings and seed the config gives it.

Two walks read it. The flow (flows/pipeline.py) runs each step as a Prefect task that makes the
call and tracks what it made; `ratchet plan` (flows/plan.py) makes the same call on a store that
keys the stage and notes whether it would run. A new shape of round is added here, once, and both
follow it.

    run_shape(cfg, steps)          round 0, the cold start, then each round (RunSteps)
    round_shape(cfg, steps, ...)   one round's stages, up to its candidate model (RoundSteps)
    Calls(cfg, store, run)         each stage's call into tasks/
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import SourceConfig
from ratchet.data.store import ArtifactStore
from ratchet.flows.config import PipelineConfig, level_stage
from ratchet.tasks.sample import RolloutConfig
from ratchet.tasks.text import SLOT


def round_seed(cfg: PipelineConfig, k: int) -> int:
    return cfg.seed * 1000 + k


class EvalTarget(BaseModel):
    """One held-out set as the flow evaluates it (evaluate.sets): its name, its stage's name,
    the stage holding its prompts, and the source that scores them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    stage: str
    prompts: StageManifest
    source: SourceConfig
    rollout: RolloutConfig  # the set's own, or the samples' (sample.rollout)


class Calls:
    """Each stage's call into tasks/, as the config sets it up: `(manifest, reused)`. `run`: the
    run the stage is recorded for (None: the plan, which records nothing)."""

    def __init__(self, cfg: PipelineConfig, store: ArtifactStore, run: str | None = None):
        self.cfg, self.store, self.run = cfg, store, run

    def prompts(self, sources) -> tuple[StageManifest, bool]:
        from ratchet.tasks import prepare

        return prepare.prompts(self.store, self.cfg.data.pool(), self.cfg.seed, sources, run=self.run)

    def held_out(self, prompts: StageManifest, sources: dict[str, str]) -> list[tuple[EvalTarget, bool | None]]:
        """Every held-out set of evaluate.sets: the task's own split (`prompts`; reused None) or a
        set's own prompts stage."""
        from ratchet.flows.inputs import sources_of
        from ratchet.tasks import prepare

        cfg, out = self.cfg, []
        for s, stage in cfg.eval_stages():
            held, source, reused = prompts, s.source(cfg.data), None
            if s.data is not None:
                held, reused = prepare.held_out(self.store, s.name, source, cfg.seed, sources_of(sources, s.name),
                                                run=self.run)
            out.append((EvalTarget(name=s.name, stage=stage, prompts=held, source=source,
                                   rollout=s.rollout or cfg.sample.rollout), reused))
        return out

    def slice(self, k: int, first: int, pool_start: int, prompts: StageManifest) -> tuple[StageManifest, bool]:
        """Round k's train prompts: the next data.prompts_per_round of the pool's stream (the run
        starts at `pool_start`; its first round is first + 1)."""
        from ratchet.tasks import prepare

        count = self.cfg.data.prompts_per_round
        return prepare.round_prompts(self.store, prompts, pool_start + (k - first - 1) * count, count, self.cfg.seed,
                                     k, run=self.run)

    def retire(self, k: int, pool: StageManifest, scored: StageManifest) -> tuple[StageManifest, bool]:
        from ratchet.tasks import prepare

        return prepare.retire(self.store, pool, scored, self.cfg.label.reward_range()[1], k, run=self.run)

    def curriculum(self, k: int, prompts: StageManifest, before: StageManifest | None,
                   last) -> tuple[StageManifest, bool]:
        """Round k's prompts and level (curriculum:), from the round before's curriculum stage
        (`before`), and that round's (`last`) scored samples and evaluation of its level."""
        from ratchet.tasks import curriculum

        cfg, levels = self.cfg, self.cfg.data.level_list()
        level = curriculum.level_of(before, cfg.curriculum, levels)
        held = next((m for m in getattr(last, "evaluations", []) if m.stage == level_stage(level)), None)
        return curriculum.curriculum(self.store, cfg.curriculum, levels, cfg.label.reward_range()[1], prompts, before,
                                     getattr(last, "scored", None), held, round_seed(cfg, k), k, run=self.run)

    def sample(self, k: int, policy: StageManifest, prompts: StageManifest) -> tuple[StageManifest, bool]:
        from ratchet.tasks import sample as sample_mod

        cfg = self.cfg
        return sample_mod.sample(self.store, policy, prompts, cfg.sample, cfg.sampler, round_seed(cfg, k), k,
                                 isolate=cfg.isolate, run=self.run, executor=cfg.executor)

    def label(self, k: int, source: StageManifest, policy: StageManifest,
              label_model: StageManifest | None) -> tuple[StageManifest, bool]:
        """Label the round's samples, or search from its prompts (a kind that consumes prompts);
        with the label's fixed model where it has one, else the policy."""
        from ratchet.tasks import label as label_mod

        cfg = self.cfg
        return label_mod.label(self.store, source, cfg.label, cfg.data.pool(), k, policy=label_model or policy,
                               sampler=cfg.sampler, seed=round_seed(cfg, k), isolate=cfg.isolate, run=self.run,
                               executor=cfg.executor, rollout=cfg.sample.rollout, turn_tokens=cfg.sample.max_tokens)

    def filter(self, k: int, labels: StageManifest) -> tuple[StageManifest, bool]:
        from ratchet.tasks import filter as filter_mod

        return filter_mod.filter_rows(self.store, labels, self.cfg.filter, round_seed(self.cfg, k), k, run=self.run)

    def agreement(self, k: int, labels: StageManifest, train_set: StageManifest):
        """The agreement gate's verdict (tasks/agreement.py): LabelDisagreesError stops the round."""
        from ratchet.tasks import agreement

        return agreement.check(self.cfg.agreement, self.cfg.label.title(), k, labels.metrics, train_set.metrics)

    def train(self, k: int, policy: StageManifest, train_set: StageManifest) -> tuple[StageManifest, bool]:
        from ratchet.tasks import train as train_mod

        cfg = self.cfg
        return train_mod.train(self.store, policy, train_set, cfg.train, round_seed(cfg, k), k, isolate=cfg.isolate,
                               run=self.run)

    def online_train(self, k: int, policy: StageManifest, prompts: StageManifest,
                     label_model: StageManifest | None) -> tuple[StageManifest, bool]:
        """An online train kind's stage (train.kind=grpo): it samples the round's prompts, scores
        them with the label kind (on its fixed model, if any) and trains, in one stage."""
        from ratchet.tasks import train as train_mod

        cfg = self.cfg
        return train_mod.train_online(self.store, policy, prompts, cfg.train, cfg.sample, cfg.sampler, cfg.label,
                                      cfg.data, round_seed(cfg, k), k, isolate=cfg.isolate, run=self.run,
                                      label_model=label_model)

    def bind(self, k: int, weights: StageManifest, carried: StageManifest | None = None) -> tuple[StageManifest, bool]:
        """The pair of `weights` and a text (tasks/text.py): the config's prompt.template (version
        1), or the text of `carried`, the pair a round trained under."""
        from ratchet.tasks import text

        template = self.cfg.prompt.template if carried is None else None
        return text.bind(self.store, weights, k, template=template, carried=carried, run=self.run)

    def search(self, k: int, policy: StageManifest, prompts: StageManifest,
               optimiser: StageManifest | None = None) -> tuple[StageManifest, bool]:
        """The text a search finds for `policy` on the round's train prompts (prompt.search), its
        optimiser's own model where it has one (`optimiser`)."""
        from ratchet.tasks import text_search

        cfg = self.cfg
        return text_search.search(self.store, policy, prompts, cfg.prompt.search, cfg.data, cfg.sample.rollout,
                                  cfg.evaluate.max_tokens, cfg.sampler, round_seed(cfg, k), k, isolate=cfg.isolate,
                                  run=self.run, optimiser=optimiser)

    def demonstrations(self, digest: str) -> tuple[StageManifest, bool]:
        from ratchet.tasks import cold_start

        return cold_start.demonstrations(self.store, self.cfg.cold_start.demonstrations, digest, run=self.run)

    def cold_start(self, k: int, policy: StageManifest, demos: StageManifest) -> tuple[StageManifest, bool]:
        """Generation k's model (the run's first): `policy` fine-tuned on the demonstrations."""
        from ratchet.tasks import cold_start

        cfg = self.cfg
        return cold_start.cold_start(self.store, policy, demos, cfg.cold_start, cfg.sample.rollout,
                                     round_seed(cfg, k), k, isolate=cfg.isolate, run=self.run)

    def evaluate(self, k: int, policy: StageManifest, target: EvalTarget) -> tuple[StageManifest, bool]:
        from ratchet.tasks import evaluate as evaluate_mod

        cfg = self.cfg
        return evaluate_mod.evaluate(self.store, policy, target.prompts, cfg.evaluate, cfg.sampler, target.source,
                                     cfg.seed, k, isolate=cfg.isolate, run=self.run, executor=cfg.executor,
                                     stage=target.stage, rollout=target.rollout)


# the shape -----------------------------------------------------------------------------------

@dataclass
class Trained:
    """What a round's stages made, before it is evaluated: its candidate model, the stages it ran
    (in order), the stage holding its samples with their rewards (which data.retire_solved reads),
    and the agreement gate's note."""

    candidate: Any
    done: list = field(default_factory=list)
    scored: Any = None
    note: str = ""


class RoundSteps(Protocol):
    """What a walk does at each stage of a round; each returns the stage's manifest."""

    def slice(self, k: int, first: int, prompts): ...
    def online_train(self, k: int, policy, prompts, label_model): ...
    def sample(self, k: int, policy, prompts): ...
    def label(self, k: int, source, policy, label_model): ...
    def filter(self, k: int, labels): ...
    def agreement(self, k: int, labels, train_set) -> str: ...  # raises to stop the round before training
    def train(self, k: int, policy, train_set): ...
    def search(self, k: int, policy, prompts, optimiser): ...
    def bind(self, k: int, weights, carried): ...  # the text of `carried` over new weights


def carries_text(policy) -> bool:
    """Whether a policy is a pair whose text the weights a round trains under it keep."""
    from ratchet.tasks.runner.stage import TEXT_STAGES

    return getattr(policy, "stage", None) in TEXT_STAGES


def round_shape(cfg: PipelineConfig, steps: RoundSteps, k: int, policy, prompts, first: int,
                label_model=None, optimiser_model=None) -> Trained:
    """Round k's stages up to its candidate (its evaluations follow): its own draw of the pool
    (data.prompts_per_round); a prompt search (improve: prompt or both), whose pair is the
    candidate where the round improves the prompt alone; then sample, label, filter, the agreement
    gate and train; or an online train kind's one stage, which samples and scores inside it; or a
    label kind that consumes prompts (a tree search), which samples its own rollouts. Weights
    trained under a text keep it: the candidate is their pair with it."""
    done, train = [], prompts
    if cfg.data.prompts_per_round:
        done.append(train := steps.slice(k, first, prompts))
    if cfg.improve != "weights":
        done.append(policy := steps.search(k, policy, train, optimiser_model))
        if cfg.improve == "prompt":
            return Trained(policy, done)
    if cfg.train.online:
        done.append(trained := steps.online_train(k, policy, train, label_model))
        return _kept(steps, k, trained, policy, done, scored=trained)
    if cfg.label.consumes == "prompts":
        done.append(labels := steps.label(k, train, policy, label_model))
    else:
        samples = steps.sample(k, policy, train)
        done += [samples, labels := steps.label(k, samples, policy, label_model)]
    train_set = steps.filter(k, labels)
    note = steps.agreement(k, labels, train_set)
    done += [train_set, trained := steps.train(k, policy, train_set)]
    return _kept(steps, k, trained, policy, done, scored=labels if cfg.label.consumes == "samples" else None,
                 note=note or "")


def _kept(steps: RoundSteps, k: int, trained, policy, done: list, **made) -> Trained:
    """The round's candidate: the trained weights, with the text they were trained under."""
    if carries_text(policy):
        done.append(trained := steps.bind(k, trained, policy))
    return Trained(trained, done, **made)


class RunSteps(Protocol):
    """What a walk does at each step of the run. A round's result (R) has `.round`, `.policy` and
    `.scored`; `begin` returns the result round k trains from, or None where that is not known
    yet (the plan, before the rounds it depends on are evaluated): the rounds from there wait."""

    started: bool  # the run continues from a registered version (not the base model)

    def prompts(self): ...
    def base(self): ...
    def bind(self, k: int, weights, carried): ...  # version 1: the base weights with the config's text
    def label_model(self): ...
    def optimiser_model(self): ...  # the search's optimiser model (prompt.search.optimiser.kind=model)
    def targets(self, prompts) -> list: ...
    def round_zero(self, base, targets, k: int): ...
    def demonstrations(self): ...
    def cold_start_round(self, k: int, base, demos, targets, before): ...
    def begin(self, k: int, results: list): ...
    def retire(self, k: int, pool, scored): ...
    def curriculum(self, k: int, prompts, before, last): ...  # None where it is not known yet (the plan)
    def ends(self, k: int, curriculum) -> None: ...  # the curriculum ends the run before round k
    def round(self, k: int, start, pool, targets, first: int, label_model, optimiser_model): ...
    def waits(self, k: int) -> None: ...


def run_shape(cfg: PipelineConfig, steps: RunSteps) -> list:
    """The run: its prompts and starting model, the held-out sets, round 0 (the starting model's
    accuracy: the bar), generation 1 from the demonstrations where there is a cold start, then
    cfg.rounds rounds, each training the model `begin` picks (evaluate.next_round_from) on the
    pool, less what the round before solved (data.retire_solved). Returns every round's result."""
    prompts = steps.prompts()
    base = steps.base()
    if not steps.started and cfg.prompt.template != SLOT:  # version 1: the base weights with the config's text
        base = steps.bind(0, base, None)
    first = base.round if steps.started else 0  # rounds count generations: a continuation numbers on
    fixed = steps.label_model() if cfg.label.fixed_model() else None
    optimiser = steps.optimiser_model() if cfg.prompt.optimiser_model() else None
    targets = steps.targets(prompts)
    first_targets = reached(cfg, targets, None)
    results = [steps.round_zero(base, first_targets, first)]
    if cold_starts(cfg, steps.started):  # generation 1; the rounds build on it, whatever the base scored
        demos = steps.demonstrations()
        results.append(steps.cold_start_round(first + 1, base, demos, first_targets, results[0]))
    begun, last, pool, taught = len(results) - 1, results[-1].round, prompts, None
    for k in range(last + 1, last + cfg.rounds + 1):
        start = steps.begin(k, results[begun:])
        if start is not None and cfg.curriculum is not None:  # the round's prompts and level, from the last's labels
            taught = steps.curriculum(k, prompts, taught, results[-1])
            start = None if taught is None else start
        if start is None:
            for j in range(k, last + cfg.rounds + 1):
                steps.waits(j)
            break
        if cfg.curriculum is not None:
            from ratchet.tasks.curriculum import ends, level_of

            if ends(taught):
                steps.ends(k, taught)
                break
            pool = taught
        elif cfg.data.retire_solved and results[-1].scored is not None:  # what the last round solved leaves
            pool = steps.retire(k, pool, results[-1].scored)
        round_targets = targets if taught is None else reached(cfg, targets, level_of(taught, cfg.curriculum, []))
        results.append(steps.round(k, start, pool, round_targets, last, fixed, optimiser))
    return results


def reached(cfg: PipelineConfig, targets: list, level: int | None) -> list:
    """The held-out sets a round evaluates: every set of evaluate.sets and every level's; under a
    curriculum at `level` (None: its start), the levels up to the next one only, so that each
    round shows what it kept of the levels before and how ready it is for the next."""
    if cfg.curriculum is None:
        return targets
    from ratchet.tasks.curriculum import level_of

    levels = cfg.data.level_list()
    at = levels.index(level if level is not None else level_of(None, cfg.curriculum, levels))
    shown = {level_stage(n) for n in levels[: at + 2]}
    every = {level_stage(n) for n in levels}
    return [t for t in targets if t.stage not in every or t.stage in shown]


def cold_starts(cfg: PipelineConfig, started: bool) -> bool:
    """Whether the run begins with the cold start: it has demonstrations and starts from the base
    model (a continuation from a registered version starts past it)."""
    return cfg.cold_start is not None and not started


class _Names:
    """A RoundSteps that records the stages' names (what `ratchet plan` lists for a round that waits)."""

    def __init__(self):
        self.names: list[str] = []

    def __getattr__(self, name: str):
        stage = {"slice": "slice", "online_train": "train", "sample": "sample", "label": "label", "filter": "filter",
                 "agreement": None, "train": "train", "search": "search", "bind": "template"}[name]

        def step(*_):
            if stage:
                self.names.append(stage)
            return SimpleNamespace(stage=stage)

        return step


def round_stage_names(cfg: PipelineConfig) -> list[str]:
    """The stages a round runs, in order, as the shape walks them: its curriculum, or its pool (data.retire_solved),
    the round_shape's stages, then one evaluation per held-out set."""
    names = _Names()
    policy = SimpleNamespace(stage="template") if cfg.prompt.has_text() else None
    round_shape(cfg, names, 1, policy, None, 0)
    drawn = ["curriculum"] if cfg.curriculum is not None else ["pool"] if cfg.data.retire_solved else []
    return drawn + names.names + [stage for _, stage in cfg.eval_stages()]
