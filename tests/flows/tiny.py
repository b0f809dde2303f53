"""The self-rewarding pipeline shrunk onto the tiny random model: every stage runs for
real (HF backend, worker processes) in about a minute."""

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "flows" / "configs" / "self_reward_dpo.yaml"


def overrides(workdir, tiny_model) -> list[str]:
    return [f"workdir={workdir}", f"model.path={tiny_model}", "rounds=1", "sampler.backend=hf",
            "sampler.dtype=float32", "data.a_max=6", "data.b_max=4", "data.train_size=12", "data.eval_size=4",
            "sample.n=3", "sample.max_tokens=6", "sample.shard_size=3", "label.top_logprobs=60000",
            "label.shard_size=9", "filter.margin=0", "filter.min_pairs=1", "filter.max_length_ratio=null",
            "train.epochs=2", "train.batch_size=4", "train.checkpoint_steps=2", "evaluate.max_tokens=6",
            "agreement.min=null"]  # a random model's labels agree with nothing; these runs test the machinery


def ratchet(*args, api_url: str | None, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`ratchet ARGS` in its own process group, against the Prefect server at api_url (None: the
    temporary one a run starts by itself). Its SIGINT is at the default a terminal gives it (a
    test worker may ignore SIGINT, and an ignored signal stays ignored across exec)."""
    full = {**os.environ, "PREFECT_API_URL": api_url}
    if api_url is None:
        full.pop("PREFECT_API_URL")
    full.pop("RATCHET_FAILPOINTS", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "ratchet.flows.cli", *map(str, args)], cwd=ROOT, env=full,
                          start_new_session=True, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def free_port() -> int:
    """A loopback port nobody listens on, for a server a test starts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
