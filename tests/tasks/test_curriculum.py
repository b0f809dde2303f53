"""The curriculum (tasks/curriculum.py): each round's prompts chosen from earlier rounds' labels,
the level raised when its held-out accuracy reaches the threshold, the run ended at the top level
or when a level stops rising; and what it refuses."""

import re
from pathlib import Path

import pytest

from ratchet.data.errors import ConfigError
from ratchet.data.records import Prompt
from ratchet.flows.config import config_from_dict
from ratchet.tasks.curriculum import CurriculumConfig, choose, decide

LEVELS = [1, 2, 3]
DEFAULT = Path(__file__).parents[2] / "flows" / "configs" / "default.yaml"


def test_the_level_rises_at_the_threshold_and_the_run_ends_at_the_top_or_when_it_stops_rising():
    cfg = CurriculumConfig(advance_at=0.8, patience=2)
    up = decide(cfg, LEVELS, {"level": 1, "best": 0.5, "stale": 1}, 0.8)
    assert (up["level"], up["advanced"], up["done"], up["best"], up["stale"]) == (2, 1, 0, None, 0)
    assert decide(cfg, LEVELS, {"level": 3, "best": 0.5, "stale": 0}, 0.9)["done"] == 1  # the top level mastered
    rise = decide(cfg, LEVELS, {"level": 2, "best": 0.3, "stale": 1}, 0.4)
    assert (rise["level"], rise["best"], rise["stale"], rise["done"]) == (2, 0.4, 0, 0)
    flat = decide(cfg, LEVELS, {"level": 2, "best": 0.4, "stale": 0}, 0.4)  # not above its best
    assert (flat["stale"], flat["done"]) == (1, 0)
    assert decide(cfg, LEVELS, {**flat, "level": 2}, 0.35)["done"] == 2  # patience spent
    assert decide(cfg, LEVELS, {"level": 2, "best": None, "stale": 0}, None) == {  # not evaluated: nothing moves
        "from_level": 2, "level": 2, "advanced": 0, "done": 0, "accuracy": None, "best": None, "stale": 0}


def test_a_round_draws_the_band_first_then_unseen_prompts_of_its_level_then_those_not_passed_yet():
    pool = [Prompt(id=f"l{n}-{i}", prompt=f"q{n}-{i}", level=n) for n in LEVELS for i in range(6)]
    seen = {"l1-0": [1, 4], "l1-1": [4, 4], "l1-2": [0, 4], "l2-0": [2, 4], "l2-1": [0, 4], "l3-0": [1, 4]}
    rows, counts = choose(pool, seen, 2, LEVELS, 6, seed=0)
    assert counts == {"review": 0, "band": 2, "unseen": 4, "retried": 0}
    assert {p.id for p in rows[:2]} == {"l1-0", "l2-0"}  # passed sometimes, at a level reached (not level 3)
    assert all(p.level == 2 and p.id not in seen for p in rows[2:])
    more, counts = choose(pool, seen, 2, LEVELS, 8, seed=0)
    assert counts == {"review": 0, "band": 2, "unseen": 4, "retried": 1} and len(more) == 7 and more[-1].id == "l2-1"
    assert choose(pool, seen, 2, LEVELS, 6, seed=0) == (rows, {"review": 0, "band": 2, "unseen": 4, "retried": 0})
    assert choose(pool, seen, 2, LEVELS, 6, seed=1)[0] != rows


def test_review_draws_its_share_first_from_the_levels_below_outside_the_band():
    """Level 1's prompts whose samples all passed, or that no round sampled, come back at level 3; its
    band prompt comes as band, its never-passed one not at all, and level 3's own never as review."""
    pool = [Prompt(id=f"l{n}-{i}", prompt=f"q{n}-{i}", level=n) for n in LEVELS for i in range(4)]
    seen = {"l1-0": [4, 4], "l1-1": [2, 4], "l1-2": [0, 4], "l2-0": [4, 4], "l2-1": [3, 4], "l3-0": [4, 4]}
    rows, counts = choose(pool, seen, 3, LEVELS, 8, seed=0, review=0.5)
    assert counts == {"review": 4, "band": 2, "unseen": 2, "retried": 0}
    assert {p.id for p in rows[:4]} <= {"l1-0", "l1-3", "l2-0", "l2-2", "l2-3"}  # all passed, or unseen, below 3
    assert {p.id for p in rows[4:6]} == {"l1-1", "l2-1"} and all(p.id in {"l3-1", "l3-2", "l3-3"} for p in rows[6:])
    few, counts = choose(pool, {}, 2, LEVELS, 8, seed=0, review=0.9)  # the levels below have fewer than the share
    assert counts == {"review": 4, "band": 0, "unseen": 4, "retried": 0} and len(few) == 8
    assert choose(pool, seen, 1, LEVELS, 8, seed=0, review=0.5)[1]["review"] == 0  # nothing below level 1


