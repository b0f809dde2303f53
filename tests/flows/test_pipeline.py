"""One real round end to end: the default model, vLLM, TRL, worker processes, Prefect, MLflow."""

from pathlib import Path

import pytest

from ratchet.flows.config import load_config

pytestmark = pytest.mark.integration
CONFIGS = Path(__file__).parents[2] / "flows" / "configs"
SMALL = ["rounds=1", "data.train_size=8", "data.eval_size=8", "sample.n=4", "sample.max_tokens=32",
         "evaluate.max_tokens=32", "filter.min_rows=2", "train.epochs=1", "train.batch_size=4",
         "train.checkpoint_steps=1", "sampler.kv_cache_gb=1"]
STAGES = ["base", "evaluate", "evaluate", "filter", "label", "prompts", "sample", "train"]


def _run(cfg):
    """A run as `ratchet run` makes it: its stages' workers forked from a fork server, sampling on
    one warm engine (this module's: `services` below)."""
    from ratchet.flows.pipeline import execute

    ctx, results, tracker = execute(cfg)
    return ctx, tracker, results


@pytest.fixture(scope="module", autouse=True)
def services(tmp_path_factory, default_model):
    """One fork server and one warm vLLM engine for this module's runs in this process, as a run
    holds them for all its stages (a run keeps services that are running already): the server's
    imports and the engine's start are paid once, not once per run. A later run's engine is lent
    or has its weights swapped in place, which tests/models/test_warm.py compares byte for byte
    with fresh engines."""
    from ratchet.data.procs import forkserver
    from ratchet.flows.inputs import run_preload
    from ratchet.models import warm

    logs = tmp_path_factory.mktemp("services")
    with forkserver.for_run(True, logs / "forkserver.log", run_preload()), warm.for_run(True, logs / "engine.log", "vllm"):
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory, prefect_harness, default_model):
    """One uninterrupted small run: the reference the other tests compare against."""
    tmp_path = tmp_path_factory.mktemp("reference")
    cfg = load_config(CONFIGS / "default.yaml", [f"workdir={tmp_path}", *SMALL])
    return (tmp_path, cfg, *_run(cfg))


