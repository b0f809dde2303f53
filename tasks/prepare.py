"""The two root stages of every pipeline: the prompt split and the base model.

`prompts` writes train.jsonl and eval.jsonl from the configured source.
`base` links the starting model's files into the store, so a model is always a
stage directory with digests, whatever its origin.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.digest import sha256_file
from ratchet.data.errors import ConfigError
from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import SourceConfig, load_split
from ratchet.data.records import write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.tasks.stage import StageRequest, code_version, run_stage

PROMPTS_CODE = code_version("ratchet.tasks.prepare", "ratchet.data.prompts", "ratchet.data.records")
BASE_CODE = code_version("ratchet.tasks.prepare")


class PromptsJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    data: SourceConfig
    seed: int
    sources: dict[str, str] = Field(description="content digest of every file the data config reads")


class BaseJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str = Field(description="model.path as the user gave it")
    path: str = Field(description="the model directory it resolved to")
    files: dict[str, str] = Field(description="sha256 of every file in it: the key, whatever the path")


def prompts_body(req: StageRequest[PromptsJob], store: ArtifactStore) -> StageManifest:
    src = req.config.data
    split = load_split(src, req.seed)
    if split.digests != req.config.sources:
        changed = sorted(k for k in split.digests if split.digests[k] != req.config.sources.get(k))
        raise ConfigError([f"data.{k}={getattr(src, k)!r} changed after this run checked it; re-run the command "
                           "to start from the new content" for k in changed])
    if not split.train:
        raise ConfigError([f"data: the source {src.kind!r} yielded no train prompts; check data.path / data.train_size"])
    d = store.stage_dir(req.stage, req.key)
    n_tr = write_jsonl(d / "train.jsonl", split.train)
    n_ev = write_jsonl(d / "eval.jsonl", split.eval)
    with_answer = sum(p.answer is not None for p in split.train)
    return req.finish(store, outputs={"train.jsonl": n_tr, "eval.jsonl": n_ev},
                      metrics={"train_prompts": n_tr, "eval_prompts": n_ev, "train_with_answer": with_answer})


def prompts(store: ArtifactStore, data_cfg: SourceConfig, seed: int, sources: dict[str, str],
            run: str | None = None) -> tuple[StageManifest, bool]:
    """The train/eval split. `sources`: the content digest of every file the data config reads
    (load_split's digests), so an edited file, directory or dataset is a new stage."""
    return run_stage(store, stage="prompts", round=0, body=prompts_body, code=PROMPTS_CODE,
                     config=PromptsJob(data=data_cfg, seed=seed, sources=sources), parents=[], run=run)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def model_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def base_body(req: StageRequest[BaseJob], store: ArtifactStore) -> StageManifest:
    src = Path(req.config.path)
    d = store.stage_dir(req.stage, req.key) / "model"
    d.mkdir(parents=True, exist_ok=True)
    for f in model_files(src):
        _link_or_copy(f, d / f.name)
    return req.finish(store, outputs={f"model/{f.name}": None for f in model_files(d)},
                      info={"source": req.config.source, "origin_path": str(src)})


def base_model(store: ArtifactStore, source: str, model_dir: Path, run: str | None = None
               ) -> tuple[StageManifest, bool]:
    """The starting policy as a store stage; keyed by the weights' digest, not the path."""
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not weights:
        raise ConfigError([f"model.path={str(model_dir)!r} has no *.safetensors or *.bin weights; "
                           "point model.path at a Hugging Face model directory"])
    digests = {f.name: sha256_file(f) for f in model_files(model_dir)}
    return run_stage(store, stage="base", round=0, body=base_body, code=BASE_CODE,
                     config=BaseJob(source=source, path=str(model_dir), files=digests), parents=[], run=run)


def model_dir(store: ArtifactStore, m: StageManifest) -> Path:
    """The model directory a base or train stage produced."""
    return store.dir_of(m) / "model"
