import pytest

from data.checkers import NumberCheck
from data.errors import ConfigError, EmptyStageError
from data.records import Completion, LabeledCompletion
from data.store import ArtifactStore
from tasks.filter import RFTFilter, accept, filter_rows
from tasks.label import reward_stats, verify


def lc(pid, idx, text, reward, n_tokens=None):
    return LabeledCompletion(prompt_id=pid, prompt=f"q {pid}", answer="1", index=idx, text=text,
                             n_tokens=n_tokens if n_tokens is not None else len(text.split()), reward=reward)


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
    from data.records import write_jsonl

    store = ArtifactStore(tmp_path)
    d = store.prepare("label", "l" * 64)
    write_jsonl(d / "labels.jsonl", [lc("a", 0, "wrong", 0.0)])
    labels = store.finish(stage="label", round=2, key="l" * 64, code_version="c", config={}, parents=[],
                          outputs={"labels.jsonl": 1})
    with pytest.raises(EmptyStageError, match=r"round 2: filter accepted 0 rows < filter.min_rows=16.*sample.n"):
        filter_rows(store, labels, RFTFilter(), seed=0, round=2)
    assert not list((tmp_path / "stages").glob("filter-*/manifest.json"))  # nothing marked complete


def test_verify_and_reward_stats():
    comps = [Completion(prompt_id=p, prompt="q", answer=a, index=i, text=t, n_tokens=1)
             for p, a, i, t in [("a", "3", 0, "1 + 2 = 3"), ("a", "3", 1, "4"), ("b", "5", 0, "5"), ("b", "5", 1, "5")]]
    labeled = verify(comps, NumberCheck())
    assert [r.reward for r in labeled] == [1.0, 0.0, 1.0, 1.0]
    assert reward_stats(labeled) == {"reward_mean": 0.75, "pass_at_n": 1.0, "all_correct_frac": 0.5, "labeled": 4.0}
    with pytest.raises(ConfigError, match="data.answer_field"):
        verify([comps[0].model_copy(update={"answer": None})], NumberCheck())


def _comps(pid, answer, texts):
    return [Completion(prompt_id=pid, prompt="q", answer=answer, index=i, text=t, n_tokens=1)
            for i, t in enumerate(texts)]


VOTE_ROWS = (_comps("a", "3", ["1 + 2 = 3", "3", "4", "it is 3.0"])  # 3 of 4 say 3: labeled, right
             + _comps("b", "5", ["5", "6"])                            # a tie: no label
             + _comps("c", "7", ["8", "8", "7", "no idea"])            # 8 wins with 2 of 4: labeled, wrong
             + _comps("d", None, ["2", "2"]))                          # no reference needed


def test_majority_vote_hand_worked():
    from tasks.label import ConsistencyLabel, majority_vote

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
    from tasks.label import ConsistencyLabel, majority_vote

    rows, m = majority_vote(VOTE_ROWS, NumberCheck(), ConsistencyLabel(min_agreement=0.6))
    assert all(r.reward == 0.0 for r in rows if r.prompt_id == "c")  # 2/4 < 0.6
    assert m["pseudo_label_accuracy"] == 1.0 and m["labeled_prompts_frac"] == 0.5
    rows, _ = majority_vote(VOTE_ROWS, NumberCheck(), ConsistencyLabel(min_votes=3))
    assert {r.prompt_id for r in rows if r.reward == 1.0} == {"a"}
