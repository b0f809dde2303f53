"""Prefect's temporary server for a run (flows/launch.py `TemporaryServer`), in a process of its own
(`spawn.command(serve, PORT)`): the program Prefect's own start runs (uvicorn serving Prefect's API
without its UI, on loopback), the collector off while it imports and makes its app and that heap
then frozen (data/procs/forkserver.py `imports_frozen`): Python's collector ran its full collections
as the heap grew, and the server took 4.2-4.3 s of CPU to its first answer, 3.7-3.8 s with them
off and one collection at the end (2 cores, a new workdir's database).
"""

from __future__ import annotations

from ratchet.data.procs.entry import entry


# What the server waits before it runs again a request that found its database locked, then
# none: the client's own retry (2 s, then 4, 8, ...) takes over. The lock is another writer's
# commit (the server's services record the run's task states and events as they arrive), a few
# milliseconds; most of these requests succeed on the first run again.
LOCKED_WAITS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)


class RetryLocked:
    """An ASGI middleware: a request Prefect answers with 503 (its answer to a SQLite database
    locked by another transaction, which its clients retry) is run again here after a short wait,
    LOCKED_WAITS, before its 503 reaches the client. A transaction that met the lock was rolled
    back, so running the request again is what the client's retry does, sooner: its client waits
    2 s before its first retry, and a partly reused run met the lock on about one start in three as
    it created round 0's subflow (2-2.5 s more to its first new stage). Any other answer passes
    through as it comes, streamed."""

    def __init__(self, app, waits: tuple[float, ...] = LOCKED_WAITS):
        self.app, self.waits = app, waits

    async def __call__(self, scope, receive, send):
        import asyncio

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body, more = body + message.get("body", b""), message.get("more_body", False)
        for wait in (*self.waits, None):
            given, locked = [False], [False]

            async def replay(given=given):
                if not given[0]:
                    given[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            async def answer(message, locked=locked):
                if message["type"] == "http.response.start" and message["status"] == 503 and wait is not None:
                    locked[0] = True
                if not locked[0]:
                    await send(message)

            try:  # each run on the scope as uvicorn gave it: Starlette's routing writes into it
                await self.app(dict(scope), replay, answer)
            except Exception:  # Starlette raises the error again once its handler has answered
                if not locked[0]:
                    raise
            if not locked[0]:
                return
            await asyncio.sleep(wait)


@entry
def serve(port: int) -> int:
    """Serve Prefect's API on 127.0.0.1:`port` until SIGTERM or SIGINT, as `uvicorn --factory
    prefect.server.api.server:create_app --lifespan on` does, a request that finds the database
    locked run again here first (`RetryLocked`)."""
    from ratchet.data.procs.forkserver import imports_frozen

    with imports_frozen():
        import uvicorn
        from prefect.server.api.server import create_app

        app = create_app()
    uvicorn.run(RetryLocked(app), host="127.0.0.1", port=port, log_level="error", lifespan="on")
    return 0
