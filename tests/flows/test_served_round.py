"""A real served judge: `vllm serve` with the default model on loopback, started here and
stopped after the module, behind the test's counting stub (tests/openai_stub.py) so every
request it was sent can be counted.

- A self-rewarding round on the tiny policy whose judge is the served model (p_yes, from the
  server's log-probabilities).
- The server gone mid-stage: the stage stops with the clear error; once the server is
  back, the same stage resumes and asks for no judgement it already has. The stub answers
  for the server as a dead one does behind it (a 502 from the proxy, `forward`); killing the
  real server there showed the stage the same 502s and cost a second start of vLLM.
"""

import json

import pytest

from tests.flows.tiny import CONFIG, free_port, overrides, ratchet
from tests.openai_stub import Failure, Stub, forward, start_vllm, stop, wait_healthy

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
    """The default model served by vLLM; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    proc = start_vllm(default_model, "judge", port, tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        stop(proc)


def test_a_self_rewarding_round_judged_by_a_served_model(served, tiny_model, tmp_path, prefect_harness):
    """Guards a served judge: a self-rewarding round whose every judgement is one call to a real `vllm
    serve` (p_yes from its log-probabilities), counted at the stub before it. Slow: the module's
    server start (the default model on vLLM) and a run of the tiny pipeline."""
    from prefect.settings import PREFECT_API_URL

    from ratchet.data.manifest import read_manifest

    url = served
    with Stub(forward(url)) as stub:
        r = ratchet("run", CONFIG, *overrides(tmp_path, tiny_model), "label.mode=p_yes", "label.top_logprobs=20",
                    f"label.endpoint={{base_url: '{stub.url}', model: judge, max_concurrency: 4}}",
                    api_url=PREFECT_API_URL.value())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (label,) = [m for d in (tmp_path / "stages").iterdir() if (m := read_manifest(d)) and m.stage == "label"]
    # every judgement came from the server, one call each, and each was read from its log-probabilities
    assert label.metrics["judge_calls"] == len(stub.requests) == label.metrics["labeled"] == 36
    assert label.metrics["judge_scored_frac"] == 1.0 and 0 < label.metrics["reward_mean"] < 1
    assert all(q["model"] == "judge" and q["logprobs"] and q["max_tokens"] == 1 for q in stub.requests)
    assert label.metrics["judge_input_tokens"] > 36 * 50 and label.metrics["judge_latency_p95_s"] > 0
    assert "36 calls (0 reused)" in r.stdout and r.stderr == "", r.stdout + r.stderr
    assert label.info["summary"] == f"judged by 'judge' at {stub.url} (p_yes)"


def test_a_server_gone_mid_stage_is_resumed_without_asking_again(served, tmp_path):
    """A served judge that goes away mid-stage fails the stage with the calls it answered kept; the stage resumed
    asks only for the rest. Guards the resume promise for a served label. Slow: 40 judgements through `vllm
    serve`, over the failed stage and the resumed one."""
    from ratchet.data.digest import sha256_json
    from ratchet.data.sources.addition import AdditionSource
    from ratchet.data.store import ArtifactStore
    from ratchet.models.endpoint import EndpointConfig, EndpointError
    from ratchet.tasks.label_kinds.judge import JudgeLabel
    from ratchet.tasks.label import label
    from tests.tasks.test_served_judge import _samples

    url = served
    texts = [f"The answer is {i}." for i in range(40)]
    store = ArtifactStore(tmp_path / "w")
    sample = _samples(store, texts)
    real = forward(url)
    seen = {"n": 0, "back": False}

    def down_from_the_12th(body):  # the server goes away while the stage runs, until it is back
        seen["n"] += 1
        return Failure(502) if seen["n"] >= 12 and not seen["back"] else real(body)

    cfg = JudgeLabel(mode="p_yes", endpoint=EndpointConfig(base_url="http://x/v1", model="judge", retries=2,
                                                           backoff_s=0.05, max_concurrency=2))
    with Stub(down_from_the_12th) as stub:
        at = cfg.model_copy(update={"endpoint": cfg.endpoint.model_copy(update={"base_url": stub.url})})
        with pytest.raises(EndpointError, match=r"failed 3 time\(s\).*HTTP 502"):
            label(store, sample, at, AdditionSource(), round=1, seed=3)
        before = len(stub.requests)
        journal = next((tmp_path / "w" / "stages").glob("label-*/shards/calls.jsonl"))
        kept = {json.loads(x)["id"] for x in journal.read_text().splitlines()}
        assert 10 <= len(kept) < 40
        seen["back"] = True
        m, reused = label(store, sample, at, AdditionSource(), round=1, seed=3)
        after = [sha256_json({**{k: v for k, v in q.items() if k != "_auth"}, "base_url": stub.url})
                 for q in stub.requests[before:]]  # each request as the journal names its call
    assert not reused and m.metrics["judge_calls_reused"] == len(kept)
    assert not kept & set(after)  # no judgement the journal held was asked for again
    assert len(after) == len(set(after)) == 40 - len(kept) == m.metrics["judge_calls"]  # each missing one, once
    rows = [json.loads(x) for x in (store.dir_of(m) / "labels.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and all(r["reward"] is not None for r in rows)


def test_the_attack_corpus_does_not_lift_the_served_judge(served, tmp_path):
    """The attack corpus (tests/tasks/attacks/) against the served judge, p_yes from the server's
    log-probabilities: without the guard some kind of attack lifts it (so the measure can see a
    lift); through the guard, as shipped, none does, and every attack scores below its clean
    control.

    Guards the judge's guard against reward hacking on a real served model (`vllm serve`). Slow: the whole
    corpus scored three ways through the server."""
    from ratchet.models.endpoint import Endpoint, EndpointConfig
    from ratchet.tasks.label_kinds.guard import guard
    from ratchet.tasks.label_kinds.judge import JudgeLabel
    from ratchet.tasks.label_kinds.judging import judge_values, rate
    from tests.tasks.test_judge_attacks import CORPUS, KIND_MEAN, SINGLE, _by_kind

    url = served
    cfg = JudgeLabel(mode="p_yes", endpoint=EndpointConfig(base_url=url, model="judge", max_concurrency=4))
    endpoint = Endpoint(cfg.endpoint, tmp_path / "calls.jsonl")
    texts = [(r["prompt"], t) for r in CORPUS for t in (r["clean"], r["attack"], guard(r["prompt"], r["attack"])[0])]
    score = {x: v if v is not None else 0.0 for x, (v, _) in zip(texts, rate(endpoint, cfg, texts, seed=0))}
    clean = [score[(r["prompt"], r["clean"])] for r in CORPUS]
    raw = [score[(r["prompt"], r["attack"])] - c for r, c in zip(CORPUS, clean)]
    assert max(sum(xs) / len(xs) for xs in _by_kind(raw).values()) > KIND_MEAN, raw
    cut = [score[(r["prompt"], guard(r["prompt"], r["attack"])[0])] - c for r, c in zip(CORPUS, clean)]
    shipped = [v - c for v, c in zip(judge_values(endpoint, cfg, [(r["prompt"], r["attack"]) for r in CORPUS], seed=0),
                                     clean)]
    for name, lifts in (("cut", cut), ("shipped", shipped)):
        worst = max(zip(lifts, (r["id"] for r in CORPUS)))
        assert worst[0] <= SINGLE, (name, worst)
        for kind, xs in _by_kind(lifts).items():
            assert sum(xs) / len(xs) <= KIND_MEAN, (name, kind, xs)
    assert all(x < 0 for x in shipped), shipped
    assert endpoint.stats["calls"] == len(set(texts)) and endpoint.stats["calls_reused"] == 0


def test_a_served_policy_s_prompt_round(served, tmp_path):
    """The default model as a served policy (sampler.backend=served), improved by its prompt: the
    round's search and evaluations, stage by stage in this process, ask the real server, with its
    own chat template and token counts. The whole run (its records, registry, export and lineage)
    is tests/flows/test_served_policy.py's, against a scripted server.

    Guards `sampler.backend=served` against a real server (its chat template and token counts). Slow:
    a prompt search and evaluations through `vllm serve`."""
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import check_inputs
    from ratchet.flows.shape import held_out
    from ratchet.tasks import evaluate, prepare, text_search
    from ratchet.tasks.runner.declare import At
    from tests.flows.test_served_policy import CONFIG, SEARCH

    url = served
    cfg = load_config(CONFIG, [f"workdir={tmp_path}", "isolate=false", "data.train_size=12", "data.eval_size=4",
                               "evaluate.max_tokens=12", *SEARCH, "prompt.search.feedback_tokens=16",
                               "prompt.search.revision_tokens=24",
                               f"sampler={{backend: served, endpoint: {{base_url: '{url}', model: judge}}}}"])
    split = check_inputs(cfg)  # the server counts the longest prompts against its context
    store = ArtifactStore(tmp_path)
    at = At(cfg, store, sources=split.digests)  # each stage's own call, as the run makes it
    prompts, _ = prepare.PROMPTS.call(at, 0)
    base, _ = prepare.BASE.call(at, 0)  # the served policy: its endpoint
    (target,) = held_out(cfg, Steps(at), prompts)
    before, _ = evaluate.STAGE.call(at, 0, base, target)
    pair, _ = text_search.STAGE.call(at, 1, base, prompts)
    after, _ = evaluate.STAGE.call(at, 1, pair, target)
    assert not (store.dir_of(base) / "model").exists() and before.metrics["eval_prompts"] == 4
    # the policy answered the score, batch and reward prompts and, as its own optimiser, wrote the feedback
    assert pair.metrics["policy_calls"] >= 3 + 3 + 3 + 1 and pair.metrics["answers"] > 0
    assert 0 <= after.metrics["accuracy"] <= 1 and after.parents[0].dir == pair.dir


class Steps:
    """A walk's steps that make each stage's own call in this process."""

    def __init__(self, at):
        self.at = at

    def run(self, stage, k, *inputs):
        return stage.call(self.at, k, *inputs)[0]
