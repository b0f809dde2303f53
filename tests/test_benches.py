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


def test_the_kill_bench_compares_what_a_resume_must_keep_and_not_when_it_ran():
    """bench/kill_bench.py's idea, without its runs: two chains that differ only in when and how
    fast their stages ran compare equal; one output digest, metric or ledger row apart does not;
    and the stage a kill cut is read from the console."""
    bench = runpy.run_path(str(BENCH / "kill_bench.py"))
    comparable, running = bench["comparable"], bench["running"]
    link = {"stage": "train", "round": 1, "key": "k", "dir": "stages/train-k", "outputs": {"model": "a1"},
            "parents": ["p"], "verified": True, "code_version": "c", "ledger": [{"step": 1, "seeds": [3]}],
            "metrics": {"loss": 0.5, "wall_s": 12.0, "tokens_per_s": 300.0}, "summary": "300 tok/s",
            "source": {"commit": "x"}}
    later = {**link, "metrics": {**link["metrics"], "wall_s": 30.0, "tokens_per_s": 120.0, "resumed": 1.0,
                                  "resumed_from_step": 14.0, "shards_reused": 15.0, "holders": 2.0},
             "summary": "120 tok/s"}  # a resumed attempt's
    assert comparable([link]) == comparable([later])
    for changed in ({"outputs": {"model": "b2"}}, {"metrics": {**link["metrics"], "loss": 0.6}},
                    {"ledger": [{"step": 1, "seeds": [4]}]}):
        assert comparable([link]) != comparable([{**link, **changed}]), changed
    console = ("12:00:01 round 1  sample   started\n12:00:09 round 1  sample   ✓     8 s  24 completions\n"
               "12:00:09 round 1  label    started\n")
    assert running(console) == "label (round 1)"
    assert running(console + "12:00:10 round 1  label    ✓     1 s\n") == "between stages, after label (round 1)"
    assert running("ratchet run default-0ac1e11d78: 1 round(s)\n") == "its start, before its first stage"
    import time

    started = time.mktime(time.strptime(time.strftime("%Y-%m-%d ") + "12:00:00", "%Y-%m-%d %H:%M:%S"))
    assert bench["windows"](console + "12:00:10 round 1  label    ✓     1 s\n", started) == [
        ("sample (round 1)", 1.0, 9.0)]  # where a kill is aimed: label's 1 s is too short to aim at


@pytest.mark.parametrize("task", ["addition", "chain_sum"])
def test_the_curriculum_bench_s_runs_and_arms_are_configs_the_product_takes(task):
    """Each --train run and each --arms arm, on each task, is a config load_config accepts (a
    filter kind no filter has, say, would stop the bench only when it ran)."""
    from ratchet.flows.config import load_config

    bench = runpy.run_path(str(BENCH / "curriculum_bench.py"))
    a = Namespace(task=task, levels=[1, 2, 3], eval_size=4, train_size=20, prompts=8, advance_at=0.9, patience=2,
                  workdir="/tmp/unused", rounds=2, worked=False, demos=0)
    for train in bench["TRAIN_METHOD"]:
        cfg = load_config(bench["config"](a), bench["overrides"](Namespace(**vars(a), train=train)))
        assert cfg.curriculum is not None and cfg.train.kind == train and cfg.data.level_list() == [1, 2, 3]
    for arm, (method, curriculum) in bench["ARMS"].items():
        overrides = bench["method_overrides"](a, method) + bench["arm_overrides"](a, curriculum)
        cfg = load_config(bench["config"](a), overrides)
        assert (cfg.curriculum is not None) == curriculum and cfg.data.prompts_per_round == (None if curriculum else 8)


