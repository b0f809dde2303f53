"""data.check.kind=python: a user's scoring function, run in a process of its own."""

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ratchet.data.checkers import Item, PythonCheck, check, check_many, score_metrics, score_sums
from ratchet.data.checks.python import CheckFailedError
from ratchet.data.checks.scorer import METRIC_NAME, Scorer, close_all
from ratchet.data.procs.host import KEPT

ROWS = [Item("the answer is 4", "4", "What is 2 + 2?", "p0#0"), Item("5", "4", "What is 2 + 2?", "p0#1"),
        Item("", None, "Say nothing.", "p1#0")]


def _file(tmp_path: Path, body: str, name: str = "rewards.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture(autouse=True)
def _fresh_scorers():
    yield
    close_all()


def test_scores_bools_none_and_metrics_by_the_row_fields(tmp_path):
    f = _file(tmp_path, """
        def score(completion, answer=None, prompt=None, **fields):
            if answer is None:
                return None                       # unscored, never guessed
            if "answer is" in completion:
                return {"score": 1.5, "format": 1.0}
            return completion.strip() == answer   # a bool
    """)
    c = PythonCheck(function=f"{f}:score", threshold=1.0)
    assert c.source and len(c.source) == 64  # the file's digest is part of the config
    v = check_many(c, ROWS)
    assert [(x.score, x.correct, x.reward) for x in v] == [(1.5, True, 1.5), (0.0, False, 0.0), (None, None, None)]
    assert v[0].metrics == {"format": 1.0} and v[2].metrics == {"unscored": 1.0}
    assert score_metrics(score_sums(v)) == {"score_mean": 0.75, "score_format_mean": 0.5, "check_unscored": 1.0}
    assert check(c, "4", "4", "q").correct  # the one-row form gives the prompt too


def test_batched_and_async_forms(tmp_path):
    f = _file(tmp_path, """
        import asyncio

        def batch(completions, prompts=None, answer=None, **fields):
            return [float(c.strip().endswith(a or "?")) for c, a in zip(completions, answer)]

        async def one(completion, answer=None, prompt=None, **fields):
            await asyncio.sleep(0)
            return len(completion) / 10
    """)
    b = PythonCheck(function=f"{f}:batch", batched=True, batch_size=2)
    assert [x.score for x in check_many(b, ROWS)] == [1.0, 0.0, 0.0]
    a = PythonCheck(function=f"{f}:one", threshold=0.5)
    assert [(x.score, x.correct) for x in check_many(a, ROWS)] == [(1.5, True), (0.1, False), (0.0, False)]


def test_a_raise_names_the_row_and_shows_the_users_traceback(tmp_path):
    f = _file(tmp_path, """
        def score(completion, answer=None, prompt=None):
            return helper(completion)

        def helper(text):
            if text == "5":
                raise KeyError("no rule for " + text)
            return 1.0
    """)
    c = PythonCheck(function=f"{f}:score")
    with pytest.raises(CheckFailedError) as e:
        check_many(c, ROWS)
    msg = str(e.value)
    assert "row 'p0#1'" in msg and "raised KeyError: 'no rule for 5'" in msg
    assert f'File "{f}", line 7, in helper' in msg and "scorer.py" not in msg  # their frames, not ours
    assert "1 of 3 rows failed" in msg and "max_failed_frac" in msg
    # within the failure budget the row stays unscored and the rest are scored
    lenient = PythonCheck(function=f"{f}:score", max_failed_frac=0.5)
    v = check_many(lenient, ROWS)
    assert [x.score for x in v] == [1.0, None, 1.0] and v[1].metrics == {"failed": 1.0}


@pytest.mark.parametrize("value, said", [
    ("float('nan')", "returned nan; a score must be a finite number"),
    ("float('inf')", "returned inf"),
    ("10 ** 400", "too large for a float"),
    ("'1.0'", "returned str '1.0'; return a float, a bool, None or {'score': x, ...}"),
    ("[1.0]", "returned list [1.0]"),
    ("{'value': 1}", "returned a dict without 'score'"),
    ("{'score': 1, 'len': float('nan')}", "metric 'len' = nan; metrics must be finite numbers"),
    ("{'score': 1, 'pass@1': 1.0}", "returned metric name 'pass@1', which MLflow cannot log"),
    ("{'score': 1, 3: 1.0}", "returned metric name 3,"),
])
def test_a_bad_value_is_an_error_naming_the_row_and_the_value(tmp_path, value, said):
    f = _file(tmp_path, f"def score(completion, answer=None, prompt=None):\n    return {value}\n")
    with pytest.raises(CheckFailedError, match="row 'p0#0'") as e:
        check_many(PythonCheck(function=f"{f}:score"), ROWS[:1])
    assert said in str(e.value)


def test_a_call_that_outlives_its_bound_fails_and_the_next_call_gets_a_new_process(tmp_path):
    f = _file(tmp_path, """
        import time

        def score(completion, answer=None, prompt=None):
            if completion == "5":
                time.sleep(60)
            return 1.0
    """)
    c = PythonCheck(function=f"{f}:score", timeout_s=1.0, max_failed_frac=0.5)
    v = check_many(c, ROWS)
    assert [x.score for x in v] == [1.0, None, 1.0]
    scorer = next(iter(KEPT.of(Scorer)))
    assert scorer.timeouts == 1 and scorer.restarts == 0 and scorer.proc.poll() is None
    with pytest.raises(CheckFailedError, match=r"row 'p0#1'.*timed out after 1 s \(check.timeout_s\)"):
        check_many(PythonCheck(function=f"{f}:score", timeout_s=1.0), ROWS)


def test_a_function_that_kills_its_process_costs_only_its_call(tmp_path):
    f = _file(tmp_path, """
        import os

        def score(completion, answer=None, prompt=None):
            if completion == "5":
                os._exit(3)
            print("scored", completion)  # prints go to the log, never into the protocol
            return 1.0
    """)
    v = check_many(PythonCheck(function=f"{f}:score", max_failed_frac=0.5), ROWS)
    assert [x.score for x in v] == [1.0, None, 1.0]
    with pytest.raises(CheckFailedError, match=r"died during the call \(exit code 3\)"):
        check_many(PythonCheck(function=f"{f}:score"), ROWS)


def test_what_cannot_be_used_is_said_before_anything_runs(tmp_path):
    broken = _file(tmp_path, "def score(completion:\n", "broken.py")
    [p] = PythonCheck(function=f"{broken}:score").problems()
    assert "importing it failed" in p and "SyntaxError" in p and str(broken) in p
    raising = _file(tmp_path, "import not_a_module_here\n", "raising.py")
    [p] = PythonCheck(function=f"{raising}:score").problems()
    assert "ModuleNotFoundError: No module named 'not_a_module_here'" in p
    other = _file(tmp_path, "def reward(completion):\n    return 1.0\n\ndef other(x):\n    pass\n", "other.py")
    [p] = PythonCheck(function=f"{other}:score").problems()
    assert "defines no 'score' (its functions: ['other', 'reward'])" in p
    [p] = PythonCheck(function=f"{other}:other").problems()
    assert "other(x) cannot take a row's fields by name" in p and "score(completion, answer=None, prompt=None" in p
    assert PythonCheck(function=f"{other}:reward").problems() == [f"data.check.function='{other}:reward': " + (
        f"{other}:reward: reward(completion) cannot take a row's fields by name (got an unexpected keyword argument "
        "'prompt'); define it as score(completion, answer=None, prompt=None, **fields)")]
    with pytest.raises(ValidationError, match=r"no file '.*missing.py'"):
        PythonCheck(function=f"{tmp_path}/missing.py:score")
    with pytest.raises(ValidationError, match="is not 'path/to/file.py:function'"):
        PythonCheck(function="rewards.py")
    with pytest.raises(ValidationError, match="module 'no_such_pkg.rewards' cannot be found.*install it"):
        PythonCheck(function="no_such_pkg.rewards:score")


def test_an_installed_module_by_dotted_path(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text("def score(completion, answer=None, **fields):\n    return float(completion == answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    c = PythonCheck(function="myrewards.scoring:score")
    assert [x.correct for x in check_many(c, ROWS[:2])] == [False, False]
    assert check(c, "4", "4").correct


def test_the_digest_follows_the_file_and_a_changed_file_is_refused_mid_run(tmp_path):
    f = _file(tmp_path, "def score(completion, answer=None, prompt=None):\n    return 1.0\n")
    before = PythonCheck(function=f"{f}:score")
    f.write_text("def score(completion, answer=None, prompt=None):\n    return 0.0\n")
    after = PythonCheck(function=f"{f}:score")
    assert before.source != after.source and before.model_dump() != after.model_dump()
    # a stage keyed with the old file finds the new one: it stops rather than mix the two
    with pytest.raises(CheckFailedError, match=r"the file \(or a module it imports from its folder\) changed while this "
                                               r"run used it.*Run the same command again"):
        check_many(before, ROWS)
    assert PythonCheck.model_validate(after.model_dump()).source == after.source  # a dumped config keeps its digest
    from ratchet.data.userfiles import with_absolute_paths

    moved = with_absolute_paths(after)
    assert moved.source is None and Path(moved.function.rpartition(":")[0]).is_absolute()


def test_in_a_pipeline_config(tmp_path, monkeypatch):
    from ratchet.data.errors import ConfigError
    from ratchet.flows.config import load_config
    from ratchet.flows.schedule import absolute_paths

    _file(tmp_path, "def score(completion, answer=None, prompt=None):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.check={kind: python, function: 'rewards.py:score', threshold: 0.5}"])
    assert cfg.data.check.kind == "python" and cfg.data.check.threshold == 0.5
    deployed = absolute_paths(cfg)
    assert deployed.data.check.function == f"{tmp_path / 'rewards.py'}:score"
    with pytest.raises(ConfigError, match="votes with the answers a check reads"):
        load_config(None, ["data.check={kind: python, function: 'rewards.py:score'}", "label.kind=consistency"])
    with pytest.raises(ConfigError, match="label.value='graded'.*does not read numbers"):
        load_config(None, ["data.check={kind: python, function: 'rewards.py:score'}", "label.kind=mcts",
                           "label.value=graded", "filter.kind=step_pairs"])
    with pytest.raises(ConfigError, match="data.check.threshold=nan"):
        load_config(None, ["data.check={kind: python, function: 'rewards.py:score', threshold: .nan}"])


def test_any_model_text_reaches_the_function_intact(tmp_path):
    """Whatever a model wrote (control characters, lone surrogates, a protocol's own newlines and
    braces) arrives at the user's function as it was, and its verdict comes back."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    f = _file(tmp_path, """
        def score(completion, answer=None, prompt=None):
            return {"score": float(completion == answer), "n": float(len(completion)),
                    "h": float(sum(map(ord, completion)) % 1000003)}
    """)
    c = PythonCheck(function=f"{f}:score")

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.text(alphabet=st.characters(codec=None, categories=None), max_size=2000))
    def run(text):
        [v] = check_many(c, [Item(text, text, "p")])
        assert v.correct and v.metrics == {"n": float(len(text)), "h": float(sum(map(ord, text)) % 1000003)}

    run()
    for text in ("\ud800 lone surrogate", '{"result": {"score": 1}}\n', "\x00\x1b[2J"):
        [v] = check_many(c, [Item(text, text, "p")])
        assert v.correct and v.metrics["n"] == float(len(text))


def test_a_killed_stage_leaves_no_scoring_call_running(tmp_path):
    """SIGKILL the process that started the scorer while the user's function is mid-call: the
    scoring process ends with it instead of running on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.procs import gone_within

    f = _file(tmp_path, """
        import os, time

        def score(completion, answer=None, prompt=None):
            open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
            time.sleep(300)
    """)
    pid_file = tmp_path / "child.pid"
    driver = subprocess.Popen([sys.executable, "-c", (
        "from ratchet.data.checkers import PythonCheck, Item, check_many\n"
        f"check_many(PythonCheck(function={str(f) + ':score'!r}, timeout_s=300), [Item('x', '1')])\n")],
        env={**os.environ, "PID_FILE": str(pid_file)})
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and driver.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    assert gone_within(child, 10), "the scoring process outlived the process that started it"


def test_a_rows_other_columns_reach_the_function_by_name(tmp_path):
    """A file's extra columns travel with its prompts and samples (and only for a check that reads
    them), and a function whose signature cannot take them is refused before any model loads."""
    import json

    from ratchet.data.prompts import FileSource, load_split
    from ratchet.data.records import Completion, Prompt

    f = _file(tmp_path, """
        def score(completion, answer=None, prompt=None, unit=None, tolerance=0, **fields):
            value = float(completion.split()[0])
            return abs(value - float(answer)) <= tolerance and completion.rstrip().endswith(unit)

        def strict(completion, answer=None, prompt=None):
            return 1.0
    """)
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"How long is rod {i}?", "answer": str(10 + i), "unit": "cm",
                                          "tolerance": 1}) for i in range(8)) + "\n")
    src = FileSource(path=str(data), eval_size=2, check=PythonCheck(function=f"{f}:score"))
    split = load_split(src, seed=0)
    assert all(p.fields == {"unit": "cm", "tolerance": 1} for p in split.train + split.eval)
    assert src.check.problems(["tolerance", "unit"]) == []
    [bad] = PythonCheck(function=f"{f}:strict").problems(["tolerance", "unit"])
    assert "cannot take a row's fields by name" in bad and "['tolerance', 'unit']" in bad
    # a check that reads no columns carries none: the prompts keep the bytes they had
    plain = load_split(FileSource(path=str(data), eval_size=2), seed=0)
    assert all(p.fields == {} for p in plain.train) and '"fields"' not in plain.train[0].model_dump_json()
    # through a sample row (as the verifier label reads it) and back from JSON
    p = split.eval[0]
    row = Completion.model_validate_json(Completion(prompt_id=p.id, prompt=p.prompt, answer=p.answer, index=0,
                                                    text=f"{p.answer} cm", n_tokens=2, fields=p.fields)
                                         .model_dump_json())
    v = check_many(src.check, [Item(row.text, row.answer, row.prompt, p.id, row.fields),
                               Item(f"{float(p.answer) + 1} cm", p.answer, p.prompt, p.id, row.fields),
                               Item(f"{p.answer} mm", p.answer, p.prompt, p.id, row.fields)])
    assert [x.correct for x in v] == [True, True, False]
    assert len({Prompt(id="a", prompt="b", fields={"x": [1]}), Prompt(id="a", prompt="b", fields={"x": [1]})}) == 1
    # a column taken as a required parameter: what `ratchet check` accepts, a stage's calls accept
    g = _file(tmp_path, """
        def required(completion, answer, prompt, unit, tolerance):
            return completion.rstrip().endswith(unit)
    """, "required.py")
    need = PythonCheck(function=f"{g}:required")
    assert need.problems(["tolerance", "unit"]) == []
    assert [x.score for x in check_many(need, [Item(f"{p.answer} cm", p.answer, p.prompt, p.id, p.fields)])] == [1.0]


