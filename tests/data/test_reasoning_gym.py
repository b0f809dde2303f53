"""data.kind=reasoning_gym: seeded, disjoint problems from a reasoning-gym generator, scored by
the dataset's own score_answer on the answer read from the response."""


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet.data.checkers import Item, check_many
from ratchet.data.errors import ConfigError
from ratchet.data.prompts import load_split
from ratchet.data.sources.reasoning_gym import extract_answer
from ratchet.flows.config import load_config

EASY = "data={kind: reasoning_gym, dataset: chain_sum, config: {min_terms: 2, max_terms: 2, max_digits: 1}, " \
       "eval_size: 20, train_size: 60}"


def test_a_split_is_seeded_disjoint_and_scored_by_the_datasets_own_scorer():
    cfg = load_config(None, [EASY])
    split = load_split(cfg.data, seed=0)
    assert (len(split.train), len(split.eval)) == (60, 20)
    assert not {p.prompt for p in split.train} & {p.prompt for p in split.eval}  # never a held-out question
    assert load_split(cfg.data, seed=0) == split
    assert load_split(load_config(None, [EASY, "data.dataset_seed=1"]).data, 0).eval != split.eval
    p = split.eval[0]
    assert p.prompt.endswith("\n\nGive only the final answer.") and p.id.startswith("rg-") and p.answer
    wrong = str(int(p.answer) + 1)
    verdicts = check_many(cfg.data.check, [
        Item(f"{p.answer}", p.answer, p.prompt, p.id), Item(f"The answer is {p.answer}.", p.answer, p.prompt, p.id),
        Item(f"<answer>{p.answer}</answer> or {wrong}", p.answer, p.prompt, p.id + "#2"),
        Item(f"I think {wrong}", p.answer, p.prompt, p.id), Item("", p.answer, p.prompt, p.id)])
    assert [v.correct for v in verdicts] == [True, True, True, False, False]
    assert [v.score for v in verdicts][:3] == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="'add-1-2' is not one of them"):
        check_many(cfg.data.check, [Item("3", "3", "q", "add-1-2")])


def test_bad_datasets_and_settings_are_named_with_what_exists():
    with pytest.raises(ConfigError, match=r"no reasoning-gym dataset 'chain_sums'; did you mean \['chain_sum'"):
        load_config(None, ["data={kind: reasoning_gym, dataset: chain_sums}"])
    with pytest.raises(ConfigError, match=r"data.config has \['max_term'\], which dataset 'chain_sum' does not take; "
                                          r"its settings: \[.*'max_terms'"):
        load_config(None, ["data={kind: reasoning_gym, dataset: chain_sum, config: {max_term: 2}}"])
    with pytest.raises(ConfigError, match="not a valid chain_sum config"):
        load_config(None, ["data={kind: reasoning_gym, dataset: chain_sum, config: {min_terms: 5, max_terms: 2}}"])
    # settings its config class accepts but its generator cannot use: found before any model loads
    with pytest.raises(ConfigError, match="not a valid simple_equations config: ValueError: The number of weights"):
        load_config(None, ["data={kind: reasoning_gym, dataset: simple_equations, config: {operators: ['+']}}"])
    tiny = load_config(None, ["data={kind: reasoning_gym, dataset: chain_sum, config: {min_terms: 2, max_terms: 2, "
                              "max_digits: 1}, eval_size: 150, train_size: 1000}"])
    with pytest.raises(ConfigError, match="distinct problems .* fewer than data.eval_size \\+ data.train_size = 1150"):
        load_split(tiny.data, 0)


@pytest.mark.parametrize("text, reference, how, want", [
    ("So <answer>12</answer>, I think 13", "12", "auto", "12"),
    ("I think 1,234 or rather 17.", "17", "auto", "17"),
    ("The answer is cat.\nThanks", "cat", "auto", "cat"),
    ("Answer: a, b, c", "a, b, c", "auto", "a, b, c"),
    ("first line\nlast line.", "x", "auto", "last line"),
    ("no tag here", "x", "tag", None),
    ("  spaced out  ", "x", "whole", "spaced out"),
    ("", "4", "auto", None),
])
def test_reading_the_answer(text, reference, how, want):
    assert extract_answer(text, reference, how) == want


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=2000), st.lists(st.sampled_from(
    ["<answer>", "</answer>", "answer is", "Answer:", "\n", "1" * 400, "-", ".", " ", "=" * 50]),
    max_size=200).map("".join)))
def test_any_text_gets_a_score_in_bounded_time(text):
    from ratchet.data.checks import scorer
    from ratchet.data.procs.host import KEPT

    cfg = load_config(None, [EASY]).data.check
    [v] = check_many(cfg, [Item(text, "5", "q", "rg-0")])
    assert isinstance(v.correct, bool) and 0.0 <= v.score <= 1.0
    assert sum(s.timeouts for s in KEPT.of(scorer.Scorer)) == 0  # scored, never cut off by the host's bound
