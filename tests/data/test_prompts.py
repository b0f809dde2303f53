import json
import re

import pytest

from ratchet.data.errors import ConfigError
from ratchet.data.prompts import AdditionSource, ChainSource, FileSource, chain_values, load_split, pool_slice


def test_addition_split_is_disjoint_complete_and_seeded():
    s = load_split(AdditionSource(a_max=20, b_max=10, eval_size=50), seed=0)
    tr, ev = s.train, s.eval
    assert (len(tr), len(ev)) == (150, 50)
    assert not {p.id for p in tr} & {p.id for p in ev}
    assert {p.id for p in tr + ev} == {f"add-{a}-{b}" for a in range(20) for b in range(10)}
    p = next(p for p in tr + ev if p.id == "add-7-5")
    assert (p.prompt, p.answer) == ("What is 7 + 5?", "12")
    assert load_split(AdditionSource(), seed=0) == s
    assert load_split(AdditionSource(), seed=1).eval != ev


def test_addition_train_size_bad_eval_size_and_template():
    s = load_split(AdditionSource(train_size=10, eval_size=5), seed=0)
    assert (len(s.train), len(s.eval)) == (10, 5)
    with pytest.raises(ConfigError, match="data.eval_size=200"):
        load_split(AdditionSource(a_max=20, b_max=10, eval_size=200), seed=0)
    with pytest.raises(ValueError, match=r"placeholders \{a\} and \{b\}, found \['a', 'c'\]"):
        AdditionSource(template="What is {a} + {c}?")


def _rows(n):
    return [{"question": f"q{i}?", "answer": i} for i in range(n)]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_chain_problems_are_seeded_distinct_disjoint_and_worked_out_right():
    from ratchet.data.checkers import check

    cfg = ChainSource(train_size=300, eval_size=40)
    split = load_split(cfg, seed=0)
    assert len(split.train) == 300 and len(split.eval) == 40
    ids = [p.id for p in split.train + split.eval]
    assert len(set(ids)) == len(ids) and len({p.prompt for p in split.train + split.eval}) == len(ids)
    assert load_split(cfg, seed=0) == split and load_split(cfg, seed=1).eval != split.eval
    # the held-out problems are drawn first: a bigger pool keeps the same eval set and extends the train pool
    bigger = load_split(ChainSource(train_size=500, eval_size=40), seed=0)
    assert bigger.eval == split.eval and bigger.train[:300] == split.train
    for p in split.train + split.eval:  # the answer is the start carried through every step, never below zero
        m = re.fullmatch(r"Start with (\d+)\. (.+)\. What number do you end with\? Work step by step\.", p.prompt)
        value = int(m.group(1))
        steps = m.group(2).split(", then ")
        assert len(steps) == 3
        for step in steps:
            op, b = step.lower().split()
            value += int(b) if op == "add" else -int(b)
            assert value >= 0
        assert p.answer == str(value)
        assert chain_values(p.id)[-1] == value and len(chain_values(p.id)) == 3
    assert chain_values("chain-7m1m5p7") == [6, 1, 8] and chain_values("add-7-5") is None
    # a worked answer names start, operands and running values: the default check has room for them
    worked = "First, 7 - 1 = 6. Then, 6 - 5 = 1. Finally, 1 + 7 = 8. So the answer is 8."
    assert check(cfg.check, worked, "8").correct and not check(cfg.check, worked, "1").correct


def test_chain_with_the_steps_check_lists_every_running_value_as_its_reference():
    from ratchet.data.checkers import check

    plain = load_split(ChainSource(train_size=50, eval_size=10), seed=0)
    cfg = ChainSource(train_size=50, eval_size=10, check={"kind": "steps"})
    assert cfg.check.max_numbers == 9  # room for what a worked answer to 3 steps names, as for `number`
    split = load_split(cfg, seed=0)
    assert [p.id for p in split.train] == [p.id for p in plain.train]  # the same problems, fuller references
    for p, q in zip(split.train + split.eval, plain.train + plain.eval):
        assert p.answer == ", ".join(str(v) for v in chain_values(p.id)) and p.answer.split(", ")[-1] == q.answer
    p = next(p for p in split.train if len(set(chain_values(p.id))) == 3)
    a, b, c = chain_values(p.id)
    assert check(cfg.check, f"So {a}, then {b}, then = {c}.", p.answer).correct is False  # values not stated
    assert check(cfg.check, f"That gives {a}. Then we get {b}. Finally = {c}. The answer is {c}.", p.answer).correct
    with pytest.raises(ValueError, match=r"check.max_numbers=4 .* at least 7"):
        ChainSource(check={"kind": "steps", "max_numbers": 4})


