"""The self-rewarding pipeline shrunk onto the tiny random model: every stage runs for
real (HF backend, worker processes) in about a minute."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests import cli_template

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "flows" / "configs" / "self_reward_dpo.yaml"


def tiny_causal_lm(out: Path, tokenizer: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama with `tokenizer`'s vocabulary, written to `out`: every code path of a
    real model, seconds a stage (the tests' policy and judge, bench/kill_bench.py's runs)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def overrides(workdir, tiny_model) -> list[str]:
    return [f"workdir={workdir}", f"model.path={tiny_model}", "rounds=1", "sampler.backend=hf",
            "sampler.dtype=float32", "data.a_max=6", "data.b_max=4", "data.train_size=12", "data.eval_size=4",
            "sample.n=3", "sample.max_tokens=6", "sample.shard_size=3", "label.top_logprobs=60000",
            "label.shard_size=9", "filter.margin=0", "filter.min_pairs=1", "filter.max_length_ratio=null",
            "train.epochs=2", "train.batch_size=4", "train.checkpoint_steps=2", "evaluate.max_tokens=6",
            "agreement.min=null"]  # a random model's labels agree with nothing; these runs test the machinery


# one thread per engine holder (a Ray node of the tests' cluster has one CPU), evaluation in two
# units so that it too can spread over two holders; the runs compared with `reference_run` use these
ONE_THREAD = ["executor.threads_per_engine=1", "evaluate.shard_size=2"]


def reference_run(workdir, tiny_model, api_url) -> subprocess.CompletedProcess:
    """The uninterrupted run the fault and Ray tests compare with (tests/conftest.py makes it once
    for a test process), against the Prefect server at api_url. Its stage workers are forked from
    its fork server, as every run's are by default; that a fresh interpreter's worker
    (`executor.warm_workers=false`) writes the same bytes is tests/tasks/test_stages_tiny.py's, and
    the Ray round compares its nodes' fresh workers with this run."""
    return ratchet("run", CONFIG, *overrides(workdir, tiny_model), *ONE_THREAD, api_url=api_url)


def ratchet(*args, api_url: str | None, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`ratchet ARGS` in its own process group, against the Prefect server at api_url (None: the
    temporary one a run starts by itself). Its SIGINT is at the default a terminal gives it (a
    test worker may ignore SIGINT, and an ignored signal stays ignored across exec). A run or
    resume is forked from the test process's CLI template where it listens (tests/cli_template.py),
    its imports made."""
    full = {**os.environ, "PREFECT_API_URL": api_url}
    if api_url is None:
        full.pop("PREFECT_API_URL")
    full.pop("RATCHET_FAILPOINTS", None)
    full.update(env or {})
    argv = [str(a) for a in args]
    if cli_template.usable(argv, full) and (done := cli_template.run(argv, full, ROOT, timeout)) is not None:
        return done
    return subprocess.run([sys.executable, "-m", "ratchet.flows.cli", *argv], cwd=ROOT, env=full,
                          start_new_session=True, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def free_port() -> int:
    """A loopback port nobody listens on, for a server a test starts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
