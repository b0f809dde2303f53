"""A run's start (flows/launch.py): the temporary Prefect server the run starts itself."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.integration

SERVER = """
import json, os, sys
from ratchet.flows.launch import TemporaryServer

server = TemporaryServer.start_here()
copied = os.path.exists(os.path.join(os.environ["PREFECT_HOME"], "prefect.db"))  # before its server could build it
same = TemporaryServer.start_here() is server
server.wait(120)
from prefect.client.orchestration import get_client

with get_client(sync_client=True) as client:
    said = client.hello().status_code
    url = str(client.api_url)
    flows = len(client.read_flows())
beats = {}
if not copied:  # the first server: does a flow run on it send heartbeats (a thread of its own while it runs)?
    import time

    from prefect import flow
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    from ratchet.flows.launch import heartbeats_where_heard

    @flow
    def probe() -> bool:  # a thread in Prefect's heartbeat loop, looked for for up to 1 s
        end = time.monotonic() + 1
        while time.monotonic() < end:
            for frame in sys._current_frames().values():
                while frame is not None:
                    if frame.f_code.co_name == "heartbeat_loop":
                        return True
                    frame = frame.f_back
            time.sleep(0.05)
        return False

    beats["prefect's"] = probe()
    with heartbeats_where_heard():
        beats["own server"] = probe()
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}), heartbeats_where_heard():
        beats["another server"] = get_current_settings().flows.heartbeat_frequency is not None
    os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "60"  # the user's own interval
    with heartbeats_where_heard():
        beats["set by the user"] = probe()
print(json.dumps({"error": server.error, "url": url, "api": server.api_url, "env": os.environ["PREFECT_API_URL"],
                  "same": same, "hello": said, "pid": server.proc.pid, "log": str(server.log), "copied": copied,
                  "flows": flows, "server modules": "prefect.server.api.server" in sys.modules,
                  "beats": beats}), flush=True)
sys.stdin.read()  # held until the test kills this process
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped by whoever adopted it
    except FileNotFoundError:
        return True


def _server(tmp_path, home: str):
    """The SERVER script in a process of its own, with PREFECT_HOME=tmp_path/home and the user cache
    (the empty database's template) in tmp_path: (the process, what it printed)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / home), RATCHET_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        pytest.fail(proc.stderr.read()[-3000:])
    return proc, json.loads(line)


def test_the_temporary_server_is_named_before_prefect_is_imported_and_dies_with_its_run(tmp_path):
    """Guards a run's start (issue 86: a partly reused run reaches its first new stage fast): the run
    starts Prefect's temporary server itself, before importing Prefect, and names it to Prefect
    (PREFECT_API_URL), so Prefect's client talks to it without starting its own and the run's
    process never imports the server's code (1.2-1.9 s a run). One per process. A `kill -9` of
    the run's process leaves it serving nothing: it dies by itself, as every process below a run.
    The first new database a server builds is kept, empty, in the user cache, and the next new
    home starts from a copy of it (its server then skips Prefect's migrations, some 5 s of CPU).
    Flows run on the run's own server send no heartbeats (each flow's end waited up to 1 s for its
    heartbeat thread); on another server, or with the user's own interval, they do."""
    proc, out = _server(tmp_path, "prefect")
    try:
        assert out["error"] is None and out["hello"] == 200 and out["same"] and not out["copied"], out
        assert out["url"].rstrip("/") == out["api"] == out["env"] and out["api"].startswith("http://127.0.0.1:"), out
        assert out["server modules"] is False, out
        # heartbeats: Prefect's default sends them; the run's own server, which dies with it, gets none
        assert out["beats"] == {"prefect's": True, "own server": False, "another server": True,
                                "set by the user": True}, out
        assert Path(out["log"]) == tmp_path / "prefect" / "temporary-server.log" and Path(out["log"]).exists()
        assert not _gone(out["pid"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while not _gone(out["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(out["pid"]), f"the temporary server {out['pid']} outlived its run"

    # the template: Prefect's tables, rows in none but the schema's revision and the block types
    import sqlite3

    from ratchet.flows.launch import EMPTY_TABLES

    (template,) = (tmp_path / "cache" / "prefect-schema").glob("empty-*.db")
    with sqlite3.connect(template) as db:
        tables = [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        used = {t for t in tables if db.execute(f'SELECT 1 FROM "{t}" LIMIT 1').fetchone()}
    assert len(tables) > 30 and used == EMPTY_TABLES, (len(tables), used)
    # a new home's database is that copy, there before its server starts, and the server serves from it
    proc, out = _server(tmp_path, "second")
    try:
        assert out["error"] is None and out["copied"] and out["hello"] == 200 and out["flows"] == 0, out
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
