"""The run's warm engine: one engine kept for a whole run, lent to stage after stage.

Starting an engine is most of what a sampling stage waits for: importing vLLM (about 6 s on
2 cores) and initialising it (about 11 s for the 135M default: profile run, KV cache, warm-up;
a minute or more for a 7-8B model with CUDA graphs). A round samples with the model the round
before evaluated, and evaluates the model it trains, so a run would pay that start two or
three times a round for weights it has mostly seen.

Instead `ratchet run` starts one engine process per run (`WarmEngine`, from the run's main
thread) and lends its engine to each stage worker that samples on this machine with one
engine (`executor.kind=local`, `engines=1`, `executor.warm_engine`, the default):

- the worker's units call it over a Unix socket (`WarmSampler`, the same `Sampler` interface
  as an engine in the worker's own process);
- asked for the weights it holds, it lends them as they are; asked for other weights of the
  same shape (the same sampler settings, model config and tokenizer: a round's trained model
  and the model it trained from), it loads them into the engine in place
  (`reload_weights`, 0.3 s for the default model) and forgets its prefix cache; asked for
  another shape, it opens one. On a CPU it keeps the engine of the other shape where memory
  allows (a round on a bf16 CPU samples in bf16 and evaluates in float32: two shapes a round,
  each then swapped rather than opened again); on a GPU it closes it first;
- between stages it holds nothing on a GPU but its CUDA context: a released vLLM engine
  sleeps (vLLM's sleep mode, level 1: weights to CPU memory, KV cache freed) and wakes for
  the next stage; a transformers model is let go and loaded again. Training gets the GPU's
  memory. vLLM's CPU backend has no sleep mode: on a CPU the engine keeps its memory
  (weights and `sampler.kv_cache_gb`) while training runs;
- it answers one stage at a time, and each stage seeds every call, so a unit's text does not
  depend on which stage the engine served before (tests/models/test_warm.py compares a warm
  run with cold engines byte for byte).

Stage isolation is kept: each stage still runs in a fresh worker process; only the engine
outlives it. An error inside the engine ends the engine process after its report (its state
is unknown), and the next stage that needs it gets a new one. The engine process dies with
the run (data/procs/lifetime.py); nothing it holds is written to the store.

The worker takes the address from RATCHET_ENGINE (removed from its environment at start, so
no process the worker starts, an engine holder of a pool or a Ray actor, can borrow it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet.data.errors import StageFailedError
from ratchet.data.procs import forkserver, services, spawn
from ratchet.data.procs.entry import entry
from ratchet.data.procs.lifetime import Spawner
from ratchet.models.tokenizer import WEIGHT_SUFFIXES, files_digest

log = logging.getLogger("ratchet")

ENV = "RATCHET_ENGINE"  # "<socket path>|<authkey hex>", for the stage worker alone


def shape_of(model_dir: Path, sampler_json: str) -> str:
    """What an engine is, all but its weights: the sampler settings and every file of the model
    directory that is not a weight file (config, generation config, tokenizer, chat template).
    Two models of one shape can share an engine by swapping weights."""
    import hashlib

    return files_digest(model_dir, hashlib.sha256(sampler_json.encode()))


# the worker's side ---------------------------------------------------------------------------

def take_address() -> str | None:
    """In a stage worker, first thing: the run's warm engine's address, dropped from the
    environment, so it is this process's alone (no process it starts can borrow it)."""
    return os.environ.pop(ENV, "") or None


REFUSED_S = 10.0  # how long a worker retries an engine whose socket refuses it


def connect(path: str, key: bytes, refused_s: float = REFUSED_S):
    """A connection to the engine listening at `path`, the key proven. The engine binds its socket
    and then listens, so a worker that finds the socket between the two (on a loaded machine the
    engine can wait there a while) is refused: it tries again for up to `refused_s`."""
    from multiprocessing.connection import Client

    deadline = time.time() + refused_s
    while True:
        try:
            return Client(path, family="AF_UNIX", authkey=key)
        except ConnectionRefusedError as e:
            if time.time() < deadline:
                time.sleep(0.05)
                continue
            error: OSError = e
        except OSError as e:
            error = e
        raise StageFailedError(f"the run's warm engine at {path} cannot be reached ({error}); re-run the same "
                               "command to resume, or set executor.warm_engine=false") from error


