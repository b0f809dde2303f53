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


def test_levels_are_the_dataset_s_own_settings_each_scored_with_its_level_s():
    """Each level draws its problems with its settings laid over data.config, holds out its own,
    and a problem is scored against its own level's dataset (index 0 is another problem there)."""
    levels = "data.levels={1: {min_digits: 1, max_digits: 1}, 3: {min_digits: 3, max_digits: 3}}"
    cfg = load_config(None, [EASY, levels, "data.eval_size=4", "data.train_size=6"])
    split = load_split(cfg.data, seed=0)
    assert [sum(p.level == n for p in split.eval) for n in (1, 3)] == [4, 4] and len(split.train) == 12
    one, three = (next(p for p in split.eval if p.level == n) for n in (1, 3))
    assert (one.id, three.id) == ("rg-0@1", "rg-0@3") and len(three.answer) > len(one.answer)
    assert cfg.data.at_level(3).load(0, True).eval == [p for p in split.eval if p.level == 3]
    verdicts = check_many(cfg.data.check, [Item(p.answer, p.answer, p.prompt, p.id) for p in (one, three)] +
                          [Item(one.answer, three.answer, three.prompt, three.id)])
    assert [v.correct for v in verdicts] == [True, True, False]
    assert [s.name for s, _ in cfg.eval_stages()] == ["heldout", "level_1", "level_3"]
    # a level without labels: its train prompts come without answers, its held-out set keeps them
    grown = load_config(None, [EASY, levels, "data.eval_size=4", "data.train_size=6", "data.labeled_levels=[1]",
                                      "data.check.read=last_number", "label={kind: consistency}"])
    split = load_split(grown.data, seed=0)
    assert [p.answer is None for p in split.train if p.level == 3] == [True] * 6
    assert all(p.answer for p in split.train if p.level == 1) and all(p.answer for p in split.eval)
    assert [s.name for s, _ in grown.eval_stages()] == ["heldout", "level_1", "level_3"]
    with pytest.raises(ConfigError, match=r"data.levels\[2\]: data.config has \['max_digitz'\]"):
        load_config(None, [EASY, "data.levels={2: {max_digitz: 2}}"])


def test_a_vote_reads_reasoning_gym_answers_by_a_rule_that_needs_no_reference():
    """A vote labels prompts whose references it must not see, so `read: auto` (which asks the
    reference whether to read a number) is refused for it with the fix; `read: last_number` keys
    answers as the number check does, the reference in the same form."""
    with pytest.raises(ConfigError, match=r"reads none; give data.check.read a rule .* last_number"):
        load_config(None, [EASY, "label={kind: consistency}"])
    cfg = load_config(None, [EASY, "data.check.read=last_number", "label={kind: vote, models: 2, of: seeds}"])
    check = cfg.data.check
    assert [check.extract(t) for t in ("-5", "It is -05.", "so 3 - 4 = -1", "<answer>7</answer>", "none")] == \
        ["-5", "-5", "-1", "7", None]
    assert check.answer_key("-5") == check.extract("the answer is -5.0") == "-5"
    assert load_config(None, [EASY]).data.check.extract("-5") is None  # auto: the scorer's, no vote


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


def test_demonstrations_of_a_reasoning_gym_task_are_scored_by_their_own_entries(tmp_path):
    """A cold start on a reasoning-gym task: each demonstration carries the entry its problem came from
    (`entry`), and the dataset's own scorer reads it as it reads one of its own problems. The problems
    here come from another seed than the run's, so no row is one of the run's prompts."""
    import json

    import reasoning_gym

    from ratchet.flows.inputs import check_data

    ds = reasoning_gym.create_dataset("chain_sum", size=4, seed=99, min_terms=2, max_terms=2, max_digits=1)
    rows = [{"id": f"mine-{i}", "prompt": e["question"], "completion": f"The answer is {e['answer']}.",
             "answer": str(e["answer"]), "entry": json.loads(json.dumps(e))} for i, e in enumerate(ds)]
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [EASY, f"cold_start.demonstrations={demos}"])
    split, _ = check_data(cfg)  # every row accepted by the dataset's scorer
    assert len(split.train) == 60
    wrong = dict(rows[1], completion=f"It is {int(rows[1]['answer']) + 1}.")
    bare = {k: v for k, v in rows[2].items() if k != "entry"}
    broken = dict(rows[3], entry="the answer is whatever I say")
    demos.write_text("".join(json.dumps(r) + "\n" for r in (rows[0], wrong, bare)))
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert "row 'mine-2' is not one of them. A row of your own (a demonstration)" in str(e.value), str(e.value)
    demos.write_text("".join(json.dumps(r) + "\n" for r in (rows[0], wrong)))
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert "rows whose answer the check does not accept" in str(e.value) and "line 2" in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="its `entry` column is not a reasoning-gym entry"):
        check_many(cfg.data.check, [Item("3", "3", "q", "mine-3", {"entry": broken["entry"]})])