def test_columns_a_call_cannot_take_are_named_with_the_fix(tmp_path):
    import json

    from ratchet.data.errors import ConfigError
    from ratchet.data.prompts import FileSource, load_split

    f = _file(tmp_path, "def score(completion, **fields):\n    return 1.0\n")
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": "1", "prompt": "a clash", "my-col": 1})
                              for i in range(4)) + "\n")
    with pytest.raises(ConfigError) as e:
        load_split(FileSource(path=str(data), prompt_field="question", eval_size=1,
                              check=PythonCheck(function=f"{f}:score")), seed=0)
    text = str(e.value)
    assert "columns named like an argument the check already gets" in text and "'prompt'" in text
    assert "column names that cannot be keyword arguments" in text and "'my-col'" in text


def test_the_failure_budget_counts_rows_across_a_units_calls(tmp_path):
    """A tree search checks a unit in many small batches, and a label's audit row by row: the
    budget is the share of the unit's rows, not of each call's (one failure in a call of one
    row is 100% of that call)."""
    from ratchet.data.checkers import Tally
    from ratchet.data.records import Completion
    from ratchet.tasks.label_kinds import truths

    f = _file(tmp_path, """
        def score(completion, answer=None, prompt=None, **fields):
            if completion == "boom":
                raise ValueError("cannot score " + completion)
            return completion == answer
    """)
    c = PythonCheck(function=f"{f}:score", max_failed_frac=0.34)
    tally = Tally()
    for text in ("4", "boom", "5"):  # three calls of one row each: one failure is 1 of 3 rows
        check_many(c, [Item(text, "4", "q", f"row-{text}")], tally)
    c.settle(tally)
    assert tally.rows == 3 and [r for r, _ in tally.failed] == ["row-boom"]
    check_many(c, [Item("boom", "4", "q", "row-again")], tally)  # 2 of 4 rows now: past the budget
    with pytest.raises(CheckFailedError, match=r"failed on row 'row-boom': raised ValueError: cannot score boom"):
        c.settle(tally)
    # a label's audit (the judge's, a reward model's, a vote's) checks its rows as one batch, by row id
    rows = [Completion(prompt_id="p", prompt="q", answer="4", index=i, text=t, n_tokens=1)
            for i, t in enumerate(["4", "boom", "5"])] + \
        [Completion(prompt_id="u", prompt="q", answer=None, index=0, text="4", n_tokens=1)]
    assert truths(c, rows) == [True, None, False, None]
    with pytest.raises(CheckFailedError, match=r"(?s)failed on row 'p#1'.*\(1 of 3 rows failed"):
        truths(PythonCheck(function=f"{f}:score"), rows)


