import pytest

from ratchet.data.checkers import ExactCheck, NumberCheck, RegexCheck, Verdict, check


@pytest.mark.parametrize(
    "response, answer, correct, extracted",
    [
        ("7 + 5 = 12.", "12", True, "12"),
        ("12", "12", True, "12"),
        ("The sum is 12, not 13", "12", False, "13"),  # the LAST number is the answer
        ("The sum is 13, no wait, 12", "12", True, "12"),
        ("no digits here", "12", False, None),
        ("1,234 apples", "1234", True, "1,234"),
        ("-3 is the result", "-3", True, "-3"),
        ("x2 and 3rd", "3", False, None),  # numbers glued to letters are not answers
        ("it is 2.50", "2.5", True, "2.50"),
    ],
)
def test_number_check_reads_last_number(response, answer, correct, extracted):
    v = check(NumberCheck(), response, answer)
    assert (v.correct, v.extracted) == (correct, extracted)


def test_number_check_rejects_enumeration():
    # five distinct numbers > max_numbers=4: listing candidates never scores, even if the last is right
    assert not check(NumberCheck(), "11 12 13 14 15", "15").correct
    assert check(NumberCheck(max_numbers=5), "11 12 13 14 15", "15").correct
    # repeats of one number count once: 3 + 4 = 7, so 7 -> {3, 4, 7}
    assert check(NumberCheck(), "3 + 4 = 7. Yes, 7.", "7").correct


def test_exact_and_regex_checks():
    assert check(ExactCheck(), "  Paris. ", "paris").correct
    assert not check(ExactCheck(), "Paris, France", "paris").correct
    rc = RegexCheck(pattern=r"Answer:\s*(\w+)")
    v = check(rc, "Answer: no\nAnswer: Yes", "yes")
    assert v.correct and v.extracted == "Yes"
    assert not check(rc, "yes", "yes").correct


def test_extract_gives_voting_keys():
    from ratchet.data.checkers import extract

    assert extract(NumberCheck(), "so 1,234.") == "1234"
    assert extract(NumberCheck(), "It is 12.0") == "12"
    assert extract(NumberCheck(), "2.50") == "2.5"
    assert extract(NumberCheck(), "11 12 13 14 15") is None  # an enumeration casts no vote
    assert extract(NumberCheck(), "none") is None
    assert extract(ExactCheck(), " Paris. ") == "paris"
    assert extract(RegexCheck(pattern=r"A:\s*(\w+)"), "A: x A: Yes") == "yes"


def test_graded_value_credits_a_wrong_number_by_its_distance():
    from ratchet.data.checkers import graded

    num = NumberCheck()
    assert graded(num, "6 + 5 = 11", "11", 0.5) == 1.0
    assert graded(num, "6 + 5 = 10", "11", 0.5) == 0.25  # one away: half the partial credit
    assert graded(num, "so 15", "11", 0.5) == 0.1
    assert graded(num, "so 15", "11", 0.2) == pytest.approx(0.04)
    assert graded(num, "no number at all", "11", 0.5) == 0.0
    # listing candidates earns nothing, even around the answer; nor does a verdict-like tail
    assert graded(num, "10 11 12 13 14", "11", 0.5) == 0.0
    assert graded(num, "The answer is 3. Value: 1.0 (full marks)", "11", 0.5) == 0.5 / 11
    assert graded(ExactCheck(), "Paris", "paris", 0.5) == 1.0
    assert graded(ExactCheck(), "Lyon", "paris", 0.5) == 0.0  # no distance between words


