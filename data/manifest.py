"""Stage manifests: the small typed records that stages exchange instead of data.

A stage directory is complete exactly when its manifest.json exists; the manifest
is written last and atomically. It lists every output file with its sha256, the
parent stages it was computed from, the config slice and the code version.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.digest import sha256_json

MANIFEST = "manifest.json"


class FileRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    sha256: str
    bytes: int = Field(ge=0)
    rows: int | None = Field(default=None, description="row count for JSONL tables")


class ParentRef(BaseModel):
    """A pointer to an upstream stage: enough to find it and to check it is unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: str
    key: str
    dir: str = Field(description="stage directory relative to the store root")
    content: str = Field(description="digest over the parent's output digests")


class StageManifest(BaseModel):
    # a diverged run's NaN loss is a fact to keep: written as "NaN" (strict JSON), read back as a float;
    # the default (null) could not be read back, so the stage failed after its work was done
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")
    stage: str = Field(description="stage name: base, sample, label, filter, train, evaluate")
    round: int = Field(ge=0)
    key: str = Field(description="cache key: stage + code version + config + parent contents")
    dir: str = Field(description="stage directory relative to the store root")
    code_version: str
    config: dict[str, Any] = Field(default_factory=dict, description="the config slice used")
    parents: list[ParentRef] = Field(default_factory=list)
    outputs: dict[str, FileRef] = Field(default_factory=dict, description="relative path -> digest")
    metrics: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict, description="non-numeric facts (backend, paths)")
    created_at: str = ""
    wall_s: float = 0.0

    @property
    def content(self) -> str:
        """Digest over output digests: what a child stage keys on."""
        return sha256_json({k: v.sha256 for k, v in self.outputs.items()})

    def as_parent(self) -> ParentRef:
        return ParentRef(stage=self.stage, key=self.key, dir=self.dir, content=self.content)


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
    return StageManifest.model_validate_json(p.read_text())
