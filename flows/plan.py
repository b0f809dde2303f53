"""`ratchet plan CONFIG [key=value ...]`: for every stage of every round, whether the run would reuse
it, run it again and why, run it for the first time, or wait on a stage before it; in the manner
of `terraform plan`, `dvc status` and `snakemake -n --reason`.

    ratchet plan flows/configs/default.yaml
    ratchet plan flows/configs/default.yaml sample.temperature=0.9 --json

It reads the data (the checks `ratchet check` makes of it, not those that need the tokenizer),
the store's manifests and the code; it loads no model, imports neither torch nor vLLM, and
writes nothing in the workdir or in MLflow. Each stage is keyed by `run_stage` itself, handed to
a planner (tasks/plan.py) instead of run, so the plan and the run cannot key a stage differently.
The walk below follows the flow (flows/pipeline.py): the stages of round 0, then each round's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.flows.config import PipelineConfig
from ratchet.tasks.plan import Planner, Step, pending


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


def plan(cfg: PipelineConfig, run: str | None = None, start: StageManifest | None = None,
         pool_start: int | None = None, sources: dict[str, str] | None = None) -> Plan:
    """The plan of the run `cfg` names (`run`: its name, when a record or `--from` gives another),
    from the base model, or from `start` (a registered version's stage, `--from`). `sources`: the
    data's digests where the caller has checked the data already (`ratchet run`)."""
    from ratchet.flows.inputs import check_data, sources_of, with_sets
    from ratchet.flows.runs import read_record, run_name_for

    if sources is None:
        split, sets = check_data(cfg)
        sources = with_sets(split, sets).digests
    workdir = Path(cfg.workdir).resolve()
    run = run or run_name_for(cfg)
    if pool_start is None:
        record = workdir / "runs" / f"{run}.json"
        pool_start = read_record(record).ctx.pool_start if record.is_file() else 0
    planner = Planner(ArtifactStore(workdir, create=False), run, cfg.name)
    store = ArtifactStore(workdir, create=False, planner=planner)  # run_stage hands its stages to the planner
    _walk(cfg, planner, store, sources_of(sources), sources, start, pool_start)
    return Plan(run=run, workdir=workdir, steps=planner.steps)


def _walk(cfg: PipelineConfig, planner: Planner, store: ArtifactStore, data_sources, sources: dict[str, str],
          start: StageManifest | None, pool_start: int) -> None:
    from ratchet.flows.pipeline import trains_from
    from ratchet.flows.stages import EvalTarget, round_seed
    from ratchet.tasks import agreement, prepare
    from ratchet.tasks import filter as filter_mod
    from ratchet.tasks import label as label_mod
    from ratchet.tasks import sample as sample_mod
    from ratchet.tasks import train as train_mod

    prompts, _ = prepare.prompts(store, cfg.data.pool(), cfg.seed, data_sources)
    base = start if start is not None else _base(cfg, planner, store)
    first = base.round if start is not None else 0
    fixed = None
    if (src := cfg.label.fixed_model()) is not None:
        fixed = _model_stage(cfg, planner, store, src, "label-model", "label.model", cfg.label.chats)
    targets = []
    for s, stage in cfg.evaluate.stages():
        held, source = prompts, s.source(cfg.data)
        if s.data is not None:
            from ratchet.flows.inputs import sources_of

            held, _ = prepare.held_out(store, s.name, source, cfg.seed, sources_of(sources, s.name))
        targets.append(EvalTarget(name=s.name, stage=stage, prompts=held, source=source,
                                  rollout=s.rollout or cfg.sample.rollout))
    results = [_evaluate(cfg, store, base, targets, first)]
    if cfg.cold_start is not None and start is None:  # generation 1: the base model on the demonstrations
        from ratchet.flows.inputs import DEMOS
        from ratchet.tasks import cold_start

        demos, _ = cold_start.demonstrations(store, cfg.cold_start.demonstrations, sources[DEMOS])
        candidate, _ = cold_start.cold_start(store, base, demos, cfg.cold_start, cfg.sample.rollout,
                                             round_seed(cfg, first + 1), first + 1, isolate=cfg.isolate)
        results.append(_evaluate(cfg, store, candidate, targets, first + 1))
    begun, last = len(results) - 1, results[-1].round  # the rounds build on the cold start, whatever the base scored
    for k in range(last + 1, last + cfg.rounds + 1):
        if cfg.data.retire_solved and results[-1].scored is not None:  # what the last round solved leaves the pool
            prompts, _ = prepare.retire(store, prompts, results[-1].scored, cfg.label.reward_range()[1], k)
        known = all(r.accuracy is not None for r in results[begun:])
        if cfg.evaluate.next_round_from == "best" and not known and len(results) - begun > 1:
            for stage in _round_stages(cfg):
                planner.note(stage, k, "waits", "on the gate's decision (evaluate.next_round_from=best): which model "
                             "round k trains is known once the rounds before it are evaluated")
            continue
        begin = trains_from(results[begun:], cfg.evaluate) if known else results[-1]
        policy, seed = begin.policy, round_seed(cfg, k)
        train = prompts
        if cfg.data.prompts_per_round:
            count = cfg.data.prompts_per_round
            train, _ = prepare.round_prompts(store, prompts, pool_start + (k - last - 1) * count, count, cfg.seed, k)
        if cfg.train.online:  # it samples and scores inside its own stage
            candidate, _ = train_mod.train_online(store, policy, train, cfg.train, cfg.sample, cfg.sampler, cfg.label,
                                                  cfg.data, seed, k, isolate=cfg.isolate, label_model=fixed)
            results.append(_evaluate(cfg, store, candidate, targets, k, scored=candidate))
            continue
        common = dict(sampler=cfg.sampler, seed=seed, isolate=cfg.isolate, executor=cfg.executor,
                      rollout=cfg.sample.rollout, turn_tokens=cfg.sample.max_tokens)
        if cfg.label.consumes == "prompts":
            labels, _ = label_mod.label(store, train, cfg.label, cfg.data.pool(), k, policy=fixed or policy, **common)
        else:
            samples, _ = sample_mod.sample(store, policy, train, cfg.sample, cfg.sampler, seed, k, isolate=cfg.isolate,
                                           executor=cfg.executor)
            labels, _ = label_mod.label(store, samples, cfg.label, cfg.data.pool(), k, policy=fixed or policy,
                                        **common)
        train_set, _ = filter_mod.filter_rows(store, labels, cfg.filter, seed, k)
        if not pending(labels) and not pending(train_set):
            try:
                agreement.check(cfg.agreement, cfg.label.title(), k, labels.metrics, train_set.metrics)
            except agreement.LabelDisagreesError as e:
                planner.note("train", k, "waits", f"the agreement gate stops round {k} before training: {e}")
                return
        candidate, _ = train_mod.train(store, policy, train_set, cfg.train, seed, k, isolate=cfg.isolate)
        results.append(_evaluate(cfg, store, candidate, targets, k,
                                 scored=labels if cfg.label.consumes == "samples" else None))


def _round_stages(cfg: PipelineConfig) -> list[str]:
    stages = ["pool"] if cfg.data.retire_solved else []
    stages += ["slice"] if cfg.data.prompts_per_round else []
    if cfg.train.online:
        return stages + ["train"] + [stage for _, stage in cfg.evaluate.stages()]
    stages += ["label"] if cfg.label.consumes == "prompts" else ["sample", "label"]
    return stages + ["filter", "train"] + [stage for _, stage in cfg.evaluate.stages()]


def _evaluate(cfg: PipelineConfig, store: ArtifactStore, policy: StageManifest, targets: list, k: int,
              scored: StageManifest | None = None) -> _Round:
    from ratchet.tasks import evaluate as evaluate_mod

    scores = {}
    for t in targets:
        m, _ = evaluate_mod.evaluate(store, policy, t.prompts, cfg.evaluate, cfg.sampler, t.source, cfg.seed, k,
                                     isolate=cfg.isolate, executor=cfg.executor, stage=t.stage, rollout=t.rollout)
        scores[t.name] = None if pending(m) else m.metrics["accuracy"]
    if any(v is None for v in scores.values()):
        return _Round(k, policy, None, None, scored)
    return _Round(k, policy, scores[cfg.evaluate.gate_set], scores, scored)


def _base(cfg: PipelineConfig, planner: Planner, store: ArtifactStore) -> StageManifest:
    return _model_stage(cfg, planner, store, cfg.model.path, "base", "model.path", True)


def _model_stage(cfg: PipelineConfig, planner: Planner, store: ArtifactStore, src: str, stage: str, field_name: str,
                 chats: bool) -> StageManifest:
    """The base (or label-model) stage, keyed as the run keys it: by the weights' digests and the
    template its copy reads prompts with (found in a child process where it needs the tokenizer:
    this one imports no model library)."""
    from ratchet.models import prompt_format
    from ratchet.tasks import prepare

    path = _model_dir(src)
    if path is None:
        planner.note(stage, 0, "to run", f"{field_name}={src!r} is converted (the embedded default) or fetched "
                     "on first use; nothing of it is here yet")
        return planner.placeholder(stage, 0)
    fmt = cfg.model.prompt_format if stage == "base" else "auto"
    if stage == "base" or chats:
        template = prompt_format.written_template(path, fmt, cfg.model.plain_layout) if fmt != "auto" else \
            _apart(prompt_format.written_template, path, fmt, cfg.model.plain_layout)
    else:
        template = None
    m, _ = prepare.base_model(store, src, path, stage=stage, field=field_name, template=template)
    return m


def _model_dir(src: str) -> Path | None:
    """The model directory a config names, where it is here; None where a run would first convert
    it (the embedded default) or fetch it (a hub id not in the cache)."""
    if src == "default":
        from ratchet.models.default_model import default_model_dir

        return default_model_dir(convert=False)
    p = Path(src).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        from ratchet.flows.inputs import hub_id

        repo, revision = hub_id(src)
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache: the run fetches it
        return None


def _apart(fn, *args):
    """`fn(*args)` in another process, as the base stage's task makes it: a child of the run's fork
    server where there is one (`ratchet run`), else a fresh one (`ratchet plan`): what reads a
    tokenizer imports torch, which this process does not."""
    from ratchet.data.procs import forkserver

    if forkserver.current() is not None:
        return forkserver.call(fn, *args)
    return forkserver.call_apart(fn, *args)


def start_of(cfg: PipelineConfig, workdir: Path, version: str) -> StageManifest:
    """The stage behind the registered version a run continues from, read from MLflow's registry
    without a Tracker (which would create the experiment): its `ratchet.stage_dir` tag."""
    from mlflow.tracking import MlflowClient

    from ratchet.data.errors import RatchetError
    from ratchet.data.manifest import read_manifest

    uri = cfg.tracking.uri or f"sqlite:///{workdir / 'mlflow.db'}"
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise RatchetError(f"the run continues from version {version}, but its MLflow store {uri} is not there")
    name = cfg.tracking.model_name or f"ratchet-{cfg.name}"
    mv = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version(name, version)
    m = read_manifest(workdir / mv.tags.get("ratchet.stage_dir", "-"))
    if m is None:
        raise RatchetError(f"{name} version {version} names no finished stage in {workdir}")
    return m
