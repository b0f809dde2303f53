"""Model text is hostile input: every built-in check, on arbitrary and adversarial strings up to
a few thousand characters, returns its kind of answer (never raises) within a time bound."""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet.data.checkers import (ExactCheck, NumberCheck, RegexCheck, StepsCheck, answer_key, check, extract,
                                   graded)

CHECKS = [NumberCheck(), StepsCheck(), ExactCheck(), RegexCheck(pattern=r"Answer:\s*(\S+)")]
LONGEST = 4096  # characters: past what max_tokens allows the shipped configs
BOUND_S = 0.5  # per call, on the slowest CI machine: the linear work a few KB take is far below it

# pieces a model (or an attacker) strings together: numbers of every shape, separators the
# parsers split on, runs that are slow for a backtracking pattern, unicode look-alikes
PIECES = st.sampled_from([
    "1" * 400, "-", ".", ",", ",000", "0.5", "1e400", "nan", "inf", " ", " " * 200, "\n", "\t", "=", " = ", "is ",
    "gives us ", "Answer:", "Answer: ", "١٢٣", "１２", "½", "\u200b", "\x00", "🙂", "((((", "9" * 30, ".9" * 50,
    "1,234,567.89", "-0", "00012", "1.", ".5", "e", "E+", "+", "=" * 300, "is " * 100,
])
TEXT = st.one_of(st.text(max_size=LONGEST),
                 st.lists(PIECES, max_size=60).map("".join),
                 st.lists(st.one_of(PIECES, st.text(max_size=8)), max_size=200).map("".join))
ANSWERS = st.one_of(st.sampled_from(["4", "6, 1, 8", "1" * 400, "nan", "-0.5", "", "Paris"]), st.text(max_size=40))


def _bounded(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    assert time.perf_counter() - t < BOUND_S, f"{fn.__name__} took {time.perf_counter() - t:.2f} s"
    return out


@pytest.mark.parametrize("cfg", CHECKS, ids=lambda c: c.kind)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=TEXT, answer=ANSWERS)
def test_every_check_reads_any_text_without_raising(cfg, response, answer):
    response = response[:LONGEST]
    v = _bounded(check, cfg, response, answer)
    assert isinstance(v.correct, bool) and (v.extracted is None or isinstance(v.extracted, str))
    key = _bounded(extract, cfg, response)
    assert key is None or isinstance(key, str)
    ref = _bounded(answer_key, cfg, answer)
    assert ref is None or isinstance(ref, str)
    g = _bounded(graded, cfg, response, answer, 0.5)
    assert 0.0 <= g <= 1.0


def test_the_known_hard_cases():
    big = "1" * 400
    for cfg in (NumberCheck(), StepsCheck()):
        assert extract(cfg, f"The answer is {big}") == big  # too large for a float: its digits are its key
        assert graded(cfg, f"so it is {big}", "5", 0.5) == 0.0
        assert not check(cfg, f"= {big}", "5").correct
    assert answer_key(NumberCheck(), big) == big
    assert check(NumberCheck(), f"so {big}", big).correct  # integers compare exactly, however long
    assert not check(NumberCheck(), f"so {big}1", big + "2").correct
    assert not check(NumberCheck(), "1e400", "1e401").correct  # inf is no answer
    # an integer's key is every digit: 17-digit sums a float rounds alike stay apart
    a, b = "12345678901234567", "12345678901234568"
    assert float(a) == float(b) and extract(NumberCheck(), f"so {a}") != extract(NumberCheck(), f"so {b}")
    assert answer_key(NumberCheck(), b) == extract(NumberCheck(), f"= {b}") == b
    assert [extract(NumberCheck(), t) for t in ("007", "-0", "-00", "1,234", "12.0", "-3")] == \
        ["7", "0", "0", "1234", "12", "-3"]
    for cfg in CHECKS:
        _bounded(check, cfg, " " * LONGEST, "4")
        _bounded(check, cfg, "= " * (LONGEST // 2), "4")
