from pathlib import Path

import pytest

from ratchet.data.checkers import NumberCheck
from ratchet.data.errors import ConfigError, EmptyStageError
from ratchet.data.records import Completion, LabeledCompletion
from ratchet.data.store import ArtifactStore
from ratchet.tasks.filter import filter_rows
from ratchet.tasks.filter_kinds.pairs import PairFilter, build_pairs
from ratchet.tasks.filter_kinds.rft import RFTFilter, accept
from ratchet.tasks.label_kinds import agreement, auc, reward_stats
from ratchet.tasks.label_kinds.verifier import verify


def lc(pid, idx, text, reward, n_tokens=None, correct=None):
    return LabeledCompletion(prompt_id=pid, prompt=f"q {pid}", answer="1", index=idx, text=text,
                             n_tokens=n_tokens if n_tokens is not None else len(text.split()), reward=reward,
                             correct=correct)


ROWS = [
    lc("a", 0, "one two three", 1.0),
    lc("a", 1, "One  two three", 1.0),  # duplicate of 0 after normalisation
    lc("a", 2, "x", 1.0),
    lc("a", 3, "wrong", 0.0),
    lc("a", 4, "a b c d e f", 1.0),
    lc("b", 0, "nope", 0.0),
    lc("c", 0, "c1 c2", 1.0),
]


def test_accept_dedups_caps_and_prefers_shortest():
    kept, m = accept(ROWS, RFTFilter(max_per_prompt=2, min_rows=1), seed=0)
    # prompt a: correct & distinct = [idx0 (3 tok), idx2 (1 tok), idx4 (6 tok)] -> shortest two: idx2, idx0
    assert [(r.prompt_id, r.completion) for r in kept] == [("a", "x"), ("a", "one two three"), ("c", "c1 c2")]
    assert m == {"dropped_below_reward": 2.0, "dropped_duplicate": 1.0, "dropped_too_long": 0.0,
                 "dropped_over_cap": 1.0, "accepted": 3.0, "prompts_covered": 2.0, "prompts": 3.0}


def test_accept_length_cap_and_random_is_seeded():
    kept, m = accept(ROWS, RFTFilter(max_per_prompt=4, max_tokens=3, min_rows=1), seed=0)
    assert sorted(r.completion for r in kept) == ["c1 c2", "one two three", "x"]
    assert m["dropped_too_long"] == 1.0
    cfg = RFTFilter(max_per_prompt=1, prefer="random", min_rows=1)
    assert accept(ROWS, cfg, seed=3) == accept(ROWS, cfg, seed=3)


def test_empty_filter_stops_the_round_naming_the_knobs(tmp_path):
    from ratchet.data.records import write_jsonl

    store = ArtifactStore(tmp_path)
    d = store.prepare("label", "l" * 64)
    write_jsonl(d / "labels.jsonl", [lc("a", 0, "wrong", 0.0)])
    labels = store.finish(stage="label", round=2, key="l" * 64, code_version="c", config={}, parents=[],
                          outputs={"labels.jsonl": 1})
    with pytest.raises(EmptyStageError, match=r"round 2: filter accepted 0 rows < filter.min_rows=16.*sample.n"):
        filter_rows(store, labels, RFTFilter(), seed=0, round=2)
    assert not list((tmp_path / "stages").glob("filter-*/manifest.json"))  # nothing marked complete


def _verify(tmp_path, comps, check, shard_size=3):
    """The verifier label's units, in a stage directory of their own."""
    from types import SimpleNamespace

    req = SimpleNamespace(stage="label", key="v" * 64, executor=None, engine=None)
    return verify(req, ArtifactStore(tmp_path), comps, check, shard_size)


def test_verify_and_reward_stats(tmp_path):
    comps = [Completion(prompt_id=p, prompt="q", answer=a, index=i, text=t, n_tokens=1)
             for p, a, i, t in [("a", "3", 0, "1 + 2 = 3"), ("a", "3", 1, "4"), ("b", "5", 0, "5"), ("b", "5", 1, "5")]]
    labeled, metrics = _verify(tmp_path, comps, NumberCheck())
    assert metrics == {}  # a built-in check gives verdicts, no scores of its own
    assert [r.reward for r in labeled] == [1.0, 0.0, 1.0, 1.0]
    assert reward_stats(labeled) == pytest.approx({
        "reward_mean": 0.75, "reward_std": (0.75 * 0.25) ** 0.5, "labeled": 4.0, "unscored": 0.0,
        "correct_frac": 0.75, "pass_at_n": 1.0, "all_correct_frac": 0.5})
    with pytest.raises(ConfigError, match="data.answer_field"):
        _verify(tmp_path / "b", [comps[0].model_copy(update={"answer": None})], NumberCheck())


