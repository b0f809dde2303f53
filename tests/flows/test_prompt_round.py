"""Rounds that improve text: what the config refuses of a prompt before any model loads, and a run
on the tiny model whose round searches for a prompt, then trains under it; every version is a
pair of weights and text, kept, keyed, planned, registered and exported as one. The search's own
tree and resume are tests/tasks/test_prompt_search.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchet.data.errors import ConfigError
from ratchet.flows.config import load_config
from tests.flows.recorded import SEARCH

CONFIG = Path(__file__).parents[2] / "flows" / "configs" / "default.yaml"


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, list(overrides))
    return str(e.value)


def test_a_prompt_that_cannot_work_is_refused_with_its_fix():
    assert "has no {prompt}; write {prompt} once" in refused("prompt.template=Answer briefly.")
    assert "has 2 {prompt} slots" in refused("prompt.template='{prompt} {prompt}'")
    assert "prompt.search.width=0" in refused(SEARCH, "improve=prompt", "prompt.search.width=0")
    assert "prompt.search.depth=0" in refused(SEARCH, "improve=prompt", "prompt.search.depth=0")
    assert "add prompt: {search: {kind: prompt_agent}}" in refused("improve=prompt")
    assert "improve='weights' never runs it" in refused(SEARCH)
    assert "improve='prompt' samples none" in refused(SEARCH, "improve=prompt", "data.retire_solved=true")
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG.parent / "guess_env_rft.yaml", ["prompt.template='Q: {prompt}'"])
    env = str(e.value)
    assert "sample.rollout.kind='environment' gives the model the environment's observations" in env, env
    assert load_config(CONFIG, [SEARCH, "improve=both"]).trains_weights()


def test_a_config_without_a_prompt_keeps_its_bytes_and_so_its_run_s_name():
    from ratchet.flows.runs import run_name_for

    plain = load_config(CONFIG)
    assert "prompt" not in plain.model_dump(mode="json") and "improve" not in plain.model_dump(mode="json")
    assert run_name_for(plain) != run_name_for(load_config(CONFIG, ["prompt.template='Q: {prompt}'"]))


def test_a_search_needs_its_prompts_before_any_model_loads():
    from ratchet.flows.inputs import check_data

    with pytest.raises(ConfigError) as e:
        check_data(load_config(CONFIG, [SEARCH, "improve=prompt", "data.prompts_per_round=6"]))
    assert "prompt.search needs 7 train prompts its check can score" in str(e.value)
    for path, said in [("/nonexistent/m", "prompt.search.optimiser.path='/nonexistent/m' is not a local directory"),
                       (str(CONFIG.parent), "lacks config.json, weights (*.safetensors or *.bin), a tokenizer")]:
        with pytest.raises(ConfigError) as e:  # a search's own optimiser model that cannot load
            check_data(load_config(CONFIG, [SEARCH, "improve=prompt", f"prompt.search.optimiser={{kind: model, "
                                                                     f"path: '{path}'}}"]))
        assert said in str(e.value), str(e.value)


def test_a_served_optimiser_that_is_down_or_lacks_its_key_stops_the_run_before_any_model_loads(monkeypatch):
    from ratchet.flows.inputs import check_data
    from tests.flows.tiny import free_port

    served = f"prompt.search.optimiser={{kind: served, endpoint: {{base_url: 'http://127.0.0.1:{free_port()}/v1', " \
             "model: opt, api_key_env: OPT_KEY}}"
    monkeypatch.delenv("OPT_KEY", raising=False)
    with pytest.raises(ConfigError) as e:
        check_data(load_config(CONFIG, [SEARCH, "improve=prompt", served]))
    assert "prompt.search.optimiser.endpoint.api_key_env='OPT_KEY'" in str(e.value) and "export it" in str(e.value)
    monkeypatch.setenv("OPT_KEY", "sk-x")
    with pytest.raises(ConfigError) as e:
        check_data(load_config(CONFIG, [SEARCH, "improve=prompt", served]))
    assert "the server did not answer" in str(e.value) and "start it, or fix the URL" in str(e.value)


@pytest.mark.integration
def test_a_round_searches_for_a_prompt_then_trains_under_it_and_the_pair_is_one_version(recorded_run, tmp_path):
    """Guards rounds that improve text: a round searches for a prompt, samples and trains under the
    chosen one, and the weights and text are one version (kept, keyed, registered, drawn in the
    report). Slow: the recorded run it reads (recorded_run, shared with the docs' commands)."""
    from ratchet.flows.tracking import Tracker

    work, config, run = recorded_run.work, recorded_run.config, recorded_run.run  # `ratchet run CONFIG`'s
    manifests = {m["dir"]: m for m in (json.loads(p.read_text()) for p in (work / "stages").glob("*/manifest.json"))}
    by = {}
    for m in manifests.values():
        by.setdefault((m["stage"], m["round"]), []).append(m)
    parents = {k: [p["stage"] for p in ms[0]["parents"]] for k, ms in by.items() if len(ms) == 1}
    assert parents[("template", 0)] == ["base"] and parents[("search", 1)] == ["template", "prompts"]
    assert parents[("sample", 1)] == ["search", "prompts"] and parents[("train", 1)] == ["search", "filter"]
    assert parents[("template", 1)] == ["train", "search"]  # the trained weights keep the text they trained under
    search = by[("search", 1)][0]
    chosen = json.loads((work / search["dir"] / "prompt.json").read_text())["text"]["template"]
    nodes = [json.loads(x) for x in (work / search["dir"] / "nodes.jsonl").read_text().splitlines()]
    assert nodes[0]["template"] == "Q: {prompt}" and chosen in [n["template"] for n in nodes]
    assert search["metrics"]["nodes"] + search["metrics"]["refused"] >= 2  # the root's expansion wrote 2 revisions
    samples = [json.loads(x) for x in (work / by[("sample", 1)][0]["dir"] / "samples.jsonl").read_text().splitlines()]
    before, after = chosen.split("{prompt}")
    assert all(s["prompt"].startswith(before) and s["prompt"].endswith(after) for s in samples)  # sampled under it

    (page,) = (work / "reports").glob("*/index.html")  # the report draws the search's tree
    assert "<h2>Prompt search</h2>" in page.read_text() and "node 0 · " in page.read_text()

    # the registered version is the pair: its MLflow prompt version, the registry's champion alias on it
    cfg = load_config(config)
    tracker = Tracker(cfg.tracking, work, cfg.name)
    v2 = tracker.version("2")
    assert v2.tags["ratchet.stage_dir"] == by[("template", 1)][0]["dir"]
    name, number = v2.tags["ratchet.prompt"].removeprefix("prompts:/").split("/")
    assert tracker.client.get_prompt_version(name, number).template == chosen.replace("{prompt}", "{{task_prompt}}")
    v1 = tracker.version("1").tags["ratchet.prompt"]
    assert tracker.client.get_prompt_version(name, v1.rsplit("/", 1)[1]).template == "Q: {{task_prompt}}"

    # exported, traced and planned in this process (each a CLI command a user runs: the run's own test is above)
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.lineage import annotate, export, render_text, version_manifest, walk
    from ratchet.flows.plan import plan

    store = ArtifactStore(work)
    out = export(store, tracker, "2", tmp_path / "out")
    assert json.loads((out / "prompt.json").read_text())["text"]["template"] == chosen
    assert (out / "config.json").exists() and chosen in (out / "README.md").read_text()
    links = walk(store, version_manifest(store, tracker, "2"))
    annotate(links, tracker)
    shown = render_text(links)
    assert all(link.verified for link in links), shown
    assert "(carried from the pair the weights were trained under)" in shown
    assert "chosen by the policy's revisions" in shown and "(the config's prompt.template)" in shown
    from ratchet.flows.lineage import resolve  # a prompt version traces to the first stage that wrote its text

    wrote = by[("template", 0)][0] if chosen == nodes[0]["template"] else search  # a search may keep its start
    assert resolve(v2.tags["ratchet.prompt"], store, tracker).dir == wrote["dir"]
    assert resolve(v1, store, tracker).dir == by[("template", 0)][0]["dir"]

    steps = plan(load_config(config, ["prompt.template='A: {prompt}'"])).steps
    why = {(s.round, s.stage): (s.state, s.why) for s in steps}
    assert why[(0, "template")] == ("stale", "since run " + run + ": config template: 'Q: {prompt}' -> 'A: {prompt}'")
    assert why[(1, "search")][0] == "waits" and why[(0, "base")][0] == "reused"
    # a run from version 2 starts from the pair: its weights and its text, with no template of its own
    onwards = plan(load_config(config), run="from-v2",
                   start=version_manifest(store, tracker, "2")).steps
    assert [(s.round, s.stage, s.state) for s in onwards] == [
        (0, "prompts", "reused"), (1, "evaluate", "reused"), (2, "search", "to run"), *(
            (2, stage, "waits") for stage in ("sample", "label", "filter", "train", "template", "evaluate"))]