def test_the_curriculum_bench_s_worked_demonstrations_pass_the_run_s_own_check(tmp_path):
    """--worked: every demonstration's working ends on the sum, and the run it configures (the check's
    max_numbers, the cold start) takes them: `ratchet check`'s own checks, up to 8-digit sums."""
    import random

    from ratchet.data.prompts import load_split
    from ratchet.flows.config import load_config
    from ratchet.tasks import cold_start

    bench = runpy.run_path(str(BENCH / "curriculum_bench.py"))
    rng = random.Random(0)
    for n in range(1, 9):
        for _ in range(20):
            x, y = rng.randint(10 ** (n - 1), 10 ** n - 1), rng.randint(0, 10 ** n - 1)
            text = bench["worked"](x, y)
            assert text.endswith(f"So {x} + {y} = {x + y}.") and text.count("\n") == 1 + len(str(max(x, y))) + (
                len(str(x + y)) > len(str(max(x, y))))
    a = Namespace(task="addition", levels=[1, 2, 8], eval_size=4, train_size=20, prompts=8, advance_at=0.9,
                  patience=2, workdir=str(tmp_path), rounds=2, worked=True, demos=9, demo_levels=[1, 8], train="rft",
                  start=8, temperature=0.3, review=0.7, check_working=True, lr=5e-5,
                  demo_epochs=1.5, demo_adapter="full", demo_lr=2e-5)
    assert bench["write_demonstrations"](a).startswith("9 worked demonstrations of levels [1, 8]")
    cfg = load_config(bench["config"](a), bench["overrides"](a))
    check = cfg.data.check
    assert check.max_numbers == bench["WORKED_NUMBERS"] and cfg.sample.max_tokens == bench["WORKED_TOKENS"]
    assert (cfg.curriculum.start, cfg.curriculum.review, cfg.sample.temperature) == (8, 0.7, 0.3)
    assert cfg.train.learning_rate == 5e-5 and cfg.cold_start.train.learning_rate == 2e-5  # each its own
    assert (cfg.cold_start.train.epochs, cfg.cold_start.train.adapter) == (1.5, "full")
    held = load_split(cfg.data, cfg.seed).eval
    rows, _ = cold_start.check(cfg.cold_start, cfg.sample.rollout, check, held)
    assert len(rows) == 9 and sum("so far" in r.final for r in rows) == 9
    assert check.check(bench["worked"](99999999, 99999999), "199999998").correct  # the most numbers working names
    # --check-working: the label's check is the working's own, loaded as `ratchet check` loads it
    assert cfg.label.check.function.endswith("examples/addition/worked.py:working") and not cfg.label.check.problems()


def test_the_curriculum_bench_finds_where_a_worked_answer_first_goes_wrong():
    """Each kind of miss the climb's figures count, on one edit of a right working of 458 + 867."""
    bench = runpy.run_path(str(BENCH / "curriculum_bench.py"))
    right = bench["worked"](458, 867)  # 8+7=15 carry 1 | 5+6=11 +1=12 carry 1 | 4+8=12 +1=13 carry 1 | the carry
    assert right.splitlines()[1:3] == ["8+7=15, +0=15, carry 1, so far 5, left 45 + 86",
                                        "5+6=11, +1=12, carry 1, so far 25, left 4 + 8"]
    edits = {"wrong digits": ("5+6=11, +1=12", "4+6=10, +1=11"), "carry in": ("+1=12", "+0=11"),
             "digit sum": ("8+7=15", "8+7=14"), "adding the carry": ("+1=12", "+1=13"),
             "carry out": ("15, carry 1", "15, carry 0"),
             "so far": ("so far 25,", "so far 35,"), "left: copy": ("left 45 + 86", "left 4 + 8"),
             "left: stopped early": ("left 4 + 8", "left none"), "form": ("8+7=15,", "8 plus 7 is 15,"),
             "the last lines": ("So 458 + 867 = 1325.", "So 458 + 867 = 1335.")}
    for kind, (old, new) in edits.items():
        assert old in right and bench["first_miss"](458, 867, right.replace(old, new), False) == kind, kind
    assert bench["first_miss"](458, 867, right, True) == "right"
    assert bench["first_miss"](458, 867, "1325", False) == "form"  # no working at all
    # the label check of --check-working: only the working itself, line for line, on the task's prompt
    working = runpy.run_path(str(BENCH.parent / "examples" / "addition" / "worked.py"))["working"]
    assert working(right, "1325", "What is 458 + 867?") == 1.0 and working(right + "\n", "1325", "What is 458 + 867?")
    for old, new in edits.values():
        assert working(right.replace(old, new), "1325", "What is 458 + 867?") == 0.0, new
    for text in ("1325", right + "\nScore: 1.0", right.replace("So 458", "So, 458"), ""):
        assert working(text, "1325", "What is 458 + 867?") == 0.0, text
    assert working(right, "1325", "What is 458 + 868?") == 0.0 and working(right, "1325", "Add them.") is None
    answers = [{"prompt_id": "add-458-867", "text": right, "correct": True},
               {"prompt_id": "add-45-86", "text": "", "correct": False}]
    assert bench["misses"](answers) == "L2: form 1\nL3: right 1"


