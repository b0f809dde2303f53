"""Stage manifests: the small typed records that stages exchange instead of data.

A stage directory is complete exactly when its manifest.json exists; the manifest
is written last and atomically. It lists every output file with its sha256, the
parent stages it was computed from, the config slice and the code version.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ratchet.data.digest import sha256_json
from ratchet.data.errors import ArtifactError

MANIFEST = "manifest.json"
STAGE_DIR = re.compile(r"stages/[a-z][a-z0-9_.-]{0,63}-[0-9a-z]{16}")  # the store writes hex keys


def _stage_dir(rel: str) -> str:
    """A manifest names directories of its own store only: `stages/<stage>-<key>`."""
    if not STAGE_DIR.fullmatch(rel):
        raise ValueError(f"{rel!r} is not a stage directory of a Ratchet store (stages/<stage>-<key>)")
    return rel


def _output_name(name: str) -> str:
    """An output is a file inside its stage directory: a relative POSIX path with no `..`, `.`
    or empty part, so no reader (verify, export, lineage) is sent outside the directory."""
    parts = name.split("/")
    if (not name or PurePosixPath(name).is_absolute() or "\\" in name or "\0" in name
            or any(part in ("", ".", "..") for part in parts)):
        raise ValueError(f"output name {name!r} is not a relative path inside the stage directory")
    return name


StageDir = Annotated[str, AfterValidator(_stage_dir)]
OutputName = Annotated[str, AfterValidator(_output_name)]
# What a stage's outputs are (its declaration says: tasks/runner/declare.py): weights (`model`), a
# prompt's text over weights (`text`, a pair), rows (`data`: prompts, samples, labels, a training
# set) or a held-out figure (`eval`). Readers ask this, never a stage's name.
Role = Literal["model", "text", "data", "eval"]
# Manifests written before stages declared a role name it by their stage alone: read so, once, here.
_ROLE_BEFORE = {"base": "model", "train": "model", "label-model": "model", "optimiser-model": "model",
                "template": "text", "search": "text", "evaluate": "eval"}


def _role_before(data: Any) -> Any:
    if isinstance(data, dict) and "role" not in data and isinstance(data.get("stage"), str):
        data = {**data, "role": _ROLE_BEFORE.get(data["stage"].partition(".")[0], "data")}
    return data


class FileRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    sha256: str
    bytes: int = Field(ge=0)
    rows: int | None = Field(default=None, description="row count for JSONL tables")


class ParentRef(BaseModel):
    """A pointer to an upstream stage: enough to find it and to check it is unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: str
    role: Role = Field(description="what its outputs are: model, text, data or eval")
    key: str
    dir: StageDir = Field(description="stage directory relative to the store root")
    content: str = Field(description="digest over the parent's output digests")

    @model_validator(mode="before")
    @classmethod
    def _before_roles(cls, data: Any) -> Any:
        return _role_before(data)


class StageManifest(BaseModel):
    # a diverged run's NaN loss is a fact to keep: written as "NaN" (strict JSON), read back as a float;
    # the default (null) could not be read back, so the stage failed after its work was done
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")
    stage: str = Field(description="stage name: base, sample, label, filter, train, evaluate")
    role: Role = Field(description="what its outputs are: model (weights), text (a prompt's text over weights), "
                       "data (rows) or eval (a held-out figure)")
    round: int = Field(ge=0)
    key: str = Field(description="cache key: stage + code version + config + parent contents")
    dir: StageDir = Field(description="stage directory relative to the store root")
    code_version: str
    config: dict[str, Any] = Field(default_factory=dict, description="the config slice used")
    parents: list[ParentRef] = Field(default_factory=list)
    outputs: dict[OutputName, FileRef] = Field(default_factory=dict, description="relative path -> digest")
    metrics: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict, description="non-numeric facts (backend, paths)")
    ran_by: dict[str, Any] | None = Field(default=None, description="what ran it: the git commit of the checkout "
                                          "(commit, None for an installed package), whether the package's files "
                                          "differed from it (dirty), the package's version (version) and the "
                                          "stage's body (body: module:function, which `ratchet verify` runs again)")
    created_at: str = ""
    wall_s: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _before_roles(cls, data: Any) -> Any:
        return _role_before(data)

    @property
    def content(self) -> str:
        """Digest over output digests: what a child stage keys on."""
        return sha256_json({k: v.sha256 for k, v in self.outputs.items()})

    def as_parent(self) -> ParentRef:
        return ParentRef(stage=self.stage, role=self.role, key=self.key, dir=self.dir, content=self.content)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_manifest(stage_dir: Path, manifest: StageManifest) -> Path:
    """Written last: its presence is what marks the stage complete."""
    tmp = stage_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())
    return tmp.replace(stage_dir / MANIFEST)


def read_manifest(stage_dir: Path) -> StageManifest | None:
    p = stage_dir / MANIFEST
    if not p.exists():
        return None
    try:
        return StageManifest.model_validate_json(p.read_bytes())
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'the file'}: {x['msg']}" for x in e.errors()[:5])
        raise ArtifactError(f"{p} is not a Ratchet stage manifest ({problems}); it was edited or is not "
                            f"Ratchet's. Delete {stage_dir} to recompute the stage, or restore the file") from None
