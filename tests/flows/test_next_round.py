"""Which model the next round trains: the last round's, or (`evaluate.next_round_from: best`)
the best this run has evaluated, so a round that made the model worse is set aside."""

import pytest

from ratchet.data.manifest import StageManifest
from ratchet.flows.shape import trains_from
from ratchet.flows.stages import RoundResult
from ratchet.tasks.evaluate import EvaluateConfig


def _round(k: int, acc: float) -> RoundResult:
    policy = StageManifest(stage="train" if k else "base", round=k, key=f"key-{k}", dir=f"stages/s-{k:016x}", code_version="c")
    return RoundResult(round=k, policy=policy, version=str(k + 1), accuracy=acc, promoted=False, child_run_id=f"run-{k}")


def test_best_builds_only_on_rounds_that_beat_the_model_they_trained_from():
    r = [_round(0, 0.10), _round(1, 0.13), _round(2, 0.08), _round(3, 0.13), _round(4, 0.20)]
    best, last = EvaluateConfig(next_round_from="best"), EvaluateConfig()
    assert last.next_round_from == "last"  # the default: each round builds on the one before
    assert [trains_from(r[:n], last).round for n in range(1, 6)] == [0, 1, 2, 3, 4]
    # round 2 fell to 8%: round 3 trains from round 1 again; round 3 only tied it, so round 4 does too
    assert [trains_from(r[:n], best).round for n in range(1, 6)] == [0, 1, 1, 1, 4]
    # a round must clear the gate's margin as well: +3 points is not more than 5
    margin = EvaluateConfig(next_round_from="best", min_improvement=0.05)
    assert [trains_from(r[:n], margin).round for n in range(1, 6)] == [0, 0, 0, 0, 4]


def test_best_follows_the_gate_set_and_refuses_a_drop_on_another():
    """With several held-out sets, `best` reads the gate's set and, like the champion gate,
    passes over a round that fell more than max_drop on any other set."""
    def at(k, task, reg):
        return _round(k, task).model_copy(update={"accuracies": {"task": task, "reg": reg}, "gate_set": "task"})

    r = [at(0, 0.10, 0.80), at(1, 0.20, 0.60), at(2, 0.30, 0.78)]
    sets = [{"name": "task"}, {"name": "reg", "data": {"kind": "addition"}}]
    free = EvaluateConfig(next_round_from="best", sets=sets)
    guarded = EvaluateConfig(next_round_from="best", sets=sets, max_drop=0.05)
    assert [trains_from(r[:n], free).round for n in range(1, 4)] == [0, 1, 2]
    assert [trains_from(r[:n], guarded).round for n in range(1, 4)] == [0, 0, 2]  # round 1 lost 20 points on reg
    on_reg = EvaluateConfig(next_round_from="best", sets=sets, gate="reg")
    assert [trains_from(r[:n], on_reg).round for n in range(1, 4)] == [0, 0, 0]


def test_a_round_below_the_floor_is_never_trained_on_under_either_rule():
    """`evaluate.floor`: a round under it on the gate's set is passed over (the climb past its labels
    that lost its 8-digit guard at round 3 trains round 4 from round 2); the run's start is kept
    whatever it scored, and the console says which rule set the round aside."""
    from ratchet.flows.config import RunEvaluateConfig
    from ratchet.flows.shape import set_aside_reason

    r = [_round(0, 0.96), _round(1, 0.92), _round(2, 0.84), _round(3, 0.88), _round(4, 0.94)]
    last = RunEvaluateConfig(floor=0.9)
    assert [trains_from(r[:n], last).round for n in range(1, 6)] == [0, 1, 1, 1, 4]
    assert [trains_from(r[:n], RunEvaluateConfig()).round for n in range(1, 6)] == [0, 1, 2, 3, 4]  # no floor
    # under best, the floor passes over round 4's 94% too when it is not above round 0's 96%
    best = RunEvaluateConfig(floor=0.9, next_round_from="best")
    assert [trains_from(r[:n], best).round for n in range(1, 6)] == [0, 0, 0, 0, 0]
    assert trains_from([_round(0, 0.5), _round(1, 0.6)], last).round == 0  # a start below it is still the start
    assert trains_from([_round(0, 0.5), _round(1, 0.9)], last).round == 1  # at the floor holds it
    # on the gate's set, not another
    sets = [{"name": "heldout"}, {"name": "guard", "data": {"kind": "addition"}}]
    on_guard = RunEvaluateConfig(floor=0.9, sets=sets, gate="guard")
    low = _round(1, 0.2).model_copy(update={"accuracies": {"heldout": 0.2, "guard": 0.92}, "gate_set": "guard"})
    fell = _round(2, 0.5).model_copy(update={"accuracies": {"heldout": 0.5, "guard": 0.84}, "gate_set": "guard"})
    assert trains_from([_round(0, 0.1), low, fell], on_guard).round == 1
    assert set_aside_reason(fell, on_guard) == "round 2's version 3 fell below evaluate.floor=0.9 on guard (84.0%)"
    assert set_aside_reason(r[2], best.model_copy(update={"floor": None})) == \
        "round 2's version 3 did not beat it (evaluate.next_round_from=best)"


