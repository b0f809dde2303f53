"""Merged weights a round can make again are dropped to save disk (`ratchet gc --models`) and made
again, byte for byte, where they are needed: the policy that picks what to drop, with no model;
and on the tiny model, a run continuing from a dropped version, an export of one, and the lineage
of a chain that holds one."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ratchet.data.digest import sha256_file
from ratchet.data.manifest import read_manifest
from ratchet.data.store import ArtifactStore
from tests.flows.tiny import ROOT, ratchet


def _train_stage(store, name, parent=None, lora=True):
    """A finished train stage written by hand: merged weights, a config, an adapter."""
    key = name * 64
    d = store.stage_dir("train", key)
    (d / "model").mkdir(parents=True)
    (d / "model" / "model.safetensors").write_bytes(b"w" * 4096)
    (d / "model" / "config.json").write_text("{}")
    outputs = {"model/model.safetensors": None, "model/config.json": None}
    if lora:
        (d / "adapter").mkdir()
        (d / "adapter" / "adapter_model.safetensors").write_bytes(b"a" * 64)
        outputs["adapter/adapter_model.safetensors"] = None
    return store.finish(stage="train", round=1, key=key, code_version="c", config={},
                        parents=[parent] if parent is not None else [], outputs=outputs)


def test_gc_keeps_the_champion_each_runs_newest_and_their_bases_and_drops_the_rest(tmp_path):
    from ratchet.flows.lineage import walk
    from ratchet.flows.gc import drop_models

    store = ArtifactStore(tmp_path)
    v1 = _train_stage(store, "1")
    v2 = _train_stage(store, "2", v1)
    v3 = _train_stage(store, "3", v2)
    v4 = _train_stage(store, "4", v3)
    full = _train_stage(store, "5", v1, lora=False)  # a full fine-tune: nothing to make it again from
    tags = {"1": (v1, "a", 1), "2": (v2, "a", 2), "3": (v3, "a", 3), "4": (v4, "a", 4), "5": (full, "b", 1)}
    versions = [SimpleNamespace(version=v, tags={"ratchet.stage_dir": m.dir, "ratchet.run": run, "ratchet.round": str(k)})
                for v, (m, run, k) in tags.items()]
    set_tags = {}
    tracker = SimpleNamespace(model_name="m", champion=lambda: "1", client=SimpleNamespace(
        search_model_versions=lambda _: versions,
        set_model_version_tag=lambda name, v, key, value: set_tags.setdefault(v, {}).update({key: value})))
    before = _tree(tmp_path)
    planned = drop_models(tmp_path, tracker, dry_run=True)
    assert _tree(tmp_path) == before  # a dry run drops nothing
    said = {p.path.parent.name[-1]: (p.remove, p.why) for p in planned}
    assert said["1"] == (False, "merged weights of version 1: the champion")
    assert said["4"] == (False, "merged weights of version 4: run a's newest round (4)")
    assert said["3"][0] is False and "version 4 was trained from" in said["3"][1]
    assert said["2"][0] is True and "dropped, re-makeable" in said["2"][1] and "5" not in said
    assert [p.bytes for p in planned if p.remove] == [4096]

    drop_models(tmp_path, tracker)
    assert not (store.dir_of(v2) / "model" / "model.safetensors").exists()
    # version 3's MLflow model loads its adapter against version 2's merged weights: it says so
    assert list(set_tags) == ["3"] and f"against {v2.dir}/model" in set_tags["3"]["ratchet.mlflow_base_dropped"]
    assert (store.dir_of(v2) / "model" / "config.json").exists() and (store.dir_of(v2) / "adapter").is_dir()
    assert store.dropped(v2)["outputs"] == ["model/model.safetensors"]
    assert read_manifest(store.dir_of(v2)) == v2  # the manifest is as training wrote it
    store.verify(v2)  # dropped is not missing
    assert store.find("train", v2.key) == v2
    links = walk(store, v4)
    assert all(x.verified for x in links)
    assert [x.dropped for x in links if x.key == v2.key] == [["model/model.safetensors"]]
    (store.dir_of(v2) / "model" / "model.safetensors").write_bytes(b"not it")  # made again wrong: refused
    with pytest.raises(Exception, match="sha256 differs"):
        store.restored(v2)


def _tree(root: Path) -> dict:
    return {str(p): p.stat().st_size for p in root.rglob("*")}


def _args(workdir, tiny_model):
    """The default config on the tiny model, with a reward a random model's answers earn (a long one)."""
    rewards = workdir.parent / "rewards.py"
    rewards.write_text("def score(completion, **fields):\n    return float(len(completion) > 3)\n")
    return [ROOT / "flows" / "configs" / "default.yaml", f"workdir={workdir}", f"model.path={tiny_model}",
            "sampler.backend=hf", "sampler.dtype=float32", "data.a_max=6", "data.b_max=4", "data.eval_size=4",
            "sample.n=3", "sample.max_tokens=6", "sample.shard_size=6", "filter.min_rows=1", "train.epochs=1",
            "train.batch_size=4", "evaluate.max_tokens=6",
            f"data.check={{kind: python, function: '{rewards}:score', threshold: 1.0}}"]


