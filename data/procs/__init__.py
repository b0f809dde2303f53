"""The engine room: every process Ratchet starts is started, fed and stopped here.

It sits in the lowest layer (data/) because its users are in every layer: the answer checks
(data/checks: the scorer host, the code check's sandbox), the models (the warm engine, torchrun
training), the tasks (stage workers, engine holders, environment hosts) and the flows (the fork
server, Prefect's temporary server, git). Each imports it downward; it imports nothing above
data/, and names no module above it: a child runs an entry (`entry.py`) its caller hands over as
an object, found again in the child by the name the object gives.

    entry.py      the entries: a child's main, declared with @entry where it is defined
    spawn.py      starting one: `start(entry, ...)`, `launch` under torchrun, `run_program` for
                  programs that are not Ratchet's (git, a sandboxed program)
    channel.py    the protocol: JSON lines, numbered calls, the user's frames in a failure
    host.py       hosts: a child answering calls under time bounds, one per call or one per session
    forkserver.py the run's fork server: stage workers, the warm engine and calls forked from a
                  process that imported the heavy libraries once
    services.py   a run's service processes (its fork server, its warm engine), held by the run in
                  a context variable, not by the process
    executors.py  where a stage's units run: in the stage's process, a pool of engine holders, Ray
    lifetime.py   no process outlives the one that started it
    sandbox.py    a model's program, where it can do no harm

How a parent and its child talk, and why each way stays:
- a channel (channel.py), JSON lines: every child that answers calls (scorer hosts, environment
  hosts and their episodes, the fork server, the pool's engine holders). JSON because these
  children run the user's code or read the model's text: what comes back is data, never code.
- files: a stage's worker and a fork-server call (in the stage's directory), torchrun's training
  processes (started by torchrun, not by us), and a pool holder's work (Ratchet's own objects,
  pickled, read once). The fork server's child is not the waiting process's own child, so it
  holds no channel to it, and a stage's result is its manifest on disk anyway (written last, its
  error report beside it).
- a Unix socket with a key (models/warm.py): the run's warm engine, which every stage's worker
  borrows in turn (none of them its parent), exchanging Ratchet's own Python objects (pickled:
  both ends are Ratchet's code, and the key keeps every other process out).
- a program's own input and output: programs that are not Ratchet's (a judged program in the
  sandbox, git, Prefect's server, torchrun's launcher), which speak no protocol of ours.

tests/test_engine_room.py holds it to this: no process starts outside this folder, no string
names a module of the package, imports point down the layers.
"""
