"""MLflow tracking: a parent run per pipeline run, a child run per round.

Everything goes through MlflowClient with explicit run ids: MLflow's fluent
"active run" is thread-local, and Prefect runs tasks on worker threads.
Datasets are logged with the project's own full-file sha256 (MLflow's pandas
digest reads only the first 10,000 rows). Each round's model is registered as a
version tagged with its parent version, data digests, config hash and code version.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.manifest import StageManifest
from ratchet.data.store import ArtifactStore

CHAMPION = "champion"


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uri: str | None = Field(default=None, description="MLflow tracking URI; default sqlite:///<workdir>/mlflow.db")
    experiment: str | None = Field(default=None, description="experiment name; default ratchet-<name>")
    model_name: str | None = Field(default=None, description="registered model name; default ratchet-<name>")
    log_weights: bool = Field(
        default=False, description="copy full merged weights into MLflow artifacts (else adapter + digests only)"
    )


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


class Tracker:
    def __init__(self, cfg: TrackingConfig, workdir: Path, name: str):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        self.uri = cfg.uri or f"sqlite:///{workdir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.cfg = cfg
        self.workdir = workdir
        self.model_name = cfg.model_name or f"ratchet-{name}"
        exp_name = cfg.experiment or f"ratchet-{name}"
        exp = self.client.get_experiment_by_name(exp_name)
        if exp is None:
            art = None if cfg.uri else (workdir / "mlartifacts").resolve().as_uri()
            self.experiment_id = self.client.create_experiment(exp_name, artifact_location=art)
        else:
            self.experiment_id = exp.experiment_id

    # runs -----------------------------------------------------------------
    def start_parent(self, run_name: str, config: dict, tags: dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        rid = run.info.run_id
        params = flat(config)
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(rid, params=items[i : i + 100])
        self.log_text(rid, json.dumps(config, indent=2), "config/resolved.json")
        return rid

    def reopen(self, run_id: str, tags: dict[str, str]) -> bool:
        """Mark an earlier attempt's run as running again; False if the store no longer has it."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        self.client.update_run(run_id, status="RUNNING")
        for k, v in tags.items():
            self.client.set_tag(run_id, k, v)
        return True

    def child(self, parent_id: str, round: int, tags: dict[str, str]) -> str:
        """The round's child run: the one an earlier attempt created, or a new one."""
        found = self.client.search_runs(
            [self.experiment_id],
            f"tags.mlflow.parentRunId = '{parent_id}' and tags.`ratchet.round` = '{round}'",
        )
        if found:
            rid = found[0].info.run_id
            self.client.update_run(rid, status="RUNNING")
            return rid
        tags = {"mlflow.parentRunId": parent_id, "ratchet.round": str(round), **tags}
        return self.client.create_run(self.experiment_id, run_name=f"round-{round}", tags=tags).info.run_id

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    # metrics and artifacts --------------------------------------------------
    def log_metrics(self, run_id: str, metrics: dict[str, float], prefix: str = "", step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(f"{prefix}{k}", float(v), ts, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not math.isnan(float(v))]
        if items:
            self.client.log_batch(run_id, metrics=items)

    def log_stage(self, run_id: str, m: StageManifest, reused: bool) -> bool:
        """Log a stage's metrics once per run: a resumed run that reuses a stage it already
        logged adds nothing. Returns whether anything was logged."""
        run = self.client.get_run(run_id)
        if run.data.tags.get(f"ratchet.stage.{m.stage}") == m.dir:
            return False
        self.log_metrics(run_id, {**m.metrics, "wall_s": m.wall_s, "reused": float(reused)}, prefix=f"{m.stage}.")
        self.client.set_tag(run_id, f"ratchet.stage.{m.stage}", m.dir)
        return True

    def log_text(self, run_id: str, text: str, path: str) -> None:
        with tempfile.TemporaryDirectory() as t:
            p = Path(t) / Path(path).name
            p.write_text(text)
            self.client.log_artifact(run_id, str(p), artifact_path=str(Path(path).parent) or None)

    def log_train_curve(self, run_id: str, store: ArtifactStore, m: StageManifest) -> None:
        """The trainer's per-step log as stepped metrics: loss, grad norm, learning rate, and for
        DPO the implicit rewards, margins, accuracies and log-probs of chosen and rejected."""
        rows = [json.loads(x) for x in store.path(m, "train_log.jsonl").read_text().splitlines() if x.strip()]
        keys = sorted({k for r in rows for k, v in r.items()
                       if isinstance(v, (int, float)) and k not in ("step", "epoch", "num_tokens")})
        self.log_curve(run_id, rows, tuple(keys), prefix="train/")

    def log_curve(self, run_id: str, rows: list[dict], keys: tuple[str, ...], prefix: str) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(f"{prefix}{k}", float(r[k]), ts, int(r.get("step", i))) for i, r in enumerate(rows)
                 for k in keys if k in r]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i : i + 500])

    def log_dataset(self, run_id: str, store: ArtifactStore, m: StageManifest, name: str, context: str) -> None:
        """Log a JSONL artifact as a run input, digest = our full-file sha256."""
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        import warnings

        ref = m.outputs[name]
        with warnings.catch_warnings():
            # MLflow registers its local-file source class twice and warns that a path is ambiguous
            # between the two; both are the same class, so the warning carries no information
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(str(store.path(m, name)))
        ds = MetaDataset(source,
                         name=f"{m.stage}-r{m.round}-{Path(name).stem}", digest=ref.sha256[:20])
        tags = [InputTag("mlflow.data.context", context), InputTag("ratchet.sha256", ref.sha256),
                InputTag("ratchet.rows", str(ref.rows)), InputTag("ratchet.stage_dir", m.dir)]
        self.client.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(), tags)])

    # registry -------------------------------------------------------------
    def version_of(self, stage_key: str) -> str | None:
        """The registered version of the model a stage produced, if it was registered before."""
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.search_model_versions(
                f"name='{self.model_name}' and tags.`ratchet.stage_key` = '{stage_key}'"
            )
        except MlflowException:
            return None
        return str(min(int(v.version) for v in found)) if found else None

    def register(self, run_id: str, store: ArtifactStore, model: StageManifest, tags: dict[str, str]) -> str:
        """Log the model's artifacts to the round's run and register them as a version.

        The same model (same stage key) is registered once: a re-run gets the existing version.
        """
        from mlflow.exceptions import MlflowException

        if (existing := self.version_of(model.key)) is not None:
            return existing

        d = store.dir_of(model)
        card = {"stage_dir": str(d), "key": model.key, "files": {k: v.sha256 for k, v in model.outputs.items()}}
        self.log_text(run_id, json.dumps(card, indent=2), "model/ratchet-model.json")
        if (d / "adapter").is_dir():
            self.client.log_artifacts(run_id, str(d / "adapter"), artifact_path="model/adapter")
        if self.cfg.log_weights:
            self.client.log_artifacts(run_id, str(d / "model"), artifact_path="model/weights")
        try:
            self.client.create_registered_model(self.model_name)
        except MlflowException:
            pass  # already exists
        source = f"{self.client.get_run(run_id).info.artifact_uri}/model"
        v = self.client.create_model_version(self.model_name, source=source, run_id=run_id, tags=tags)
        return str(v.version)

    def champion(self) -> tuple[str, float] | None:
        """(version, accuracy) of the current champion, if any."""
        from mlflow.exceptions import MlflowException

        try:
            v = self.client.get_model_version_by_alias(self.model_name, CHAMPION)
        except MlflowException:
            return None
        return str(v.version), float(v.tags.get("ratchet.accuracy", "nan"))

    def promote_if_better(self, version: str, accuracy: float, min_improvement: float) -> bool:
        """Move `champion` to this version only if it beats the champion's held-out accuracy."""
        cur = self.champion()
        if cur is not None and not accuracy > cur[1] + min_improvement:
            return False
        self.client.set_registered_model_alias(self.model_name, CHAMPION, version)
        return True