@settings(max_examples=300, deadline=None)
@given(st.from_regex(METRIC_NAME, fullmatch=True))
def test_every_metric_name_a_function_may_return_is_one_mlflow_logs(name):
    """A name the call accepts never reaches MLflow to be refused after the stage's manifest."""
    from mlflow.utils.validation import _validate_metric_name

    for stage in ("label", "evaluate"):
        _validate_metric_name(f"{stage}.score_{name}_mean")


MANY = [Item(f"answer {k}", str(k), f"What is {k}?", f"p{k}#0") for k in range(6)]


def test_a_function_that_hangs_costs_its_budget_not_a_timeout_per_row(tmp_path):
    """With max_failed_frac 0, the first call that times out stops the batch: no other row is
    called (a 40-row evaluation used to wait 40 timeouts in turn)."""
    log = tmp_path / "called"
    f = _file(tmp_path, f"""
        import time

        def score(completion, answer=None, prompt=None):
            open({str(log)!r}, "a").write(completion + "\\n")
            time.sleep(60)
    """)
    with pytest.raises(CheckFailedError, match=r"(?s)row 'p0#0'.*timed out after 1 s.*\(1 of 6 rows failed, and the "
                                               r"rest were not called; data.check.max_failed_frac=0\)"):
        check_many(PythonCheck(function=f"{f}:score", timeout_s=1.0), MANY)
    assert log.read_text().splitlines() == ["answer 0"]
    # within a budget of half the rows, the calls go on until it is spent: 3 may fail, the 4th stops them
    log.unlink()
    with pytest.raises(CheckFailedError, match=r"\(4 of 6 rows failed, and the rest were not called"):
        check_many(PythonCheck(function=f"{f}:score", timeout_s=1.0, max_failed_frac=0.5), MANY)
    assert len(log.read_text().splitlines()) == 4


