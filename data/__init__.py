"""Records, manifests, digests, the artifact store, prompt sources and answer checks, and the
engine room (procs/), where every process Ratchet starts is started: the lowest floor, because
every floor above starts processes (a check's scorer host, a training launcher, a stage worker).

The bottom layer: nothing here imports torch, Prefect or MLflow, at the top of a module or inside
a function (tests/test_engine_room.py holds it to that).
"""
