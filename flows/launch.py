"""One start sequence for a run, however it is started: `ratchet run` and `ratchet resume`
(flows/cli.py, under its console) and `ratchet.flows.api.run` (without one).

    library_env()                  the libraries' settings, before the run's first process
    prepare_env(workdir)           Prefect's home in the workdir, before Prefect is imported
    with launcher(cfg, stamp) as launch:
        ctx, tracker = launch.start(start_from, split)   the run's record; services' logs renamed
        ...                                              (the console's header)
        ctx, results, tracker = launch.execute(ctx)      waits for Prefect, runs the flow

`launcher` starts the temporary Prefect server in a thread, so its start overlaps with the run's
own (MLflow's database, the records), and the run's services (its fork server, its warm engine)
for the run's length.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ratchet.flows.config import PipelineConfig


def library_env() -> None:
    """The libraries' settings for every process of a run (no telemetry, one tokenizer thread),
    the user's own where set; in the environment before the run's first process starts (its fork
    server starts before the run's inputs have passed their checks)."""
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# What a run's own process imports between its checks and its first stage, several seconds of
# CPU: MLflow's client and its SQLite store (the run's record), and with Prefect's home settled,
# Prefect and its temporary server (then the flow's module, flows/pipeline.py, which imports Prefect).
TRACKING_IMPORTS = ("mlflow", "mlflow.tracking", "mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store",
                    "mlflow.store.model_registry.sqlalchemy_store")
PREFECT_IMPORTS = ("prefect",)
SERVER_IMPORTS = ("prefect.server.api.server",)  # the temporary server's: 1.2 s, none where PREFECT_API_URL names one


@contextlib.contextmanager
def imports_meanwhile(workdir: Path) -> Iterator[None]:
    """Import TRACKING_IMPORTS and PREFECT_IMPORTS in a thread while the block lasts (the model's
    checks, which wait on the fork server's own imports: a run's process sat idle there), and
    wait for them at its end, so no import of the run's runs beside another of this thread's.
    Prefect is imported here only where its home is settled already (a server of the user's, a
    PREFECT_HOME, or the workdir's own prefect/ from an earlier run): its import creates its
    home, and a run writes nothing before its checks pass. A failed import is left for the run's
    own import of it to raise."""
    import importlib
    import sys
    import threading

    names = list(TRACKING_IMPORTS)
    home = workdir / "prefect"
    flow = {"PREFECT_API_URL", "PREFECT_HOME"} & set(os.environ) or home.is_dir()
    if flow:
        names += PREFECT_IMPORTS if "PREFECT_API_URL" in os.environ else PREFECT_IMPORTS + SERVER_IMPORTS
        if not {"PREFECT_API_URL", "PREFECT_HOME"} & set(os.environ):
            os.environ["PREFECT_HOME"] = str(home)  # as prepare_env sets it, before Prefect is imported
    names = [n for n in names if n not in sys.modules]

    def load() -> None:
        try:
            for name in names:
                importlib.import_module(name)
            if flow:
                from ratchet.flows import pipeline  # noqa: F401
        except Exception:  # noqa: BLE001 - raised again where the run imports it
            return

    thread = threading.Thread(target=load, daemon=True, name="ratchet-imports")
    if names:
        thread.start()
    try:
        yield
    finally:
        if names:
            thread.join()


def prepare_env(workdir: Path | None) -> None:
    """Point Prefect and MLflow at the workdir before either is imported. Without a
    workdir (`serve`), the user's Prefect profile decides which server to talk to."""
    library_env()
    if workdir is not None and "PREFECT_API_URL" not in os.environ and "PREFECT_HOME" not in os.environ:
        (workdir / "prefect").mkdir(parents=True, exist_ok=True)  # Prefect does not create parents
        os.environ["PREFECT_HOME"] = str(workdir / "prefect")


def ephemeral_server_dies_with_us():
    """The temporary Prefect server a run starts when no PREFECT_API_URL is set (a process of
    its own) dies with this process, as every process below a run does (data/procs/lifetime.py):
    Prefect stops it only at a clean exit, so a `kill -9` of the run would leave it serving.

    Prefect keeps one such server per port and hands it to every client that asks; the one
    registered here first is the one they get, and it starts the server's process asking for
    SIGTERM (a clean stop of its database) when this process dies. It runs in a session of its
    own: a Ctrl-C at the terminal reaches the run's process group, and a server stopped by it
    would leave the interrupted run retrying its last state updates for minutes, then failing
    with a connection error instead of saying it was interrupted."""
    import subprocess
    import types

    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # a server of the user's: none is started
        return None
    from prefect.server.api import server

    from ratchet.data.procs.spawn import program_starter

    class DiesWithUs(server.SubprocessASGIServer):
        def _run_uvicorn_command(self):
            real = server.subprocess
            server.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": program_starter(
                signal.SIGTERM, session=True)})
            try:
                return super()._run_uvicorn_command()
            finally:
                server.subprocess = real

    if None not in server.SubprocessASGIServer._instances:
        DiesWithUs()
    return server.SubprocessASGIServer()


def started_meanwhile(server):
    """Start the temporary Prefect server (`server`, or none) in a thread while the run prepares
    (MLflow's database, the run's records), so its start, several seconds, overlaps with them.
    The caller waits on the returned event before the first flow asks for the server; should
    the start fail here, the flow's own start of it raises the error. The thread then stays
    until this process ends: the server dies with the thread that started it."""
    import threading

    ready = threading.Event()

    def start() -> None:
        try:
            if server is not None:
                server.start()
        except Exception:  # noqa: BLE001 - the flow starts it again and reports what fails
            pass
        finally:
            ready.set()
        threading.Event().wait()

    threading.Thread(target=start, daemon=True, name="ratchet-prefect-server").start()
    return ready


@dataclass
class Launch:
    """A run being started (`launcher`): its config, its workdir, the stamp its logs carry and the
    event set once the temporary Prefect server is up."""

    cfg: PipelineConfig
    workdir: Path
    stamp: str
    ready: object

    def start(self, start_from: str | None, split, say=None, run_name: str | None = None):
        """The run's record (flows/runs.py `start`): (ctx, tracker); the services' logs then carry
        the run's name."""
        from ratchet.flows.pipeline import name_helper_logs
        from ratchet.flows.runs import start

        ctx, tracker = start(self.cfg, start_from, split, say=say, run_name=run_name)
        name_helper_logs(self.workdir / "logs", f"{ctx.run_name}.{self.stamp}")
        return ctx, tracker

    def execute(self, ctx):
        """Run the flow once Prefect's server is up: (ctx, results, tracker)."""
        from ratchet.flows.pipeline import execute

        self.ready.wait()
        return execute(self.cfg, ctx=ctx)


@contextlib.contextmanager
def launcher(cfg: PipelineConfig, stamp: str) -> Iterator[Launch]:
    """The temporary Prefect server started meanwhile, and the run's services while the block
    lasts (flows/pipeline.py `services`), their logs first named STAMP-PID."""
    from ratchet.flows.pipeline import services

    workdir = Path(cfg.workdir).resolve()
    ready = started_meanwhile(ephemeral_server_dies_with_us())
    with services(cfg, workdir / "logs", f"{stamp}-{os.getpid()}"):  # their imports overlap with the start
        yield Launch(cfg, workdir, stamp, ready)
