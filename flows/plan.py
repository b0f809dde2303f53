"""`ratchet plan CONFIG [key=value ...]`: for every stage of every round, whether the run would reuse
it, run it again and why, run it for the first time, or wait on a stage before it; in the manner
of `terraform plan`, `dvc status` and `snakemake -n --reason`.

    ratchet plan flows/configs/default.yaml
    ratchet plan flows/configs/default.yaml sample.temperature=0.9 --json

It reads the data (the checks `ratchet check` makes of it, not those that need the tokenizer),
the store's manifests and the code; it loads no model, imports neither torch nor vLLM, and
writes nothing in the workdir or in MLflow. Each stage is keyed by `run_stage` itself, handed to
a planner (tasks/runner/plan.py) instead of run, so the plan and the run cannot key a stage differently.
The walk is the flow's own: flows/shape.py, which both walk, each with its own steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore
from ratchet.flows.config import PipelineConfig
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
    evaluations: list[StageManifest] = field(default_factory=list)  # the curriculum reads its level's


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


class PlanRound:
    """A round's stages as the plan walks them (flows/shape.py `round_shape`): each keyed by the
    same call the flow makes, on a store that notes it instead of running it."""

    def __init__(self, calls, planner: Planner, pool_start: int):
        self.calls, self.planner, self.pool_start = calls, planner, pool_start

    def slice(self, k, first, prompts):
        return self.calls.slice(k, first, self.pool_start, prompts)[0]

    def online_train(self, k, policy, prompts, label_model):
        return self.calls.online_train(k, policy, prompts, label_model)[0]

    def sample(self, k, policy, prompts):
        return self.calls.sample(k, policy, prompts)[0]

    def label(self, k, source, policy, label_model):
        return self.calls.label(k, source, policy, label_model)[0]

    def filter(self, k, labels):
        return self.calls.filter(k, labels)[0]

    def agreement(self, k, labels, train_set):
        from ratchet.tasks import agreement

        if pending(labels) or pending(train_set):
            return ""  # decided once the labels are there
        try:
            return self.calls.agreement(k, labels, train_set).note
        except agreement.LabelDisagreesError as e:
            self.planner.note("train", k, "waits", f"the agreement gate stops round {k} before training: {e}")
            raise _Stop from None

    def train(self, k, policy, train_set):
        return self.calls.train(k, policy, train_set)[0]

    def search(self, k, policy, prompts, optimiser):
        return self.calls.search(k, policy, prompts, optimiser)[0]

    def bind(self, k, weights, carried):
        return self.calls.bind(k, weights, carried)[0]


class PlanRun:
    """The run's steps as the plan walks them (flows/shape.py `run_shape`)."""

    def __init__(self, cfg: PipelineConfig, planner: Planner, store: ArtifactStore, sources: dict[str, str],
                 start: StageManifest | None, pool_start: int):
        from ratchet.flows.shape import Calls

        self.cfg, self.planner, self.store, self.sources = cfg, planner, store, sources
        self.start, self.started = start, start is not None
        self.calls = Calls(cfg, store)
        self.rounds = PlanRound(self.calls, planner, pool_start)
        self._waiting: tuple[int, str] | None = None  # (round, why) where a curriculum stage is not known yet

    def prompts(self):
        from ratchet.flows.inputs import sources_of

        return self.calls.prompts(sources_of(self.sources))[0]

    def base(self):
        return self.start if self.started else _base(self.cfg, self.planner, self.store)

    def bind(self, k, weights, carried):
        return self.calls.bind(k, weights, carried)[0]

    def label_model(self):
        return _model_stage(self.cfg, self.planner, self.store, self.cfg.label.fixed_model(), "label-model",
                            "label.model", self.cfg.label.chats)

    def optimiser_model(self):
        return _model_stage(self.cfg, self.planner, self.store, self.cfg.prompt.optimiser_model(), "optimiser-model",
                            "prompt.search.optimiser.path", True)

    def targets(self, prompts):
        return [t for t, _ in self.calls.held_out(prompts, self.sources)]

    def round_zero(self, base, targets, k):
        return self._evaluate(k, base, targets)

    def demonstrations(self):
        from ratchet.flows.inputs import DEMOS

        return self.calls.demonstrations(self.sources[DEMOS])[0]

    def cold_start_round(self, k, base, demos, targets, before):
        from ratchet.flows.shape import carries_text

        trained = self.calls.cold_start(k, base, demos)[0]
        return self._evaluate(k, self.calls.bind(k, trained, base)[0] if carries_text(base) else trained, targets)

    def begin(self, k, results):
        from ratchet.flows.pipeline import trains_from

        known = all(r.accuracy is not None for r in results)
        if self.cfg.evaluate.next_round_from == "best" and not known and len(results) > 1:
            return None  # which model round k trains is known once the rounds before it are evaluated
        return trains_from(results, self.cfg.evaluate) if known else results[-1]

    def retire(self, k, pool, scored):
        return self.calls.retire(k, pool, scored)[0]

    def curriculum(self, k, prompts, before, last):
        m = self.calls.curriculum(k, prompts, before, last)[0]
        if pending(m):
            self._waiting = (k, f"on the curriculum of round {k}: its prompts and level are known once the rounds "
                                "before it are labelled and evaluated")
            return None
        return m

    def ends(self, k, curriculum):
        pass  # its stage's line says why (reused: its metrics hold the decision)

    def round(self, k, start, pool, targets, first, label_model, optimiser_model):
        from ratchet.flows.shape import round_shape

        made = round_shape(self.cfg, self.rounds, k, start.policy, pool, first, label_model, optimiser_model)
        return self._evaluate(k, made.candidate, targets, made.scored)

    def waits(self, k):
        from ratchet.flows.shape import round_stage_names

        on, why = self._waiting or (None, "on the gate's decision (evaluate.next_round_from=best): "
                                                       "which model round k trains is known once the rounds before "
                                                       "it are evaluated")
        for stage in round_stage_names(self.cfg):
            if not (stage == "curriculum" and on == k):  # that one has its own line already
                self.planner.note(stage, k, "waits", why)

    def _evaluate(self, k, policy, targets, scored=None) -> _Round:
        scores, made = {}, []
        for t in targets:
            m, _ = self.calls.evaluate(k, policy, t)
            made.append(m)
            scores[t.name] = None if pending(m) else m.metrics["accuracy"]
        if any(v is None for v in scores.values()):
            return _Round(k, policy, None, None, scored, made)
        return _Round(k, policy, scores[self.cfg.evaluate.gate_set], scores, scored, made)


