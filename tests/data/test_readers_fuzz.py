"""Every byte of a user's file gets a report, never a traceback: each reader (JSONL, JSON, CSV,
Parquet, a `datasets` directory, a YAML config) is given arbitrary bytes and arbitrary
structures, and the only error that may come out is Ratchet's own, naming the file."""

import json
import string

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ratchet.data.errors import ConfigError
from ratchet.data.prompts import FileSource, load_split
from ratchet.flows.config import load_config

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# JSON values of every shape, with the shapes Python's reader refuses (more than 4,300 digits)
# or that crowd the nesting limit
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=30), st.sampled_from(["", " ", "nan", "1e400", "What is 1 + 1?", "2"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
ROWS = st.lists(st.one_of(
    st.fixed_dictionaries({"prompt": VALUES, "answer": VALUES}, optional={"id": VALUES, "x": VALUES}),
    VALUES), min_size=0, max_size=6)
BIG = "1" * 5001
NESTED = "[" * 5000 + "]" * 5000
LINES = st.lists(st.one_of(
    st.sampled_from(['{"prompt": "What is 1 + 1?", "answer": 2}', '{"prompt": "What is 1 + 1?", "answer": %s}' % BIG,
                     '{"prompt": %s, "answer": 2}' % BIG, NESTED, '{"prompt": "a", "answer": ' + NESTED + "}",
                     "", "\ufeff", "{", "[1,", '"\\ud800"', "NaN", "-Infinity"]),
    ROWS.map(lambda rows: "\n".join(json.dumps(r) for r in rows)),
    st.text(max_size=60)), max_size=8).map("\n".join)


def _only_our_errors(source, path):
    try:
        load_split(source, seed=0)
    except ConfigError as e:
        assert e.problems and all(str(path) in p or "data." in p for p in e.problems), e.problems


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
@SETTINGS
@given(data=st.one_of(st.binary(max_size=400), LINES.map(lambda s: s.encode("utf-8", "surrogatepass"))))
@example(data=('{"prompt": "What is 1 + 1?", "answer": %s}\n' % BIG).encode())
@example(data=NESTED.encode())
def test_any_bytes_in_a_data_file_get_a_report(tmp_path, suffix, data):
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(data)
    _only_our_errors(FileSource(path=str(path), eval_size=1), path)


@SETTINGS
@given(rows=ROWS)
def test_any_structure_in_a_json_array_or_a_parquet_file_gets_a_report(tmp_path, rows):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    _only_our_errors(FileSource(path=str(path), eval_size=1), path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    try:
        pq.write_table(pa.Table.from_pylist([r for r in rows if isinstance(r, dict)]), path)
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        return  # pyarrow cannot write these rows as one table: no such file can exist
    _only_our_errors(FileSource(path=str(path), eval_size=1), path)


def test_a_datasets_directory_with_broken_files_gets_a_report(tmp_path):
    import datasets

    d = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]).save_to_disk(d)
    for f in sorted(p for p in d.iterdir() if p.is_file()):
        f.write_bytes(b"\x00\xff{[" * 10)
    _only_our_errors(FileSource(path=str(d), eval_size=1), d)


YAML = st.one_of(
    st.binary(max_size=300),
    st.text(alphabet=string.printable + "é\u2028\ufeff", max_size=300).map(str.encode),
    st.sampled_from([b"rounds: " + BIG.encode(), b"[" * 3000, b"a: &a [*a]", b"sample: {n: " + BIG.encode() + b"}",
                     b"\xff\xfe", b"!!python/object:os.system ls", b"- 1\n- 2", b"data:\n  kind: [1]"]),
    st.dictionaries(st.sampled_from(["rounds", "sample", "data", "train", "label", "x"]), VALUES, max_size=4)
      .map(lambda d: json.dumps(d).encode()),
)


@SETTINGS
@given(data=YAML)
def test_any_bytes_in_a_config_file_get_a_report(tmp_path, data):
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    try:
        load_config(path, [f"workdir={tmp_path}"])
    except ConfigError as e:
        assert e.problems, str(e)
