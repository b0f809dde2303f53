"""Scheduled continuation: `ratchet serve`.

    ratchet serve flows/configs/default.yaml --cron "0 3 * * *"              serve from this process
    ratchet serve flows/configs/default.yaml --cron "0 3 * * *" --pool ratchet  for `prefect worker start`

A deployment runs `flows.pipeline.continue_improve`: `rounds` more rounds on top of the
MLflow `champion`, in the same workdir and tracking store, with the parent version
recorded in the new run's tags and lineage. Schedules need a real Prefect server
(`prefect server start`); the ephemeral one a plain `ratchet run` starts lives only as
long as that process.
"""

from __future__ import annotations

from pathlib import Path

from ratchet.data.errors import ConfigError, RatchetError
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
    from ratchet.tasks.runner.code_reach import code_digest

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
