"""Ratchet from Python: the same config, checks and runs as the commands, as functions.

    from ratchet.flows.api import check, load, run

    cfg = load("flows/configs/default.yaml", ["rounds=1", "workdir=runs"])
    check(cfg)                  # what `ratchet check` checks; raises ConfigError, nothing loaded
    result = run(cfg)           # what `ratchet run` runs, without its console
    for r in result.rounds:
        print(r.round, r.version, r.accuracy, r.promoted)
    print(result.champion, result.model_dir(result.champion))

`run` is `ratchet run`: the same stages, keys and store, so calling it again with the same
config continues the same run, and the CLI sees what it made (`ratchet runs`, `ratchet
report`). Its output goes to the process's own streams and logging.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.flows.config import PipelineConfig


@dataclass(frozen=True)
class RoundOutcome:
    """One round as the run recorded it."""

    round: int
    version: str | None  # its registered model version
    accuracy: float | None  # held-out accuracy on the gate's set
    accuracies: dict[str, float]  # on every held-out set, by name
    promoted: bool  # whether it became the champion


@dataclass(frozen=True)
class RunResult:
    run: str  # the run's name (`ratchet runs`, `ratchet resume RUN`)
    workdir: Path
    model_name: str  # the MLflow registered model
    rounds: list[RoundOutcome]
    champion: str | None  # the version the champion alias names after the run
    _tracker: Any = field(repr=False, compare=False, default=None)

    def model_dir(self, version: str | None) -> Path:
        """The Hugging Face model directory of a registered version (in the store; read it, do not
        write it): `AutoModelForCausalLM.from_pretrained(result.model_dir(v))`."""
        from ratchet.data.store import ArtifactStore
        from ratchet.flows.lineage import version_manifest
        from ratchet.tasks.prepare import model_dir

        if version is None:
            raise ValueError("no version: the run registered none (result.champion is None before any round)")
        store = ArtifactStore(self.workdir)
        return model_dir(store, version_manifest(store, self._tracker, str(version)), remake_here=False)


def load(config: str | Path | dict, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """A pipeline config from a YAML file (or a dict of the same shape) and `key=value` overrides,
    validated: a ConfigError names every bad field."""
    from ratchet.flows.config import config_from_dict, load_config

    if isinstance(config, dict):
        return config_from_dict(config, list(overrides))
    return load_config(config, list(overrides))


def check(cfg: PipelineConfig) -> None:
    """Every check `ratchet check` makes: the data's rows, the answer check, the model directory,
    its prompt format and every prompt against the token budgets. Raises ConfigError."""
    from ratchet.flows.inputs import check_task

    check_task(cfg)


def run(cfg: PipelineConfig, start_from: str | None = None) -> RunResult:
    """Run (or continue) the pipeline: `start_from` None for the base model, "champion" or a
    version number to add `cfg.rounds` rounds on top of it (`ratchet run --from`).

    Prefect: the server PREFECT_API_URL names, else a temporary one started for this process. A
    failed stage raises its error; every finished stage is kept, and calling `run` again with the
    same config resumes from the first unfinished one. The start is `ratchet run`'s
    (flows/launch.py), without its console."""
    from ratchet.flows.inputs import checked_run
    from ratchet.flows.launch import launcher, library_env, prepare_env

    if "prefect" not in sys.modules:  # Prefect reads its settings once, when first imported
        library_env()  # for the fork server started first; Prefect's home once the checks pass
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with checked_run(cfg) as split:  # before anything is written
        if "prefect" not in sys.modules:
            prepare_env(Path(cfg.workdir).resolve())
        with launcher(cfg, time.strftime("%Y%m%dT%H%M%S")) as launch:
            ctx, _ = launch.start(start_from, split)
            ctx, results, tracker = launch.execute(ctx)
    return RunResult(run=ctx.run_name, workdir=Path(ctx.workdir), model_name=tracker.model_name,
                     rounds=[RoundOutcome(r.round, r.version, r.accuracy, dict(r.accuracies), r.promoted)
                             for r in results],
                     champion=tracker.champion(), _tracker=tracker)
