"""The run's warm engine (models/warm.py): one engine lent to stage after stage, its weights
swapped in place, answering exactly as an engine of the stage's own would."""

import shutil
import time
from pathlib import Path

import pytest

from ratchet.models import warm
from ratchet.tasks.runner.stage import WORKER_LIBRARIES
from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler

PROMPTS = [f"What is {a} + {b}?" for a in range(6) for b in range(3)]
SAMPLED = SamplingParams(n=3, temperature=0.9, top_k=50, max_tokens=8)


def _other_weights(src, dst):
    """A copy of the model at `src` with other weights (every weight scaled): the same shape."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(weights)
    torch.manual_seed(1)
    save_file({k: (v.float() * (1 + 0.05 * torch.randn(()))).to(v.dtype).contiguous() for k, v in tensors.items()},
              weights, metadata={"format": "pt"})
    return dst


def _texts(gens):
    return [[(g.text, g.n_tokens, g.finish_reason) for g in row] for row in gens]


def _cold(model, cfg, seed, params=SAMPLED, call_seed=7):
    s = open_sampler(model, cfg, seed=seed)
    try:
        return _texts(s.generate(PROMPTS, params, seed=call_seed))
    finally:
        s.close()


def _lent(model, cfg, seed, address, params=SAMPLED, call_seed=7):
    """What a stage worker's units get from the warm engine at `address`: (how it was opened, the texts)."""
    s = warm.WarmSampler(model, cfg, seed=seed, address=address)
    try:
        return s.opened["how"], _texts(s.generate(PROMPTS, params, seed=call_seed))
    finally:
        s.close()


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """The run's warm engine, and this process as the stage worker that borrows it."""
    with warm.for_run(True, tmp_path / "engine.log", "hf") as w:
        w.borrowed = borrow(w, monkeypatch)
        assert warm.ENV not in __import__("os").environ  # the worker's alone: no process it starts inherits it
        yield w


def borrow(w, monkeypatch) -> str:
    """This process as a stage worker of the run that holds `w`: the address it takes."""
    monkeypatch.setenv(warm.ENV, w.env()[warm.ENV])
    return warm.take_address()


def test_the_warm_engine_keeps_swaps_and_reopens_and_answers_as_a_cold_engine(tiny_model, tmp_path, engine):
    """The run's warm engine on the HF backend: kept for the same weights, its weights swapped in place for
    others, another engine for another shape, each answer a new engine's. Guards `executor.warm_engine`. Slow:
    five engines on the tiny model, two kept warm."""
    cfg = SamplerConfig(backend="hf", dtype="float32")
    other = _other_weights(tiny_model, tmp_path / "other")
    base_cold, other_cold = _cold(tiny_model, cfg, 0), _cold(other, cfg, 0)
    assert base_cold != other_cold  # the two weights answer differently, so a stale engine would show

    assert _lent(tiny_model, cfg, seed=0, address=engine.borrowed) == ("opened", base_cold)
    assert _lent(tiny_model, cfg, seed=5, address=engine.borrowed) == ("kept", base_cold)  # the engine's seed is not the call's
    assert _lent(other, cfg, seed=0, address=engine.borrowed) == ("swapped weights to", other_cold)
    assert _lent(tiny_model, cfg, seed=0, address=engine.borrowed) == ("swapped weights to", base_cold)
    wider = cfg.model_copy(update={"hf_batch_size": 4})  # another shape: another engine
    assert _lent(tiny_model, wider, seed=0, address=engine.borrowed) == ("opened", _cold(tiny_model, wider, 0))


def test_a_second_shape_is_kept_beside_the_first_only_where_memory_allows(tiny_model, monkeypatch):
    """A CPU engine process keeps an engine of a second shape beside the first (a round's sampling
    and its evaluation in another dtype), and opens it in place of the first where memory is short
    or the run asks for one shape at a time (executor.warm_engine_shapes=1)."""
    cfg = SamplerConfig(backend="hf", dtype="float32")
    wider = cfg.model_copy(update={"hf_batch_size": 4})
    monkeypatch.setattr(warm, "_on_gpu", lambda: False)  # the CPU's rule, wherever the suite runs
    engines = warm._Engines()
    ask = lambda c: engines.open(str(tiny_model), c.model_dump_json(), 0, None)["how"]
    try:
        assert [ask(cfg), ask(wider), ask(cfg), ask(wider)] == ["opened", "opened", "kept", "kept"]
        assert len(engines.held) == 2
        engines.close()
        monkeypatch.setattr(warm, "_available_bytes", lambda: 2**30)  # 1 GiB free: no room beside the first
        assert [ask(cfg), ask(wider), ask(cfg)] == ["opened", "opened", "opened"] and len(engines.held) == 1
    finally:
        engines.close()
    monkeypatch.undo()
    monkeypatch.setattr(warm, "_on_gpu", lambda: False)
    engines = warm._Engines(keep=1)  # executor.warm_engine_shapes=1: one at a time, whatever is free
    try:
        assert [ask(cfg), ask(wider), ask(cfg)] == ["opened", "opened", "opened"] and len(engines.held) == 1
    finally:
        engines.close()