def test_calls_run_in_parallel_each_in_a_process_of_its_own_and_keep_their_rows(tmp_path):
    log, inside = tmp_path / "calls", tmp_path / "inside"
    inside.mkdir()
    f = _file(tmp_path, f"""
        import os, time
        from pathlib import Path

        def score(completion, answer=None, prompt=None):
            me = Path({str(inside)!r}, f"{{os.getpid()}}-{{answer}}")
            me.touch()
            for _ in range(100):  # until another call is inside too (a rendezvous), at most 5 s
                met = len(list(me.parent.iterdir()))
                if met > 1:
                    break
                time.sleep(0.05)
            open({str(log)!r}, "a").write(f"{{os.getpid()}} {{met}}\\n")
            time.sleep(0.2)
            me.unlink()
            return float(answer)
    """)
    v = check_many(PythonCheck(function=f"{f}:score", workers=3, threshold=100), MANY)
    assert [x.score for x in v] == [float(k) for k in range(6)]  # each row its own score
    calls = [line.split() for line in log.read_text().splitlines()]
    assert len({pid for pid, _ in calls}) == 3
    assert max(int(met) for _, met in calls) >= 2  # two calls were inside the function at once


def test_a_timeout_ends_the_processes_the_function_started(tmp_path):
    pids = tmp_path / "pids"
    f = _file(tmp_path, f"""
        import subprocess, time

        def score(completion, answer=None, prompt=None):
            p = subprocess.Popen(["sleep", "300"])
            open({str(pids)!r}, "a").write(f"{{p.pid}}\\n")
            time.sleep(60)
    """)
    with pytest.raises(CheckFailedError, match="timed out"):
        check_many(PythonCheck(function=f"{f}:score", timeout_s=1.0), MANY[:1])
    from tests.procs import gone_within

    (pid,) = map(int, pids.read_text().split())
    assert gone_within(pid, 5), "the function's own process outlived its call's timeout"


