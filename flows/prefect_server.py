"""Prefect's temporary server for a run (flows/launch.py `TemporaryServer`), in a process of its own
(`spawn.command(serve, PORT)`): the program Prefect's own start runs (uvicorn serving Prefect's API
without its UI, on loopback), the collector off while it imports and makes its app and that heap
then frozen (data/procs/forkserver.py `imports_frozen`): Python's collector ran its full collections
as the heap grew, and the server took 4.2-4.3 s of CPU to its first answer, 3.7-3.8 s with them
off and one collection at the end (2 cores, a new workdir's database).
"""

from __future__ import annotations

from ratchet.data.procs.entry import entry


@entry
def serve(port: int) -> int:
    """Serve Prefect's API on 127.0.0.1:`port` until SIGTERM or SIGINT, as `uvicorn --factory
    prefect.server.api.server:create_app --lifespan on` does."""
    from ratchet.data.procs.forkserver import imports_frozen

    with imports_frozen():
        import uvicorn
        from prefect.server.api.server import create_app

        app = create_app()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")
    return 0