def test_chain_settings_that_cannot_work_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"check.max_numbers=4 .* at least 7"):
        ChainSource(check={"kind": "number", "max_numbers": 4})
    assert ChainSource(steps=5).check.max_numbers == 13  # the default check grows with the steps
    assert ChainSource(steps=5, check={"kind": "number"}).check.max_numbers == 13  # unless max_numbers is given
    with pytest.raises(ValueError, match="lower data.train_size"):
        ChainSource(steps=1, train_size=500)
    with pytest.raises(ValueError, match="placeholders"):
        ChainSource(template="Start with {start}.")


def test_rounds_draw_the_pool_without_repeats_until_it_is_spent():
    from ratchet.data.records import Prompt

    pool = [Prompt(id=f"p{i}", prompt=f"q{i}", answer="1") for i in range(10)]
    draws = [pool_slice(pool, start, 4, seed=0) for start in (0, 4, 8, 12)]
    first = [p.id for p in draws[0][0] + draws[1][0]]
    assert first == [f"p{i}" for i in range(8)]  # the pool in its order
    assert draws[0][1]["summary"] == "train prompts 0-3 of a pool of 10 (pass 1)"
    across, where = draws[2]  # positions 8-11: the last two of pass 1, then two of pass 2's new order
    assert [p.id for p in across[:2]] == ["p8", "p9"] and where["passes"] == [1, 2]
    assert len({p.id for p in across}) == len(across)  # never the same prompt twice in one round
    pass2 = [p.id for p in across[2:] + draws[3][0]]
    assert pass2 != sorted(pass2, key=lambda x: int(x[1:]))  # a new order ...
    assert pool_slice(pool, 8, 4, seed=0) == draws[2] and pool_slice(pool, 8, 4, seed=1) != draws[2]  # ... by seed
    with pytest.raises(ConfigError, match="prompts_per_round=11 exceeds the 10 train prompts"):
        pool_slice(pool, 0, 11, seed=0)


def test_jsonl_source(tmp_path):
    p = _write(tmp_path / "p.jsonl", _rows(10))
    s = load_split(FileSource(path=str(p), prompt_field="question", eval_size=3), seed=0)
    assert (len(s.train), len(s.eval)) == (7, 3)
    assert {r.prompt for r in s.train + s.eval} == {f"q{i}?" for i in range(10)}
    assert all(r.answer == r.prompt[1:-1] for r in s.train + s.eval)
    assert s.places["row-4"] == (str(p), "line 4")  # rows without ids are numbered by line