def test_the_grow_bench_s_copies_name_no_sum_and_its_misses_find_the_first_wrong_part():
    """--copies: a copy row holds one number and no sum, so it labels no level; --misses replays a
    tagged answer against the sum its prompt names and says where it first goes wrong."""
    import re

    bench = runpy.run_path(str(BENCH / "grow_bench.py"))
    form, copy, miss = bench["FORMS"]["shifted"], bench["copy"], bench["first_miss_tagged"]
    prompt, text = copy(123456789012, form)
    assert "+" not in prompt + text and text.endswith(" so 123456789012")
    assert [d for d, _ in re.findall(r"(\d)@(\d+)", text)] == list("123456789012")
    x, y = 123456789, 987654321
    right = form(x, y)
    assert miss(x, y, right) == "right"
    tags = re.findall(r"\d@\d+", right)
    assert miss(x, y, right.replace(tags[3] + " ", "", 1)) == "copy of a: 8 of 9 digits"  # a digit dropped
    step = re.search(r"(\d+: \d\+\d(?:\+\d)?=)(\d+)", right)
    assert miss(x, y, right.replace(step[0], step[1] + "99", 1)) == "step 1"
    assert miss(x, y, right.rsplit(" so ", 1)[0] + " so 1111111111") == "read-back"
    assert miss(x, y, "So the sum is 1111111110.") == "form"


def test_chain_sum_s_worked_form_ends_on_the_value_the_task_s_scorer_reads():
    """--task chain_sum --form worked: the demonstrations' working of a two-term sum or difference
    ends on its value (negative where the second term is the larger; no leading zeros), which the
    task's own check reads as the last number, and the bench refuses forms a task does not have."""
    import random

    from ratchet.data.checks.number import last_number

    bench = runpy.run_path(str(BENCH / "grow_bench.py"))
    work = bench["worked_expression"]
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 7)
        a, b = rng.randint(10 ** (n - 1), 10 ** n - 1), rng.randint(10 ** (n - 1), 10 ** n - 1)
        for op, value in (("+", a + b), ("-", a - b)):
            assert last_number(work(f"{a} {op} {b}"), 200) == str(value), (a, op, b)
    assert work("478 - 718").splitlines()[0] == "478 - 718: 718 is larger, so work 718 - 478"
    assert "without the leading zeros: 3" in work("361 - 358") and last_number(work("5 - 5"), 200) == "0"
    with pytest.raises(ValueError, match="two-term"):
        work("1 + 2 + 3")
    for argv in (["--task", "chain_sum", "--form", "shifted"], ["--form", "answer"],
                 ["--task", "chain_sum", "--form", "worked", "--terms", "3"]):
        with pytest.raises(SystemExit):
            bench["main"]([*argv, "--fresh", "0", "--table-only"])


def test_the_grow_bench_s_work_seconds_count_a_round_s_voters_and_no_other_arm_s_stages(tmp_path):
    """Arms compare at equal wall time by each round's stage seconds: a round's own stages, the voters'
    stages they descend from, and the voters' trainings on the last round's labels (which nothing
    reads), but not another arm's stages in the same workdir."""
    import json
    from types import SimpleNamespace

    bench = runpy.run_path(str(BENCH / "grow_bench.py"))

    def stage(name, k, wall, *parents):
        d = tmp_path / "stages" / name
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"stage": name.split("-")[0], "round": k, "wall_s": wall,
                                                     "parents": [{"dir": f"stages/{p}"} for p in parents]}))

    stage("train-cold", 1, 60.0)
    stage("train-voter1", 1, 60.0)  # a voter's cold start
    stage("sample-policy2", 2, 10.0, "train-cold")
    stage("sample-voter2", 2, 11.0, "train-voter1")
    stage("label-2", 2, 1.0, "sample-policy2", "sample-voter2")
    stage("filter-2", 2, 0.5, "label-2")
    stage("train-policy2", 2, 20.0, "filter-2", "train-cold")
    stage("train-voter2", 2, 21.0, "filter-2", "train-voter1")  # read by nothing after it
    stage("sample-other", 2, 99.0, "train-cold", "curriculum-other")  # another arm's
    stage("train-other", 2, 99.0, "filter-other", "train-cold")
    rounds = [SimpleNamespace(round=1, stage_dirs={"train": "stages/train-cold"}),
              SimpleNamespace(round=2, stage_dirs={"train": "stages/train-policy2", "label": "stages/label-2"})]
    assert bench["work_seconds"](tmp_path, rounds) == {1: 120.0, 2: 63.5}