def test_review_gives_each_level_below_an_even_share_whatever_its_size():
    """Level 1 holds 3 prompts and level 2 forty: drawn by prompt, level 1 would come back about once
    in 6 draws of 8; by level it takes half the share, and leaves what it lacks to level 2."""
    pool = [Prompt(id=f"l{n}-{i}", prompt=f"q{n}-{i}", level=n) for n, size in ((1, 3), (2, 40), (3, 8))
            for i in range(size)]
    for seed in range(6):
        rows, counts = choose(pool, {}, 3, LEVELS, 8, seed=seed, review=0.5)
        assert counts["review"] == 4 and sorted(p.level for p in rows[:4]) == [1, 1, 2, 2]
    rows, _ = choose(pool, {}, 3, LEVELS, 16, seed=0, review=0.5)
    assert sorted(p.level for p in rows[:8]) == [1, 1, 1, 2, 2, 2, 2, 2]  # level 1 has 3: level 2 takes the rest


@pytest.mark.parametrize("settings, says", [
    ({"data": {"kind": "addition"}}, "has no levels; set data.levels"),
    ({"curriculum": {"start": 5}}, "curriculum.start=5 is not one of data.levels [1, 2, 3]"),
    ({"data": {"prompts_per_round": 8}}, "data.prompts_per_round=8 and curriculum both choose"),
    ({"sample": {"n": 1}}, "sample.n=1 cannot form a band"),
    ({"curriculum": {"advance_at": 1.5}}, "curriculum.advance_at"),
    ({"curriculum": {"advance_at": 0}}, "curriculum.advance_at"),
    ({"curriculum": {"review": 1}}, "curriculum.review"),
])
def test_a_curriculum_that_cannot_work_is_refused_with_the_fix(settings, says):
    base = {"data": {"kind": "addition", "levels": LEVELS, "eval_size": 4, "train_size": 8}, "curriculum": {}}
    cfg = {**base, **{k: ({**base.get(k, {}), **v} if k in ("data", "curriculum") else v) for k, v in settings.items()}}
    if settings.get("data", {}).get("kind") == "addition" and "levels" not in settings["data"]:
        cfg["data"] = {"kind": "addition"}
    with pytest.raises(ConfigError, match=re.escape(says)):
        config_from_dict(cfg)


def test_a_vote_across_models_climbs_on_one_greedy_answer_a_model_and_greedy_asks_one():
    """Lee et al.'s loop: each model answers each prompt once, greedily, and the answers vote; a
    curriculum takes it (each model's answer is its vote, no band of samples needed). More than one
    greedy answer a prompt is one answer repeated, which the local engines refuse: refused here."""
    base = {"data": {"kind": "addition", "levels": LEVELS, "labeled_levels": [1], "eval_size": 4, "train_size": 8},
            "curriculum": {"advance_by": "rounds"}, "filter": {"kind": "length"}}
    greedy = config_from_dict({**base, "sample": {"n": 1, "temperature": 0}, "label": {"kind": "vote", "models": 3}})
    assert greedy.sample.n == 1 and greedy.label.voters() == 2
    with pytest.raises(ConfigError, match=re.escape("sample.temperature=0 samples greedily, and sample.n=2 greedy "
                                                    "answers to a prompt are one answer 2 times")):
        config_from_dict({**base, "sample": {"n": 2, "temperature": 0}, "label": {"kind": "vote", "models": 3}})