def test_file_answers_under_the_steps_check_list_values(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": f"{i}, {i + 1}"} for i in range(6)] + [{"prompt": "q9", "answer": "n/a"}]
    with pytest.raises(ConfigError, match=r"answers the 'steps' check cannot compare \(1\): line 7: 'n/a'"):
        load_split(FileSource(path=str(_write(tmp_path / "p.jsonl", rows)), eval_size=2, check={"kind": "steps"}), 0)
    s = load_split(FileSource(path=str(_write(tmp_path / "p.jsonl", rows[:6])), eval_size=2, check={"kind": "steps"}), 0)
    assert sorted(r.answer for r in s.train + s.eval) == [f"{i}, {i + 1}" for i in range(6)]


def test_parquet_csv_json_and_datasets_sources(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(_rows(6))
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "p.csv").write_text("question,answer\n" + "".join(f"q{i}?,{i}\n" for i in range(6)))
    (tmp_path / "p.json").write_text(json.dumps(_rows(6)))
    for name in ("p.parquet", "ds", "p.csv", "p.json"):
        s = load_split(FileSource(path=str(tmp_path / name), prompt_field="question", eval_size=2), seed=0)
        assert (len(s.train), len(s.eval)) == (4, 2), name
        assert sorted(p.answer for p in s.train + s.eval) == [str(i) for i in range(6)], name


def test_file_source_names_the_missing_column_and_file(tmp_path):
    p = _write(tmp_path / "p.jsonl", _rows(5))
    with pytest.raises(ConfigError, match=r"data.prompt_field='prompt' is not a column.*'question'"):
        load_split(FileSource(path=str(p), eval_size=1), seed=0)
    with pytest.raises(ConfigError, match=r"nope.jsonl: file not found"):
        load_split(FileSource(path=str(tmp_path / "nope.jsonl")), seed=0)
    with pytest.raises(ConfigError, match=r"unsupported file type.*'.txt'"):
        load_split(FileSource(path=str(_write(tmp_path / "p.txt", _rows(3)))), seed=0)


def _problems(tmp_path, rows, eval_rows=None, **kw):
    """The problems load_split reports for these rows (and a separate eval file)."""
    path = _write(tmp_path / "train.jsonl", rows)
    if eval_rows is not None:
        kw["eval_path"] = str(_write(tmp_path / "eval.jsonl", eval_rows))
    with pytest.raises(ConfigError) as e:
        load_split(FileSource(path=str(path), **{"eval_size": 1, **kw}), seed=0)
    return e.value.problems, str(e.value)


NOT_FINITE = "answers that are not finite numbers, or too large for one"
GOOD = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(4)]
HELD = [{"prompt": "What is 50 + 1?", "answer": 51}]


@pytest.mark.parametrize("bad, kind, where", [
    ('{"prompt": "What is 1 + 1?", "answer": 2', "malformed JSON lines", "line 5: Expecting ',' delimiter"),
    ('["What is 1 + 1?", 2]', "rows that are not objects", "line 5: ['What is 1 + 1?', 2]"),
    ({"question": "What is 1 + 1?", "answer": 2}, "rows without the prompt field 'prompt'", "line 5: keys"),
    ({"prompt": None, "answer": 2}, "null prompts", "line 5: None"),
    ({"prompt": 12, "answer": 2}, "prompts that are not text", "line 5: 12"),
    ({"prompt": ["What is", "1 + 1?"], "answer": 2}, "prompts that are not text", "line 5: ['What is'"),
    ({"prompt": "   ", "answer": 2}, "empty prompts", "line 5"),
    ('{"prompt": "What is 1 + 1?", "answer": NaN}', NOT_FINITE, "line 5: nan"),
    ({"prompt": "What is 1 + 1?", "answer": "nan"}, NOT_FINITE, "line 5: 'nan'"),
    ({"prompt": "What is 1 + 1?", "answer": "1e400"}, NOT_FINITE, "line 5: '1e400'"),
    ('{"prompt": "What is 1 + 1?", "answer": 1%s}' % ("0" * 400), NOT_FINITE,
     "line 5: 1000"),
    ('{"prompt": "What is 1 + 1?", "answer": 1%s}' % ("0" * 5000), "numbers too long to read",
     "line 5: an integer of more than 4,300 digits"),  # valid JSON that Python's reader refuses
    ('{"prompt": "a", "answer": %s}' % ("[" * 5000 + "]" * 5000), "values nested too deep to read", "line 5: deeper"),
    ({"prompt": "What is 1 + 1?", "answer": True}, "answers that are not text or a number", "line 5: True"),
    ({"prompt": "What is 1 + 1?", "answer": ""}, "empty answers", "line 5"),
    ({"prompt": "What is 1 + 1?", "answer": "two"}, "answers the 'number' check cannot compare", "line 5: 'two'"),
    ({"prompt": "What is 1 + 1?", "answer": 2, "id": {"a": 1}}, "ids that are not text or an integer", "line 5"),
])
def test_each_bad_row_is_named_by_file_line_value_and_fix(tmp_path, bad, kind, where):
    problems, text = _problems(tmp_path, [*GOOD, bad], eval_rows=HELD)
    (line,) = [p for p in problems if kind in p]
    assert line.startswith(f"{tmp_path / 'train.jsonl'}: {kind} (1): {where}"), line
    assert "Fix: " in line
    assert len(problems) == 1, problems  # the other rows are fine


