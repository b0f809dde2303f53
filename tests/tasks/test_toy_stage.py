"""A stage is one declared object: a new one (tests/tasks/toy_stage.py, a module of its own, and one
registration line, here) runs in every round, in `ratchet plan`, in the lineage, gc and the report,
without a line of flows/ naming it."""

from pathlib import Path

import pytest

from tests.tasks.toy_stage import DEDUPE

ROOT = Path(__file__).parents[2]


@pytest.fixture
def registered(monkeypatch):
    """The registration line: the toy stage appended to tasks/registry.py's STAGES."""
    from ratchet.tasks import registry

    monkeypatch.setattr(registry, "STAGES", (*registry.STAGES, DEDUPE))
    return DEDUPE


def test_no_file_of_the_flows_names_the_toy_stage():
    """What the other tests show it does, it does with flows/ as it is."""
    named = [p.relative_to(ROOT) for p in sorted((ROOT / "flows").rglob("*.py"))
             if "dedupe" in p.read_text() or "toy_stage" in p.read_text()]
    assert named == []


def test_a_stage_placed_after_another_is_in_every_round_s_shape(registered):
    from ratchet.flows.config import load_config
    from ratchet.flows.shape import round_stage_names

    cfg = load_config(ROOT / "flows" / "configs" / "default.yaml", [])
    assert round_stage_names(cfg) == ["sample", "label", "filter", "dedupe", "train", "evaluate"]
    grpo = load_config(ROOT / "flows" / "configs" / "grpo.yaml", [])
    assert round_stage_names(grpo) == ["train", "evaluate"]  # no filter, so nothing after it


@pytest.mark.integration
def test_a_toy_stage_runs_in_a_round_and_is_planned_traced_kept_and_reported(registered, tiny_model, tmp_path,
                                                                              prefect_harness):
    """One round on the tiny model: the toy stage runs between the filter and training, the train
    stage trains on what it wrote, `ratchet plan` shows it to run and then reused, the lineage walks
    through it, gc leaves it, and the report's wall times show it."""
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.config import load_config
    from ratchet.flows.gc import collect_garbage
    from ratchet.flows.lineage import walk
    from ratchet.flows.pipeline import execute
    from ratchet.flows.plan import plan
    from ratchet.flows.report import build
    from tests.flows.tiny import CONFIG, overrides

    cfg = load_config(CONFIG, overrides(tmp_path, tiny_model) + ["isolate=false"])
    before = {(s.stage, s.round): s.state for s in plan(cfg).steps}
    assert before[("dedupe", 1)] == "waits"  # on the filter before it, which will run too
    ctx, (_, r1), tracker = execute(cfg)

    store = ArtifactStore(tmp_path)
    chain = walk(store, r1.policy)
    names = [x.stage for x in chain]
    assert names[:3] == ["train", "dedupe", "filter"] and all(x.verified for x in chain)
    dedupe = next(x for x in chain if x.stage == "dedupe")
    assert dedupe.role == "data" and dedupe.metrics["rows"] + dedupe.metrics["dropped"] >= 1
    assert r1.stage_wall_s["dedupe"] >= 0
    after = {(s.stage, s.round): s.state for s in plan(cfg).steps}
    assert after[("dedupe", 1)] == "reused" and set(after.values()) == {"reused"}
    assert not [x for x in collect_garbage(tmp_path, dry_run=True) if x.remove]  # all finished: nothing to collect
    child = tracker.client.get_run(r1.child_run_id).data
    assert "dedupe.rows" in child.metrics  # its metrics on the round's MLflow run
    report = build(tmp_path, tracker, ctx.run_name, log=False, state="finished")
    assert "dedupe" in next(r for r in report.rounds if r.round == 1).wall_s()