class WarmSampler:
    """The run's warm engine, seen from a stage worker: the `Sampler` interface over a socket."""

    def __init__(self, model_dir: Path, cfg, seed: int, address: str, threads: int | None = None):
        self.model_dir, self.cfg, self.broken = Path(model_dir), cfg, False
        path, _, hexkey = address.partition("|")
        self.conn = connect(path, bytes.fromhex(hexkey))
        self.opened = self._call("open", {"model": str(self.model_dir), "sampler": cfg.model_dump_json(),
                                          "seed": seed, "threads": threads})
        log.info("warm engine (pid %s): %s %s in %.2f s", self.opened["pid"], self.opened["how"], self.model_dir,
                 self.opened["load_s"])

    def _call(self, *msg):
        try:
            self.conn.send(msg)
            reply = self.conn.recv()
        except (EOFError, OSError) as e:
            raise StageFailedError(f"the run's warm engine stopped answering ({type(e).__name__}: {e}); its log is "
                                   "under the workdir's logs/. Finished units are kept: re-run the same command to "
                                   "resume") from e
        if reply[0] == "error":
            self.broken = True  # the engine process has ended: nothing to release
            _, kind, message, tb = reply
            log.error("the warm engine's traceback:\n%s", tb)
            raise RuntimeError(f"in the run's warm engine: {kind}: {message}")
        return reply[1]

    def generate(self, prompts, params, seed: int, prefixes=None):
        return self._call("generate", prompts, params, seed, prefixes)

    def generate_ids(self, contexts, params, seed: int):
        return self._call("generate_ids", contexts, params, seed)

    def next_token_logprobs(self, prompts, prefix: str, top: int):
        return self._call("logprobs", prompts, prefix, top)

    @functools.cached_property
    def tokenizer(self):
        """The model's tokenizer, loaded here (the engine's is the same files: one shape)."""
        from ratchet.models import tokenizer

        return tokenizer.load(self.model_dir)

    def close(self) -> None:
        """Let the engine go (it closes after a stage's units, also after one failed: the unit's
        error is what the stage reports, never a failed release)."""
        try:
            if not self.broken:
                self._call("release")
        except StageFailedError:
            pass
        finally:
            self.conn.close()


# the engine process -----------------------------------------------------------------------------

@dataclass
class _Held:
    shape: str
    model: str
    sampler: Any
    engine: Any
    threads: int  # what the engine set torch's threads to when it opened
    asleep: bool = False


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


KEEP_ON_CPU = 2  # engines of different shapes kept at once on a CPU (the default of executor.warm_engine_shapes)
SPARE_GIB = 4.0  # memory left free beside a second engine (the training between them, the rest of the machine)


def _weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none: keep one engine)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def room_for_another(model_dir: Path, cfg) -> bool:
    """Whether an engine of another shape can open beside the one held, on a CPU: twice what it
    will take (its weights in float32 at most, twice the stored bytes of a 16-bit model, and its
    KV cache), plus SPARE_GIB, must be free now."""
    free = _available_bytes()
    if free is None:
        return False
    need = 2 * _weights_bytes(model_dir) + int(getattr(cfg, "kv_cache_gb", 0) * 2**30)
    return free >= 2 * need + int(SPARE_GIB * 2**30)


