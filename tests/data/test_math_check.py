"""data.check.kind=math: math-verify in a process of its own, where its signal alarms hold."""

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet.data.checkers import Item, MathCheck, check, check_many
from ratchet.data.checks.scorer import close_all


@pytest.fixture(autouse=True, scope="module")
def _scorer_per_module():
    yield
    close_all()


CASES = [  # (response, reference, right)
    ("The answer is $\\frac{1}{2}$.", "0.5", True),
    ("so $x = \\boxed{(x+1)^2}$", "x^2+2x+1", True),
    ("$\\{1,2\\}$", "\\{2,1\\}", True),
    ("It is $[0, 1)$", "[0,1)", True),
    ("It is $[0, 1]$", "[0,1)", False),
    ("The answer is 12.", "12", True),
    ("The answer is 13.", "12", False),
    ("", "3", False),
    ("no numbers here", "3", False),
]


def test_equal_answers_in_any_notation():
    got = [v.correct for v in check_many(MathCheck(), [Item(r, a) for r, a, _ in CASES])]
    assert got == [right for *_, right in CASES]
    assert check_many(MathCheck(), [Item("4", None)])[0].correct is None  # no reference: no verdict


def test_off_the_main_thread_it_still_bounds_and_answers():
    """A stage runs checks on threads other than the main one, where math-verify's alarms cannot
    be set; in its own process they are, and a runaway parse is a wrong answer in bounded time."""
    out = {}

    def run():
        t = time.monotonic()
        out["verdicts"] = check_many(MathCheck(timeout_s=1), [Item("$9^{9^{9^{9^{9}}}}$", "1"), Item("$2$", "2")])
        out["s"] = time.monotonic() - t

    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    assert [v.correct for v in out["verdicts"]] == [False, True]
    assert _host_timeouts() == 0  # math-verify's own bound answered; the host never had to kill the call


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=st.one_of(st.text(max_size=300), st.lists(st.sampled_from(
    ["$", "\\frac{", "}", "{", "^", "\\boxed{", "(", ")", "[", "]", "1", "x", "=", "\\sqrt", "\\\\", " ", "9" * 50,
     "\\left(", "\\right)", "e^{", ",", "\\{", "\\}", "\\infty"]), max_size=80).map("".join)))
def test_any_text_gets_a_verdict_in_bounded_time(response):
    v = check(MathCheck(timeout_s=1), response, "1")
    assert isinstance(v.correct, bool) and _host_timeouts() == 0  # math-verify's own bound, never the host's kill


def _host_timeouts() -> int:
    """Calls the scorer hosts of this process had to end at their own bound (a call math-verify's
    alarms did not stop in time)."""
    from ratchet.data.checks import scorer
    from ratchet.data.procs.host import KEPT

    return sum(s.timeouts for s in KEPT.of(scorer.Scorer))
