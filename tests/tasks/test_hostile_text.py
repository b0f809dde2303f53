"""Model text is hostile input to every parser that reads it after the checks (those are
tests/data/test_checks_property.py): the judge's guard, the judge's verdict parser and prompt,
the tree search's step cutter and the filter. On arbitrary and adversarial strings up to
the longest completion a config allows, each returns its kind of result, never raises, and
finishes within a time bound far above the linear work it does."""

import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ratchet.data.records import LabeledCompletion
from ratchet.tasks.filter_kinds.pairs import PairFilter, build_pairs
from ratchet.tasks.filter_kinds.rft import RFTFilter, accept
from ratchet.tasks.label_kinds.guard import guard, neutralize, scan
from ratchet.tasks.label_kinds.judging import DEFAULT_TEMPLATES, copied_mask, judge_prompt, parse_verdict
from ratchet.tasks.label_kinds.tree_search import step_text

LONGEST = 16384  # characters: 4,096 tokens of the longest completion at about 4 characters each
BOUND_S = 1.0  # per call on the slowest CI machine; 1,000 spaces after "score" took 12 s before

# what the patterns key on, each followed by a long run of what a backtracking pattern could
# split between two of its quantifiers (1,000 spaces after "score" took 12 s)
KEYS = st.sampled_from(["score", "Score:", "verdict", "rating", "grade", "system", "assistant", "judge", "please",
                        "must", "answer is", "response", "ignore", "out of", "final score is", "#", "<", "[", "✅",
                        "s c o r e", "а", ""])
RUNS = st.sampled_from([" ", "\n", "\t", "\r\n", "\u00a0", " \n", "*", "_", "*_", "(", "'", ":", "-", "#", ">", "<",
                        "|", "!", ".", "9", "0", "a", "a1", "\u200b", "score ", "yes\n", "* "])
PIECES = st.sampled_from([" ", "\n", "5", "10", "/5", "correct", "yes", "Score: 4", "</response>", "<|im_end|>"])
ATTACK = st.tuples(KEYS, RUNS, st.sampled_from([1, 3, 200, 1000, 4000]), PIECES).map(lambda t: t[0] + t[1] * t[2] + t[3])
ATTACKS = st.lists(ATTACK, min_size=1, max_size=4).map(lambda xs: "".join(xs)[:LONGEST])
TEXT = st.one_of(
    ATTACKS, ATTACKS,
    st.text(max_size=2000),
    st.lists(st.one_of(KEYS, PIECES, st.text(max_size=6)), max_size=400).map("".join),
)
# no shrinking: a slow example is reported as found, not shrunk by re-running it for minutes
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


def _bounded(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    took = time.perf_counter() - t
    assert took < BOUND_S, f"{fn.__name__} took {took:.2f} s on {len(args[-1])} characters"
    return out


@SETTINGS
@given(response=TEXT, prompt=st.one_of(st.just("What is 2 + 2?"), TEXT))
def test_the_guard_reads_any_text(response, prompt):
    findings = _bounded(scan, response, prompt)
    assert all(0 <= f.start < f.end <= len(response) for f in findings)
    safe, kinds = _bounded(guard, prompt, response)
    assert isinstance(safe, str) and set(kinds) <= {"score", "verdict", "instruction", "fence", "role",
                                                          "obfuscation"}
    assert isinstance(_bounded(neutralize, response, findings), str)


@SETTINGS
@given(judge=TEXT, response=TEXT)
def test_the_verdict_parser_reads_any_judge_text(judge, response):
    value = _bounded(parse_verdict, judge, response)
    assert value is None or 0.0 <= value <= 5.0
    assert len(_bounded(copied_mask, judge, response)) == len(judge)


@SETTINGS
@given(prompt=TEXT, response=TEXT)
def test_any_text_stays_inside_the_judge_prompt(prompt, response):
    for template in DEFAULT_TEMPLATES.values():
        text = _bounded(judge_prompt, template, prompt, response)
        assert text.count("</response>") == template.count("</response>")  # a response cannot close its block


@SETTINGS
@given(text=TEXT, stop=st.sampled_from([None, "\n", ". ", "\n\n", "Step"]))
def test_the_step_cutter_reads_any_text(text, stop):
    out = _bounded(step_text, text, stop)
    assert text.startswith(out) and len(text) - len(out) <= len(stop or "")


@SETTINGS
@given(texts=st.lists(TEXT, min_size=2, max_size=6))
def test_the_filters_take_any_completions(texts):
    rows = [LabeledCompletion(prompt_id="p", prompt="q", index=i, text=t, n_tokens=len(t) // 4, reward=float(i % 2))
            for i, t in enumerate(texts)]
    kept, _ = _bounded(accept, rows, RFTFilter(min_reward=1.0), 0)
    assert {r.completion for r in kept} <= set(texts)
    pairs, _ = _bounded(build_pairs, rows, PairFilter(margin=0.5, max_length_ratio=None))
    assert all(p.chosen in texts and p.rejected in texts for p in pairs)


@pytest.mark.parametrize("text", ["score" + " " * 4000, "Score: 5" + " " * 8000 + "x", "\n" * LONGEST,
                                  "score" + "*_" * 8000, "verdict" + ":\n " * 5000])
def test_runs_that_were_slow_are_linear_now(text):
    _bounded(guard, "What is 2 + 2?", text)
    _bounded(parse_verdict, text, "")


FENCED = st.lists(st.one_of(st.sampled_from(["```", "```python\n", "\n```\n", "``", "`", "\n", "x = 1"]), TEXT),
                  max_size=60).map(lambda xs: "".join(xs)[:LONGEST])


@SETTINGS
@given(text=st.one_of(TEXT, FENCED), tests=st.one_of(TEXT, st.just('[{"input": "", "output": "1"}]')))
def test_the_code_checks_reader_takes_any_text(text, tests):
    """What the code check reads in this process: the program out of a response, the cases out of
    a row's tests (the program itself runs in the sandbox, bounded by its limits)."""
    from ratchet.data.checks.code import io_cases, program_of

    program = _bounded(program_of, text)
    assert isinstance(program, str) and len(program) <= len(text)
    assert _bounded(io_cases, tests) is None or isinstance(io_cases(tests), list)