def test_a_floor_is_a_share_and_reaches_no_evaluation_s_key():
    """The floor is refused outside (0, 1] with its field named; neither its value nor its class
    reaches an evaluate stage's key, so setting it re-runs no evaluation."""
    from pydantic import ValidationError

    from ratchet.flows.config import RunEvaluateConfig
    from ratchet.models.sampler import SamplerConfig
    from ratchet.data.prompts import AdditionSource
    from ratchet.tasks import evaluate
    from ratchet.tasks.runner.code_reach import reach, roots_of

    for bad in (0, 1.5):
        with pytest.raises(ValidationError, match="floor"):
            RunEvaluateConfig(floor=bad)
    cfg = RunEvaluateConfig(floor=0.9)
    run_cfg = evaluate.EvalRun.model_validate(cfg.model_dump(include=set(evaluate.EvalRun.model_fields)))
    assert run_cfg == evaluate.EvalRun.model_validate(RunEvaluateConfig().model_dump(
        include=set(evaluate.EvalRun.model_fields)))  # what the job holds, floor or none
    job = evaluate.EvaluateJob(evaluate=run_cfg, sampler=SamplerConfig(), data=AdditionSource(), seed=0)
    reached = {m for m, _ in reach(roots_of(evaluate.evaluate_body, job))}
    assert "ratchet.tasks.evaluate" in reached and not any(m.startswith("ratchet.flows") for m in reached)


def test_held_out_sets_are_named_once_and_the_gate_names_one():
    from pydantic import ValidationError

    cfg = EvaluateConfig(sets=[{"name": "task"}, {"name": "reg", "data": {"kind": "chain"}}])
    assert cfg.gate_set == "task" and [s for _, s in cfg.stages()] == ["evaluate", "evaluate.reg"]
    with pytest.raises(ValidationError, match=r"names \['a'\] more than once"):
        EvaluateConfig(sets=[{"name": "a"}, {"name": "a"}])
    with pytest.raises(ValidationError, match=r"evaluate.gate='nope' is not a set; name one of \['a'\]"):
        EvaluateConfig(sets=[{"name": "a"}], gate="nope")
    with pytest.raises(ValidationError, match="name"):
        EvaluateConfig(sets=[{"name": "Has Space"}])


def test_an_unknown_rule_names_the_field_and_the_choices():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"next_round_from[\s\S]*'last' or 'best'"):
        EvaluateConfig(next_round_from="champion")


@pytest.mark.integration
def test_a_round_that_does_not_beat_its_start_is_set_aside(tiny_model, tmp_path, prefect_harness):
    """Two rounds on the tiny random model, whose held-out accuracy never moves from 0: under
    `best`, round 2 trains from the base model again, samples from it, says so on the
    console, and the registry and lineage show version 1 as its parent.

    Guards `next_round=best`. Slow: a 2-round run on the tiny model."""
    from ratchet.data import events
    from ratchet.data.manifest import read_manifest
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.config import load_config
    from ratchet.flows.lineage import walk
    from ratchet.flows.pipeline import execute
    from ratchet.flows.stages import start_manifest
    from tests.flows.tiny import CONFIG, overrides

    cfg = load_config(CONFIG, overrides(tmp_path, tiny_model) + ["isolate=false", "rounds=2",
                                                                 "evaluate.next_round_from=best"])
    notes = []
    stop = events.subscribe(lambda e: notes.append(e) if e.kind == "note" and e.stage == "policy" else None)
    try:
        _, (r0, r1, r2), tracker = execute(cfg)
    finally:
        stop()
    assert (r0.accuracy, r1.accuracy) == (0.0, 0.0) and r0.policy.stage == "base"
    assert [p.key for p in r2.policy.parents if p.stage in ("base", "train")] == [r0.policy.key]
    assert [p.key for p in r1.policy.parents if p.stage in ("base", "train")] == [r0.policy.key]
    samples = [m for d in (tmp_path / "stages").glob("sample-*") if (m := read_manifest(d)).round == 2]
    assert len(samples) == 1 and r0.policy.key in [p.key for p in samples[0].parents]
    assert [(e.round, e.data["text"]) for e in notes] == [
        (2, f"version {r0.version} again (round 0, 0.0% held-out): round 1's version {r1.version} did not beat "
            "it (evaluate.next_round_from=best)")]
    assert tracker.version(r2.version).tags["ratchet.parent_version"] == r0.version
    store = ArtifactStore(tmp_path)
    chain = [x for x in walk(store, start_manifest(store, tracker, r2.version)) if x.stage in ("train", "base")]
    assert [x.dir for x in chain] == [r2.policy.dir, r0.policy.dir] and all(x.verified for x in chain)