def test_non_utf8_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "What is 1 + 1?", "answer": 2}\n{"prompt": "caf\xe9", "answer": 1}\n')
    with pytest.raises(ConfigError, match=r"lines that are not UTF-8 text \(1\): line 2"):
        load_split(FileSource(path=str(path), eval_size=1), seed=0)


def test_csv_that_is_not_utf8_or_has_a_row_longer_than_its_header(tmp_path):
    """Refused like the same bytes as JSONL, never read with replacement characters; a row with
    an extra field is named, not a traceback."""
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"prompt,answer\nWhat is 1 + 1?,2\nCaf\xe9 costs 3 and 4?,7\n")
    with pytest.raises(ConfigError, match=r"latin.csv: a file that is not UTF-8 text \(1\): line 3: byte b'\\xe9'"):
        load_split(FileSource(path=str(latin), eval_size=1), seed=0)
    wide = tmp_path / "wide.csv"
    wide.write_text("prompt,answer\n" + "".join(f"What is {i} + 1?,{i + 1}\n" for i in range(4)) + "What is 1,5?,2,x\n")
    with pytest.raises(ConfigError) as e:
        load_split(FileSource(path=str(wide), eval_size=1), seed=0)
    assert e.value.problems == [f"{wide}: rows with more fields than the header (1): line 6: ['2', 'x']. Fix: quote "
                                "fields that hold commas, or remove the extra values"]


def test_duplicate_ids_name_both_places(tmp_path):
    rows = [{"id": "q1", "prompt": "What is 1 + 1?", "answer": 2}, {"id": "q2", "prompt": "What is 2 + 2?", "answer": 4},
            {"id": "q1", "prompt": "What is 3 + 3?", "answer": 6}]
    problems, _ = _problems(tmp_path, rows, eval_rows=[{"id": "q2", "prompt": "What is 5 + 5?", "answer": 10}])
    (line,) = problems
    train, ev = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    assert f"duplicate ids (2): 'q1': {train} line 1 and {train} line 3; 'q2': {train} line 2 and {ev} line 1" in line


def test_empty_eval_file_and_unanswered_eval_rows(tmp_path):
    problems, _ = _problems(tmp_path, GOOD, eval_rows=[])
    assert problems == [f"{tmp_path / 'eval.jsonl'}: no rows (1): data.eval_path: the file is empty. Fix: held-out "
                        "accuracy (and the champion gate) needs at least one answered row"]
    problems, _ = _problems(tmp_path, GOOD, eval_rows=[{"prompt": "What is 9 + 9?"}, {"prompt": "What is 8 + 8?"}])
    column, rows = problems
    assert "data.answer_field='answer' is not a column (1): columns: ['prompt']" in column
    assert "eval rows without a reference answer (2): line 1: id 'eval-row-1'; line 2: id 'eval-row-2'" in rows


def test_train_answers_are_required_only_when_the_label_needs_them(tmp_path):
    rows = [{"prompt": f"What is {i} + 1?"} for i in range(3)]
    path = _write(tmp_path / "train.jsonl", rows)
    ev = str(_write(tmp_path / "eval.jsonl", HELD))
    s = load_split(FileSource(path=str(path), eval_path=ev), seed=0)  # label-free: fine
    assert [p.answer for p in s.train] == [None] * 3
    with pytest.raises(ConfigError, match=r"data.answer_field='answer' is not a column \(1\): columns: \['prompt'\]"):
        load_split(FileSource(path=str(path), eval_path=ev), seed=0, train_answers=True)


