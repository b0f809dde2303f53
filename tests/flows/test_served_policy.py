"""A served policy (sampler.backend=served, models/served.py): a model behind an OpenAI-compatible
endpoint whose weights the run cannot train, improved by its prompt. What the config refuses of
it before anything loads, and a whole run against a scripted server (tests/openai_stub.py) that
answers right only under a prompt the search must find. The same run against `vllm serve` of the
default model is tests/flows/test_served_round.py's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ratchet.data.errors import ConfigError
from ratchet.flows.config import load_config
from tests.openai_stub import Stub, verdict

CONFIG = Path(__file__).parents[2] / "flows" / "configs" / "prompt_search.yaml"
SEARCH = ["prompt.search.iterations=1", "prompt.search.width=1", "prompt.search.depth=1", "prompt.search.batch=3",
          "prompt.search.score_prompts=3", "prompt.search.reward_prompts=3"]


def served(url: str, model: str = "policy") -> str:
    return f"sampler={{backend: served, endpoint: {{base_url: '{url}', model: {model}, max_concurrency: 4}}}}"


def refused(*overrides: str, config: Path = CONFIG) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(config, list(overrides))
    return str(e.value)


def test_what_a_served_policy_cannot_do_is_refused_with_the_fix():
    at = served("http://127.0.0.1:9/v1")
    said = refused(at, "improve=weights", "prompt.search=null")
    assert "cannot be trained here, and improve='weights' trains them each round; set improve: prompt" in said
    assert "the policy's weights are on its server" in refused(at, "improve=both")
    assert "model.path='/m' and model.prompt_format='auto' are not read" in refused(at, "model.path=/m")
    roles = refused(at, config=CONFIG.parent / "trading_roles.yaml")
    assert "sample.rollout.kind='roles' feeds the model's own token ids back each turn" in roles, roles
    assert "backend='served' needs endpoint" in refused("sampler.backend=served")
    assert "endpoint is set, and backend='vllm' runs the model here" in refused(
        "sampler.endpoint={base_url: 'http://127.0.0.1:9/v1', model: p}")
    plain = load_config(CONFIG).model_dump(mode="json")["sampler"]
    assert "endpoint" not in plain  # a config without one keeps its bytes, and so its keys


def test_a_served_policy_that_is_down_lacks_its_key_or_is_not_served_stops_before_anything_runs(monkeypatch):
    from ratchet.flows.inputs import check_data
    from tests.flows.tiny import free_port

    monkeypatch.delenv("POLICY_KEY", raising=False)
    down = f"sampler={{backend: served, endpoint: {{base_url: 'http://127.0.0.1:{free_port()}/v1', model: p, " \
           "api_key_env: POLICY_KEY}}"
    with pytest.raises(ConfigError) as e:
        check_data(load_config(CONFIG, [down]))
    assert "sampler.endpoint.api_key_env='POLICY_KEY'" in str(e.value) and "export it" in str(e.value)
    monkeypatch.setenv("POLICY_KEY", "sk-x")
    with pytest.raises(ConfigError) as e:
        check_data(load_config(CONFIG, [down]))
    assert "sampler.endpoint.base_url=" in str(e.value) and "did not answer" in str(e.value)
    with Stub(lambda body: verdict("0"), models=("other",)) as stub, pytest.raises(ConfigError) as e:
        check_data(load_config(CONFIG, [served(stub.url, "p")]))
    assert "sampler.endpoint.model='p'" in str(e.value) and "serves 'other'" in str(e.value)


def scripted(body: dict) -> dict:
    """A served model that answers a sum right only when its prompt tells it to add, and, as its
    own optimiser, writes that prompt when shown its wrong answers."""
    text = body["messages"][-1]["content"]
    if "Give brief reasons" in text:
        return verdict("It never says to add the two numbers.")
    if "write an improved prompt" in text:
        return verdict("<START>Add the two numbers. [question]<END>")
    a, b = map(int, re.findall(r"\d+", text)[:2])
    return verdict(f"The sum is {a + b if text.startswith('Add the two numbers.') else a + b + 1}.")


@pytest.mark.integration
def test_a_served_policy_is_improved_by_its_prompt_and_every_version_is_the_server_s_model_and_a_text(
        tmp_path, prefect_harness):
    from ratchet.data.store import ArtifactStore
    from ratchet.flows import api
    from ratchet.flows.lineage import annotate, export, render_text, version_manifest, walk
    from ratchet.flows.plan import plan
    from ratchet.flows.tracking import Tracker

    work = tmp_path / "runs"
    with Stub(scripted, models=("policy",), tokenize=lambda body: {"count": 40, "max_model_len": 1024}) as stub:
        args = [f"workdir={work}", "rounds=1", "isolate=false", "data.train_size=12", "data.eval_size=4", *SEARCH, served(stub.url)]
        cfg = api.load(CONFIG, args)
        result = api.run(cfg)  # as `ratchet run` runs it, in this process
        asked = len(stub.requests)
        steps = plan(cfg).steps  # planned again: every stage reused, so no call would be made again
    assert {s.state for s in steps} == {"reused"}, [(s.stage, s.state, s.why) for s in steps]
    manifests = [json.loads(p.read_text()) for p in (work / "stages").glob("*/manifest.json")]
    by = {(m["stage"], m["round"]): m for m in manifests}
    assert sorted(by) == [("base", 0), ("evaluate", 0), ("evaluate", 1), ("prompts", 0), ("search", 1)]
    assert by[("base", 0)]["config"] == {"source": "served", "base_url": stub.url, "model": "policy"}
    assert by[("evaluate", 0)]["metrics"]["accuracy"] == 0.0 and by[("evaluate", 1)]["metrics"]["accuracy"] == 1.0
    search = by[("search", 1)]["metrics"]
    assert search["chosen_reward"] == 1.0 and search["base_reward"] == 0.0 and search["policy_calls"] > 0
    # every call went to the served model by name; a greedy answer's seed is the stage's, per prompt
    assert {q["model"] for q in stub.requests} == {"policy"} and asked == len(stub.requests)
    assert all(q["temperature"] == 0.0 for q in stub.requests if q["messages"][0]["content"].startswith("What"))

    tracker = Tracker(cfg.tracking, work, cfg.name)
    store = ArtifactStore(work)
    assert result.champion == tracker.champion() == "2" and [r.accuracy for r in result.rounds] == [0.0, 1.0]
    out = export(store, tracker, "2", tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "prompt.json", "served.json"]
    assert json.loads((out / "prompt.json").read_text())["text"]["template"] == "Add the two numbers. {prompt}"
    assert f"the model served as 'policy' at {stub.url}" in (out / "README.md").read_text()
    links = walk(store, version_manifest(store, tracker, "2"))
    annotate(links, tracker)
    shown = render_text(links)
    assert all(link.verified for link in links), shown
    assert f"the policy 'policy' served at {stub.url}" in shown and "chosen by the policy's revisions" in shown
