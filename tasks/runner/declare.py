"""A stage, declared once, in its own module; the one registration line is in tasks/registry.py.

    STAGE = Stage("sample", role="data", body=sample_body, call=call,
                  records=Records(datasets=(("samples.jsonl", "samples"),)))

- `name`: the store's name for it (its directory `stages/<name>-<key>`, its manifest's `stage`).
  `named(suffix)` is the same stage under `<name>.<suffix>` (one evaluation per held-out set).
- `role`: what its manifest holds: `model` (weights), `text` (a prompt's text over weights: a
  pair), `data` (rows: prompts, samples, labels, a training set) or `eval` (a held-out figure).
  `run_stage` writes it into the manifest and every parent reference, so a reader (lineage, gc,
  a policy's text, the weights a stage trains from) asks the manifest, never its name.
- `body`: the function that computes it (`run_stage` keys it and runs it, maybe in a worker).
- `call`: how a run calls it, `call(at, k, *inputs) -> (manifest, reused)`: the job made from
  the run's config (`at.cfg`) and `STAGE.run(...)`. The flow makes this call in the stage's
  Prefect task; `ratchet plan` makes the same call on a store that keys the stage instead of
  running it (tasks/runner/plan.py), so the two cannot key a stage differently.
- `records`: what its task logs to MLflow: datasets, artifacts, the training curve, metrics on
  the run's parent at step k (flows/stages.py, which knows MLflow, reads it).
- `tags`: what the stage says of the round's model: tags on the round's MLflow run and on the
  version registered from it (a round's prompts, its level).
- `after`, `when`: a stage a round runs right after another one (`after`, by name), on that
  stage's output, where the config asks for it (`when(cfg)`); what it makes stands in for that
  output for the stages after it. Built-in stages are placed by flows/shape.py; `after` lets a
  stage place itself.

`task` is the stage's Prefect task, made on first use (Prefect is imported then, not by `ratchet
plan` or `ratchet check`): it makes `call` and hands the result to the run's recorder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ratchet.data.manifest import Role, StageManifest
from ratchet.data.store import ArtifactStore

Made = tuple[StageManifest, bool]  # a stage's manifest, and whether it was reused


@dataclass(frozen=True)
class Records:
    """What a stage's task logs to MLflow, besides its metrics (always, once per run).

    `on`: the MLflow run it is logged on: the round's (`round`, where the round calls it) or the
    pipeline run's parent (`run`: the run's prompts, its pool, its curriculum). `datasets`:
    (output file, dataset context) pairs logged as MLflow inputs with the file's sha256; `{suffix}`
    in a context is the stage's name after its first dot (`prompts.more` -> `more`). `artifacts`:
    output files logged as artifacts under `artifact_path`, those the manifest has. `curve`: the
    training log as metric history. `metrics`: these metrics of the manifest again on the parent,
    at step k, under `prefix` (`{suffix}.` appended where the name has one). `log`: the worker's
    log as the artifact logs/<stage>.log."""

    on: Literal["round", "run"] = "round"
    datasets: tuple[tuple[str, str], ...] = ()
    artifacts: tuple[str, ...] = ()
    artifact_path: str = ""
    curve: bool = False
    metrics: tuple[str, ...] = ()
    prefix: str = ""
    log: bool = True


class Recorder(Protocol):
    """What a stage's Prefect task hands its result to (flows/stages.py StoreTracker): the run's
    place (`at`) and its MLflow records."""

    at: At

    def record(self, stage: Stage, m: StageManifest, reused: bool, k: int, child: str | None) -> None: ...


def _no_tags(m: StageManifest) -> dict[str, str]:
    return {}


@dataclass(frozen=True, eq=False)
class Stage:
    name: str
    role: Role
    body: Callable
    call: Callable[..., Made] | None = None
    records: Records = Records()
    tags: Callable[[StageManifest], dict[str, str]] = _no_tags
    after: str | None = None
    when: Callable[[Any], bool] | None = None
    _task: list = field(default_factory=list, repr=False)  # the Prefect task, once made

    def named(self, suffix: str) -> Stage:
        """This stage under `<name>.<suffix>`: one of several of a run (an evaluation per set)."""
        return dataclasses.replace(self, name=f"{self.name}.{suffix}", _task=[])

    @property
    def family(self) -> str:
        return self.name.partition(".")[0]

    @property
    def suffix(self) -> str:
        return self.name.partition(".")[2]

    def run(self, store: ArtifactStore, *, round: int, config, parents: list[StageManifest], name: str | None = None,
            **how) -> Made:
        """`run_stage` for this stage: its body and role, under its name (or `name`: one of several
        of a run, `evaluate.<set>`); `how`: run_stage's own settings (isolate, keep_partial, run,
        executor)."""
        from ratchet.tasks.runner.stage import run_stage

        return run_stage(store, stage=name or self.name, round=round, body=self.body, role=self.role, config=config,
                         parents=parents, **how)

    @property
    def task(self):
        """The stage's Prefect task, `task(recorder, k, inputs, child)`: it makes `call(recorder.at,
        k, *inputs)` and hands what it made to the recorder (MLflow, on the round's run `child`);
        a reused stage ends in a Completed state named "Cached", its manifest the state's result."""
        if not self._task:
            from prefect import task
            from prefect.cache_policies import NONE

            stage = self

            def run_stage_task(recorder: Recorder, k: int, inputs: tuple, child: str | None):
                m, reused = stage.call(recorder.at, k, *inputs)
                recorder.record(stage, m, reused, k, child)
                return finished(m, reused)

            self._task.append(task(name=self.name, cache_policy=NONE, retries=0,
                                   task_run_name=f"{self.name}-r{{k}}")(run_stage_task))
        return self._task[0]


def finished(m: StageManifest, reused: bool):
    """A reused stage ends its Prefect task in a Completed state named "Cached".

    The cache is the artifact store, keyed by stage + code version + config slice + input
    digests and verified on every hit; Prefect's own cache policies (which include the flow
    run) are off. Callers unwrap the state with `unwrap`."""
    if not reused:
        return m
    from prefect.states import Completed

    return Completed(name="Cached", data=m, message=f"{m.stage} reused from {m.dir} (key {m.key[:16]}, verified)")


@dataclass
class At:
    """Where a stage is called from: the run's config (flows/config.py PipelineConfig), its store,
    the run it is recorded for (None: `ratchet plan`, which records nothing), and what the run
    knows that its config does not say: where in the pool's stream its rounds start
    (`pool_start`) and the digests of the data it checked (`sources`)."""

    cfg: Any
    store: ArtifactStore
    run: str | None = None
    pool_start: int = 0
    sources: dict[str, str] = field(default_factory=dict)

    def seed(self, k: int, voter: int = 0) -> int:
        """Round k's seed; a voter's (a model trained beside the policy, label.kind=vote) its own."""
        base = self.cfg.seed * 1000 + k
        if not voter:
            return base
        import hashlib

        return int(hashlib.sha256(f"{base}/voter-{voter}".encode()).hexdigest()[:8], 16)

    @property
    def planning(self) -> bool:
        """`ratchet plan`: the store keys stages and runs none."""
        return self.store.planner is not None

    def unknown(self, stage: Stage, round: int, why: str) -> Made:
        """A stage the plan cannot key yet (`why`); the run finds out when it gets there."""
        planner = self.store.planner
        planner.note(stage.name, round, "to run", why)
        return planner.placeholder(stage.name, round, stage.role), False
