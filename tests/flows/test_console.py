"""The run console: stage events as lines, the running stage's progress, one block per failure."""

import io
import re
from pathlib import Path

from ratchet.data import events
from ratchet.data.errors import EmptyStageError, StageFailedError
from ratchet.flows.console import RunConsole, rate_of
from ratchet.models.sampler import SamplerConfig
from ratchet.models.train_kinds import RFTTrainConfig
from ratchet.tasks.sample import SampleConfig, SampleJob, SampleWork
from ratchet.tasks.train import TrainJob

STAMP = re.compile(r"^\d\d:\d\d:\d\d ")


def _plain() -> tuple[RunConsole, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return RunConsole.for_streams(out, err), out, err


def test_without_a_terminal_every_event_is_one_plain_line(tmp_path):
    console, out, _ = _plain()
    assert not console.live  # a StringIO is no terminal: plain lines
    with console:
        console.header(["ratchet run demo-1: 1 round(s) from the base model"])
        events.emit(events.Event("reused", "evaluate", 0, tmp_path, metrics={"accuracy": 0.42}, wall_s=20,
                                 summary="held-out accuracy 42.0%"))
        events.emit(events.Event("round", round=0, data={"version": "1", "accuracy": 0.42, "promoted": True}))
        events.emit(events.Event("start", "sample", 1, tmp_path))
        sample = {"completions": 1200, "tokens_per_s": 437.4, "truncated_frac": 0.49}
        events.emit(events.Event("done", "sample", 1, tmp_path, wall_s=121.4, metrics=sample,
                                 summary=events.summary_of(SampleJob(sample=SampleConfig(), sampler=SamplerConfig(),
                                                                     seed=0), sample)))
        train = {"steps": 48, "first_loss": 1.073, "last_loss": 1.162, "train_s": 130}
        events.emit(events.Event("done", "train", 1, tmp_path, wall_s=139, metrics=train,
                                 summary=events.summary_of(TrainJob(train=RFTTrainConfig(), seed=0), train)))
        events.emit(events.Event("round", round=1, data={"version": "2", "accuracy": 0.8, "promoted": False,
                                                         "dtype": "float32",
                                                         "gate": "accuracy 0.8 <= champion's 0.9 on eval set ab",
                                                         "parent_version": "1"}))
        # round 2 trained from version 1 again (next_round_from=best): its gain is against version 1
        events.emit(events.Event("note", round=2, stage="policy", data={"text": "version 1 again"}))
        events.emit(events.Event("round", round=2, data={"version": "3", "accuracy": 0.5, "promoted": False,
                                                         "parent_version": "1"}))
    events.emit(events.Event("start", "sample", 3, tmp_path))  # after the console closed: not shown
    lines = out.getvalue().splitlines()
    assert all(STAMP.match(x) for x in lines) and len(lines) == 9
    text = [STAMP.sub("", x) for x in lines]
    assert text[1] == "round 0  evaluate ↺ reused   held-out accuracy 42.0%"
    assert text[2] == "round 0  -> version 1 · held-out accuracy 42.0% · promoted to champion"
    assert text[3] == "round 1  sample   started"
    assert text[4] == "round 1  sample   ✓   121 s  1,200 completions · 437 tok/s · 49% truncated"
    assert text[5] == "round 1  train    ✓   139 s  48 steps · loss 1.073 -> 1.162 · 0.37 steps/s"
    assert text[6] == ("round 1  -> version 2 · held-out accuracy 80.0% in float32 (+38.0 points) · not promoted "
                       "(accuracy 0.8 <= champion's 0.9)")
    assert text[7:] == ["round 2  policy   version 1 again",
                        "round 2  -> version 3 · held-out accuracy 50.0% (+8.0 points) · not promoted"]


def test_a_training_that_logged_one_loss_shows_it_once():
    """Fewer steps than two logging_steps log one loss: "loss 0.786", not "0.786 -> 0.786", which
    would read as a loss that did not move."""
    job = TrainJob(train=RFTTrainConfig(), seed=0)
    one = {"steps": 2, "first_loss": 0.7863, "last_loss": 0.7863, "train_s": 8.7}
    assert events.summary_of(job, one) == "2 steps · loss 0.786 · 0.23 steps/s"
    assert events.summary_of(job, {**one, "last_loss": 0.7}) == "2 steps · loss 0.786 -> 0.700 · 0.23 steps/s"


def test_progress_files_give_the_running_stage_its_rate(tmp_path):
    p = events.Progress(tmp_path, 4, "unit", done=1, counters={"gen_tokens": 100.0, "gen_s": 1.0},
                        rate=SampleWork.rate)  # the counters the stage's work says its rate is read from
    p.update(2, {"gen_tokens": 150.0, "gen_s": 2.0})  # within every_s of the first write: skipped
    assert events.read_progress(tmp_path)["done"] == 1
    p.update(3, {"gen_tokens": 700.0, "gen_s": 3.0}, force=True)
    got = events.read_progress(tmp_path)
    assert (got["done"], got["total"], got["done_at_start"]) == (3, 4, 1)
    assert rate_of(got) == "300 tok/s"  # (700 - 100) tokens over (3 - 1) s of generation: reused work excluded
    p.update(4, {"gen_tokens": 800.0, "gen_s": 4.0})  # the last unit is always written
    assert events.read_progress(tmp_path)["done"] == 4
    (tmp_path / "t").mkdir()
    steps = events.Progress(tmp_path / "t", 10, "step")
    steps.update(10, {"loss": 0.25})
    assert rate_of(events.read_progress(tmp_path / "t")).endswith("steps/s · loss 0.250")
    steps.update(10, {"loss": 0.0, "reward": 0.4, "zero_std": 0.25, "entropy": 1.5, "logp_gap": 3e-6,
                      "gen_tok_s": 151.4})  # online RL
    assert rate_of(events.read_progress(tmp_path / "t")).endswith(
        "steps/s · reward 0.40 · 75% of groups taught · entropy 1.5 · logp gap 3e-06 · generating 151 tok/s")
    assert events.read_progress(tmp_path / "missing") is None
    # a work that declares no rate shows none, whatever its counters
    (tmp_path / "n").mkdir()
    events.Progress(tmp_path / "n", 4, "unit", counters={"gen_tokens": 100.0, "gen_s": 1.0}).update(4, force=True)
    assert rate_of(events.read_progress(tmp_path / "n")) == ""


def test_a_failed_stage_prints_one_block_with_its_log_and_the_resume_command(tmp_path):
    stage = tmp_path / "train-abc"
    stage.mkdir()
    (stage / events.STAGE_LOG).write_text("loading\n" + "".join(f"step {i}\n" for i in range(40)) + "Killed\n")
    console, out, err = _plain()
    with console:
        events.emit(events.Event("start", "train", 2, stage))
        events.emit(events.Event("failed", "train", 2, stage, error="StageFailedError: died"))
        console.failure(StageFailedError("train stage (round 2) worker died with exit code -9"), Path("run.log"),
                        "ratchet resume demo-1 --workdir runs")
    block = err.getvalue().splitlines()
    assert block[0] == "ratchet: round 2 train failed"
    assert block[1] == "  StageFailedError: train stage (round 2) worker died with exit code -9"
    assert block[2].startswith("  if the kernel killed it for memory: set train.gradient_checkpointing=true")
    assert block[3] == f"  log: {stage / events.STAGE_LOG}"
    assert block[-2] == "    Killed" and "    step 39" in block  # a crash shows how its log ends
    assert block[-1] == "  finished stages are kept; to resume: ratchet resume demo-1 --workdir runs"
    assert "✗ failed" in out.getvalue()

    console, _, err = _plain()  # a clear error is the whole story: no log tail
    with console:
        console.failure(EmptyStageError("round 1: 3 pairs < filter.min_pairs=16; lower filter.min_pairs"),
                        tmp_path / "run.log", "re-run the same command")
    assert err.getvalue().splitlines() == [
        "ratchet: the run failed", "  EmptyStageError: round 1: 3 pairs < filter.min_pairs=16; lower filter.min_pairs",
        f"  log: {tmp_path / 'run.log'}", "  finished stages are kept; to resume: re-run the same command"]

    console, out, err = _plain()  # a Ctrl-C: said as such, without the log's tail (the stage did nothing wrong)
    with console:
        events.emit(events.Event("start", "train", 2, stage))
        events.emit(events.Event("failed", "train", 2, stage, error="KeyboardInterrupt: "))
        console.failure(KeyboardInterrupt(), Path("run.log"), "ratchet resume demo-1 --workdir runs")
    assert "round 2  train    ✗ interrupted" in out.getvalue() and "failed" not in out.getvalue()
    assert err.getvalue().splitlines() == [
        "ratchet: round 2 train interrupted (Ctrl-C)", f"  log: {stage / events.STAGE_LOG}",
        "  finished stages are kept; to resume: ratchet resume demo-1 --workdir runs"]


def test_a_listener_that_raises_never_fails_the_run():
    def broken(e):
        raise RuntimeError("display bug")

    unsubscribe = events.subscribe(broken)
    try:
        events.emit(events.Event("start", "sample", 1))  # logged, not raised
    finally:
        unsubscribe()