@pytest.mark.integration
def test_a_dropped_version_is_made_again_byte_for_byte(tiny_model, tmp_path, prefect_harness, capsys, monkeypatch):
    """Three rounds with drop_models: version 2's weights go once version 4 is registered (version 1,
    the base model, stays the champion: nothing beats it by more than 1). A run continuing from
    version 2 makes them again in its stage worker, `ratchet export` in a child of its own, and both
    are the bytes training wrote; the lineage meanwhile verifies and says what is dropped. Every
    version loads through MLflow's own API (the transformers flavor and pyfunc), and a LoRA version
    computes what its exported merged weights do.

    Guards `drop_models` and `ratchet gc --models`: dropped weights come back byte for byte wherever a run, an
    export or MLflow needs them. Slow: a 3-round run and a 1-round run on the tiny model, an export and MLflow
    loads of four versions."""
    from prefect.settings import PREFECT_API_URL

    api, work = PREFECT_API_URL.value(), tmp_path / "runs"
    first = ratchet("run", *_args(work, tiny_model), "rounds=3", "drop_models=true", "evaluate.min_improvement=1",
                    api_url=api)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "of merged weights dropped (drop_models)" in first.stdout
    store = ArtifactStore(work)
    trained = {m.round: m for m in (read_manifest(d) for d in (work / "stages").glob("train-*"))}
    v2, weights = trained[1], store.dir_of(trained[1]) / "model" / "model.safetensors"
    digest = v2.outputs["model/model.safetensors"].sha256
    assert store.dropped(v2)["outputs"] == ["model/model.safetensors"] and not weights.exists()
    assert [r for r, m in sorted(trained.items()) if store.dropped(m)] == [1]  # 3 is version 4's base, 4 the newest
    from ratchet.flows.cli import main  # two commands that read the store, in this process: no server, no model

    capsys.readouterr()
    assert main(["gc", *map(str, _args(work, tiny_model)), "--models", "--dry-run"]) == 0, capsys.readouterr().err
    listed = capsys.readouterr().out
    assert "would remove 0 item(s)" in listed, listed
    assert main(["lineage", *map(str, _args(work, tiny_model)), "4"]) == 0, capsys.readouterr().err
    lineage = capsys.readouterr().out
    assert "merged weights dropped, re-makeable" in lineage and "all verified" in lineage, lineage

    # every registered version loads through MLflow's own API: one whose adapter loads against
    # dropped weights (3's, against 2's) is tagged so, and `ratchet restore` makes them again first
    import mlflow.pyfunc
    import mlflow.transformers
    from mlflow.tracking import MlflowClient

    from ratchet.flows.gc import UNLOADABLE

    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)

    def tagged():
        return sorted(str(mv.version) for mv in client.search_model_versions("name='ratchet-default'")
                      if UNLOADABLE in mv.tags)

    assert tagged() == ["3"]
    assert main(["gc", *map(str, _args(work, tiny_model)), "--models"]) == 0, capsys.readouterr().err
    assert "version 3 loads through MLflow after `ratchet restore`" in capsys.readouterr().out
    assert main(["restore", *map(str, _args(work, tiny_model))]) == 0, capsys.readouterr().err
    assert "version 3: made again the weights its MLflow model loads against" in capsys.readouterr().out
    assert sha256_file(weights) == digest and tagged() == []
    # through the environment, which the test's end restores: mlflow.set_registry_uri would outlive the
    # test and point every later MlflowClient in this worker at this store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", uri)
    pipes = {v: mlflow.transformers.load_model(f"models:/ratchet-default{v}") for v in ("@champion", "/2", "/3", "/4")}
    assert type(pipes["@champion"].model).__name__ == "LlamaForCausalLM"  # the base: its weights in the version
    # ... linked to the store's, not copied (MLflow's artifacts are local files here)
    from ratchet.flows.tracking import _local_artifacts

    base = read_manifest(next((work / "stages").glob("base-*")))
    source = client.get_model_version("ratchet-default", "1").source
    in_version = _local_artifacts(source) / "model" / "model.safetensors"
    assert in_version.stat().st_ino == (store.dir_of(base) / "model" / "model.safetensors").stat().st_ino
    assert {type(pipes[v].model).__name__ for v in ("/2", "/3", "/4")} == {"PeftModelForCausalLM"}  # adapters
    ask = "What is 2 + 3?"
    for v in ("@champion", "/2"):
        said = pipes[v](ask, max_new_tokens=4, do_sample=False)[0]["generated_text"]
        assert said.startswith(ask) and len(said) > len(ask), (v, said)
        assert mlflow.pyfunc.load_model(f"models:/ratchet-default{v}").predict([ask])[0].startswith(ask), v
    store.drop(v2, ["model/model.safetensors"], "test")  # dropped again, for a run to make

    # round 2 again from version 2, sampled otherwise: its sample stage reads version 2's weights
    again = ratchet("run", *_args(work, tiny_model), "rounds=1", "sample.temperature=0.9", "--from", "2", api_url=api)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert sha256_file(weights) == digest and not store.dropped(v2)  # made again by the stage that read it

    store.drop(v2, ["model/model.safetensors"], "test")
    out = tmp_path / "export"
    exported = ratchet("export", *_args(work, tiny_model), "2", out, api_url=api)
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    assert sha256_file(out / "model.safetensors") == digest == sha256_file(weights)
    assert "## Lineage" in (out / "README.md").read_text()  # the export's card says where the weights came from
    # the adapter on its base computes what the exported merged weights do (float error), and
    # training moved them from the base by far more than that
    import torch
    from transformers import AutoModelForCausalLM

    ids = pipes["/2"].tokenizer(ask, return_tensors="pt").input_ids
    with torch.no_grad():
        adapter, base = (pipes[v].model(ids).logits[0, -1] for v in ("/2", "@champion"))
        merged = AutoModelForCausalLM.from_pretrained(out)(ids).logits[0, -1]
    error, trained = (adapter - merged).abs().max().item(), (base - merged).abs().max().item()
    assert error < 1e-4 and trained > 10 * error, (error, trained)
    assert json.loads((store.dir_of(v2) / "model" / "config.json").read_text())  # the rest never went

