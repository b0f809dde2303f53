"""The served policy's sampler (models/served.py) against a scripted server: what it asks, how a
reply becomes a Generation, and that a stage killed part way asks nothing twice, whichever process
made the calls before."""

from __future__ import annotations

import pytest

from ratchet.models.endpoint import EndpointConfig, EndpointError
from ratchet.models.sampler import SamplingParams, fits
from ratchet.models.served import ServedSampler
from tests.openai_stub import Failure, Stub


def reply(text: str, finish: str = "stop", tokens: int = 5) -> dict:
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "p",
            "choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens}}


def cfg(url: str, **kw) -> EndpointConfig:
    return EndpointConfig(base_url=url, model="p", retries=1, backoff_s=0.01, max_concurrency=2, **kw)


def test_each_completion_is_one_seeded_call_and_reads_as_a_local_engine_s(tmp_path):
    def answer(body):
        q = body["messages"][0]["content"]
        return reply("x" * 40, "length", 16) if q == "long" else reply(f"{q} -> 4 STOP and more", tokens=7)

    with Stub(answer, models=("p",)) as stub:
        sampler = ServedSampler(cfg(stub.url), tmp_path / "calls")
        params = SamplingParams(n=2, temperature=0.7, top_k=20, max_tokens=16, stop=("STOP",))
        out = sampler.generate(["2+2", "long"], params, seed=3)
    assert [len(row) for row in out] == [2, 2] and len(stub.requests) == 4
    first = out[0][0]
    # a stop string ends the text here and stays in it, as a local engine keeps it
    assert (first.text, first.stop, first.finish_reason, first.n_tokens) == ("2+2 -> 4 STOP", "STOP", "stop", 7)
    assert out[1][0].finish_reason == "length" and out[1][0].token_ids == ()
    seeds = [q["seed"] for q in stub.requests]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**31 for s in seeds)  # each completion its own draw
    assert all(q["top_k"] == 20 and q["temperature"] == 0.7 and "stop" not in q for q in stub.requests)
    with pytest.raises(ValueError, match="returns no token ids"):
        sampler.generate(["2+2"], SamplingParams(logprobs=True), seed=0)
    with pytest.raises(ValueError, match="cannot continue an assistant prefix"):
        sampler.generate(["2+2"], SamplingParams(), seed=0, prefixes=["Step 1:"])


def test_a_stage_killed_part_way_asks_only_for_what_no_process_was_answered(tmp_path):
    calls, seen = tmp_path / "calls", {"n": 0, "back": False}

    def down_after_three(body):  # the server goes away mid-stage, until it is back
        seen["n"] += 1
        return Failure(503) if seen["n"] > 3 and not seen["back"] else reply("ok")

    prompts = [f"q{i}" for i in range(6)]
    with Stub(down_after_three, models=("p",)) as stub:
        with pytest.raises(EndpointError, match="failed 2 time"):
            ServedSampler(cfg(stub.url), calls).generate(prompts, SamplingParams(), seed=1)
        (mine,) = calls.glob("*.jsonl")  # this process's journal, with the 3 answered
        mine.rename(calls / "another-worker.jsonl")  # read back as any process's
        seen["back"], before = True, len(stub.requests)
        out = ServedSampler(cfg(stub.url), calls).generate(prompts, SamplingParams(), seed=1)
    answered_first = [q["messages"][0]["content"] for q in stub.requests[:3]]
    again = [q["messages"][0]["content"] for q in stub.requests[before:]]
    assert len(again) == 3 and not set(again) & set(answered_first) and [r[0].text for r in out] == ["ok"] * 6


def test_a_prompt_is_measured_against_the_server_s_own_count_and_context(tmp_path):
    with Stub(lambda body: reply("ok"), models=("p",),
              tokenize=lambda body: {"count": len(body["messages"][0]["content"]), "max_model_len": 100}) as stub:
        sampler = ServedSampler(cfg(stub.url), tmp_path / "calls")
        assert fits(sampler, "x" * 60, 40, max_model_len=10) and sampler.context == 100  # the server's context
        assert not fits(sampler, "x" * 61, 40, max_model_len=4096)
    with Stub(lambda body: reply("ok"), models=("p",)) as stub:  # a server that does not count decides itself
        assert fits(ServedSampler(cfg(stub.url), tmp_path / "c2"), "x" * 5000, 40, max_model_len=10)