def test_a_fork_inside_the_function_cannot_send_scores_to_other_rows(tmp_path):
    """The forked process returns from the function too: it is ended there, so only the parent
    answers, and each row gets its own score."""
    f = _file(tmp_path, """
        import os

        def score(completion, answer=None, prompt=None):
            if os.fork() == 0:
                return -1.0  # the forked copy's answer, which must never be taken for any row
            os.wait()
            return float(answer)
    """)
    v = check_many(PythonCheck(function=f"{f}:score", threshold=100), MANY)
    assert [x.score for x in v] == [float(k) for k in range(6)]


COLUMNS = [Item("so it is 4", "4", "What is 2 + 2?", "a#0", {"data_source": "arith", "unit": "apples"}),
           Item("5", "4", "What is 2 + 2?", "a#1", {"data_source": "arith", "unit": "apples"}),
           Item("nine", "9", "What is 3 * 3?", "b#0", {"unit": "pears"})]


def test_reward_functions_written_for_trl_and_verl_are_called_as_those_libraries_call_them(tmp_path):
    """Functions in TRL's and verl's own signatures, unchanged: found from the signature or named
    in config, and given each row as that library gives it."""
    f = _file(tmp_path, """
        # TRL: every column as a keyword list (the order of the parameters does not matter), a list back
        def accuracy_reward(prompts, completions, answer, **kwargs):
            assert "unit" in kwargs and len(prompts) == len(completions)
            return [1.0 if c.split()[-1] == a else 0.0 for c, a in zip(completions, answer)]

        # verl: one row at a time, the other columns in extra_info
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.1, score=1.0):
            seen.append((data_source, extra_info["prompt"], extra_info["unit"]))
            if solution_str.split()[-1] == ground_truth:
                return score
            return {"score": format_score, "said": float(len(seen))}

        seen = []
    """)
    trl = PythonCheck(function=f"{f}:accuracy_reward", batch_size=2)
    assert trl.called_as() is None and trl.problems(["data_source", "unit"]) == []
    # what `ratchet check` shows of it, once loaded: how it is called, and why
    assert trl.called_as() == ("called as TRL calls a reward function, with keyword lists "
                               "(data.check.convention=auto: from its signature)")
    assert [v.score for v in check_many(trl, COLUMNS)] == [1.0, 0.0, 0.0]
    assert [v.score for v in check_many(PythonCheck(function=f"{f}:accuracy_reward", convention="trl"), COLUMNS)] \
        == [1.0, 0.0, 0.0]
    verl = PythonCheck(function=f"{f}:compute_score")
    assert verl.problems() == [] and verl.called_as() == ("called as verl calls compute_score "
                                                          "(data.check.convention=auto: from its signature)")
    v = check_many(verl, COLUMNS)
    assert [x.score for x in v] == [1.0, 0.1, 0.1] and v[1].metrics == {"said": 2.0}
    assert [x.score for x in check_many(PythonCheck(function=f"{f}:compute_score", convention="verl"), COLUMNS)] \
        == [1.0, 0.1, 0.1]
    # Ratchet's own form is what a function without either library's names gets, as before
    g = _file(tmp_path, """
        def score(completion, answer=None, prompt=None, **fields):
            return completion.split()[-1] == answer
        def verl_shaped(data_source, solution_str):
            return 1.0
    """, "mine.py")
    assert [x.score for x in check_many(PythonCheck(function=f"{g}:score"), COLUMNS)] == [1.0, 0.0, 0.0]
    mine = PythonCheck(function=f"{g}:score", convention="ratchet", batched=True)
    assert mine.problems() == [] and mine.called_as() == ("called with a row's fields by name, a list of rows a call "
                                                          "(data.check.convention=ratchet)")
    # a convention the function cannot take is said before anything runs, with the signature wanted
    [bad] = PythonCheck(function=f"{g}:score", convention="verl").problems()
    assert "cannot take a row's fields by name" in bad and "compute_score(data_source, solution_str, ground_truth" in bad
    [bad] = PythonCheck(function=f"{g}:verl_shaped").problems()
    assert "compute_score(data_source, solution_str, ground_truth, extra_info=None)" in bad
    # a scorer of verl's own modules takes the completion and the reference alone, as verl's dispatcher calls it
    h = _file(tmp_path, """
        def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
            return score if solution_str.split()[-1] == ground_truth else format_score
    """, "gsm8k_like.py")
    assert [x.score for x in check_many(PythonCheck(function=f"{h}:compute_score"), COLUMNS)] == [1.0, 0.0, 0.0]