def test_one_round_end_to_end(reference):
    """Guards the default pipeline on the default model: one round's stages on vLLM through the run's
    warm engine and fork server, each stage's directory and manifest, the MLflow parent and round
    runs, their metrics, datasets and registered versions. Slow: the module's reference run on the
    default model (shared with the module's other tests)."""
    tmp_path, cfg, ctx, tracker, results = reference

    # the store holds exactly one finished directory per stage, each with its manifest
    stage_dirs = sorted((tmp_path / "stages").iterdir())
    assert sorted(d.name.split("-")[0] for d in stage_dirs) == STAGES
    assert all((d / "manifest.json").exists() for d in stage_dirs)
    r0, r1 = results
    assert (r0.round, r1.round) == (0, 1) and r1.policy.stage == "train"
    # the sampling stage borrowed the run's warm engine, which its Prefect task found in the run's
    # context (data/procs/services.py): Prefect runs each task in a copy of the flow's
    from ratchet.data import events

    sample_dir = next(d for d in stage_dirs if d.name.startswith("sample-"))
    assert "warm engine (pid" in (sample_dir / events.STAGE_LOG).read_text()
    assert (tmp_path / r1.policy.dir / "model" / "model.safetensors").exists()

    c = tracker.client
    runs = c.search_runs([tracker.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = sorted((r for r in runs if "mlflow.parentRunId" in r.data.tags), key=lambda r: r.info.run_name)
    assert [r.info.run_id for r in parents] == [ctx.parent_run_id]
    assert [r.info.run_name for r in children] == ["round-0", "round-1"]
    assert all(r.info.status == "FINISHED" for r in runs)
    m = children[1].data.metrics
    for key in ("sample.tokens_per_s", "label.reward_mean", "filter.accepted", "train.train_loss",
                "evaluate.accuracy", "round.accuracy"):
        assert key in m, key
    assert m["round.accuracy"] == r1.accuracy
    assert len(c.get_metric_history(children[1].info.run_id, "train/loss")) >= 1
    inputs = {i.dataset.name: {t.key: t.value for t in i.tags} for i in children[1].inputs.dataset_inputs}
    filt = next(p for p in r1.policy.parents if p.stage == "filter")
    train_set = [v for k, v in inputs.items() if k.startswith("filter-r1")][0]
    assert train_set["mlflow.data.context"] == "training"
    from ratchet.data.manifest import read_manifest

    assert train_set["ratchet.sha256"] == read_manifest(tmp_path / filt.dir).outputs["train_set.jsonl"].sha256

    versions = sorted(c.search_model_versions(f"name='{tracker.model_name}'"), key=lambda v: int(v.version))
    assert [v.tags["ratchet.round"] for v in versions] == ["0", "1"]
    assert versions[1].tags["ratchet.parent_version"] == str(versions[0].version)
    assert versions[1].tags["ratchet.config_hash"] == ctx.config_hash
    assert versions[1].tags["ratchet.digest.filter"] == filt.content
    champ = c.get_model_version_by_alias(tracker.model_name, "champion")
    best = max(results, key=lambda r: (r.accuracy, -r.round))
    assert str(champ.version) == best.version

    # lineage: written to MLflow with the run, and `ratchet lineage` verifies the whole chain
    assert sorted(a.path for a in c.list_artifacts(ctx.parent_run_id, "lineage")) == [
        "lineage/lineage.json", "lineage/lineage.md"]
    lin = _lineage(tmp_path, r1.version)
    assert lin.returncode == 0, lin.stderr
    import json

    links = json.loads(lin.stdout)
    assert [x["stage"] for x in links] == ["train", "filter", "label", "sample", "prompts", "base"]
    assert [x["model_version"] for x in links if x["stage"] in ("train", "base")] == [r1.version, r0.version]
    assert all(x["verified"] for x in links)

    # the same run again, from Python (flows/api.py): every stage is found by key and reused
    from ratchet.flows import api

    again = api.run(api.load(CONFIGS / "default.yaml", [f"workdir={tmp_path}", *SMALL]))
    assert again.run == ctx.run_name and again.workdir == tmp_path and again.model_name == tracker.model_name
    assert [(r.round, r.version, r.accuracy, r.promoted) for r in again.rounds] == \
        [(r.round, r.version, r.accuracy, r.promoted) for r in results]
    assert again.champion == str(champ.version)
    assert again.model_dir(r1.version) == tmp_path / r1.policy.dir / "model"
    assert sorted((tmp_path / "stages").iterdir()) == stage_dirs
    # ... and Prefect shows each reused stage's task run as Cached
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as pc:
        flow_runs = pc.read_flow_runs()
        latest = max((f for f in flow_runs if f.name == cfg.name), key=lambda f: f.created)
        subflows = {f.id for f in flow_runs if f.parent_task_run_id is not None and f.created >= latest.created}
        states = {(t.name.rsplit("-", 1)[0], t.state.name) for t in pc.read_task_runs()
                  if t.flow_run_id in subflows | {latest.id}}
    assert {("prompts", "Cached"), ("base", "Cached"), ("sample", "Cached"), ("label", "Cached"),
            ("filter", "Cached"), ("train", "Cached"), ("evaluate", "Cached")} <= states, states
    assert not {s for s in states if s[0] in ("sample", "train") and s[1] != "Cached"}
    # ... in the same MLflow runs, with nothing logged twice
    runs2 = c.search_runs([tracker.experiment_id])
    assert sorted(r.info.run_id for r in runs2) == sorted(r.info.run_id for r in runs)
    assert all(r.info.status == "FINISHED" for r in runs2)
    assert len(c.get_metric_history(children[1].info.run_id, "sample.tokens_per_s")) == 1
    assert len(c.get_metric_history(ctx.parent_run_id, "eval.accuracy")) == 2  # rounds 0 and 1, once each
    # the same models are not registered twice, and the round table shows the registry's decisions again
    assert results[0].promoted
    assert len(c.search_model_versions(f"name='{tracker.model_name}'")) == 2

    # a hand-corrupted artifact is reported, and the command fails
    (tmp_path / filt.dir / "train_set.jsonl").write_text("{}\n")
    bad = _lineage(tmp_path, r1.version)
    assert bad.returncode == 1 and '"verified": false' in bad.stdout and "sha256 differs" in bad.stdout


def _lineage(workdir, version):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "lineage", str(CONFIGS / "default.yaml"), version,
                           f"workdir={workdir}", "--json"], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])


