"""The content-addressed artifact store.

Every stage writes into ``<root>/stages/<stage>-<key[:16]>/``. The key is derived
from what the stage computes (name, code version, config slice, parent contents),
so the same work always lands in the same directory and different work never
shares one: two pipeline runs on one workdir cannot overwrite each other, and a
re-run finds finished stages by key.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet.data import failpoints
from ratchet.data.digest import batched, fsync_dir, known_sha256, sha256_json
from ratchet.data.errors import ArtifactError, TamperedArtifactError
from ratchet.data.manifest import MANIFEST, FileRef, Role, StageManifest, now_iso, read_manifest, write_manifest


def stage_key(stage: str, code_version: str, config: dict[str, Any], parents: list[StageManifest]) -> str:
    return sha256_json(
        {
            "stage": stage,
            "code": code_version,
            "config": config,
            "parents": sorted((p.stage, p.content) for p in parents),
        }
    )


class ArtifactStore:
    def __init__(self, root: Path, create: bool = True, planner: Any = None):
        """`create=False`: a reader that writes nothing: a store not made yet is empty. `planner`
        (tasks/runner/plan.py, `ratchet plan`): `run_stage` hands it each stage to key and look up, and
        runs none."""
        self.root = Path(root).resolve()
        self.planner = planner
        if create:
            (self.root / "stages").mkdir(parents=True, exist_ok=True)

    def stage_dir(self, stage: str, key: str) -> Path:
        return self.root / "stages" / f"{stage}-{key[:16]}"

    def dir_of(self, m: StageManifest) -> Path:
        return self.root / m.dir

    def recorded_dir(self, rel: str, where: str) -> Path:
        """A stage directory that a record outside the store names (a registry or run tag, `where`):
        `stages/<stage>-<16 hex>` under this store and nothing else, so a tag that was edited, or
        came from another tool, can never point a read (or an export) outside the store."""
        import re

        if not isinstance(rel, str) or not re.fullmatch(r"stages/[a-z][a-z0-9_.-]{0,63}-[0-9a-f]{16}", rel):
            raise ArtifactError(f"{where} names {rel!r}, which is not a stage directory of a Ratchet store "
                                "(stages/<stage>-<key>); the record was edited or is not Ratchet's")
        return self.root / rel

    def path(self, m: StageManifest, name: str) -> Path:
        if name not in m.outputs:
            raise ArtifactError(f"{m.stage} (round {m.round}) has no output {name!r}; it has {sorted(m.outputs)}")
        d = self.dir_of(m)
        if not (d / name).resolve().is_relative_to(d.resolve()):  # a link in the stage directory leads out
            raise ArtifactError(f"{d / name} leads outside its stage directory {d} (a link); a Ratchet stage "
                                f"writes none. Delete {d} to recompute the stage")
        return d / name

    def find(self, stage: str, key: str, verify: bool = True) -> StageManifest | None:
        """The finished stage with this key, verified; None if absent or unfinished."""
        d = self.stage_dir(stage, key)
        m = read_manifest(d)
        if m is None:
            return None
        if verify:
            self.verify(m)
        return m

    def verify(self, m: StageManifest) -> None:
        """Raise TamperedArtifactError naming every file whose digest changed. A file `drop` removed
        (and the stage can make again) is not missing; one that is there must match."""
        d = self.dir_of(m)
        dropped = set(self.dropped(m).get("outputs", []))
        bad = []
        with batched():
            for name, ref in m.outputs.items():
                p = d / name
                if not p.is_file() and name in dropped:
                    continue
                if not p.is_file():
                    bad.append(f"{name}: missing")
                elif p.stat().st_size != ref.bytes or known_sha256(p) != ref.sha256:
                    bad.append(f"{name}: sha256 differs from the manifest")
        if bad:
            raise TamperedArtifactError(
                f"{m.stage} stage of round {m.round} at {d} was changed after it finished: "
                + "; ".join(bad)
                + f". Delete {d} to recompute it, or restore the files."
            )

    @contextlib.contextmanager
    def lock(self, stage: str, key: str):
        """Exclusive lock on one stage key across processes; the kernel drops it if the holder dies."""
        import fcntl

        (self.root / "locks").mkdir(exist_ok=True)
        path = self.root / "locks" / f"{stage}-{key[:16]}.lock"
        with open(path, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def prepare(self, stage: str, key: str, keep_partial: bool = False) -> Path:
        """Create the stage directory. An unfinished one is wiped unless the stage resumes from it."""
        d = self.stage_dir(stage, key)
        if (d / MANIFEST).exists():
            raise ArtifactError(f"{d} is already complete; look it up with find() instead")
        if d.exists() and not keep_partial:
            shutil.rmtree(d)
        d.mkdir(parents=True, exist_ok=True)
        return d

    @contextlib.contextmanager
    def claim(self, stage: str, key: str, *, keep_partial: bool = False, run: str | None = None):
        """The work of one stage key, in one call: a `Claim` whose `found` is the finished stage
        (verified; scratch a kill left in it removed), or, under the key's exclusive lock for the
        block, whose `dir` is ready to compute it in (an unfinished one wiped unless it resumes,
        `keep_partial`; recorded as `run`'s, so `ratchet gc` knows a run would resume it). Two
        pipelines that reach the same key at once compute it once: the second waits for the lock,
        then finds it finished (`by_another`)."""
        found = self.find(stage, key)
        if found is not None:
            self.drop_scratch(found)
            yield Claim(found=found)
            return
        with self.lock(stage, key):
            found = self.find(stage, key)
            if found is not None:
                yield Claim(found=found, by_another=True)
                return
            d = self.prepare(stage, key, keep_partial=keep_partial)
            if run is not None:
                self.add_owner(d, run)
            yield Claim(dir=d)

    def keep_code(self, opened: dict[str, Any]) -> Path:
        """Keep what a stage's code version covers (`code_reach.opened`: its definitions, each with
        its module, name and digest, and its libraries) as `code/<digest>.json`, once per digest
        (not the files it was read from: where they are is this machine's)."""
        path = self.root / "code" / f"{opened['digest']}.json"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({k: v for k, v in opened.items() if k != "texts"}, indent=1, sort_keys=True))
            tmp.replace(path)
        return path

    def code(self, digest: str) -> dict[str, Any]:
        """What the code version `digest` covers, as `keep_code` kept it; ArtifactError if it is not here."""
        import re

        if not re.fullmatch(r"[0-9a-f]{16}", digest or ""):
            raise ArtifactError(f"{digest!r} is not a code version (16 hex digits, as `ratchet lineage` prints them)")
        path = self.root / "code" / f"{digest}.json"
        if not path.is_file():
            raise ArtifactError(f"code version {digest} is not kept in {self.root / 'code'}: no stage of this "
                                "workdir ran with it (versions kept since this Ratchet: older stages have none)")
        return json.loads(path.read_text())

    OWNERS = "runs.json"
    SCRATCH = ("shards", "checkpoints")  # what stages resume from; dead weight once the manifest is written

    def drop_scratch(self, m: StageManifest) -> list[Path]:
        """Remove the scratch a kill left in a finished stage (between its manifest and the
        clean-up in finish); the removed folders."""
        d = self.dir_of(m)
        gone = [d / name for name in self.SCRATCH if (d / name).is_dir()]
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
        return gone

    DROPPED = "dropped.json"  # beside a manifest: outputs removed to save disk, which the stage can make again

    def dropped(self, m: StageManifest) -> dict[str, Any]:
        """What `drop` removed from a finished stage ({"outputs": [...], "bytes": n, "why": ...}), or {}."""
        p = self.dir_of(m) / self.DROPPED
        return json.loads(p.read_text()) if p.is_file() else {}

    def drop(self, m: StageManifest, names: list[str], why: str) -> int:
        """Remove outputs of a finished stage that it can make again (a train stage's merged weights,
        from its adapter and its parent model), recording them first in `dropped.json` beside the
        manifest, which stays as it was: the manifest still names each file's digest, and whatever
        makes one again is checked against it. Returns the bytes freed."""
        d = self.dir_of(m)
        names = sorted(set(names) | set(self.dropped(m).get("outputs", [])))
        missing = [n for n in names if n not in m.outputs]
        if missing:
            raise ArtifactError(f"{d}: {missing} are not outputs of its manifest; nothing dropped")
        total = sum(m.outputs[n].bytes for n in names)
        tmp = d / (self.DROPPED + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"outputs": names, "bytes": total, "why": why}, indent=1))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(d / self.DROPPED)
        fsync_dir(d)
        freed = 0
        for n in names:
            p = d / n
            if p.is_file():
                freed += p.stat().st_size
                p.unlink()
        return freed

    def restored(self, m: StageManifest) -> None:
        """The dropped outputs were made again and verified: the stage is whole."""
        self.verify(m)
        if any(not (self.dir_of(m) / n).is_file() for n in self.dropped(m).get("outputs", [])):
            raise ArtifactError(f"{self.dir_of(m)}: a dropped output was not made again")
        (self.dir_of(m) / self.DROPPED).unlink(missing_ok=True)

    def add_owner(self, d: Path, run: str) -> None:
        """Record that pipeline run `run` started (or resumed) the unfinished stage in `d`."""
        runs = self.owners(d)
        if run not in runs:
            tmp = d / (self.OWNERS + ".tmp")
            tmp.write_text(json.dumps(sorted([*runs, run])))
            tmp.replace(d / self.OWNERS)

    def owners(self, d: Path) -> list[str]:
        p = d / self.OWNERS
        return json.loads(p.read_text()) if p.exists() else []

    def finish(
        self,
        *,
        stage: str,
        round: int,
        key: str,
        code_version: str,
        role: Role | None = None,
        config: dict[str, Any],
        parents: list[StageManifest],
        outputs: dict[str, int | None],
        metrics: dict[str, float] | None = None,
        info: dict[str, Any] | None = None,
        started: float | None = None,
        scratch: tuple[str, ...] = (),
        ran_by: dict[str, Any] | None = None,
    ) -> StageManifest:
        """Digest the named outputs (relative path -> row count or None) and write the manifest.

        `scratch`: folders the stage resumes from (shards, trainer checkpoints). They are
        removed only once the manifest is durable, so a kill at any moment loses no work.

        Every output is durable before the manifest names it (each file is fsynced as it is
        digested, then each directory that holds one), and the manifest's rename is durable
        before this returns: a power cut never leaves a manifest that vouches for lost bytes.
        """
        d = self.stage_dir(stage, key)
        refs = {}
        with batched():  # into the stat cache too: the outputs' first check on reuse reads nothing
            for name, rows in sorted(outputs.items()):
                p = d / name
                if not p.is_file():
                    raise ArtifactError(f"{stage} stage declared output {name!r} but {p} does not exist")
                refs[name] = FileRef(sha256=known_sha256(p, sync=True, fresh=True), bytes=p.stat().st_size,
                                     rows=rows)
        for folder in sorted({(d / name).parent for name in outputs} | {d}, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(folder)
        m = StageManifest(
            stage=stage,
            **({"role": role} if role is not None else {}),  # unsaid: read as a manifest written before roles
            round=round,
            key=key,
            dir=d.relative_to(self.root).as_posix(),
            code_version=code_version,
            config=config,
            parents=[p.as_parent() for p in parents],
            outputs=refs,
            metrics=metrics or {},
            info=info or {},
            ran_by=ran_by,
            created_at=now_iso(),
            wall_s=round_s(time.time() - started) if started else 0.0,
        )
        failpoints.hit(f"{stage}:before-manifest")
        write_manifest(d, m)
        fsync_dir(d)
        failpoints.hit(f"{stage}:after-manifest")
        for name in scratch:
            shutil.rmtree(d / name, ignore_errors=True)
        return m


@dataclass(frozen=True)
class Claim:
    """What `ArtifactStore.claim` gives: a finished stage, or a directory to compute one in."""

    found: StageManifest | None = None
    dir: Path | None = None
    by_another: bool = False  # finished by another run while this one waited for the key's lock


def round_s(x: float) -> float:
    return float(f"{x:.3f}")
