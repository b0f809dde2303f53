"""One start sequence for a run, however it is started: `ratchet run` and `ratchet resume`
(flows/cli.py, under its console) and `ratchet.flows.api.run` (without one).

    library_env()                  the libraries' settings, before the run's first process
    prepare_env(workdir)           Prefect's home in the workdir, before Prefect is imported
    with launcher(cfg, stamp) as launch:
        ctx, tracker = launch.start(start_from, split)   the run's record; services' logs renamed
        ...                                              (the console's header)
        ctx, results, tracker = launch.execute(ctx)      waits for Prefect, runs the flow

Where no server of the user's is named (PREFECT_API_URL), the run's process starts Prefect's
temporary server itself (`TemporaryServer`), as soon as it may write to Prefect's home: beside the
model's checks where an earlier run made that home, else as `launcher` begins; its start (several
seconds of its own process) overlaps with the run's imports, MLflow's database and the records,
and this process never imports the server's code (1.2-1.9 s). `launcher` also holds the run's
services (its fork server, its warm engine) for the run's length.
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
        if not {"PREFECT_API_URL", "PREFECT_HOME"} & set(os.environ):
            os.environ["PREFECT_HOME"] = str(home)  # as prepare_env sets it, before Prefect is imported
        TemporaryServer.start_here()  # its home is there: the server starts beside the checks
        names += PREFECT_IMPORTS if os.environ.get("PREFECT_API_URL") else PREFECT_IMPORTS + SERVER_IMPORTS
    names = [n for n in names if n not in sys.modules]

    def load() -> None:
        try:
            for name in names:
                importlib.import_module(name)
            if flow:
                from ratchet.flows import pipeline  # noqa: F401
        except Exception:  # noqa: BLE001 - raised again where the run imports it
            return

    from ratchet.data.procs.forkserver import imports_frozen

    thread = threading.Thread(target=load, daemon=True, name="ratchet-imports")
    with imports_frozen():  # the imports grow the heap fourfold: no collection as it grows
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


class TemporaryServer:
    """Prefect's temporary server for this process's runs, started by the run itself: the program
    Prefect's own start runs (`SubprocessASGIServer`: uvicorn serving the API without its UI, on
    loopback; flows/prefect_server.py, its imports frozen), on a port the system finds
    free, named to Prefect as PREFECT_API_URL before Prefect is imported, so every client of the
    process (the flow's, its log handler's) talks to it and none starts another. It dies with this
    process as every process below a run does (a `kill -9` too: it asks for SIGTERM, a clean stop of
    its database), runs in a session of its own (a Ctrl-C at the terminal stops the run, which then
    says so, not its server), and is stopped at exit. Its output goes to
    prefect/temporary-server.log in Prefect's home.

    One per process (`start_here`), and only where Prefect is not imported yet (it reads its
    settings once) and from the main thread (the signal asked for follows the thread that started
    the program); elsewhere the run uses Prefect's own start (`ephemeral_server_dies_with_us`)."""

    current: TemporaryServer | None = None

    def __init__(self, home: Path):
        import socket
        import subprocess

        from ratchet.data.procs import spawn
        from ratchet.flows import prefect_server

        with socket.socket() as sock:  # a port no server listens on now; the system gives each once in a while
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = home / "temporary-server.log"
        self.database = _empty_database(home)
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update(PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
        with open(self.log, "ab") as out:
            self.proc = spawn.program_starter(signal.SIGTERM, session=True)(
                spawn.command(prefect_server.serve, self.port),
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.error: str | None = None
        import atexit

        atexit.register(self.stop)

    @classmethod
    def start_here(cls) -> TemporaryServer | None:
        """This process's temporary server, started now where none is and this process may start it
        (see the class); PREFECT_API_URL then names it. None where a server of the user's is named,
        Prefect is imported already, or this is not the main thread."""
        import sys
        import threading

        if cls.current is None and not os.environ.get("PREFECT_API_URL") and "prefect" not in sys.modules \
                and threading.current_thread() is threading.main_thread():
            home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")
            home.mkdir(parents=True, exist_ok=True)
            cls.current = cls(home)
            os.environ["PREFECT_API_URL"] = cls.current.api_url
        return cls.current

    def wait(self, timeout: float) -> None:
        """Until the server answers its health check; else `error` says why (its exit, or the time
        it took) and where its log is."""
        import time
        import urllib.error
        import urllib.request

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (code := self.proc.poll()) is not None:
                self.error = f"Prefect's temporary server exited with code {code} as it started; its log: {self.log}"
                return
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        if self.database is not None:
                            _keep_empty_database(*self.database)
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.error = (f"Prefect's temporary server did not answer within {timeout:.0f} s "
                      f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); its log: {self.log}")

    def stop(self) -> None:
        """Stop the server as Prefect stops its own: SIGTERM, then SIGKILL after 5 s."""
        from ratchet.data.procs.lifetime import end

        end(self.proc, wait_s=5)


# The tables a Prefect database holds rows in before any run has used it: its migrations' revision
# and the block types Prefect registers as its server starts.
EMPTY_TABLES = {"alembic_version", "block_type", "block_schema", "block_schema_reference"}


def _empty_database(home: Path) -> tuple[Path, Path] | None:
    """A new workdir's Prefect database starts as a copy of an empty one, as MLflow's store does
    (flows/tracking.py): Prefect's server builds a new database with its 108 schema migrations
    (Prefect 3.6), about 5 s of its start's 10 s of CPU on 2 cores, to reach the same tables every
    time. The copy is kept in the user cache, one per Prefect version, made from the first new
    database a temporary server builds. Returns (the database, the template to make of it once the
    server answers: `_keep_empty_database`) where this server builds a new one; None where the
    database was there or is copied now, or where it is set elsewhere (a setting of the user's:
    Prefect builds it as it would)."""
    if any(k.startswith(("PREFECT_API_DATABASE_", "PREFECT_SERVER_DATABASE_")) or k == "PREFECT_PROFILES_PATH"
           for k in os.environ) or (home / "profiles.toml").exists():
        return None
    database = home / "prefect.db"
    if database.exists():
        return None
    import importlib.metadata

    from ratchet.models.default_model import default_cache_dir

    template = default_cache_dir() / "prefect-schema" / f"empty-{importlib.metadata.version('prefect')}.db"
    if not template.exists():
        return database, template
    from ratchet.flows.tracking import copy_new

    with contextlib.suppress(OSError):  # else the server builds it, as without a template
        copy_new(template, database)
    return None


def _keep_empty_database(database: Path, template: Path) -> None:
    """The template `_empty_database` copies: a consistent copy of `database` (SQLite's backup, safe
    while the server has it open), kept where it holds rows in EMPTY_TABLES alone, that is before
    any run has written to it. Anything that fails leaves the cache without one."""
    if template.exists() or not database.exists():
        return
    import sqlite3
    import uuid

    tmp = template.with_name(f".{template.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as src, \
                contextlib.closing(sqlite3.connect(tmp)) as dst:
            src.backup(dst)
            tables = [t for (t,) in dst.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            used = {t for t in tables if dst.execute(f'SELECT 1 FROM "{t}" LIMIT 1').fetchone()}
        if used and used <= EMPTY_TABLES:
            os.replace(tmp, template)
    except (OSError, sqlite3.Error):
        pass
    finally:
        tmp.unlink(missing_ok=True)


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
            if isinstance(server, TemporaryServer):  # started already: its answer waited for
                server.wait(float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")))
            elif server is not None:
                server.start()
        except Exception:  # noqa: BLE001 - the flow starts it again and reports what fails
            pass
        finally:
            ready.set()
        if not isinstance(server, TemporaryServer):
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
        if (server := TemporaryServer.current) is not None and server.error:
            from ratchet.data.errors import RatchetError

            raise RatchetError(server.error)
        with heartbeats_where_heard():
            return execute(self.cfg, ctx=ctx)


# Prefect's settings for the interval of a flow run's heartbeats (the second: its older name)
HEARTBEAT_SETTINGS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")


@contextlib.contextmanager
def heartbeats_where_heard() -> Iterator[None]:
    """Prefect's flow-run heartbeats off while the block lasts where the run's server is its own.

    Each flow a run calls (the run's, each round's) sends Prefect a heartbeat every 180 s, so that a
    server that outlives a dead run can mark it crashed when they stop (Prefect's zombie detection).
    A run's own temporary server (`TemporaryServer`, or Prefect's ephemeral one) dies with it, so
    nothing is there to read them; and each flow's heartbeat thread sleeps a second at a time, so
    every flow's end waited for it: 0.56 s on average, a round's time on the path to the next.
    On a server of the user's (PREFECT_API_URL, a deployment's), and wherever the user set their
    interval, they are as Prefect's settings say."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    server, url = TemporaryServer.current, PREFECT_API_URL.value()
    own = not url or (server is not None and url == server.api_url)
    if not own or any(k in os.environ for k in HEARTBEAT_SETTINGS):
        yield
        return
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@contextlib.contextmanager
def launcher(cfg: PipelineConfig, stamp: str) -> Iterator[Launch]:
    """The temporary Prefect server started meanwhile, and the run's services while the block
    lasts (flows/pipeline.py `services`), their logs first named STAMP-PID."""
    workdir = Path(cfg.workdir).resolve()
    ready = started_meanwhile(TemporaryServer.start_here() or ephemeral_server_dies_with_us())
    from ratchet.flows.pipeline import services  # Prefect's import, once its server is named
    with services(cfg, workdir / "logs", f"{stamp}-{os.getpid()}"):  # their imports overlap with the start
        yield Launch(cfg, workdir, stamp, ready)