def test_self_reward_dpo_round_stops_at_its_agreement_gate_then_trains_anyway(tmp_path, prefect_harness,
                                                                            default_model):
    """The shipped self-rewarding config, small: the policy judges itself (vLLM logprobs) and
    pairs are built; a gate its judge cannot meet stops the round before training with a
    message that says why; `agreement.on_below=train` then trains on the kept stages (DPO
    against the round's start) and the round says so. MLflow holds the judge's statistics,
    its agreement with the verifier, the pairs and the DPO curves.

    Guards the agreement gate on the shipped self-rewarding path: a label that disagrees with the answers
    stops the round before training, and what the round finished is kept and reused. Slow: two runs on the
    default model (8 prompts; the second trains DPO and evaluates)."""
    from ratchet.tasks.agreement import LabelDisagreesError

    # a gate at 1 (a perfect ranking), further from what this judge of itself measures (0.40-0.50 here)
    # than 0.95; 8 prompts make 8 pairs and 2 DPO steps here
    small = [f"workdir={tmp_path}", *[o for o in SMALL if not o.startswith("filter.")], "filter.min_pairs=2",
             "filter.margin=0.01", "filter.max_length_ratio=null",
             "agreement.metric=verifier_auc", "agreement.min=1", "agreement.min_prompts=1"]
    with pytest.raises(LabelDisagreesError, match=r"round 1 stopped before training: the judge \(rating, the policy\)"
                       r" label .* verifier_auc=0\.\d{3} over \d+ prompts .* below agreement.min=1.0") as stop:
        _run(load_config(CONFIG := CONFIGS / "self_reward_dpo.yaml", small))
    assert "agreement.on_below=train" in str(stop.value)
    kept = {d.name: (d / "manifest.json").stat().st_mtime_ns for d in (tmp_path / "stages").iterdir()}
    assert sorted(n.split("-")[0] for n in kept) == ["base", "evaluate", "filter", "label", "prompts", "sample"]

    cfg = load_config(CONFIG, small + ["agreement.on_below=train"])
    ctx, tracker, (r0, r1) = _run(cfg)
    assert r1.agreement.startswith("agreement BELOW the gate: verifier_auc=") and "trained anyway" in r1.agreement
    # what the stopped round finished is reused, not redone (round 1's evaluate is a new stage of its own)
    assert {d.name: (d / "manifest.json").stat().st_mtime_ns for d in (tmp_path / "stages").iterdir()
            if d.name in kept} == kept
    assert {d.name.split("-")[0] for d in (tmp_path / "stages").iterdir() if d.name not in kept} == {"train",
                                                                                                   "evaluate"}
    assert tracker.version(r1.version).tags["ratchet.agreement"] == r1.agreement
    c = tracker.client
    child = next(r for r in c.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{ctx.parent_run_id}'")
                 if r.info.run_name == "round-1")
    assert child.data.tags["ratchet.agreement"] == r1.agreement and child.data.metrics["agreement.passed"] == 0
    m = child.data.metrics
    from ratchet.data.records import LabeledCompletion, PairRow, read_jsonl
    from ratchet.tasks.label_kinds import agreement

    label_dir = next((tmp_path / "stages").glob("label-*"))
    rows = read_jsonl(label_dir / "labels.jsonl", LabeledCompletion)
    assert m["label.judge_scored_frac"] == sum(r.reward is not None for r in rows) / len(rows) > 0.9
    assert m["label.verifier_auc"] == pytest.approx(agreement(rows)["verifier_auc"])  # what the rows say
    assert m["label.injection_suspects"] == sum(bool(r.flags) for r in rows)
    pairs = read_jsonl(next((tmp_path / "stages").glob("filter-*")) / "train_set.jsonl", PairRow)
    assert m["filter.pairs"] == len(pairs) >= 2 and "label.verifier_within_prompt_auc" in m
    assert m["filter.pair_accuracy"] == pytest.approx(
        sum(p.chosen_correct and not p.rejected_correct for p in pairs) / len(pairs))
    for key in ("train/loss", "train/rewards/margins", "train/rewards/accuracies", "train/logps/chosen"):
        assert len(c.get_metric_history(child.info.run_id, key)) >= 1, key
    from ratchet.data.manifest import read_manifest

    label = read_manifest(tmp_path / next(p for p in read_manifest(
        tmp_path / next(p for p in r1.policy.parents if p.stage == "filter").dir).parents).dir)
    assert [p.stage for p in label.parents] == ["sample", "base"]  # the judge was the round's starting policy
    assert read_manifest(tmp_path / r1.policy.dir).info["reference"] == r0.policy.dir
    datasets = {i.dataset.name.split("-")[0]: i for i in child.inputs.dataset_inputs}
    assert {"sample", "filter"} <= datasets.keys()


