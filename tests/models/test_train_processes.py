"""Training in two processes (torchrun, DDP over gloo on CPU) against one process.

The tolerance, derived: at the same global batch B = 2b, two processes average two means of
b rows each, which is what one process computes with batch b and grad_accum=2; so those two
must agree to float rounding (1e-6 here). One process with batch B sums the same rows in
another order; that order alone moves the weights by some amount d (measured in the same
test as one-process B vs one-process b x 2), and two processes must be within 2 d of it.
"""

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

ROWS = [{"prompt": f"What is {a} + 2?", "completion": f"{a} + 2 = {a + 2}."} for a in range(8)]
PAIRS = [{"prompt": f"What is {a} + 2?", "chosen": f"{a + 2}", "rejected": f"{a + 3}"} for a in range(8)]
# fp32 everywhere: the same arithmetic on CPUs with and without native bf16
COMMON = dict(epochs=2, learning_rate=5e-3, logging_steps=1, checkpoint_steps=2, precision="fp32")


@contextlib.contextmanager
def _one_thread():
    """Every training process on one thread, in this process and in the two: the same kernels
    split the same sums whatever set the thread count before (a vLLM engine in this worker sets
    OMP_NUM_THREADS, which the two processes would inherit). The processes talk over loopback only."""
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("GLOO_SOCKET_IFNAME", "lo")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    with _one_thread():
        yield


@pytest.fixture(scope="module")
def two_rft(tiny_model, tmp_path_factory):
    """RFT in two processes at batch 2 each, uninterrupted: the run the tests below compare with,
    made once. Returns its result and its directory."""
    out = tmp_path_factory.mktemp("two-rft") / "out"
    with _one_thread():
        return _train("rft", tiny_model, out, batch_size=2, num_processes=2), out


def _train(kind, model, out, **kw):
    from ratchet.models.train_kinds import DPOTrainConfig, RFTTrainConfig
    from ratchet.models.trainer import train

    cfg = (DPOTrainConfig if kind == "dpo" else RFTTrainConfig)(**{**COMMON, **kw})
    return train(model, PAIRS if kind == "dpo" else ROWS, cfg, out, seed=0)


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "model" / "model.safetensors"))


def _diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _losses(out) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["rft", "dpo"])
def test_two_processes_train_what_one_does_at_the_same_global_batch(kind, tiny_model, tmp_path, one_thread, request):
    """Guards training in two processes (RFT and DPO): at the same global batch the weights are one
    process's with gradient accumulation to float rounding, and within twice the sum-order
    difference of one process's full batch. Slow: three trainings a kind, one of them in two
    processes (torchrun)."""
    one = _train(kind, tiny_model, tmp_path / "one", batch_size=4)
    accum = _train(kind, tiny_model, tmp_path / "accum", batch_size=2, grad_accum=2)
    if kind == "rft":
        two, two_dir = request.getfixturevalue("two_rft")
    else:
        two, two_dir = _train(kind, tiny_model, tmp_path / "two", batch_size=2, num_processes=2), tmp_path / "two"
    assert one["processes"] == accum["processes"] == 1 and two["processes"] == 2
    assert one["steps"] == accum["steps"] == two["steps"] == 4  # 8 rows, global batch 4, 2 epochs
    w1, wa, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "accum"), _weights(two_dir)
    from safetensors.torch import load_file

    assert _diff(w1, load_file(str(tiny_model / "model.safetensors"))) > 1e-3  # training moved the weights
    assert _diff(w2, wa) <= 1e-6
    assert _diff(w2, w1) <= max(2 * _diff(wa, w1), 1e-6)
    # the train log has today's shape, its losses on the same scale as one process's
    assert len(_losses(two_dir)) == len(_losses(tmp_path / "one")) == 4
    assert _losses(two_dir) == pytest.approx(_losses(tmp_path / "accum"), abs=1e-5)
    assert sorted(p.name for p in two_dir.iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


MARK = "RATCHET_TEST_KILLED_TRAINING"  # every process below the killed one carries it


def test_a_kill_of_the_process_that_trains_alone_stops_all_and_resumes_to_the_same_weights(tiny_model, tmp_path,
                                                                                           one_thread, two_rft):
    """kill -9 of the process that started two-process training (a stage worker; its orchestrator
    has the same fate), its PID alone and not its group, right after training saved its first
    checkpoint: torchrun and both training processes die with it, nothing writes into the stage
    directory afterwards, and training resumed there from that checkpoint ends on the
    uninterrupted run's weights and log.

    Guards the resume promise for training in two processes (torchrun): no orphan, no late write, the same
    weights. Slow: two two-process trainings (killed, resumed) beside the module's uninterrupted one."""
    from tests.procs import carrying, gone_within

    full, full_dir = two_rft
    out = tmp_path / "killed"
    script = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from pathlib import Path; "
              "from ratchet.data import failpoints; failpoints.orchestrator(); "
              "from tests.models.test_train_processes import _train; "
              f"_train('rft', Path({str(tiny_model)!r}), Path({str(out)!r}), batch_size=2, num_processes=2)")
    env = {**os.environ, "RATCHET_FAILPOINTS": "train:checkpoint", "RATCHET_FAILPOINTS_KILL": "orchestrator", MARK: "1"}
    started, log = set(), tmp_path / "killed.log"  # a file, not a pipe nobody reads until the end
    with open(log, "w") as err:
        parent = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=err)
    deadline = time.time() + 300
    while parent.poll() is None and time.time() < deadline:  # the processes below it, as they start
        started |= set(carrying(f"{MARK}=1")) - {parent.pid}
        time.sleep(0.2)
    hung = parent.poll() is None  # the failpoint never killed it: the test's deadline does
    if hung:
        parent.kill()
    assert parent.wait() == -9 and not hung, log.read_text()[-2000:]  # killed at the checkpoint, by its failpoint
    assert len(started) >= 3, started  # torchrun and its two trainers ran
    assert all(gone_within(p, 30) for p in started), "a training process outlived the process that started it"
    time.sleep(1)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    time.sleep(3)
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert (out / "checkpoints" / "checkpoint-2" / "trainer_state.json").exists() and not (out / "model").exists()

    resumed = _train("rft", tiny_model, out, batch_size=2, num_processes=2)
    assert resumed["resumed"] == 1 and resumed["resumed_from_step"] == 2 and resumed["steps"] == full["steps"] == 4
    assert _diff(_weights(out), _weights(full_dir)) <= 1e-6
    assert (out / "train_log.jsonl").read_bytes() == (full_dir / "train_log.jsonl").read_bytes()


def test_one_process_on_a_machine_of_several_gpus_trains_on_one_at_the_documented_batch(tmp_path):
    """HF's Trainer in one process splits each batch over every GPU it sees (DataParallel) and so
    multiplies the global batch by their count; a training process keeps to one GPU. This machine
    has none: the count HF's arguments found is set as a machine of four would have it."""
    from trl import SFTConfig

    from ratchet.models.train_kinds.rft import RFTTrainConfig
    from ratchet.models.trainer import one_device, trainer_args

    args, _ = trainer_args(SFTConfig, RFTTrainConfig(batch_size=3), tmp_path, seed=0)
    assert args.train_batch_size == 3
    args._n_gpu = 4
    assert args.train_batch_size == 12  # what HF's Trainer would take a batch to be over four GPUs
    assert one_device(args).n_gpu == 1 and args.train_batch_size == 3