def _walk(cfg: PipelineConfig, planner: Planner, store: ArtifactStore, sources: dict[str, str],
          start: StageManifest | None, pool_start: int) -> None:
    """The run's stages, in the flow's order: flows/shape.py walked with the plan's steps."""
    from ratchet.flows.shape import run_shape

    try:
        run_shape(cfg, PlanRun(cfg, planner, store, sources, start, pool_start))
    except _Stop:
        return


def _base(cfg: PipelineConfig, planner: Planner, store: ArtifactStore) -> StageManifest:
    if (served := cfg.sampler.endpoint) is not None:  # the policy is served elsewhere: keyed by its endpoint
        from ratchet.tasks import prepare

        return prepare.served_model(store, served.base_url, served.model)[0]
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
        if fmt != "auto":
            template = prompt_format.written_template(path, fmt, cfg.model.plain_layout)
        elif _has_chat_template_file(path):  # what loading its tokenizer would say, read from its files
            template = None
        else:
            template = _apart(prompt_format.written_template, path, fmt, cfg.model.plain_layout)
    else:
        template = None
    m, _ = prepare.base_model(store, src, path, stage=stage, field=field_name, template=template)
    return m


def _has_chat_template_file(path: Path) -> bool:
    """Whether the tokenizer in `path` has a chat template, where its files say so for certain:
    transformers reads a non-empty chat_template.jinja, or tokenizer_config.json's chat_template,
    into the loaded tokenizer's. False is "load it to know" (a template may come from elsewhere),
    which takes a child process importing transformers: about 6 s of a plan on 2 cores."""
    import json

    jinja = path / "chat_template.jinja"
    if jinja.is_file() and jinja.stat().st_size:
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


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