def test_mcts_dpo_round_end_to_end(tmp_path, prefect_harness, default_model):
    """The shipped MCTS config, small: no sample stage; the search runs in a worker on vLLM,
    its trees and statistics reach the store and MLflow, step pairs train DPO, and the
    lineage runs label -> prompts + base.

    Guards the shipped MCTS config (`flows/configs/mcts_dpo.yaml`) end to end on the default model. Slow: a
    round of tree search on vLLM, DPO and two evaluations."""
    from ratchet.data.manifest import read_manifest
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.lineage import walk

    cfg = load_config(CONFIGS / "mcts_dpo.yaml", [
        f"workdir={tmp_path}", "rounds=1", "data.train_size=8", "data.eval_size=8", "label.simulations=2",
        "label.k=3", "label.step_max_tokens=8", "label.rollout_tokens=24", "label.shard_size=4",
        "filter.min_pairs=1", "train.epochs=1", "train.batch_size=4", "train.logging_steps=1",
        "evaluate.max_tokens=32", "sampler.kv_cache_gb=1"])  # a step's loss is logged however few pairs come
    ctx, tracker, (r0, r1) = _run(cfg)
    stages = sorted(d.name.split("-")[0] for d in (tmp_path / "stages").iterdir())
    assert stages == ["base", "evaluate", "evaluate", "filter", "label", "prompts", "train"]
    label = read_manifest(next((tmp_path / "stages").glob("label-*")))
    assert sorted(label.outputs) == ["labels.jsonl", "trees.jsonl"]
    assert [p.stage for p in label.parents] == ["prompts", "base"]
    assert label.metrics["mcts_prompts"] == 8 and label.metrics["mcts_gen_tokens"] > 0

    c = tracker.client
    child = next(r for r in c.search_runs([tracker.experiment_id]) if r.info.run_name == "round-1")
    m = child.data.metrics
    import json

    trees = [json.loads(x) for x in (tmp_path / label.dir / "trees.jsonl").read_text().splitlines()]
    assert m["label.mcts_solved_frac"] == sum(any(n["correct"] for n in t["nodes"]) for t in trees) / len(trees)
    assert m["label.mcts_root_visits_mean"] >= 2
    assert m["filter.pairs"] >= 1 and m["filter.pair_accuracy"] == 1.0  # verifier values: right over wrong
    assert [a.path for a in c.list_artifacts(child.info.run_id, "label")] == ["label/trees.jsonl"]
    assert len(c.get_metric_history(child.info.run_id, "train/loss")) >= 1

    chain = [x.stage for x in walk(ArtifactStore(tmp_path), r1.policy)]
    assert chain == ["train", "filter", "label", "prompts", "base"]
