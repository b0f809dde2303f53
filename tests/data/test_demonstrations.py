"""A demonstrations file's shape (data/demonstrations.py): every problem at once, each with its line
and the fix; good rows of both forms read as the turns a cold start trains on."""

from __future__ import annotations

import json

from ratchet.data.demonstrations import read


def _file(tmp_path, *rows) -> str:
    p = tmp_path / "demos.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_both_forms_read_as_turns_with_their_columns(tmp_path):
    path = _file(tmp_path,
                 {"prompt": "What is 2 + 3?", "completion": "5", "answer": 5},
                 {"id": 7, "answer": "6", "seed": 3, "messages": [
                     {"role": "user", "content": "What is 2 * 3?"},
                     {"role": "assistant", "content": "```python\nprint(2 * 3)\n```"},
                     {"role": "tool", "content": "6"}, {"role": "assistant", "content": "It is 6."}]})
    rows, digest, report = read(path)
    assert not report and len(digest) == 64
    a, b = rows
    assert (a.id, a.prompt, a.answer, [t.role for t in a.turns], a.final) == ("demo-1", "What is 2 + 3?", "5",
                                                                                ["model"], "5")
    assert (b.id, b.answer, b.fields, [t.role for t in b.turns], b.final) == ("7", "6", {"seed": 3},
                                                                                ["model", "tool", "model"], "It is 6.")
    assert b.item().response == "It is 6." and b.item().answer == "6"


def test_every_broken_row_is_named_with_its_line_and_fix(tmp_path):
    user = {"role": "user", "content": "q"}
    said = {"role": "assistant", "content": "a"}
    path = _file(tmp_path,
                 "not json",                                                   # 1
                 ["a", "list"],                                                # 2
                 {"prompt": "q", "completion": "a", "messages": [user, said]},  # 3 both forms
                 {"prompt": "q"},                                              # 4 no completion
                 {"messages": [{"role": "system", "content": "s"}, user, said]},  # 5
                 {"messages": [user, {"role": "tool", "content": "1"}, said]},  # 6 a tool answers nobody
                 {"messages": [user, said, said]},                            # 7
                 {"messages": [user, said, user]},                            # 8 ends with the user
                 {"messages": [user, {"role": "bot", "content": "a"}]},       # 9
                 {"messages": [user, said, {"role": "tool", "content": "1"}, said, user, said]},  # 10 both kinds
                 {"messages": [user, {"role": "assistant", "content": "  "}]},  # 11 empty
                 {"prompt": "q", "completion": "a", "answer": [1]},          # 12
                 {"id": "x", "prompt": "q", "completion": "a"},                # 13
                 {"id": "x", "prompt": "q2", "completion": "a"})              # 14 duplicate id
    rows, _, report = read(path)
    text = "\n".join(report.lines())
    for line, words in [(1, "malformed JSON"), (2, "not JSON objects"), (3, "not both"), (4, "without a completion"),
                        (5, "leave the system turn out"), (6, "answers the user's prompt first"),
                        (7, "join them into one turn"), (8, "end with the model's answer"), (9, "unknown role"),
                        (10, "keep one kind of turn"), (11, "empty turns"), (12, "answer that is not text"),
                        (14, "give each row its own id")]:
        kind_line = next((x for x in report.lines() if f"line {line}:" in x or f"line {line}" in x.split(": ", 2)[-1]),
                         None)
        assert kind_line is not None and words in kind_line, (line, words, text)
    assert [r.id for r in rows] == ["x"]  # only the good row is kept


def test_a_missing_or_empty_file_is_refused(tmp_path):
    _, _, report = read(str(tmp_path / "none.jsonl"))
    assert "file not found" in report.lines()[0] and "cold_start.demonstrations" in report.lines()[0]
    _, _, report = read(_file(tmp_path))
    assert "no demonstrations" in report.lines()[0]
    (tmp_path / "d.csv").write_text("prompt,completion\n")
    _, _, report = read(str(tmp_path / "d.csv"))
    assert "not a JSONL file" in report.lines()[0]
