"""sample.rollout.kind=single: one generation per completion, the prompt as the user's message."""

from __future__ import annotations

from typing import Literal

from ratchet.data.records import Completion, Prompt, Segment
from ratchet.models.sampler import SamplingParams, chat_token_ids, ended_turns
from ratchet.tasks.rollouts import Rollout


class SingleRollout(Rollout):
    """One generation per completion: a plain completion, no turns."""

    kind: Literal["single"] = "single"

    def roll(self, sampler, prompts: list[Prompt], params: SamplingParams,
             seed: int) -> tuple[list[Completion], dict[str, float]]:
        if params.logprobs:  # online RL trains on the ids and log-probabilities the engine sampled
            return self._tokens(sampler, prompts, params, seed)
        gens = sampler.generate([p.prompt for p in prompts], params, seed=seed)
        rows = [Completion(prompt_id=p.id, prompt=p.prompt, answer=p.answer, fields=p.fields, level=p.level, index=i,
                           text=g.text, n_tokens=g.n_tokens, finish_reason=g.finish_reason)
                for p, gs in zip(prompts, gens) for i, g in enumerate(gs)]
        return rows, {"gen_tokens": sum(r.n_tokens for r in rows)}

    def _tokens(self, sampler, prompts: list[Prompt], params: SamplingParams,
                seed: int) -> tuple[list[Completion], dict[str, float]]:
        """The same generations as rows that keep their prompt's ids and one model segment: the
        ids the engine produced and their log-probabilities."""
        tok = sampler.tokenizer
        contexts = chat_token_ids(tok, [p.prompt for p in prompts])
        gens = ended_turns(tok, sampler.generate_ids, contexts, params, seed)
        rows = [Completion(prompt_id=p.id, prompt=p.prompt, answer=p.answer, fields=p.fields, level=p.level, index=i,
                           text=g.text, n_tokens=g.n_tokens, finish_reason=g.finish_reason, prompt_ids=tuple(ids),
                           segments=(Segment(role="model", text=g.text, token_ids=g.token_ids,
                                             logprobs=g.logprobs or None),))
                for p, ids, gs in zip(prompts, contexts, gens) for i, g in enumerate(gs)]
        return rows, {"gen_tokens": sum(r.n_tokens for r in rows)}