def test_a_check_that_needs_no_reference_takes_rows_without_answers(tmp_path):
    """A python check scores without a reference: its rows' answer column may be a column of
    their own (TRL's `solution`), while a check that compares with answers still needs them."""
    from ratchet.data.checkers import PythonCheck

    score = tmp_path / "score.py"
    score.write_text("def score(completion, solution, **kw):\n    return completion == solution\n")
    rows = [{"problem": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(6)]
    path = str(_write(tmp_path / "rows.jsonl", rows))
    check = PythonCheck(function=f"{score}:score")
    s = load_split(FileSource(path=path, prompt_field="problem", answer_field=None, eval_size=2, check=check), seed=0)
    assert all(p.answer is None and p.fields == {"solution": str(int(p.prompt.split()[2]) + 1)} for p in s.train + s.eval)
    with pytest.raises(ConfigError, match=r"data.answer_field='answr' is not a column.*or to null: this check needs"):
        load_split(FileSource(path=path, prompt_field="problem", answer_field="answr", eval_size=2, check=check), seed=0)
    # the default name need not be a column, also as a stored config (every field set) reads it on resume
    default = FileSource(path=path, prompt_field="problem", eval_size=2, check=check)
    again = FileSource.model_validate(default.model_dump())
    assert len(load_split(again, seed=0).eval) == 2
    with pytest.raises(ConfigError, match=r"eval rows without a reference answer.*set data.answer_field to the column "
                                          r"holding the reference answers \(data.check.kind='number'"):
        load_split(FileSource(path=path, prompt_field="problem", answer_field=None, eval_size=2), seed=0)


def test_overlap_between_train_and_eval_is_an_error_unless_allowed(tmp_path):
    ev = [{"prompt": "what is 0  + 1?", "answer": 1}]  # the same text once normalised
    problems, _ = _problems(tmp_path, GOOD, eval_rows=ev)
    (line,) = problems
    assert (f"prompts in both the train and the eval split (1): {tmp_path / 'train.jsonl'} line 1 and "
            f"{tmp_path / 'eval.jsonl'} line 1: 'what is 0  + 1?'") in line and "data.allow_overlap=true" in line
    s = load_split(FileSource(path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "eval.jsonl"),
                              allow_overlap=True), seed=0)
    assert len(s.eval) == 1


def test_every_problem_is_reported_at_once_first_few_with_a_count(tmp_path):
    rows = [*GOOD, *['{"prompt": broken' for _ in range(5)], {"prompt": None}, {"q": "x"}]
    problems, text = _problems(tmp_path, rows, eval_rows=[])
    assert len(problems) == 4, problems
    malformed = next(p for p in problems if "malformed JSON lines" in p)
    assert "(5): line 5:" in malformed and "line 7:" in malformed and "line 8" not in malformed
    assert len(re.findall(r"line \d+:", malformed)) == 3 and "; and 2 more. Fix:" in malformed
    assert text.startswith("4 problem(s) in data:")


def test_digests_follow_the_content_of_every_kind_of_source(tmp_path, monkeypatch):
    import datasets

    p = _write(tmp_path / "p.jsonl", _rows(6))
    ev = _write(tmp_path / "e.jsonl", [{"question": "z?", "answer": 9}])
    cfg = FileSource(path=str(p), eval_path=str(ev), prompt_field="question")
    first = load_split(cfg, seed=0).digests
    _write(ev, [{"question": "z?", "answer": 8}])
    second = load_split(cfg, seed=0).digests
    assert first["path"] == second["path"] and first["eval_path"] != second["eval_path"]

    d = tmp_path / "ds"
    datasets.Dataset.from_list(_rows(6)).save_to_disk(str(d))
    a = load_split(FileSource(path=str(d), prompt_field="question", eval_size=2), seed=0).digests["path"]
    datasets.Dataset.from_list(_rows(7)).save_to_disk(str(d))
    b = load_split(FileSource(path=str(d), prompt_field="question", eval_size=2), seed=0).digests["path"]
    assert a != b

    # a dataset named by id (no hub here: the loader stands in for the local HF cache)
    hub = {"rows": _rows(6)}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: datasets.Dataset.from_list(hub["rows"]))
    named = FileSource(path="someone/arith", prompt_field="question", eval_size=2)
    a = load_split(named, seed=0).digests["path"]
    hub["rows"] = [{**r, "answer": r["answer"] + 1} for r in _rows(6)]
    assert load_split(named, seed=0).digests["path"] != a