def test_shown_steps_counts_the_running_values_stated_as_results_in_order():
    from ratchet.data.checkers import shown_steps

    num = NumberCheck(max_numbers=9)
    values = [6, 1, 8]  # start 7: subtract 1, subtract 5, add 7
    assert shown_steps(num, "First, 7 - 1 = 6. Then, 6 - 5 = 1. Finally, 1 + 7 = 8. So the answer is 8.", values) == 3
    assert shown_steps(num, "7 minus 1 gives us 6, which minus 5 is 1, and adding 7 gets 8.", values) == 3
    # a right last number without the work before it is not a derivation
    assert shown_steps(num, "The answer is 8.", values) == 0
    assert shown_steps(num, "7 - 1 = 6. 6 - 5 = 2. 2 + 7 = 8.", values) == 1  # a wrong step stops the count
    # the values must come in order and as results: operands and restated numbers do not count
    assert shown_steps(num, "1 + 7 = 8 after 7 - 1 = 6.", values) == 1
    assert shown_steps(num, "Subtract 1 from 6, subtract 1, add 8.", values) == 0
    assert shown_steps(num, "6.5 = 6.5 and 1.0 = 1", [6, 1]) == 0  # 6.5 is not 6
    assert shown_steps(num, "7 - 1 = 61. 6x1 = 1.", [6, 1]) == 0  # nor is 61, nor a 6 inside a word
    # listing candidates as results earns nothing: more distinct numbers than the check allows
    assert shown_steps(num, " ".join(f"= {i}" for i in range(12)), values) == 0
    assert shown_steps(num, "= 6 = 1 = 8", values) == 3  # within the cap, stating the values is showing them


def test_worked_accuracy_counts_only_right_answers_with_every_step_shown():
    """The chain source measures its evaluation beyond accuracy; other sources measure nothing more."""
    from ratchet.data.prompts import AdditionSource, ChainSource
    from ratchet.data.records import LabeledCompletion, Prompt

    chain = ChainSource(check=NumberCheck(max_numbers=9))
    prompts = [Prompt(id="chain-7m1m5p7", prompt="Start with 7. ...", answer="8", task="chain"),
               Prompt(id="chain-2p2p2p2", prompt="Start with 2. ...", answer="8", task="chain")]

    def row(pid, text, correct):
        return LabeledCompletion(prompt_id=pid, prompt="", answer="8", index=0, text=text, n_tokens=1,
                                 reward=float(correct), correct=correct)

    rows = [row("chain-7m1m5p7", "7 - 1 = 6. 6 - 5 = 1. 1 + 7 = 8. The answer is 8.", True),
            row("chain-2p2p2p2", "Adding 2s, the answer is 8.", True)]  # right by its last number only
    assert chain.eval_metrics(prompts, rows) == {"worked_accuracy": 0.5}
    # a right-looking derivation with a wrong answer is not worked out; other sources have no such measure
    rows[0] = row("chain-7m1m5p7", "7 - 1 = 6. 6 - 5 = 1. 1 + 7 = 8. Oops, 9.", False)
    assert chain.eval_metrics(prompts, rows) == {"worked_accuracy": 0.0}
    assert AdditionSource().eval_metrics(prompts, rows) == {}
    assert chain.eval_metrics([Prompt(id="row-3", prompt="a file row", answer="8")],
                              [row("row-3", "8", True)]) == {}


def test_steps_check_wants_every_running_value_not_just_a_lucky_last_number():
    from ratchet.data.checkers import StepsCheck, answer_key, extract, graded

    steps, ref = StepsCheck(), "6, 1, 8"
    worked = "First, 7 - 1 = 6. Then, 6 - 5 = 1. Finally, 1 + 7 = 8. So the answer is 8."
    assert check(steps, worked, ref) == Verdict(True, "8")
    assert check(NumberCheck(max_numbers=9), "Adding it all up, I get 8.", "8").correct  # a guess passes `number`
    assert check(steps, "Adding it all up, I get 8.", ref) == Verdict(False, "8")  # but not `steps`
    assert not check(steps, "7 - 1 = 6. 6 - 5 = 1. 1 + 7 = 9. The answer is 9.", ref).correct
    assert not check(steps, worked + " Or maybe 3.", ref).correct  # the last number is still the answer
    # listing candidates, or stating every value among many, is no derivation
    assert not check(steps, "= 6 = 1 = 8 " + " ".join(str(i) for i in range(20, 30)) + " = 8", ref).correct
    # partial credit follows the derivation: right so far earns more than wrong from the start
    assert graded(steps, worked, ref, 0.5) == 1.0
    assert graded(steps, "7 - 1 = 6. 6 - 5 = 1. 1 + 7 = 9.", ref, 0.5) == pytest.approx(0.5 * 2 / 3)
    assert graded(steps, "7 - 1 = 5. 5 - 5 = 0. 0 + 7 = 7.", ref, 0.5) == 0.0
    assert graded(steps, "The answer is 8. Value: 1.0 (full marks)", ref, 0.5) == 0.0
    # the final answer is the reference's last value: votes and keys compare like `number`
    assert answer_key(steps, ref) == "8" and extract(steps, worked) == "8"
    assert answer_key(steps, "no numbers") is None and not check(steps, worked, "no numbers").correct


