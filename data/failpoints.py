"""Failpoints: named places where a run can be made to die on purpose, to prove it resumes.

    RATCHET_FAILPOINTS=sample:shard ratchet run flows/configs/default.yaml

A failpoint listed in RATCHET_FAILPOINTS (comma-separated) SIGKILLs the whole process
group when reached: the CLI, its Prefect server and the stage worker die at once, as
with `kill -9` or a lost machine. Nothing is cleaned up, which is the point. Unset, a
failpoint costs one environment lookup.

With RATCHET_FAILPOINTS_KILL=orchestrator, a failpoint instead kills the run's orchestrator
(the `ratchet` process) by its PID alone, as `kill -9 PID` does, and waits: every process
below it must then die by itself (data/procs/lifetime.py), the one that reached the failpoint
included. A process left standing is a bug the tests look for.

With RATCHET_FAILPOINTS_KILL=interrupt, a failpoint sends SIGINT to the run's process group, as
a Ctrl-C at the terminal does, and goes on: the run must stop with an interrupt, promptly, and
leave nothing running. With RATCHET_FAILPOINTS_KILL=terminate, it sends SIGTERM to the run's
orchestrator alone, as systemd, `docker stop` or Kubernetes do: the same, exit code 143.

Points: <stage>:shard (sample and judge, after the first shard is written),
<stage>:before-manifest (outputs written, manifest not yet), <stage>:after-manifest
(stage finished, nothing downstream started or logged), train:checkpoint (after the
first trainer checkpoint is saved).
"""

from __future__ import annotations

import os
import signal
import time

ENV = "RATCHET_FAILPOINTS"
GROUP = "RATCHET_FAILPOINTS_GROUP"  # set for processes started in a group of their own (torchrun's processes)
KILL = "RATCHET_FAILPOINTS_KILL"  # "group" (the default), "orchestrator", "interrupt" or "terminate"
ORCHESTRATOR = "RATCHET_ORCHESTRATOR_PID"  # set by `ratchet run` for the processes below it


def orchestrator() -> None:
    """Mark this process as the run's orchestrator for the processes it starts."""
    os.environ[ORCHESTRATOR] = str(os.getpid())


def armed(name: str) -> bool:
    return name in os.environ.get(ENV, "").split(",")


def hit(name: str) -> None:
    """Die here, with the whole process group (the pipeline's, where a helper runs in a group
    of its own), if `name` is armed; or kill the orchestrator alone and wait to die with it."""
    if armed(name):
        if os.environ.get(KILL) == "interrupt":  # a Ctrl-C: the whole group, this process included
            os.killpg(int(os.environ.get(GROUP, os.getpgrp())), signal.SIGINT)
            return
        if os.environ.get(KILL) == "terminate" and ORCHESTRATOR in os.environ:  # systemd's, docker stop's SIGTERM
            os.kill(int(os.environ[ORCHESTRATOR]), signal.SIGTERM)
            return
        if os.environ.get(KILL) == "orchestrator" and ORCHESTRATOR in os.environ:
            os.kill(int(os.environ[ORCHESTRATOR]), signal.SIGKILL)
            while True:  # until the orchestrator's death reaches this process
                time.sleep(1)
        pipeline = int(os.environ.get(GROUP, os.getpgrp()))
        if pipeline != os.getpgrp():
            os.killpg(pipeline, signal.SIGKILL)
        os.killpg(os.getpgrp(), signal.SIGKILL)