def test_the_verifier_checks_answers_without_importing_torch(tmp_path):
    """The verifier's label stage runs in the run's own process (its kind runs no model): its units
    import no torch there, which the run's process would otherwise carry from its first label on."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from tests.tasks.test_filter_label import _verify, _comps\n"
        "from ratchet.data.checkers import NumberCheck\n"
        f"labeled, _ = _verify(Path({str(tmp_path)!r}), _comps('a', '3', ['3', '4', 'x 3']), NumberCheck())\n"
        "print(json.dumps({'rewards': [r.reward for r in labeled], 'torch': 'torch' in sys.modules}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"rewards": [1.0, 0.0, 1.0], "torch": False}


def _comps(pid, answer, texts):
    return [Completion(prompt_id=pid, prompt="q", answer=answer, index=i, text=t, n_tokens=1)
            for i, t in enumerate(texts)]


VOTE_ROWS = (_comps("a", "3", ["1 + 2 = 3", "3", "4", "it is 3.0"])  # 3 of 4 say 3: labeled, right
             + _comps("b", "5", ["5", "6"])                            # a tie: no label
             + _comps("c", "7", ["8", "8", "7", "no idea"])            # 8 wins with 2 of 4: labeled, wrong
             + _comps("d", None, ["2", "2"]))                          # no reference needed


def test_majority_vote_hand_worked():
    from ratchet.tasks.label_kinds.consistency import ConsistencyLabel, majority_vote

    rows, m = majority_vote(VOTE_ROWS, NumberCheck(), ConsistencyLabel())
    by = {(r.prompt_id, r.index): r for r in rows}
    assert [by[("a", i)].reward for i in range(4)] == [1.0, 1.0, 0.0, 1.0]
    assert [by[("b", i)].reward for i in range(2)] == [0.0, 0.0]
    assert [by[("c", i)].reward for i in range(4)] == [1.0, 1.0, 0.0, 0.0]
    assert [by[("d", i)].reward for i in range(2)] == [1.0, 1.0]
    assert by[("a", 3)].extracted == "3" and by[("c", 3)].extracted is None
    # agreement: a 3/4, b 1/2, c 2/4, d 2/2 -> mean 0.6875; labeled a, c, d; of a and c (with refs) one right
    assert m == {"labeled_prompts_frac": 0.75, "agreement_mean": 0.6875, "pseudo_label_accuracy": 0.5}


def test_majority_vote_thresholds():
    from ratchet.tasks.label_kinds.consistency import ConsistencyLabel, majority_vote

    rows, m = majority_vote(VOTE_ROWS, NumberCheck(), ConsistencyLabel(min_agreement=0.6))
    assert all(r.reward == 0.0 for r in rows if r.prompt_id == "c")  # 2/4 < 0.6
    assert m["pseudo_label_accuracy"] == 1.0 and m["labeled_prompts_frac"] == 0.5
    rows, _ = majority_vote(VOTE_ROWS, NumberCheck(), ConsistencyLabel(min_votes=3))
    assert {r.prompt_id for r in rows if r.reward == 1.0} == {"a"}


PAIR_ROWS = [
    # a: best 0.9 (idx 0) vs worst 0.1 (idx 2); idx 3 duplicates idx 0; idx 4 was not scored
    lc("a", 0, "four", 0.9, correct=True), lc("a", 1, "maybe five", 0.5, correct=False),
    lc("a", 2, "six", 0.1, correct=False), lc("a", 3, " Four ", 0.95, correct=True),
    lc("a", 4, "unknown", None, correct=False),
    # b: every score equal -> a tie, no pair
    lc("b", 0, "x", 0.4), lc("b", 1, "y", 0.4),
    # c: the gap 0.05 is below the margin
    lc("c", 0, "p", 0.55), lc("c", 1, "q", 0.5),
    # d: the widest pair (idx 0 vs 2) has a 30-token chosen against 10 tokens; idx 1 (12 tokens) passes the guard
    lc("d", 0, "long", 1.0, n_tokens=30, correct=False), lc("d", 1, "mid", 0.8, n_tokens=12, correct=True),
    lc("d", 2, "short", 0.0, n_tokens=10, correct=True),
    # e: one candidate only
    lc("e", 0, "alone", 1.0),
]


def test_pairs_best_vs_worst_with_margin_ties_and_dedup():
    pairs, m = build_pairs(PAIR_ROWS, PairFilter(margin=0.1, min_pairs=1))
    assert [(p.prompt_id, p.chosen, p.rejected, p.chosen_reward, p.rejected_reward) for p in pairs] == [
        ("a", "four", "six", 0.9, 0.1),
        ("d", "long", "short", 1.0, 0.0),
    ]
    assert m["dropped_duplicate"] == 1 and m["dropped_unscored"] == 1
    assert m["dropped_tie_prompts"] == 1 and m["dropped_below_margin_prompts"] == 1 and m["dropped_single_prompts"] == 1
    assert m["reward_gap_mean"] == pytest.approx((0.8 + 1.0) / 2)
    # verifier's view: a is right-over-wrong, d is wrong-over-right
    assert m["pair_accuracy"] == 0.5 and m["pair_inverted"] == 0.5 and m["chosen_correct_frac"] == 0.5


def test_pairs_length_guard_takes_the_best_pair_that_passes():
    pairs, m = build_pairs(PAIR_ROWS, PairFilter(margin=0.1, max_length_ratio=1.5, min_pairs=1))
    d = [p for p in pairs if p.prompt_id == "d"]
    assert [(p.chosen, p.rejected) for p in d] == [("mid", "short")]  # 12 <= 1.5 * 10; 30 > 15 was refused
    only_long = [lc("f", 0, "long", 1.0, n_tokens=40), lc("f", 1, "short", 0.0, n_tokens=10)]
    pairs, m = build_pairs(only_long, PairFilter(max_length_ratio=1.5, min_pairs=1))
    assert pairs == [] and m["dropped_length_bias_prompts"] == 1


def test_pairs_per_prompt_use_each_completion_once():
    rows = [lc("a", i, t, r) for i, (t, r) in enumerate([("w", 1.0), ("x", 0.8), ("y", 0.3), ("z", 0.0)])]
    pairs, _ = build_pairs(rows, PairFilter(margin=0.2, max_pairs_per_prompt=2, min_pairs=1))
    # by gap: w>z 1.0, x>z 0.8, w>y 0.7, x>y 0.5; after w>z, the next two reuse w or z, so x>y
    assert [(p.chosen, p.rejected) for p in pairs] == [("w", "z"), ("x", "y")]


def test_too_few_pairs_stop_the_round_naming_the_knobs(tmp_path):
    from ratchet.data.records import write_jsonl

    store = ArtifactStore(tmp_path)
    d = store.prepare("label", "k" * 64)
    write_jsonl(d / "labels.jsonl", [lc("b", 0, "x", 0.4), lc("b", 1, "y", 0.4)])
    labels = store.finish(stage="label", round=1, key="k" * 64, code_version="c", config={}, parents=[],
                          outputs={"labels.jsonl": 2})
    with pytest.raises(EmptyStageError, match=r"0 preference pairs < filter.min_pairs=16.*1 had all-equal rewards"
                                              r".*filter.margin"):
        filter_rows(store, labels, PairFilter(), seed=0, round=1)


def test_auc_and_agreement_by_hand():
    assert auc([0.9, 0.1, 0.5], [True, False, False]) == 1.0
    assert auc([0.5, 0.5], [True, False]) == 0.5  # a tie counts half
    assert auc([0.2, 0.8, 0.6], [True, False, True]) == pytest.approx(0.0)  # both right answers rank below
    assert auc([1.0], [True]) is None
    rows = [lc("a", 0, "r", 0.9, correct=True), lc("a", 1, "w", 0.2, correct=False),
            lc("b", 0, "r", 0.1, correct=True), lc("b", 1, "w", 0.3, correct=False),
            lc("c", 0, "r", 0.5, correct=True), lc("c", 1, "n", None, correct=False)]
    m = agreement(rows)
    # pooled: right {0.9, 0.1, 0.5} vs wrong {0.2, 0.3}: 0.9 beats 2, 0.1 beats 0, 0.5 beats 2 -> 4/6
    assert m["verifier_auc"] == pytest.approx(4 / 6)
    # within prompts: a -> 1, b -> 0, c has no scored wrong answer -> left out
    assert m["verifier_within_prompt_auc"] == 0.5 and m["verifier_auc_prompts"] == 2