def test_an_error_in_the_engine_fails_the_stage_and_the_next_stage_gets_a_new_engine(tiny_model, engine):
    """An error inside the warm engine fails the stage that asked, with the engine's error, and the run's next
    stage opens a new engine. Guards `executor.warm_engine` against a poisoned engine. Slow: two engines on
    the tiny model."""
    cfg = SamplerConfig(backend="hf", dtype="float32")
    s = warm.WarmSampler(tiny_model, cfg, seed=0, address=engine.borrowed)
    first = s.opened["pid"]
    with pytest.raises(RuntimeError, match="in the run's warm engine: ValueError: 1 prefixes for 18 prompts"):
        s.generate(PROMPTS, SAMPLED, seed=1, prefixes=["x"])
    s.close()  # as the executor does after a failed unit: quietly, the unit's error is the stage's
    engine.proc.wait(timeout=30)  # its state unknown, the engine process ended
    import os

    os.environ.update(engine.env())  # what the run hands the next stage's worker: a new engine
    again = warm.WarmSampler(tiny_model, cfg, seed=0, address=warm.take_address())
    assert again.opened["pid"] != first and again.opened["how"] == "opened"
    again.close()


def test_callers_that_fail_the_handshake_cost_the_engine_nothing(tiny_model, engine):
    """A wrong key, a caller that hangs up mid-handshake and one that says nothing: the engine
    process lives through each and answers the next stage worker."""
    import socket
    from multiprocessing.connection import AuthenticationError, Client

    cfg = SamplerConfig(backend="hf", dtype="float32")
    s = warm.WarmSampler(tiny_model, cfg, seed=0, address=engine.borrowed)
    pid, before = s.opened["pid"], _texts(s.generate(PROMPTS[:2], SAMPLED, seed=1))
    s.close()
    path = engine.env()[warm.ENV].split("|")[0]
    with pytest.raises(AuthenticationError):
        Client(path, family="AF_UNIX", authkey=b"not the run's key")
    hangs_up = socket.socket(socket.AF_UNIX)
    hangs_up.connect(path)
    hangs_up.close()
    silent = socket.socket(socket.AF_UNIX)  # connected, and never answers the challenge
    silent.connect(path)
    try:
        again = warm.WarmSampler(tiny_model, cfg, seed=0, address=engine.borrowed)  # waits out the silent caller's bound
        assert again.opened["pid"] == pid and engine.proc.poll() is None
        assert _texts(again.generate(PROMPTS[:2], SAMPLED, seed=1)) == before
        again.close()
    finally:
        silent.close()
    assert engine.log_path.read_text().count("failed the handshake") == 3