def test_a_users_regex_that_backtracks_costs_a_row_not_the_stage():
    """`(a+)+$` meeting 5,000 a's and a '!' backtracks for ages under Python's re; the regex
    check stops each search at its timeout_s and reads no answer (wrong), in about that time."""
    import time

    from ratchet.data.checkers import RegexCheck, check, extract

    slow = RegexCheck(pattern=r"((a+)+)$", timeout_s=0.2)
    t = time.perf_counter()
    verdict = check(slow, "a" * 5000 + "!", "aaaa")
    assert (verdict.correct, verdict.extracted) == (False, None) and time.perf_counter() - t < 2.0
    assert extract(slow, "a" * 5000 + "!") is None
    assert check(slow, "aaaa", "aaaa").correct  # a text it reads in time is read as before
    with pytest.raises(ValueError, match="timeout_s"):
        RegexCheck(pattern="(x)", timeout_s=0)


def test_answers_refused_for_their_form_are_counted_and_said_never_silent():
    """A worked answer past max_numbers, an answer without a number, a pattern that matches nothing:
    each zero names its rule, the stage metrics count them, and the console says so, with what to
    do when they are most of the answers."""
    from pathlib import Path

    from ratchet.data.checkers import Item, NumberCheck, RegexCheck, check_many, form_refusals, score_metrics, score_sums
    from ratchet.flows.config import load_config
    from ratchet.tasks.evaluate import EvaluateJob
    from ratchet.tasks.label import LabelJob

    number = NumberCheck()
    got = check_many(number, [Item("3 x 4 = 12, 12 - 2 = 10, and 10 / 5 = 2", "2"), Item("no idea", "2"),
                              Item("It is 2.", "2"), Item("It is 3.", "2")])
    assert [(v.correct, v.form) for v in got] == [(False, "too_many_numbers"), (False, "no_number"), (True, None),
                                                  (False, None)]
    (miss,) = check_many(RegexCheck(pattern=r"Answer:\s*(\d+)"), [Item("2", "2")])
    assert miss.form == "no_match" and not miss.correct
    m = score_metrics(score_sums(got + [miss]))
    assert m == {"form_too_many_numbers": 1.0, "form_no_number": 1.0, "form_no_match": 1.0}
    assert form_refusals(m, 10) == ["3/10 wrong for their form (over max_numbers numbers: 1, no number: 1, "
                                    "no pattern match: 1)"]
    most = {"form_too_many_numbers": 7.0, "accuracy": 0.1, "eval_prompts": 10.0}
    said = form_refusals(most, 10)
    assert said[1] == "most answers state more numbers than data.check.max_numbers: raise it"
    assert form_refusals(most, 10, "label.check")[1].endswith("than label.check.max_numbers: raise it")
    assert form_refusals({"accuracy": 1.0}, 10) == []
    # the stages' console lines carry them
    cfg = load_config(Path(__file__).parents[2] / "flows" / "configs" / "default.yaml", [])
    job = EvaluateJob(evaluate=cfg.evaluate.model_dump(include={"max_tokens", "shard_size"}), sampler=cfg.sampler,
                      data=cfg.data, seed=0)
    assert said[0] in job.summary(most) and said[1] in job.summary(most)
    label = LabelJob(label=cfg.label, data=cfg.data, seed=0)
    assert any("2/8 wrong for their form (no number: 2)" == x
               for x in label.summary({"labeled": 8.0, "form_no_number": 2.0, "reward_mean": 0.5}))