def test_check_says_the_levels_and_what_the_curriculum_will_do(capsys):
    from ratchet.flows.cli import main

    data = "data={kind: addition, levels: [1, 2, 3], eval_size: 25, train_size: 40}"
    assert main(["check", str(DEFAULT), data, "curriculum={advance_at: 0.9, patience: 2}"]) == 0
    out = capsys.readouterr().out
    assert ("curriculum: levels [1, 2, 3] (train prompts 1: 40, 2: 40, 3: 40); starts at level 1 and moves to the "
            "next once the current level's held-out accuracy reaches 90%") in out
    assert "after 2 round(s) without a rise" in out
    assert main(["check", str(DEFAULT), data[:-1] + ", prompts_per_round: 16}"]) == 0
    assert "levels: [1, 2, 3], every one evaluated each round; no curriculum" in capsys.readouterr().out


@pytest.mark.integration
def test_a_curriculum_climbs_the_levels_and_ends_the_run_at_the_top(tiny_model, tmp_path, prefect_harness):
    """Three levels on the tiny model, scored by a function that passes every answer, after a cold
    start: round 0 and the cold start (round 1) evaluate levels 1 and 2, each round after them trains
    one level higher than the round before reached and evaluates up to the next, and round 4's
    curriculum ends the run at the top level; the plan then reuses it all.

    Guards `curriculum`. Slow: a cold start and three rounds on the tiny model."""
    import json

    from ratchet.data import events
    from ratchet.data.manifest import read_manifest
    from ratchet.flows.pipeline import execute
    from ratchet.flows.plan import plan

    (tmp_path / "always.py").write_text("def score(completion, answer=None, **fields):\n    return 1.0\n")
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "completion": str(a + 1),
                                         "answer": str(a + 1)}) + "\n" for a in range(4)))
    cfg = config_from_dict({
        "name": "climb", "workdir": str(tmp_path / "runs"), "rounds": 3, "isolate": False,
        "model": {"path": str(tiny_model)}, "sampler": {"backend": "hf", "dtype": "float32"},
        "data": {"kind": "addition", "levels": LEVELS, "eval_size": 2, "train_size": 4,
                 "check": {"kind": "python", "function": f"{tmp_path / 'always.py'}:score"}},
        "sample": {"n": 2, "max_tokens": 4}, "evaluate": {"max_tokens": 4}, "train": {"epochs": 1, "batch_size": 4},
        "filter": {"min_rows": 1}, "agreement": {"min": None}, "curriculum": {"prompts": 3, "advance_at": 0.5},
        "cold_start": {"demonstrations": str(demos), "train": {"epochs": 1, "batch_size": 4}}})
    seen = []
    stop = events.subscribe(lambda e: seen.append(e) if e.kind in ("round", "note") else None)
    try:
        _, results, _ = execute(cfg)
    finally:
        stop()
    assert [r.round for r in results] == [0, 1, 2, 3] and "demonstrations" in results[1].stage_wall_s
    assert [sorted(m.stage for m in r.evaluations.values()) for r in results] == [
        ["evaluate", "evaluate.level_1", "evaluate.level_2"],
        ["evaluate", "evaluate.level_1", "evaluate.level_2"],
        ["evaluate", "evaluate.level_1", "evaluate.level_2", "evaluate.level_3"],
        ["evaluate", "evaluate.level_1", "evaluate.level_2", "evaluate.level_3"]]
    taught = sorted((m.round, m.metrics["level"], m.metrics["done"], m.metrics["prompts"])
                    for d in (tmp_path / "runs" / "stages").glob("curriculum-*") if (m := read_manifest(d)))
    assert taught == [(2, 2.0, 0.0, 3.0), (3, 3.0, 0.0, 3.0), (4, 3.0, 1.0, 0.0)]
    assert [e.data.get("level") for e in seen if e.kind == "round"] == [None, None, 2, 3]
    assert [e.data["text"] for e in seen if e.kind == "note" and e.stage == "curriculum"] == [
        "the run ends at level 3: the top level's held-out accuracy 100.0% reached curriculum.advance_at; "
        "round 4 is not run"]
    steps = plan(cfg).steps
    assert {s.state for s in steps} == {"reused"} and [s.round for s in steps if s.stage == "curriculum"] == [2, 3, 4]