def test_a_worker_that_finds_the_socket_bound_but_not_yet_listening_waits_for_it(tmp_path):
    """The engine binds its socket, then listens (multiprocessing's Listener: two calls). A worker
    that connects between the two is refused; it retries until the engine listens, and gives up
    with the stage's error where no engine ever does."""
    import socket
    import threading
    from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

    from ratchet.data.errors import StageFailedError

    key, path = b"k" * 32, str(tmp_path / "engine.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)  # bound: the path exists, and a connection is refused
    with pytest.raises(ConnectionRefusedError):
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(path)

    def engine():  # listens late, then answers the handshake as the engine's _accept does
        time.sleep(0.5)
        sock.listen(1)
        conn = Connection(sock.accept()[0].detach())
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        conn.send("ready")

    started = time.time()
    late = threading.Thread(target=engine)
    late.start()
    conn = warm.connect(path, key)
    assert conn.recv() == "ready" and time.time() - started >= 0.5
    late.join()
    conn.close()
    sock.close()

    never = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    never.bind(str(tmp_path / "never.sock"))
    with pytest.raises(StageFailedError, match="warm engine at .*never.sock cannot be reached .*Connection refused"):
        warm.connect(str(tmp_path / "never.sock"), key, refused_s=0.3)
    never.close()


def test_only_the_local_executor_s_own_engine_is_lent(tiny_model, engine):
    from ratchet.data.procs.executors import Lent
    from ratchet.tasks.sample import PolicyWork

    cfg = SamplerConfig(backend="hf", dtype="float32")

    class Work(PolicyWork):
        def run(self, engine, items, seed):
            return [], {}

    w = Work(model=tiny_model, sampler=cfg, seed=0, items=[], size=1)
    own = w.open()  # not lent (a pool's holder, a Ray actor): an engine of its own
    assert not isinstance(own, warm.WarmSampler)
    own.close()
    lent = w.open(Lent(engine.borrowed, 2))
    assert isinstance(lent, warm.WarmSampler)
    lent.close()


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_in_a_run_with_a_fork_server_the_engine_is_forked_from_it(tiny_model, tmp_path, monkeypatch):
    """The engine is a child of the run's fork server, forked once the server has imported what
    it loads models with; it answers as a cold engine, a killed one is forked again, and it ends
    with the run. A run that ends before the fork drops the request: nothing is left behind."""
    import os
    import signal

    from ratchet.data.procs import forkserver
    from tests.procs import gone_within

    cfg = SamplerConfig(backend="hf", dtype="float32")
    cold = _cold(tiny_model, cfg, 0)
    with forkserver.for_run(True, tmp_path / "early.log", WORKER_LIBRARIES):
        with warm.for_run(True, tmp_path / "early-engine.log", "hf") as w:
            early = w.proc
        assert early.returncode == -signal.SIGTERM and (early.pid is None or gone_within(early.pid, 30))
    with forkserver.for_run(True, tmp_path / "forkserver.log", WORKER_LIBRARIES) as server, \
            warm.for_run(True, tmp_path / "engine.log", "hf") as w:
        assert isinstance(w.proc, forkserver.Forked)
        w.rename_log(tmp_path / "named.engine.log")  # as a run names it, here before the server forks it
        assert _lent(tiny_model, cfg, seed=0, address=borrow(w, monkeypatch)) == ("opened", cold)
        first = w.proc.pid
        assert _ppid(first) == server.proc.pid
        os.kill(first, signal.SIGKILL)
        assert w.proc.wait(timeout=30) == -signal.SIGKILL and w.proc.pid == first  # its pid, for the log line
        # the next stage's worker: the engine is forked again
        assert _lent(tiny_model, cfg, seed=0, address=borrow(w, monkeypatch)) == ("opened", cold)
        second = w.proc.pid
        assert second != first and _ppid(second) == server.proc.pid
    assert gone_within(second, 30)
    said = (tmp_path / "named.engine.log").read_text()
    assert f"warm engine (pid {first}): listening" in said and f"warm engine (pid {second}): listening" in said
    assert not (tmp_path / "engine.log").exists()


def test_an_engine_the_fork_server_does_not_fork_runs_in_a_process_of_its_own(tiny_model, tmp_path, monkeypatch,
                                                                                caplog):
    import logging
    import subprocess

    from ratchet.data.procs import services

    class Refused:
        pid, returncode, refused = None, -1, "2 threads"

        def poll(self):
            return self.returncode

    class Server:
        def spawn(self, *args, **kwargs):
            return Refused()

    cfg = SamplerConfig(backend="hf", dtype="float32")
    with services.held(server=Server()), caplog.at_level(logging.INFO, logger="ratchet"), \
            warm.for_run(True, tmp_path / "engine.log", "hf") as w:
        address = borrow(w, monkeypatch)
        assert isinstance(w.proc, subprocess.Popen)
        assert _lent(tiny_model, cfg, seed=0, address=address) == ("opened", _cold(tiny_model, cfg, 0))
    assert "did not fork the warm engine (2 threads); it runs on its own" in caplog.text


@pytest.mark.integration
def test_vllm_weights_swapped_in_place_answer_byte_for_byte_as_a_fresh_engine(default_model, tmp_path, monkeypatch):
    """The default model on vLLM: the warm engine opened on it, then swapped to other weights,
    samples exactly what a fresh engine on those weights does, and differs from the first. An
    engine of a second shape (as a round's evaluation in another dtype asks for) opens beside the
    first on a CPU, and the first is kept: asked for again it swaps its weights, it does not reopen.

    Guards the warm engine on vLLM, which every round of the default run samples on: a swap of weights in
    place answers as a new engine would. Slow: three vLLM engines on the default model (two shapes warm, one
    cold)."""
    cfg = SamplerConfig(backend="vllm", kv_cache_gb=1)
    other = _other_weights(default_model, tmp_path / "other")
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16)
    shorter = cfg.model_copy(update={"max_model_len": 256})  # another shape; greedy answers as the first
    with warm.for_run(True, tmp_path / "engine.log", "vllm") as w:
        address = borrow(w, monkeypatch)
        first = _lent(default_model, cfg, seed=0, address=address, params=greedy)
        beside = _lent(default_model, shorter, seed=0, address=address, params=greedy)
        swapped = _lent(other, cfg, seed=3, address=address)
        kept = _lent(other, cfg, seed=0, address=address)
        other_greedy = _lent(other, cfg, seed=0, address=address, params=greedy)  # answers as a fresh engine: just shown
        beside_again = _lent(other, shorter, seed=0, address=address, params=greedy)
    cold = _cold(other, cfg, 9)
    assert first[0] == "opened" and swapped[0] == "swapped weights to" and kept[0] == "kept"
    assert swapped[1] == cold and kept[1] == cold
    assert first[1] != other_greedy[1]  # the swap changed what it answers
    # the second shape's engine, opened beside the first, and swapped in its turn
    assert beside == ("opened", first[1]) and beside_again == ("swapped weights to", other_greedy[1])