def test_addition_levels_are_digit_counts_each_with_its_own_held_out_pairs():
    src = AdditionSource(levels=[1, 2, 8], eval_size=5, train_size=10)
    split = src.load(0, True)
    for n in (1, 2, 8):
        tr, ev = [p for p in split.train if p.level == n], [p for p in split.eval if p.level == n]
        assert (len(tr), len(ev)) == (10, 5) and not {p.id for p in tr} & {p.id for p in ev}
        a, b = (int(x) for x in re.findall(r"\d+", ev[0].prompt))
        assert len(str(a)) == len(str(b)) == n and ev[0].answer == str(a + b)
        alone = src.at_level(n).load(0, True)  # a level's rows, whichever other levels are listed
        assert alone.eval == ev and alone.train == tr
    assert json.loads(split.eval[0].model_dump_json())["level"] == 1
    assert "level" not in json.loads(AdditionSource().load(0, True).eval[0].model_dump_json())  # no level: same bytes
    small = AdditionSource(levels=[1, 2], eval_size=50, train_size=500).load(0, True)  # level 1 has 100 pairs
    assert [sum(p.level == n for p in small.train) for n in (1, 2)] == [50, 500]


@pytest.mark.parametrize("settings, says", [
    ({"levels": [0, 2]}, "digit counts from 1"),
    ({"levels": [3, 2]}, "must rise"),
    ({"levels": [2], "a_max": 5}, "a_max do not apply"),
    ({"levels": [1], "eval_size": 100}, "level 1 (one digit) has 100 pairs"),
])
def test_addition_levels_that_cannot_work_are_refused_with_the_fix(settings, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        AdditionSource(**settings)


def test_a_file_s_level_column_splits_each_level_apart_and_is_checked(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"q{i}", "answer": str(i), "level": 1 + i % 3} for i in range(30)]
    path = tmp_path / "levels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = FileSource(path=str(path), level_field="level", levels=[1, 2], eval_size=3)
    split = src.load(0, True)
    assert sorted({p.level for p in split.train + split.eval}) == [1, 2]  # level 3 is left out
    assert [sum(p.level == n for p in split.eval) for n in (1, 2)] == [3, 3]
    assert src.at_level(2).held_out(0).eval == [p for p in split.eval if p.level == 2]
    with pytest.raises(ValueError, match="go together"):
        FileSource(path=str(path), level_field="level")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({**r, "level": "hard" if i == 4 else r["level"]}) + "\n"
                           for i, r in enumerate(rows)))
    with pytest.raises(ConfigError) as e:
        FileSource(path=str(bad), level_field="level", levels=[1, 2, 3], eval_size=3).load(0, True)
    assert "levels that are not integers" in str(e.value) and "line 5" in str(e.value) and "'hard'" in str(e.value)
    with pytest.raises(ConfigError, match="levels with too few rows to hold some out"):
        FileSource(path=str(path), level_field="level", levels=[1, 2], eval_size=10).load(0, True)


def test_each_level_is_a_held_out_set_of_its_own_and_no_set_may_take_its_name():
    from ratchet.flows.config import config_from_dict

    cfg = config_from_dict({"data": {"kind": "addition", "levels": [2, 3], "eval_size": 4, "train_size": 8}})
    stages = [(s.name, stage) for s, stage in cfg.eval_stages()]
    assert stages == [("heldout", "evaluate"), ("level_2", "evaluate.level_2"), ("level_3", "evaluate.level_3")]
    level = cfg.eval_stages()[2][0]
    assert level.source(cfg.data).held_out(cfg.seed).eval == [p for p in cfg.data.load(cfg.seed, True).eval
                                                              if p.level == 3]
    with pytest.raises(ConfigError, match="'level_3' is the name of a level's own held-out set"):
        config_from_dict({"data": {"kind": "addition", "levels": [2, 3], "eval_size": 4, "train_size": 8},
                          "evaluate": {"sets": [{"name": "heldout"}, {"name": "level_3", "data": {"kind": "addition"}}]}})