def test_the_grow_bench_plots_the_digits_reached_and_the_label_precision_per_round(tmp_path):
    """--plot: a level counts as reached where it and every level below it are at the threshold; the
    label precision drawn is the one at the level each round trained at."""
    from types import SimpleNamespace

    bench = runpy.run_path(str(BENCH / "grow_bench.py"))
    assert bench["reached"]({"level_1": 1.0, "level_2": 0.4, "level_3": 0.9}, 0.5) == 1  # a gap stops it
    assert bench["reached"]({"level_2": 1.0}, 0.5) == 0 and bench["reached"]({}, 0.5) == 0

    def rnd(k, sets, level=None, precision=None, cold=False):
        metrics = {} if precision is None else {f"label.precision.level_{level}": precision,
                                                "label.precision.level_1": 0.01}
        return SimpleNamespace(round=k, sets={f"level_{n}": v for n, v in sets.items()}, level=level,
                               metrics=metrics, cold_start=cold)

    rounds = [rnd(0, {1: 0.7}), rnd(1, {1: 1.0, 2: 0.9}, cold=True), rnd(2, {1: 1.0, 2: 0.9, 3: 0.6}, 3, 0.92),
              rnd(3, {1: 1.0, 2: 0.3, 3: 0.7}, 4, 0.5), rnd(4, {}, 5, 0.8)]  # the last not evaluated yet
    png = tmp_path / "grow.png"
    assert bench["plot"](rounds, png, 2, 0.5) == [(0, 2, None), (1, 3, 0.92), (2, 1, 0.5)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_grow_bench_s_target_set_is_the_gate_or_beside_the_run_s_own(tmp_path):
    """--fresh N: the target set is the run's gate; --evaluate: it is evaluated beside the run's own
    gate (the held-out split, or --gate guard's top labeled level), which stays the gate, so the
    run's rounds are the same run's."""
    from ratchet.flows.config import load_config

    bench = runpy.run_path(str(BENCH / "grow_bench.py"))
    a = Namespace(workdir=tmp_path, target=16, gate="heldout", task="addition", labeled_to=8, eval_size=25,
                  train_size=300)
    (tmp_path / "target-16.jsonl").write_text('{"prompt": "What is 1000000000000000 + 1000000000000000?", '
                                              '"answer": "2000000000000000"}\n')
    config = bench["config"](Namespace(task="addition"))
    gate = load_config(config, [bench["target_sets"](a)]).evaluate
    beside = load_config(config, [bench["target_sets"](a, beside=True)]).evaluate
    assert [s.name for s in gate.sets] == ["target"] and gate.gate_set == "target"
    assert [s.name for s in beside.sets] == ["heldout", "target"] and beside.gate_set == "heldout"
    assert beside.sets[0] == load_config(config).evaluate.sets[0]  # the run's own, as it was
    assert beside.sets[1].data.path == str(tmp_path / "target-16.jsonl")

    a.gate = "guard"  # the guard: 8-digit sums alone, the gate beside the target too
    guard = load_config(config, [bench["guard_set"](a)])
    assert [s.name for s in guard.evaluate.sets] == ["guard"] and guard.evaluate.sets[0].data.level_list() == [8]
    assert guard.evaluate.sets[0].data.eval_size == 25
    beside = load_config(config, [bench["guard_set"](a), bench["target_sets"](a, beside=True)]).evaluate
    assert [s.name for s in beside.sets] == ["guard", "target"] and beside.sets[0] == guard.evaluate.sets[0]
