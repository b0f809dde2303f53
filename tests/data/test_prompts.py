import json

import pytest

from ratchet.data.errors import ConfigError
from ratchet.data.prompts import AdditionSource, FileSource, load_split


def test_addition_split_is_disjoint_complete_and_seeded():
    tr, ev = load_split(AdditionSource(a_max=20, b_max=10, eval_size=50), seed=0)
    assert (len(tr), len(ev)) == (150, 50)
    assert not {p.id for p in tr} & {p.id for p in ev}
    assert {p.id for p in tr + ev} == {f"add-{a}-{b}" for a in range(20) for b in range(10)}
    p = next(p for p in tr + ev if p.id == "add-7-5")
    assert (p.prompt, p.answer) == ("What is 7 + 5?", "12")
    assert load_split(AdditionSource(), seed=0) == (tr, ev)
    assert load_split(AdditionSource(), seed=1)[1] != ev


def test_addition_train_size_and_bad_eval_size():
    tr, ev = load_split(AdditionSource(train_size=10, eval_size=5), seed=0)
    assert (len(tr), len(ev)) == (10, 5)
    with pytest.raises(ConfigError, match="data.eval_size=200"):
        load_split(AdditionSource(a_max=20, b_max=10, eval_size=200), seed=0)


def _rows(n):
    return [{"question": f"q{i}?", "answer": i} for i in range(n)]


def test_jsonl_source(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in _rows(10)))
    tr, ev = load_split(FileSource(path=str(p), prompt_field="question", eval_size=3), seed=0)
    assert (len(tr), len(ev)) == (7, 3)
    assert {r.prompt for r in tr + ev} == {f"q{i}?" for i in range(10)}
    assert all(r.answer == r.prompt[1:-1] for r in tr + ev)


def test_parquet_and_datasets_sources(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(_rows(6))
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "ds"))
    for path in (tmp_path / "p.parquet", tmp_path / "ds"):
        tr, ev = load_split(FileSource(path=str(path), prompt_field="question", eval_size=2), seed=0)
        assert (len(tr), len(ev)) == (4, 2)


def test_file_source_names_the_missing_column(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in _rows(5)))
    with pytest.raises(ConfigError, match=r"data.prompt_field='prompt' is not a column.*question"):
        load_split(FileSource(path=str(p), eval_size=1), seed=0)
    with pytest.raises(ConfigError, match="does not exist"):
        load_split(FileSource(path=str(tmp_path / "nope.jsonl")), seed=0)
