"""Scheduled continuation and store housekeeping.

    ratchet serve flows/configs/default.yaml --cron "0 3 * * *"              serve from this process
    ratchet serve flows/configs/default.yaml --cron "0 3 * * *" --pool ratchet  for `prefect worker start`
    ratchet gc flows/configs/default.yaml [--dry-run]

A deployment runs `flows.pipeline.continue_improve`: `rounds` more rounds on top of the
MLflow `champion`, in the same workdir and tracking store, with the parent version
recorded in the new run's tags and lineage. Schedules need a real Prefect server
(`prefect server start`); the ephemeral one a plain `ratchet run` starts lives only as
long as that process.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ratchet.data.errors import ConfigError, RatchetError
from ratchet.data.manifest import MANIFEST
from ratchet.flows.config import PipelineConfig
from ratchet.data.userfiles import with_absolute_paths

FLOW_NAME = "ratchet-continue"


def absolute_paths(cfg: PipelineConfig) -> PipelineConfig:
    """The config with its workdir and every user file it names (data and held-out sets' files, a
    scoring function's file, the policy's and a fixed judge's model directories: the fields typed
    as user files, data/userfiles.py) made absolute, so a worker started anywhere finds the same
    store, model and data."""
    moved = with_absolute_paths(cfg)
    return moved.model_copy(update={"workdir": str(Path(cfg.workdir).expanduser().resolve())})


def _schedule(cron: str, timezone: str | None):
    from pydantic import ValidationError

    from prefect.client.schemas.schedules import CronSchedule

    try:
        return CronSchedule(cron=cron, timezone=timezone or "UTC")
    except ValidationError as e:
        msgs = "; ".join(err["msg"] for err in e.errors())
        field = "--timezone" if timezone and "timezone" in msgs.lower() else "--cron"
        value = timezone if field == "--timezone" else cron
        raise ConfigError([f"{field} {value!r} is not valid ({msgs}); write a cron schedule as five fields, e.g. "
                           "--cron '0 3 * * *' (03:00 daily), and a timezone as an IANA name such as "
                           "Europe/Berlin"]) from None


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise RatchetError(
            "no Prefect server: PREFECT_API_URL is not set, and the ephemeral server a plain `ratchet run` "
            "starts cannot run schedules. Start one with `prefect server start` (in another shell or as a "
            "service) and `export PREFECT_API_URL=http://127.0.0.1:4200/api`"
        )
    return url


def deploy(cfg: PipelineConfig, *, cron: str, name: str | None, pool: str | None, start_from: str,
           timezone: str | None) -> int:
    """Create the deployment; serve it from this process unless a work pool runs it."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import EntrypointType

    from ratchet.flows.pipeline import continue_improve
    from ratchet.flows.runs import code_digest

    if start_from not in ("champion", "base") and not start_from.isdigit():
        raise ConfigError([f"--from {start_from!r} is not 'champion', 'base' or a model version number"])
    schedule = _schedule(cron, timezone)
    url = _api_url()
    with get_client(sync_client=True) as client:
        if (err := client.api_healthcheck()) is not None:
            raise RatchetError(f"the Prefect server at {url} does not answer ({err}); start it with "
                               "`prefect server start` or fix PREFECT_API_URL")
        if pool:
            _ensure_process_pool(client, pool)
    name = name or cfg.name
    deployment = continue_improve.to_deployment(
        name=name,
        schedules=[schedule],
        parameters={"config": cfg.model_dump(mode="json"), "start_from": start_from, "overrides": []},
        concurrency_limit=1,  # a tick that arrives while a run is still going waits for it
        description=f"ratchet: {cfg.rounds} round(s) of {cfg.name} on top of the {start_from} model, "
                    f"workdir {cfg.workdir}",
        tags=["ratchet", cfg.name],
        version=code_digest()[:12],
        entrypoint_type=EntrypointType.MODULE_PATH,  # importable wherever ratchet is installed
    )
    where = f"work pool {pool!r}" if pool else "this process"
    print(f"deployment {FLOW_NAME}/{name}: cron {cron!r} ({schedule.timezone}), {cfg.rounds} round(s) from "
          f"{start_from}, workdir {cfg.workdir}, server {url}; runs on {where}", flush=True)
    if pool:
        from prefect.deployments.runner import deploy as prefect_deploy

        (dep_id,) = prefect_deploy(deployment, work_pool_name=pool, build=False, push=False,
                                   print_next_steps_message=False)
        print(f"deployment id {dep_id}. Start a worker in the same environment:\n"
              f"  prefect worker start --pool {pool}\n"
              f"Run it now: prefect deployment run '{FLOW_NAME}/{name}'", flush=True)
        return 0
    from prefect import serve

    serve(deployment)
    return 0


def _ensure_process_pool(client, pool: str) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    try:
        wp = client.read_work_pool(pool)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        print(f"created process work pool {pool!r}", flush=True)
        return
    if wp.type != "process":
        raise ConfigError([f"--pool {pool!r} is a {wp.type!r} work pool; ratchet deploys to process pools "
                           "(runs in the worker's own environment). Name a process pool or a new one"])


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
    from ratchet.tasks.stage import MODEL_STAGES

    store = ArtifactStore(workdir)
    versions = tracker.client.search_model_versions(f"name='{tracker.model_name}'")
    champion = tracker.champion()
    newest: dict[str, tuple[int, str]] = {}
    for mv in versions:
        run, k = mv.tags.get("ratchet.run"), mv.tags.get("ratchet.round", "")
        if run and k.isdigit() and (run not in newest or int(k) > newest[run][0]):
            newest[run] = (int(k), str(mv.version))
    keep: dict[str, str] = {}  # stage dir -> why it keeps its weights
    by_version = {str(mv.version): mv.tags.get("ratchet.stage_dir") for mv in versions}
    for version, why in [(champion, "the champion"), *((v, f"run {r}'s newest round ({k})")
                                                         for r, (k, v) in sorted(newest.items()))]:
        if version is None or not by_version.get(version):
            continue
        keep.setdefault(by_version[version], f"version {version}: {why}")
        m = read_manifest(store.root / by_version[version])
        for p in (m.parents if m is not None else []):
            if p.stage in MODEL_STAGES:
                keep.setdefault(p.dir, f"the model version {version} was trained from (its adapter loads against it)")
    out = []
    for mv in sorted(versions, key=lambda v: int(v.version)):
        rel = mv.tags.get("ratchet.stage_dir")
        m = read_manifest(store.root / rel) if rel else None
        if m is None or m.stage != "train" or not (store.dir_of(m) / "adapter").is_dir():
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
    return out


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
