"""A policy served elsewhere (`sampler.backend: served`): the sampler is an OpenAI-compatible
endpoint, for a model whose weights the user cannot train (a hosted API, or a `vllm serve` of a
model too large to train here). A round improves its text alone (`improve: prompt`).

    sampler:
      backend: served
      endpoint: {base_url: "http://127.0.0.1:8000/v1", model: policy, api_key_env: POLICY_API_KEY}

It speaks the chat API, text in and text out: the server applies the model's chat template, and
its token ids never come back. So it answers the rollouts whose turns are one generation of text
(`single`), not those that feed the model's own ids back (tool, environment, roles, reflection),
nor online training, which needs its log-probabilities. Every call is made as the served judge
makes them (models/endpoint.py): a key from the environment, retries, and each finished call
journaled by its content in the stage's `calls/` folder, one journal per process, so a resumed
stage asks the server for nothing it already answered.

Each completion is one call (not every server gives n choices), seeded by the stage seed, the
prompt's place and the completion's index: a server that honours `seed` (vLLM does) samples the
same text again, and a greedy one answers the same either way.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ratchet.models.endpoint import Endpoint, EndpointConfig
from ratchet.models.backends import Backend, Generation, SamplingParams, cut_at_stop

FIELD = "sampler.endpoint"
# what a rollout that needs more than text in and text out is told (tasks/rollouts/: multi_turn)
TEXT_ONLY = ("a served policy (sampler.backend=served) answers through the chat API, text in and text out: it "
             "returns no token ids")


def call_seed(seed: int, place: int, index: int) -> int:
    """The seed of one call: the stage's seed, the prompt's place in its batch and the completion's index."""
    h = hashlib.sha256(f"{seed}:{place}:{index}".encode()).digest()
    return int.from_bytes(h[:4], "big") >> 1  # below 2**31: what every server takes


class ServedBackend(Backend):
    """`sampler.backend: served`: the policy is the model behind `sampler.endpoint`; nothing of it runs here."""

    name, title = "served", "the served policy"
    local = False

    def open(self, model_dir, cfg, seed, sleep_mode=False, calls=None):
        """The endpoint, each call journaled in `calls` (a stage's shards/calls: `model_dir` where the
        stage gives its journals as the policy's place)."""
        return ServedSampler(cfg.endpoint, Path(calls if calls is not None else model_dir))

    def config_problems(self, cfg) -> list[str]:
        if cfg.endpoint is None:
            return ["backend='served' needs endpoint: {base_url: ..., model: ...} (where the policy is served); "
                    "or set backend: vllm"]
        return []

    def run_problems(self, pipeline) -> list[str]:
        """What a served policy cannot do: have its weights trained, start from weights of its own,
        or play a rollout that feeds its own token ids back."""
        cfg = pipeline
        at = f"sampler.backend='served' ({cfg.sampler.endpoint.where()})"
        out = []
        if cfg.trains_weights():
            out.append(f"{at}: the policy's weights are on its server and cannot be trained here, and improve="
                       f"{cfg.improve!r} trains them each round; set improve: prompt with a prompt.search (a round "
                       "then improves the text around each task prompt), or give a local model (model.path) with "
                       "sampler.backend: vllm")
        if cfg.cold_start is not None:
            out.append(f"{at}: cold_start fine-tunes the policy's weights, which are on its server; remove "
                       "cold_start")
        if cfg.model.path != "default" or cfg.model.prompt_format != "auto":
            out.append(f"{at}: the policy is the served model, so model.path={cfg.model.path!r} and "
                       f"model.prompt_format={cfg.model.prompt_format!r} are not read (its server applies its own "
                       "chat template); remove them from model, or set sampler.backend: vllm to run model.path here")
        rollouts = [("sample.rollout", cfg.sample.rollout),
                    *((f"evaluate.sets[{i}].rollout", s.rollout) for i, s in enumerate(cfg.evaluate.sets)
                      if s.rollout is not None)]
        for where, rollout in rollouts:
            if rollout.multi_turn:
                out.append(f"{where}.kind={rollout.kind!r} feeds the model's own token ids back each turn, and {at} "
                           "answers through the chat API, text in and text out; use sample.rollout.kind: single "
                           "(one answer a prompt), or a local model (sampler.backend: vllm)")
        return out

    def policy_mismatch(self, where) -> str:
        return (f"sampler.backend='served', and the policy in {where} has weights of its own here: a run from a "
                "local model samples it here; set sampler.backend: vllm (or hf), or start the run from the served "
                "policy's own versions")


class ServedSampler:
    """The Sampler interface (models/sampler.py) over a served model's chat API."""

    tokenizer = None  # the server's own: prompts are counted by it (`prompt_tokens`)

    def __init__(self, cfg: EndpointConfig, calls: Path):
        calls.mkdir(parents=True, exist_ok=True)
        mine = calls / f"{os.getpid()}.jsonl"
        self.endpoint = Endpoint(cfg, mine, reads=tuple(sorted(calls.glob("*.jsonl"))), at=FIELD)
        self._context: int | None = None

    def generate(self, prompts: list[str], params: SamplingParams, seed: int,
                 prefixes: list[str] | None = None) -> list[list[Generation]]:
        """`params.n` completions of each prompt, one call each. A stop string ends the text here, and
        stays in it, as the local engines keep it (a server leaves it out, and does not say which
        one stopped it, so it is not asked to stop there: it may write past the string)."""
        if prefixes and any(prefixes):
            raise ValueError(f"{TEXT_ONLY}, so it cannot continue an assistant prefix (a tree search's steps, a "
                             "judge's verdict)")
        if params.logprobs:
            raise ValueError(f"{TEXT_ONLY} or log-probabilities: online training cannot run on it")
        extra = {"top_k": params.top_k} if params.top_k else {}  # vLLM's and SGLang's; an OpenAI setting it is not
        requests = [{"messages": [{"role": "user", "content": p}], "max_tokens": params.max_tokens,
                     "temperature": params.temperature, "top_p": params.top_p, "seed": call_seed(seed, i, j),
                     **({"extra_body": extra} if extra else {})}
                    for i, p in enumerate(prompts) for j in range(params.n)]
        replies = self.endpoint.chat(requests)
        out, it = [], iter(replies)
        for _ in prompts:
            row = []
            for _ in range(params.n):
                r = next(it)
                row.append(_generation(r, params.stop))
            out.append(row)
        return out

    def prompt_tokens(self, text: str) -> int | None:
        """How many tokens the server reads for `text` as the user's message, its chat template and the
        assistant's opening included (vLLM's /tokenize); None where the server does not say."""
        counted = self.endpoint.count([{"role": "user", "content": text}])
        if counted is None:
            return None
        self._context = counted[1]
        return counted[0]

    @property
    def context(self) -> int | None:
        """The server's context in tokens, where a count has told it."""
        return self._context

    def metrics(self, prefix: str = "policy_") -> dict[str, float]:
        return self.endpoint.metrics(prefix)

    def close(self) -> None:
        self.endpoint.close()


def _generation(reply, stops: tuple[str, ...]) -> Generation:
    """A reply as a local engine's Generation. A call the server refused for what it asks (a prompt
    past its context, within the endpoint's budget of refusals) answers nothing, ended by length:
    the check scores it wrong, as it would a local engine's truncated answer."""
    if reply is None or not reply.texts:
        return Generation("", 0, "length")
    text, hit = cut_at_stop(reply.texts[0], stops)
    finish = "stop" if hit is not None else "length" if (reply.finish or [None])[0] == "length" else "stop"
    return Generation(text, reply.output_tokens, finish, hit)
