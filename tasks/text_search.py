"""The search stage: a round's search for a better text over the same weights (prompt.search).

Its kinds, one module each, one class with its settings and its body:

    prompt_agent  PromptAgent's tree search over prompts, each revision written from the errors
                  of the prompt it revises (tasks/searches/prompt_agent.py)
    beliefs       FinCon's verbal reinforcement: a roles rollout's episodes compared in better and
                  worse pairs, and the beliefs that separate them written into the roles they
                  concern (tasks/searches/beliefs.py)

Either way the stage's parents are the policy (weights, or a pair whose text it starts from)
and the round's train prompts, and it writes a pair: the same weights and the text it chose.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import SourceConfig
from ratchet.data.store import ArtifactStore
from ratchet.models.sampler import SamplerConfig
from ratchet.tasks.searches.beliefs import BeliefsSearch, beliefs_body
from ratchet.tasks.searches.prompt_agent import PromptAgentSearch, prompt_agent_body
from ratchet.tasks.sample import RolloutConfig
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest

# the search kinds: one member each
SearchConfig = Annotated[PromptAgentSearch | BeliefsSearch, Field(discriminator="kind")]


class SearchJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    search: SearchConfig
    data: SourceConfig  # the task's check scores the answers (or the episodes)
    rollout: RolloutConfig  # how a prompt becomes an answer or an episode (sample.rollout)
    max_tokens: int  # one answer's tokens (evaluate.max_tokens: answers are greedy, as evaluated)
    sampler: SamplerConfig
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        return self.search.summary(m)


def search_body(req: StageRequest[SearchJob], store: ArtifactStore) -> StageManifest:
    body = beliefs_body if isinstance(req.config.search, BeliefsSearch) else prompt_agent_body
    return body(req, store)


def search(store: ArtifactStore, policy: StageManifest, prompts: StageManifest, cfg: SearchConfig,
           data: SourceConfig, rollout: RolloutConfig, max_tokens: int, sampler: SamplerConfig, seed: int, round: int,
           isolate: bool = True, run: str | None = None, optimiser: StageManifest | None = None) -> Made:
    """The text a search finds from `policy` on the round's train prompts: a pair of the policy's
    weights and the chosen text; `optimiser`: the optimiser's own model (an optimiser-model
    stage), where it is one."""
    job = SearchJob(search=cfg, data=data.pool(), rollout=rollout, max_tokens=max_tokens, sampler=sampler, seed=seed)
    return STAGE.run(store, round=round, config=job, parents=[policy, prompts, *([optimiser] if optimiser else [])],
                     isolate=isolate, keep_partial=True, run=run)


def search_step(at: At, k: int, policy: StageManifest, prompts: StageManifest,
                optimiser: StageManifest | None = None) -> Made:
    """Round k's search (prompt.search), on its train prompts; answers greedy, as evaluated."""
    cfg = at.cfg
    return search(at.store, policy, prompts, cfg.prompt.search, cfg.data, cfg.sample.rollout, cfg.evaluate.max_tokens,
                  cfg.sampler, at.seed(k), k, isolate=cfg.isolate, run=at.run, optimiser=optimiser)


# the tree of prompts, or the beliefs, for inspection
STAGE = Stage("search", "text", search_body, search_step, Records(
    artifacts=("nodes.jsonl", "refused.json", "versions.jsonl", "prompt.json"), artifact_path="search"))
