"""The two root stages of every pipeline: the prompt split and the base model.

`prompts` writes train.jsonl and eval.jsonl from the configured source.
`base` links the starting model's files into the store, so a model is always a
stage directory with digests, whatever its origin.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ratchet.data.digest import sha256_file
from ratchet.data.errors import ConfigError
from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import load_split
from ratchet.data.records import write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.tasks.stage import StageRequest, code_version, run_stage

PROMPTS_CODE = code_version("ratchet.tasks.prepare", "ratchet.data.prompts", "ratchet.data.records")
BASE_CODE = code_version("ratchet.tasks.prepare")


def prompts_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    from pydantic import TypeAdapter

    from ratchet.data.prompts import SourceConfig

    src = TypeAdapter(SourceConfig).validate_python(req.config["data"])
    split = load_split(src, req.seed)
    if split.digests != req.config["sources"]:
        changed = sorted(k for k in split.digests if split.digests[k] != req.config["sources"].get(k))
        raise ConfigError([f"data.{k}={getattr(src, k)!r} changed after this run checked it; re-run the command "
                           "to start from the new content" for k in changed])
    if not split.train:
        raise ConfigError([f"data: the source {src.kind!r} yielded no train prompts; check data.path / data.train_size"])
    d = store.stage_dir(req.stage, req.key)
    n_tr = write_jsonl(d / "train.jsonl", split.train)
    n_ev = write_jsonl(d / "eval.jsonl", split.eval)
    with_answer = sum(p.answer is not None for p in split.train)
    return store.finish(
        stage=req.stage, round=req.round, key=req.key, code_version=req.code_version, config=req.config,
        parents=[], outputs={"train.jsonl": n_tr, "eval.jsonl": n_ev},
        metrics={"train_prompts": n_tr, "eval_prompts": n_ev, "train_with_answer": with_answer},
        started=req.started,
    )


def prompts(store: ArtifactStore, data_cfg: dict, seed: int, sources: dict[str, str],
            run: str | None = None) -> tuple[StageManifest, bool]:
    """The train/eval split. `sources`: the content digest of every file the data config reads
    (load_split's digests), so an edited file, directory or dataset is a new stage."""
    cfg = {"data": data_cfg, "seed": seed, "sources": sources}
    return run_stage(store, stage="prompts", round=0, body="ratchet.tasks.prepare:prompts_body",
                     code=PROMPTS_CODE, config=cfg, parents=[], run=run)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def model_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def base_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    src = Path(req.config["path"])
    d = store.stage_dir(req.stage, req.key) / "model"
    d.mkdir(parents=True, exist_ok=True)
    for f in model_files(src):
        _link_or_copy(f, d / f.name)
    return store.finish(
        stage=req.stage, round=0, key=req.key, code_version=req.code_version, config=req.config, parents=[],
        outputs={f"model/{f.name}": None for f in model_files(d)},
        info={"source": req.config["source"], "origin_path": str(src)}, started=req.started,
    )


def base_model(store: ArtifactStore, source: str, model_dir: Path, run: str | None = None
               ) -> tuple[StageManifest, bool]:
    """The starting policy as a store stage; keyed by the weights' digest, not the path."""
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not weights:
        raise ConfigError([f"model.path={str(model_dir)!r} has no *.safetensors or *.bin weights; "
                           "point model.path at a Hugging Face model directory"])
    digests = {f.name: sha256_file(f) for f in model_files(model_dir)}
    cfg = {"source": source, "path": str(model_dir), "files": digests}
    return run_stage(store, stage="base", round=0, body="ratchet.tasks.prepare:base_body",
                     code=BASE_CODE, config=cfg, parents=[], run=run)


def model_dir(store: ArtifactStore, m: StageManifest) -> Path:
    """The model directory a base or train stage produced."""
    return store.dir_of(m) / "model"
