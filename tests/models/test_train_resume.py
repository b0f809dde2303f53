"""Training killed mid-run resumes from its last checkpoint, data position included."""

import os

import pytest

from tests.procs import killed_at

pytestmark = pytest.mark.integration

ROWS = [{"prompt": f"What is {a} + 2?", "completion": f"{a} + 2 = {a + 2}."} for a in range(16)]
CFG = dict(epochs=2, batch_size=4, learning_rate=5e-3, checkpoint_steps=2, logging_steps=1)


def _train(model, out):
    from ratchet.models.train_kinds.rft import RFTTrainConfig, train_rft

    return train_rft(model, ROWS, RFTTrainConfig(**CFG), out, seed=0)


def test_killed_training_resumes_to_the_same_weights(tiny_model, tmp_path):
    """Training killed after a checkpoint resumes from it to the uninterrupted run's weights and figures. Guards
    the resume promise for a training stage. Slow: three trainings (whole, killed, resumed)."""
    from safetensors.torch import load_file

    full = _train(tiny_model, tmp_path / "full")
    assert full["resumed"] == 0.0 and full["steps"] == 8

    out = tmp_path / "killed"
    script = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from pathlib import Path; "
              f"from tests.models.test_train_resume import _train; _train(Path({str(tiny_model)!r}), Path({str(out)!r}))")
    killed_at(script, out / "checkpoints" / "checkpoint-4" / "trainer_state.json", seconds=120)
    assert not (out / "model").exists(), "the run finished before it could be killed"

    resumed = _train(tiny_model, out)
    assert resumed["resumed"] == 1.0 and resumed["steps"] == 8
    for name in ("train_loss", "first_loss", "last_loss"):  # the whole training's, not the last attempt's
        assert resumed[name] == full[name], (name, resumed[name], full[name])
    a, b = load_file(str(tmp_path / "full" / "model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, f"resumed weights differ from the uninterrupted run by up to {worst}"