def test_trl_s_own_reward_functions_and_conversational_ones_get_chat_messages(tmp_path):
    """TRL passes a conversational dataset's completions as lists of messages; its own reward
    functions (trl.rewards) read `completion[0]["content"]` and say so in their annotation."""
    pytest.importorskip("math_verify")
    rows = [Item(r"My answer is \boxed{\frac{1}{3}}", None, "What is 1/3?", "q#0", {"solution": r"\frac{1}{3}"}),
            Item(r"My answer is \boxed{\frac{1}{2}}", None, "What is 1/3?", "q#1", {"solution": r"\frac{1}{3}"}),
            Item("<think>\nhm\n</think>\n4", None, "2 + 2?", "r#0", {"solution": "4"})]
    acc = PythonCheck(function="trl.rewards:accuracy_reward")  # an installed module, found as trl + messages
    assert acc.problems(["solution"]) == []
    assert acc.called_as() == ("called as TRL calls a reward function, with keyword lists, each completion a list "
                               "of chat messages (data.check.convention=auto: from its signature)")
    assert [v.score for v in check_many(acc, rows)] == [1.0, 0.0, 0.0]
    assert [v.score for v in check_many(PythonCheck(function="trl.rewards:think_format_reward"), rows)] == [0, 0, 1]
    f = _file(tmp_path, """
        def chat(completions, prompts, **kwargs):  # no annotation: messages named in config
            return [float(c[0]["role"] == "assistant" and p[0]["role"] == "user" and "2" in p[0]["content"])
                    for c, p in zip(completions, prompts)]
        def verl(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """)
    assert [v.score for v in check_many(PythonCheck(function=f"{f}:chat", messages=True), rows)] == [0, 0, 1]
    # without it, the function's own error, and what to set
    with pytest.raises(CheckFailedError, match=r"(?s)string indices.*set the check.s messages: true"):
        check_many(PythonCheck(function=f"{f}:chat"), rows)
    [bad] = PythonCheck(function=f"{f}:verl", messages=True).problems()
    assert "messages: true gives TRL's reward functions chat messages" in bad and "verl convention" in bad


def test_verl_gets_the_data_source_column_or_nothing(tmp_path):
    f = _file(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 1.0, "named": float(data_source == "arith"), "cols": float(len(extra_info))}
    """)
    v = check_many(PythonCheck(function=f"{f}:compute_score"), COLUMNS)
    assert [x.metrics for x in v] == [{"named": 1.0, "cols": 2.0}, {"named": 1.0, "cols": 2.0},
                                      {"named": 0.0, "cols": 2.0}]
