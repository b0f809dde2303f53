"""The benches under bench/ are not run by the suite (each takes minutes to hours), so what they
build from the product's own types is checked here, where a change of those types would break
them silently: each parses its options (`--help`), and the GRPO bench's job is the train stage's."""

import runpy
import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_a_bench_shows_its_options(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert done.value.code in (0, None) and "usage" in capsys.readouterr().out.lower()


def test_the_grpo_bench_builds_the_train_stage_s_job():
    from ratchet.tasks.train import OnlineJob, online_of

    job_of = runpy.run_path(str(BENCH / "grpo_bench.py"))["_job"]
    cfg, job = job_of(Namespace(steps=2, adapter="lora", beta=0.0))
    assert isinstance(job, OnlineJob) and job.train.kind == "grpo" and job.train.steps == 2
    assert online_of(job, 0).group == cfg.sample.n