class _Engines:
    """The engine process's engines, and how a request for weights is met. A round samples in the
    run's dtype and evaluates in the base model's stored one (tasks/evaluate.eval_sampler): on a
    bf16 CPU two shapes a round. On a CPU, where memory allows, the engine of the other shape is
    kept (KEEP_ON_CPU) rather than closed and opened again twice a round (4-6 s each for the
    default model); on a GPU one engine, whose memory training needs between stages. `keep`: how
    many shapes at most on a CPU (`executor.warm_engine_shapes`; 1 closes one engine to open another)."""

    def __init__(self, keep: int = KEEP_ON_CPU):
        self.held: list[_Held] = []  # the engine in use last at the end
        self.keep = keep  # shapes held at once on a CPU (executor.warm_engine_shapes)

    @property
    def current(self) -> _Held:
        return self.held[-1]

    def open(self, model: str, sampler_json: str, seed: int, threads: int | None) -> dict[str, Any]:
        import torch

        from ratchet.models.sampler import SamplerConfig, open_sampler

        t = time.time()
        cfg = SamplerConfig.model_validate_json(sampler_json)
        shape = shape_of(Path(model), sampler_json)
        h = next((x for x in self.held if x.shape == shape), None)
        kind = cfg.backend_kind
        if h is not None:
            self.held.remove(h)
            self.held.append(h)
            if h.asleep:
                kind.wake(h.engine)
                h.asleep = False
        if h is None:
            keep = 1 if _on_gpu() else self.keep
            while self.held and (len(self.held) >= keep or not room_for_another(Path(model), cfg)):
                self._close(self.held[0])
            sleep = kind.sleeps and _on_gpu()  # started so, it can give the GPU back between stages
            engine = open_sampler(Path(model), cfg, seed, sleep_mode=sleep)
            h = _Held(shape, model, cfg, engine, torch.get_num_threads())  # the threads the engine set for itself
            self.held.append(h)
            how = "opened"
        elif h.model != model:
            h.engine = kind.swap(h.engine, Path(model), cfg, seed)
            h.model = model
            how = "swapped weights to"
        else:
            kind.fresh(h.engine)  # a stage starts from an empty cache, as in an engine of its own
            how = "kept"
        torch.set_num_threads(threads or h.threads)
        return {"how": how, "load_s": time.time() - t, "pid": os.getpid()}

    def release(self) -> None:
        """Between stages nothing of the engine stays on a GPU: training may need all of it."""
        if not self.held or not _on_gpu():
            return
        h = self.current
        if h.asleep:
            return
        if h.sampler.backend_kind.release(h.engine):  # weights kept in CPU memory, KV cache freed
            h.asleep = True
        else:  # transformers: loading again is quick; the model goes
            self._close(h)
            import torch

            # cuBLAS keeps a workspace per stream in torch's allocator (32 MiB on an H200, seen
            # by the GPU tier) after the model has gone; freed here, then the cache with it
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            torch.cuda.empty_cache()

    def stats(self) -> dict[str, Any]:
        h = self.held[-1] if self.held else None
        gpu, used = 0, 0
        if _on_gpu():
            import torch

            gpu = torch.cuda.memory_allocated()  # this process's tensors
            free, total = torch.cuda.mem_get_info()
            used = total - free  # the whole device's: vLLM's engine core is a process of its own
        return {"pid": os.getpid(), "model": h.model if h else None, "asleep": bool(h and h.asleep),
                "held": [x.model for x in self.held], "gpu_allocated": gpu, "gpu_used": used}

    def _close(self, h: _Held) -> None:
        self.held.remove(h)
        h.engine.close()
        import gc

        gc.collect()

    def close(self) -> None:
        while self.held:
            self._close(self.held[0])


@entry
def serve(path: str, preload: str, keep: str = str(KEEP_ON_CPU), key: str | None = None) -> int:
    """The engine process's main: answer one stage worker at a time until the run ends it, holding
    engines of up to `keep` shapes on a CPU. The key (hex) comes on stdin (a process of its own) or
    as `key` (a child of the run's fork server)."""
    from multiprocessing.connection import Listener

    from ratchet.data.procs.lifetime import die_with_parent

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    die_with_parent()
    key = bytes.fromhex(key if key is not None else sys.stdin.readline().strip())
    listener = Listener(path, family="AF_UNIX")  # the key is checked by _accept, under a time bound
    print(f"warm engine (pid {os.getpid()}): listening; preloading {preload}", file=sys.stderr, flush=True)
    # the import is most of a start; done while the run prepares its first stage, frozen
    from ratchet.models.sampler import backend_kind

    with forkserver.imports_frozen():
        backend_kind(preload).preload()
    engines = _Engines(int(keep))
    while True:
        conn = _accept(listener, key)
        if conn is None:  # a caller that failed the handshake: the engine waits for the next
            continue
        try:
            if not _answer(engines, conn):
                return 1  # the engine failed: its state is unknown, the run starts another
        finally:
            conn.close()


