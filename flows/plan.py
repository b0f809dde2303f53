"""`ratchet plan CONFIG [key=value ...]`: for every stage of every round, whether the run would reuse
it, run it again and why, run it for the first time, or wait on a stage before it; in the manner
of `terraform plan`, `dvc status` and `snakemake -n --reason`.

    ratchet plan flows/configs/default.yaml
    ratchet plan flows/configs/default.yaml sample.temperature=0.9 --json

It reads the data (the checks `ratchet check` makes of it, not those that need the tokenizer),
the store's manifests and the code; it loads no model, imports neither torch nor vLLM, and
writes nothing in the workdir or in MLflow. Each stage is keyed by `run_stage` itself, handed to
a planner (tasks/runner/plan.py) instead of run: the stage's declared call is the one its Prefect
task makes (tasks/runner/declare.py), so the plan and the run cannot key a stage differently.
The walk is the flow's own: flows/shape.py, which both walk, each with its own steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.flows.config import PipelineConfig
from ratchet.tasks.runner.declare import At, Stage
from ratchet.tasks.runner.plan import Planner, Step, pending


@dataclass
class Plan:
    run: str
    workdir: Path
    steps: list[Step] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {"reused": 0, "stale": 0, "to run": 0, "waits": 0}
        for s in self.steps:
            out[s.state] += 1
        return out

    def summary(self) -> str:
        """The one line `ratchet run` prints before it starts."""
        c = self.counts()
        first = next((s for s in self.steps if s.state in ("stale", "to run")), None)
        at = f"; first to run: round {first.round} {first.stage}" if first else ""
        return (f"plan: {c['reused']} stage(s) reused, {c['stale']} stale, {c['to run']} to run, {c['waits']} "
                f"waiting on those{at}")

    def as_json(self) -> dict[str, Any]:
        return {"run": self.run, "workdir": str(self.workdir), "counts": self.counts(),
                "stages": [s.as_dict() for s in self.steps]}

    def render(self) -> str:
        lines = [f"{'round':>5}  {'stage':<18} {'state':<7} why"]
        for s in self.steps:
            lines.append(f"{s.round:>5}  {s.stage:<18} {s.state:<7} {s.why}")
        return "\n".join(lines + ["", self.summary()])


@dataclass
class _Round:
    """What the walk knows of a round's result: its policy and its held-out accuracies, where
    its evaluations are finished (None: they will run)."""

    round: int
    policy: StageManifest
    accuracy: float | None
    accuracies: dict[str, float] | None
    scored: StageManifest | None = None  # its samples with their rewards (data.retire_solved reads them)
    evaluations: dict[str, StageManifest] = field(default_factory=dict)  # by set: the curriculum reads its level's
    voters: list = field(default_factory=list)  # the models beside it a vote asks (label.kind=vote)


def plan(cfg: PipelineConfig, run: str | None = None, start: StageManifest | None = None,
         pool_start: int | None = None, sources: dict[str, str] | None = None) -> Plan:
    """The plan of the run `cfg` names (`run`: its name, when a record or `--from` gives another),
    from the base model, or from `start` (a registered version's stage, `--from`). `sources`: the
    data's digests where the caller has checked the data already (`ratchet run`)."""
    from ratchet.flows.inputs import check_data, with_sets
    from ratchet.flows.runs import read_record, recorded_name

    if sources is None:
        split, sets = check_data(cfg)
        sources = with_sets(split, sets).digests
    workdir = Path(cfg.workdir).resolve()
    run = run or recorded_name(cfg, workdir)
    if pool_start is None:
        record = workdir / "runs" / f"{run}.json"
        pool_start = read_record(record).ctx.pool_start if record.is_file() else 0
    planner = Planner(ArtifactStore(workdir, create=False), run, cfg.name)
    store = ArtifactStore(workdir, create=False, planner=planner)  # run_stage hands its stages to the planner
    _walk(cfg, planner, store, sources, start, pool_start)
    return Plan(run=run, workdir=workdir, steps=planner.steps)


class _Stop(Exception):
    """The walk ends here: what follows depends on a stage the plan cannot foresee (noted)."""


class PlanSteps:
    """The run's steps as the plan walks them (flows/shape.py `run_shape`, and `round_shape` for a
    round): each stage keyed by the call the flow makes, on a store that notes it instead of
    running it."""

    def __init__(self, cfg: PipelineConfig, planner: Planner, store: ArtifactStore, sources: dict[str, str],
                 start: StageManifest | None, pool_start: int):
        self.cfg, self.planner = cfg, planner
        self.at = At(cfg, store, None, pool_start, sources)
        self._start, self.started = start, start is not None
        self._waiting: tuple[int, str, str] | None = None  # (round, stage, why) where a stage's output is not known

    def run(self, stage: Stage, k: int, *inputs):
        return stage.call(self.at, k, *inputs)[0]

    def start(self):
        return self._start

    def known(self, m) -> bool:
        if not pending(m):
            return True
        self._waiting = (m.round, m.stage, f"on the {m.stage} of round {m.round}: what it chooses is known once the "
                                           "rounds before it are labelled and evaluated")
        return False

    def agreement(self, k, labels, train_set):
        from ratchet.tasks import agreement

        if pending(labels) or pending(train_set):
            return ""  # decided once the labels are there
        cfg = self.cfg
        try:
            return agreement.check(cfg.agreement, cfg.label.title(), k, labels.metrics, train_set.metrics).note
        except agreement.LabelDisagreesError as e:
            self.planner.note("train", k, "waits", f"the agreement gate stops round {k} before training: {e}")
            raise _Stop from None

    def round_zero(self, base, targets, k):
        return self._evaluate(k, base, targets)

    def cold_start_round(self, k, base, demos, targets, before):
        from ratchet.flows.shape import cold_start_shape

        made = cold_start_shape(self.cfg, self, k, base, demos)
        return self._evaluate(k, made.candidate, targets, voters=made.voters)

    def begin(self, k, results):
        from ratchet.flows.shape import trains_from

        known = all(r.accuracy is not None for r in results)
        decides = self.cfg.evaluate.next_round_from == "best" or self.cfg.evaluate.floor is not None
        if decides and not known and len(results) > 1:
            return None  # which model round k trains is known once the rounds before it are evaluated
        return trains_from(results, self.cfg.evaluate) if known else results[-1]

    def ends(self, k, curriculum):
        pass  # its stage's line says why (reused: its metrics hold the decision)

    def round(self, k, start, pool, targets, first, label_model, optimiser_model, voters):
        from ratchet.flows.shape import round_shape

        made = round_shape(self.cfg, self, k, start.policy, pool, first, label_model, optimiser_model, voters)
        return self._evaluate(k, made.candidate, targets, made.scored, made.voters)

    def waits(self, k):
        from ratchet.flows.shape import round_stage_names

        on, stage, why = self._waiting or (None, None, "on the gate's decision (evaluate.next_round_from=best, or "
                                                       "evaluate.floor): which model round k trains is known once "
                                                       "the rounds before it are evaluated")
        for name in round_stage_names(self.cfg):
            if not (name == stage and on == k):  # that one has its own line already
                self.planner.note(name, k, "waits", why)

    def _evaluate(self, k, policy, targets, scored=None, voters=()) -> _Round:
        from ratchet.tasks import evaluate

        made = {t.name: self.run(evaluate.STAGE, k, policy, t) for t in targets}
        scores = {name: None if pending(m) else m.metrics["accuracy"] for name, m in made.items()}
        if any(v is None for v in scores.values()):
            return _Round(k, policy, None, None, scored, made, list(voters))
        return _Round(k, policy, scores[self.cfg.evaluate.gate_set], scores, scored, made, list(voters))


def _walk(cfg: PipelineConfig, planner: Planner, store: ArtifactStore, sources: dict[str, str],
          start: StageManifest | None, pool_start: int) -> None:
    """The run's stages, in the flow's order: flows/shape.py walked with the plan's steps."""
    from ratchet.flows.shape import run_shape

    try:
        run_shape(cfg, PlanSteps(cfg, planner, store, sources, start, pool_start))
    except _Stop:
        return


def start_of(cfg: PipelineConfig, workdir: Path, version: str) -> StageManifest:
    """The stage behind the registered version a run continues from, read from MLflow's registry
    without a Tracker (which would create the experiment): its `ratchet.stage_dir` tag."""
    from mlflow.tracking import MlflowClient

    from ratchet.data.errors import RatchetError
    from ratchet.data.manifest import read_manifest
    from ratchet.flows.tracking import store_uri

    uri = store_uri(cfg.tracking, workdir)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise RatchetError(f"the run continues from version {version}, but its MLflow store {uri} is not there")
    name = cfg.tracking.model_name or f"ratchet-{cfg.name}"
    mv = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version(name, version)
    m = read_manifest(workdir / mv.tags.get("ratchet.stage_dir", "-"))
    if m is None:
        raise RatchetError(f"{name} version {version} names no finished stage in {workdir}")
    return m
