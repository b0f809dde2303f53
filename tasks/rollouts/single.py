"""sample.rollout.kind=single: one generation per completion, the prompt as the user's message."""

from __future__ import annotations

from typing import Literal

from ratchet.data.records import Completion, Prompt
from ratchet.models.sampler import SamplingParams
from ratchet.tasks.rollouts import Rollout


class SingleRollout(Rollout):
    """One generation per completion: a plain completion, no turns."""

    kind: Literal["single"] = "single"

    def roll(self, sampler, prompts: list[Prompt], params: SamplingParams,
             seed: int) -> tuple[list[Completion], dict[str, float]]:
        gens = sampler.generate([p.prompt for p in prompts], params, seed=seed)
        rows = [Completion(prompt_id=p.id, prompt=p.prompt, answer=p.answer, fields=p.fields, index=i,
                           text=g.text, n_tokens=g.n_tokens, finish_reason=g.finish_reason)
                for p, gs in zip(prompts, gens) for i, g in enumerate(gs)]
        return rows, {"gen_tokens": sum(r.n_tokens for r in rows)}