HANDSHAKE_S = 5.0  # a caller has this long to prove it holds the run's key


def _accept(listener, key: bytes):
    """The next caller's connection once it has proven it holds the key, or None: a wrong key, a
    caller that hangs up, or one that says nothing for HANDSHAKE_S costs the engine nothing."""
    import socket
    import struct
    from multiprocessing.connection import AuthenticationError, answer_challenge, deliver_challenge

    try:
        conn = listener.accept()
    except OSError:
        return None
    bound = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket: its options are the connection's
    try:
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            bound.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(HANDSHAKE_S), 0))
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):  # a worker's calls may be minutes apart
            bound.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", 0, 0))
    except (AuthenticationError, EOFError, OSError) as e:
        log.warning("a caller failed the handshake (%s: %s); waiting for the next", type(e).__name__, e)
        conn.close()
        return None
    finally:
        bound.close()
    return conn


def _answer(engines: _Engines, conn) -> bool:
    """Serve one stage worker's calls until it hangs up; False after an error in the engine."""
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):  # the worker finished or died: the engine is free again
            engines.release()
            return True
        try:
            if op == "open":
                a = args[0]
                reply = engines.open(a["model"], a["sampler"], a["seed"], a["threads"])
            elif op == "generate":
                reply = engines.current.engine.generate(*args)
            elif op == "generate_ids":
                reply = engines.current.engine.generate_ids(*args)
            elif op == "logprobs":
                reply = engines.current.engine.next_token_logprobs(*args)
            elif op == "release":
                engines.release()
                reply = None
            elif op == "stats":  # what the engine process holds now (for its log and the tests)
                reply = engines.stats()
            else:
                raise ValueError(f"unknown call {op!r}")
        except BaseException as e:  # noqa: BLE001 - reported to the worker, then this process ends
            log.exception("the warm engine failed on %s", op)
            with contextlib.suppress(OSError):
                conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
            return False
        try:
            conn.send(("ok", reply))
        except OSError:  # the worker died while its call ran (a killed stage): nobody to answer
            engines.release()
            return True


# the run's side ---------------------------------------------------------------------------------

