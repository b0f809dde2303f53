"""Store housekeeping: `ratchet gc`, and the merged weights a run drops as it goes (`drop_models`).

    ratchet gc flows/configs/default.yaml [--dry-run] [--all] [--models]

What is removed is only ever re-makeable or abandoned: stage directories without a manifest that
no recorded run will resume, scratch a kill left in finished stages, and (with --models) merged
weights whose adapter makes them again byte for byte (a version whose MLflow model loads against
dropped weights is tagged so, and `ratchet restore` makes them again: `restore`). Apart from
flows/schedule.py, which the
round's own tasks reach through `drop_models`: a scheduled deployment runs the flow, and the flow
must not import its scheduler back.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from ratchet.data.errors import RatchetError
from ratchet.data.manifest import MANIFEST


@dataclass(frozen=True)
class Leftover:
    path: Path
    bytes: int
    remove: bool
    why: str


def drop_models(workdir: Path, tracker, dry_run: bool = False) -> list[Leftover]:
    """The merged weights `ratchet gc --models` drops: those of every registered version but the
    champion and each run's newest, and but the models those were trained from (the registered
    version loads its LoRA adapter against that base). A dropped stage keeps its adapter and its
    manifest; `dropped.json` beside it says what went, and whatever needs the weights again (a
    resumed run, `ratchet export`) makes them again from the adapter and the parent, checked
    against the manifest's digests. Only LoRA train stages are dropped: a base model or a full
    fine-tune has nothing to make them from. Stages no version names are left alone."""
    import fnmatch

    from ratchet.data.manifest import read_manifest
    from ratchet.data.store import ArtifactStore
    from ratchet.models.trainer import WEIGHTS
    from ratchet.data.errors import ArtifactError
    from ratchet.tasks.text import weights_of

    store = ArtifactStore(workdir)

    def weights_at(rel: str | None):
        """The manifest of the weights a stage directory holds (a pair's: its weights'), if any."""
        m = read_manifest(store.root / rel) if rel else None
        if m is not None and m.role == "text":
            with contextlib.suppress(ArtifactError):
                return weights_of(store, m)
            return None
        return m

    versions = tracker.client.search_model_versions(f"name='{tracker.model_name}'")
    champion = tracker.champion()
    newest: dict[str, tuple[int, str]] = {}
    for mv in versions:
        run, k = mv.tags.get("ratchet.run"), mv.tags.get("ratchet.round", "")
        if "ratchet.voter" in mv.tags:  # a model that votes beside a round's policy is not the round's model
            continue
        if run and k.isdigit() and (run not in newest or int(k) > newest[run][0]):
            newest[run] = (int(k), str(mv.version))
    keep: dict[str, str] = {}  # stage dir -> why it keeps its weights
    by_version = {str(mv.version): mv.tags.get("ratchet.stage_dir") for mv in versions}
    for version, why in [(champion, "the champion"), *((v, f"run {r}'s newest round ({k})")
                                                         for r, (k, v) in sorted(newest.items()))]:
        if version is None or not by_version.get(version):
            continue
        m = weights_at(by_version[version])
        if m is None:
            continue
        keep.setdefault(m.dir, f"version {version}: {why}")
        for p in m.parents:
            if p.role in ("model", "text"):
                if (w := weights_at(p.dir)) is not None:
                    keep.setdefault(w.dir, f"the model version {version} was trained from (its adapter loads "
                                    "against it)")
    out = []
    for mv in sorted(versions, key=lambda v: int(v.version)):
        m = weights_at(mv.tags.get("ratchet.stage_dir"))
        rel = m.dir if m is not None else None
        if m is None or not (store.dir_of(m) / "adapter").is_dir():  # only a LoRA training's weights are made again
            continue
        weights = [k for k in m.outputs if k.startswith("model/") and
                   any(fnmatch.fnmatch(k.removeprefix("model/"), w) for w in WEIGHTS)]
        here = [k for k in weights if store.path(m, k).is_file()]
        if rel in keep:
            out.append(Leftover(store.dir_of(m) / "model", sum(store.path(m, k).stat().st_size for k in here), False,
                                f"merged weights of {keep[rel]}"))
            continue
        if not here:
            continue
        size = sum(store.path(m, k).stat().st_size for k in here)
        why = (f"merged weights of version {mv.version} (round {mv.tags.get('ratchet.round', '?')}, run "
               f"{mv.tags.get('ratchet.run', '?')}): dropped, re-makeable from adapter/ and its parent")
        if not dry_run:
            store.drop(m, weights, why)
        out.append(Leftover(store.dir_of(m) / "model", size, True, why))
    if not dry_run:
        mark_unloadable(store, tracker, versions)
    return out


UNLOADABLE = "ratchet.mlflow_base_dropped"  # on a version whose MLflow model loads against dropped weights


def mlflow_base(store, m):
    """The weights a LoRA version's MLflow model loads its adapter against (models/mlflow_model.py:
    the model it was trained from, by path), as that stage's manifest; None for a base model or a
    full fine-tune, whose MLflow model holds its own weights."""
    from ratchet.data.manifest import read_manifest
    from ratchet.tasks.text import weights_of

    if m is None or not (store.dir_of(m) / "adapter").is_dir():
        return None
    parent = next((p for p in m.parents if p.role in ("model", "text")), None)
    base = read_manifest(store.root / parent.dir) if parent is not None else None
    return weights_of(store, base) if base is not None else None


def _stage_of(store, mv):
    from ratchet.data.manifest import read_manifest
    from ratchet.tasks.text import weights_of

    rel = mv.tags.get("ratchet.stage_dir")
    m = read_manifest(store.root / rel) if rel else None
    return weights_of(store, m) if m is not None else None


def mark_unloadable(store, tracker, versions) -> dict[str, str]:
    """Tag every registered version whose MLflow model loads against weights that are dropped
    (`UNLOADABLE`: which, and the command that makes them again), and untag those whose base is
    whole again. MLflow's loader cannot make them itself; `ratchet restore` (`restore`) does.
    Returns {version: the tag's text} of those tagged."""
    out = {}
    for mv in versions:
        base = mlflow_base(store, _stage_of(store, mv))
        tagged = UNLOADABLE in mv.tags
        if base is not None and store.dropped(base):
            out[str(mv.version)] = text = (
                f"its adapter loads against {base.dir}/model, whose merged weights `ratchet gc --models` dropped: "
                f"`ratchet restore CONFIG {mv.version}` makes them again before mlflow loads it")
            if mv.tags.get(UNLOADABLE) != text:
                tracker.client.set_model_version_tag(tracker.model_name, str(mv.version), UNLOADABLE, text)
        elif tagged:
            tracker.client.delete_model_version_tag(tracker.model_name, str(mv.version), UNLOADABLE)
    return out


def restore(workdir: Path, tracker, versions: list[str] | None = None) -> list[tuple[str, str]]:
    """Make again what registered versions need to load every way (through MLflow, `ratchet export`,
    a continued run): their own merged weights and those their MLflow model loads against, where
    `ratchet gc --models` dropped them, each checked byte for byte against its manifest. `versions`
    None: every version tagged `UNLOADABLE`. Returns (version, what was made again) pairs."""
    from ratchet.data.store import ArtifactStore
    from ratchet.tasks.prepare import remade

    store = ArtifactStore(workdir)
    every = tracker.client.search_model_versions(f"name='{tracker.model_name}'")
    known = {str(mv.version): mv for mv in every}
    if versions is None:
        versions = [v for v, mv in known.items() if UNLOADABLE in mv.tags]
    if missing := [v for v in versions if v not in known]:
        raise RatchetError(f"{tracker.model_name} has no version {', '.join(missing)}; its versions are "
                           f"{', '.join(sorted(known, key=int)) or 'none'}")
    done = []
    for v in sorted(versions, key=int):
        m = _stage_of(store, known[v])
        for what, stage in (("its own merged weights", m), ("the weights its MLflow model loads against",
                                                             mlflow_base(store, m))):
            if stage is not None and store.dropped(stage):
                remade(store, stage, here=False)
                done.append((v, f"{what} ({stage.dir}/model)"))
    mark_unloadable(store, tracker, tracker.client.search_model_versions(f"name='{tracker.model_name}'"))
    return done


def collect_garbage(workdir: Path, dry_run: bool = False, everything: bool = False) -> list[Leftover]:
    """What killed or failed stages left in the store, each with what gc does to it and why.

    An unfinished stage directory is removed only when no recorded pipeline run can resume
    it: every run that started it finished (so it was superseded, e.g. by new code), or has
    no record. A run whose record cannot be read might resume it, so it is kept. One a recorded unfinished run would still resume is kept (`everything`
    removes it too), and one whose lock a live process holds is never touched. In finished
    stages, scratch that a kill left between the manifest and its clean-up (shards,
    trainer checkpoints) is removed. Finished outputs are never touched.
    """
    import fcntl

    from ratchet.data.store import ArtifactStore
    from ratchet.flows.runs import records as run_records

    stages = workdir / "stages"
    if not stages.is_dir():
        raise RatchetError(f"no artifact store at {stages}; check the config's workdir")
    store = ArtifactStore(workdir)
    records, unreadable = run_records(workdir)
    (workdir / "locks").mkdir(exist_ok=True)
    out: list[Leftover] = []
    for d in sorted(p for p in stages.iterdir() if p.is_dir()):
        if (d / MANIFEST).exists():
            for name in ArtifactStore.SCRATCH:
                if (d / name).is_dir():
                    out.append(_act(d / name, True, "scratch a finished stage no longer needs", dry_run))
            continue
        with open(workdir / "locks" / f"{d.name}.lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                out.append(Leftover(d, _size(d), False, "a live run is writing it"))
                continue
            try:
                if (d / MANIFEST).exists():  # it finished while we looked
                    continue
                out.append(_act(d, *_verdict(store.owners(d), records, unreadable, workdir, everything), dry_run))
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    return out


def _verdict(owners: list[str], records: dict, unreadable: dict[str, str], workdir: Path,
             everything: bool) -> tuple[bool, str]:
    if blind := [o for o in owners if o in unreadable]:  # it may resume it: never guessed away
        if everything:
            return True, f"run {blind[0]}'s record cannot be read; removed because of --all"
        return False, f"run {blind[0]} started it and its record cannot be read, so it may resume it: " \
            f"{unreadable[blind[0]]}"
    resumable = [o for o in owners if o in records and records[o].state != "finished"]
    if resumable:
        o = resumable[0]
        if everything:
            return True, f"run {o} ({records[o].state}) could resume it; removed because of --all"
        return False, f"run {o} ({records[o].state}) resumes it: ratchet resume --run {o} --workdir {workdir}"
    if not owners:
        return True, "unfinished, and no recorded run started it"
    gone = [o for o in owners if o not in records]
    if gone:
        return True, f"unfinished; run {gone[0]} started it and has no record left"
    return True, f"unfinished; run {owners[0]} started it and finished without it (its config or code changed)"


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _act(path: Path, remove: bool, why: str, dry_run: bool) -> Leftover:
    item = Leftover(path, _size(path), remove, why)
    if remove and not dry_run:
        shutil.rmtree(path)
    return item
