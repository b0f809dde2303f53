"""The run's temporary Prefect server (flows/prefect_server.py): a request that finds Prefect's SQLite
database locked is run again in the server after a short wait, before the client's own retry (2 s)."""

import asyncio

import pytest

from ratchet.flows.prefect_server import RetryLocked


def _call(app, body=b'{"name": "round_zero"}', sent=None):
    """One HTTP request through `app` as uvicorn makes it (the body in two messages): what the client
    was sent (into `sent`, when given, so that it is there if the app raises)."""
    incoming = [{"type": "http.request", "body": body[:5], "more_body": True},
                {"type": "http.request", "body": body[5:], "more_body": False}]
    sent = [] if sent is None else sent

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/api/task_runs/"}, receive, send))
    return sent


class Locked:
    """Prefect's app as a locked database makes it answer: 503, then the error raised again (as
    Starlette's error middleware does), `times` times; then 201 with the body it read. Like
    Starlette's routing, it writes into the request's scope."""

    def __init__(self, times: int):
        self.times, self.bodies = times, []

    async def __call__(self, scope, receive, send):
        assert scope["path"] == "/api/task_runs/" and "route" not in scope  # as uvicorn gave it, each time
        scope.update(path="/task_runs/", route="found")  # as a mounted app and its router write into it
        message = await receive()
        self.bodies.append(message["body"])
        if len(self.bodies) <= self.times:
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b'{"exception_message": "Service Unavailable"}'})
            raise RuntimeError("database is locked")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"made", "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def test_a_request_that_met_a_locked_database_is_run_again_with_the_same_body_and_the_client_sees_the_answer():
    app = Locked(times=2)
    sent = _call(RetryLocked(app, waits=(0.001, 0.001, 0.001)))
    assert app.bodies == [b'{"name": "round_zero"}'] * 3  # the whole body each time, though it came in two parts
    assert [m.get("status") for m in sent] == [201, None, None] and sent[1]["body"] == b"made"  # streamed as it came


def test_a_lock_that_outlasts_the_waits_reaches_the_client_as_prefect_answered_it():
    app, sent = Locked(times=10), []
    with pytest.raises(RuntimeError, match="locked"):  # as uvicorn sees it without the middleware
        _call(RetryLocked(app, waits=(0.001, 0.001)), sent=sent)
    assert len(app.bodies) == 3
    assert [m.get("status") for m in sent] == [503, None]


def test_other_answers_and_other_scopes_pass_through_once():
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["type"])
        if scope["type"] == "http":
            await receive()
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"no"})

    assert [m.get("status") for m in _call(RetryLocked(app, waits=(0.001,)))] == [404, None]
    asyncio.run(RetryLocked(app)({"type": "lifespan"}, None, None))
    assert calls == ["http", "lifespan"]