class WarmEngine:
    """The engine process of one run, which dies with the run and is restarted if it dies between
    stages. Where the run has a fork server (data/procs/forkserver.py), the engine is forked from it
    once it has imported torch, transformers and peft, which the engine would otherwise import
    again beside it (5-6 s of CPU on 2 cores, at the busiest moment of a run's start); elsewhere, or
    if the server does not fork it, it is a process of its own, started from a thread that lives
    as long as the run (data/procs/lifetime.Spawner)."""

    AFTER = ("torch", "transformers", "peft")  # imported by the fork server before it forks the engine (peft: the
    # modeling code the engine loads models with)
    LISTEN_S = 180.0  # how long a worker waits for the engine's socket (the fork server's imports first)

    def __init__(self, log_path: Path, preload: str, server: forkserver.ForkServer | None = None,
                 keep: int = KEEP_ON_CPU):
        self.log_path, self.preload, self.keep = Path(log_path), preload, keep
        self.server = server  # the run's fork server, which the engine is forked from (None: started cold)
        self.dir = Path(tempfile.mkdtemp(prefix="ratchet-engine-"))  # 0700: the socket is the run's alone
        self.proc: Any = None  # a subprocess.Popen, or a forkserver.Forked
        self.key = b""
        self.lock = threading.Lock()
        self.starts = 0
        self.spawner = Spawner()
        self.log_fd: int | None = None  # the engine's log, held open here: its name may change (`rename_log`)

    @property
    def path(self) -> str:
        return str(self.dir / f"engine-{self.starts}.sock")

    def start(self, forked: bool = True) -> None:
        """Start the engine process; it listens a moment later (see `_listening`)."""
        self.starts += 1
        self.key = secrets.token_bytes(32)
        if self.log_fd is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        server = self.server if forked else None
        # the fork server's child opens the log through this process's descriptor: the file it
        # names now, whatever its name when the server forks (it may wait for its imports)
        self.proc = server and server.spawn(serve, [self.path, self.preload, str(self.keep), self.key.hex()],
                                            Path(f"/proc/{os.getpid()}/fd/{self.log_fd}"), self.AFTER)
        if self.proc is not None:
            return
        self.proc = spawn.start(serve, self.path, self.preload, str(self.keep), popen=self.spawner.popen, stdin=subprocess.PIPE,
                                stdout=self.log_fd, stderr=subprocess.STDOUT).proc
        self.proc.stdin.write(self.key.hex().encode() + b"\n")
        self.proc.stdin.close()

    def _listening(self) -> bool:
        """Wait until the engine listens (a worker must never find no socket); False if its
        process ended first or it does not in LISTEN_S."""
        deadline = time.time() + self.LISTEN_S
        while not os.path.exists(self.path) and self.proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)  # listening takes a fraction of a second once the process runs
        return os.path.exists(self.path)

    def env(self) -> dict[str, str]:
        """The variable a stage worker finds its warm engine by; a dead engine process is replaced
        first (an engine error ends it, and the stage that saw it failed)."""
        with self.lock:
            refused = None  # why the fork server did not fork it
            if self.proc is None or self.proc.poll() is not None:
                refused = getattr(self.proc, "refused", None)
                if self.proc is not None and refused is None:
                    log.warning("the warm engine (pid %s) exited with code %s; starting another", self.proc.pid,
                                self.proc.returncode)
                self.start(forked=refused is None)
            if not self._listening() and getattr(self.proc, "refused", None) is not None:
                refused = self.proc.refused
                self.start(forked=False)
                self._listening()
            if refused is not None:
                log.info("the fork server did not fork the warm engine (%s); it runs on its own", refused)
            return {ENV: f"{self.path}|{self.key.hex()}"}

    def rename_log(self, path: Path) -> None:
        """Its log renamed to `path` (kept where it is if `path` exists); an engine started later
        writes to the same file, through the descriptor held here."""
        from ratchet.data.procs.lifetime import move_log

        with self.lock:
            self.log_path = move_log(self.log_path, Path(path))

    def stop(self) -> None:
        from ratchet.data.procs.lifetime import end

        with self.lock:
            end(self.proc)
            self.proc = None
            if self.log_fd is not None:
                os.close(self.log_fd)
                self.log_fd = None
        self.spawner.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def current() -> WarmEngine | None:
    """The warm engine of the run this code runs in (data/procs/services.py), or None."""
    return services.of_run().engine


def worker_env() -> dict[str, str]:
    """What a stage worker started now needs to borrow the run's warm engine (empty: none)."""
    w = current()
    return w.env() if w is not None else {}


@contextlib.contextmanager
def for_run(enabled: bool, log_path: Path, preload: str, keep: int = KEEP_ON_CPU):
    """The run's warm engine while the run lasts (nothing if not `enabled`, or if this run has one
    already), forked from the run's fork server where it has one. It is the run's
    (data/procs/services.py): the run's stages find it with `current()`; nothing outside the block does."""
    if not enabled or current() is not None:
        yield None
        return
    w = WarmEngine(log_path, preload, server=forkserver.current(), keep=keep)
    try:
        with w.lock:
            w.start()  # now: its imports overlap with the run's first stages, which wait for it in `env`
        with services.held(engine=w):
            yield w
    finally:
        w.stop()
