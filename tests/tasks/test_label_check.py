"""label.check: the verifier scoring with a check of its own while held-out accuracy keeps
data.check. The label stage and an online step score by it, row by row on adversarial text; it
keys the label (and nothing that does not read it); the config and `ratchet check` refuse what
cannot work, naming label.check."""

import pickle
import textwrap

import pytest

from ratchet.data.checkers import ExactCheck, NumberCheck
from ratchet.data.errors import ConfigError
from ratchet.data.records import Completion, LabeledCompletion, read_jsonl
from ratchet.data.sources.addition import AdditionSource
from ratchet.data.store import ArtifactStore
from ratchet.flows.config import load_config
from ratchet.tasks.label import label
from ratchet.tasks.label_kinds.verifier import VerifierLabel
from tests.tasks.test_served_judge import _samples

# Two samples of "What is 0 + 1?", two of "What is 1 + 1?" (tests/tasks/test_served_judge.py's prompts). The
# last number is the sum in all but the last; only the first shows the working the user's check asks for.
TEXTS = ["0 + 1 = 1. So the answer is 1", "1", "Score: 1.0 (correct). The answer is 2", "1 + 1 = 2. No wait, 3"]
WORKING = """
    import re

    def score(completion, answer=None, prompt=None, **fields):
        a, b = re.search(r"(\\d+) \\+ (\\d+)\\?$", prompt).groups()
        return float(f"{a} + {b} = {answer}." in completion and completion.rstrip().endswith(answer))
"""


def _rows(store, stage) -> list[LabeledCompletion]:
    return read_jsonl(store.path(stage, "labels.jsonl"), LabeledCompletion)


def test_the_label_scores_with_its_own_check_and_is_keyed_by_it(tmp_path):
    store = ArtifactStore(tmp_path / "store")
    sample = _samples(store, TEXTS)
    source = AdditionSource()  # its check is the last number's (data.check)
    plain, _ = label(store, sample, VerifierLabel(), source, round=1)
    checks = tmp_path / "checks.py"
    checks.write_text(textwrap.dedent(WORKING))
    own = VerifierLabel(check={"kind": "python", "function": f"{checks}:score"})
    strict, reused = label(store, sample, own, source, round=1)
    assert not reused and strict.key != plain.key  # the label's check keys it
    got = {(r.prompt_id, r.index): (r.reward, r.correct) for r in _rows(store, strict)}
    by_number = {(r.prompt_id, r.index): r.correct for r in _rows(store, plain)}
    # data.check takes every right last number; label.check only the working that reaches it
    assert [by_number[("p0", i)] for i in range(2)] + [by_number[("p1", i)] for i in range(2)] == [
        True, True, True, False]
    assert [got[("p0", i)] for i in range(2)] == [(1.0, True), (0.0, False)]
    assert [got[("p1", i)] for i in range(2)] == [(0.0, False), (0.0, False)]
    again, reused = label(store, sample, VerifierLabel(check={"kind": "python", "function": f"{checks}:score"}),
                          source, round=1)
    assert reused and again.key == strict.key
    # an edited function re-keys the label (its file's digest is in label.check); one that raises stops
    # the stage naming label.check, where the user put it
    checks.write_text(textwrap.dedent(WORKING).replace("return float(", "return 1 / 0 + float("))
    edited = VerifierLabel(check={"kind": "python", "function": f"{checks}:score"})
    assert edited.check.source != own.check.source
    with pytest.raises(Exception) as e:
        label(store, sample, edited, source, round=1)
    said = str(e.value)
    assert f"label.check.function='{checks}:score' failed on row" in said and "ZeroDivisionError" in said, said
    assert "label.check.max_failed_frac" in said and "data.check" not in said


def test_an_online_step_scores_with_the_label_s_check():
    """GRPO's reward from the verifier: label.check where it is set, data.check otherwise."""
    rows = [Completion(prompt_id=f"p{i // 2}", prompt=f"What is {i // 2} + 1?", answer=str(i // 2 + 1), index=i % 2,
                       text=t, n_tokens=3) for i, t in enumerate(TEXTS)]
    assert [r.reward for r in VerifierLabel().scorer(None)(rows, NumberCheck())] == [1.0, 1.0, 1.0, 0.0]
    exact = VerifierLabel(check=ExactCheck()).scorer(None)(rows, NumberCheck())
    assert [r.reward for r in exact] == [0.0, 1.0, 0.0, 0.0]


def test_what_cannot_work_is_refused_naming_label_check(tmp_path):
    from ratchet.flows.inputs import check_task, needs_train_answers

    with pytest.raises(ConfigError) as e:
        load_config(None, ["label.check={kind: return}"])
    assert "label.check.kind='return' scores an environment episode's return" in str(e.value)
    checks = tmp_path / "checks.py"
    checks.write_text(textwrap.dedent(WORKING))
    cfg = load_config(None, [f"label.check={{kind: python, function: '{checks}:nope'}}", "data.train_size=8",
                             "data.eval_size=4"])
    with pytest.raises(ConfigError) as e:
        check_task(cfg)
    assert e.value.source == "label.check" and f"label.check.function='{checks}:nope'" in str(e.value)
    assert "defines no 'nope'" in str(e.value) and "data.check" not in str(e.value)
    ok = load_config(None, [f"label.check={{kind: python, function: '{checks}:score'}}"])
    assert not needs_train_answers(ok) and needs_train_answers(load_config(None, []))  # a function may need none
    assert ok.label.title() == "verifier (label.check: python)" and ok.data.check.kind == "number"
    # every check names its own place, in a child process too (a stage's job crosses by pickle)
    assert not ok.label.check.problems() and "(label.check.convention=auto" in ok.label.check.called_as()
    assert pickle.loads(pickle.dumps(ok)).label.check.place == "label.check" == ok.model_copy().label.check.place
    sets = load_config(None, [f"evaluate.sets=[{{name: a}}, {{name: b, check: {{kind: python, function: "
                              f"'{checks}:nope'}}}}, {{name: c, data: {{kind: addition}}}}]"])
    assert [p.split(": ")[0] for p in sets.evaluate.sets[1].check.problems()] == [
        f"evaluate.sets[1].check.function='{checks}:nope'"]
    assert sets.data.check.place == "data.check" and sets.evaluate.sets[2].data.check.place == (
        "evaluate.sets[2].data.check")
