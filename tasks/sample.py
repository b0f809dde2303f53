"""sample: n completions per train prompt from the current policy.

Prompts are cut into units (tasks/runner/units.py); each finished unit is written atomically
to shards/NNNNN.jsonl, seeded by (seed, unit index), so a resumed stage generates only
the missing units and gets the same text it would have.

    ratchet run flows/configs/default.yaml   # runs this as part of a round
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ratchet.data import events
from ratchet.data.manifest import StageManifest
from ratchet.data.records import Completion, Prompt, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.models.sampler import SamplerConfig, SamplingParams
from ratchet.tasks.prepare import train_prompts
from ratchet.tasks.rollouts import Rollout
from ratchet.tasks.rollouts.environment import EnvironmentRollout
from ratchet.tasks.rollouts.reflection import ReflectionRollout
from ratchet.tasks.rollouts.roles import RolesRollout
from ratchet.tasks.rollouts.single import SingleRollout
from ratchet.tasks.rollouts.tool import ToolRollout
from ratchet.data.kinds import members
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest
from ratchet.tasks.runner.units import ExecutorConfig, UnitWork, run_units

# The rollout kinds (tasks/rollouts/), one line each: how a prompt becomes a completion or a trajectory
RolloutConfig = Annotated[SingleRollout | ToolRollout | EnvironmentRollout | ReflectionRollout | RolesRollout,
                          Field(discriminator="kind")]
ROLLOUTS: dict[str, type[Rollout]] = members(RolloutConfig)


class SparseRollout(BaseModel):
    """A config dumped without its rollout where that is the default (single): a config that
    never set one keeps the bytes, and so the stage keys, it had before rollouts were a kind."""

    @model_serializer(mode="wrap")
    def _sparse(self, handler):
        out = handler(self)
        if isinstance(out, dict) and out.get("rollout") == {"kind": "single"}:
            out.pop("rollout")
        return out


class SampleConfig(SparseRollout):
    """How the policy's completions are drawn each round."""

    model_config = ConfigDict(extra="forbid")
    n: int = Field(default=8, ge=1, description="completions per prompt")
    temperature: float = Field(default=0.8, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling; <1 costs a full-vocab sort per step")
    top_k: int = Field(default=50, ge=0, description="top-k sampling (0 = off)")
    max_tokens: int = Field(default=48, ge=1, description="completion token limit")
    shard_size: int = Field(default=64, ge=1, description="prompts per shard (the unit of resume)")
    rollout: RolloutConfig = Field(default_factory=SingleRollout, description="how a prompt becomes a completion: "
                                   "single (one generation), tool (the model runs Python mid-answer), environment "
                                   "(episodes against an environment), reflection (an environment's episodes, a "
                                   "reflection after a failed one, and another attempt with it) or roles (agents in "
                                   "roles play an environment's episodes: analysts report, a manager acts)")

    def params(self) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens
        )


class SampleJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    sample: SampleConfig
    sampler: SamplerConfig
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        out = [f"{events.count(m.get('completions', 0))} completions", f"{m.get('tokens_per_s', 0):.0f} tok/s"]
        out += [f"{m['truncated_frac']:.0%} truncated"] if m.get("truncated_frac") else []
        return out + self.sample.rollout.summary(m)


@dataclass
class PolicyWork(UnitWork):
    """Units that run on a sampler over the stage's policy (sample, judge, MCTS, evaluate)."""

    model: Path  # the policy's model directory
    sampler: SamplerConfig
    seed: int
    items: list
    size: int
    calls: Path | None = field(default=None, kw_only=True)  # a served policy's journals (models/served.py)

    def open(self, lent=None):
        from ratchet.models import warm
        from ratchet.models.sampler import open_sampler

        if lent is not None and self.sampler.backend_kind.local:  # the run's engine, its weights swapped if need be
            return warm.WarmSampler(self.model, self.sampler, seed=self.seed, address=lent.address,
                                    threads=lent.threads)
        return open_sampler(self.model, self.sampler, seed=self.seed, calls=self.calls)


def policy_of(req: StageRequest, store: ArtifactStore) -> dict:
    """The PolicyWork fields a stage's request decides: its policy's model directory (a served
    policy's: where its calls are journaled), the sampler settings and the stage seed."""
    from ratchet.tasks.prepare import model_dir, sampler_fits

    sampler, policy = req.config.sampler, req.parent_model
    sampler_fits(store, policy, sampler)
    if not sampler.backend_kind.local:
        calls = store.stage_dir(req.stage, req.key) / "shards" / "calls"
        return {"model": calls, "sampler": sampler, "seed": req.seed, "calls": calls}
    return {"model": model_dir(store, policy), "sampler": sampler, "seed": req.seed}


@dataclass
class SampleWork(PolicyWork):
    """A unit: `n` completions (or trajectories) for each of `size` prompts, seeded by (seed, unit)."""

    stage = "sample"
    rate = ("gen_tokens", "gen_s", "tok/s")
    params: SamplingParams
    rollout: Rollout = field(default_factory=SingleRollout)  # the rollout kind (tasks/rollouts/)

    def run(self, sampler, chunk: list[Prompt], seed: int):
        t = time.time()
        rows, cost = self.rollout.roll(sampler, chunk, self.params, seed)
        return rows, {**cost, "gen_s": time.time() - t}


def sample_body(req: StageRequest[SampleJob], store: ArtifactStore) -> StageManifest:
    from ratchet.tasks.text import read_text

    cfg = req.config.sample
    prompts = train_prompts(req, store)
    d = store.stage_dir(req.stage, req.key)
    rollout = cfg.rollout.with_text(read_text(req, store))
    done = run_units(SampleWork(items=prompts, size=cfg.shard_size, params=cfg.params(), rollout=rollout,
                                **policy_of(req, store)), d / "shards", req.executor, req.engine)
    rows = [Completion.model_validate_json(x) for x in done.shards.lines()]
    n = write_jsonl(d / "samples.jsonl", rows)
    m = done.cost
    m.update(tokens_per_s=m["gen_tokens"] / m["gen_s"] if m.get("gen_s") else 0.0, shards=float(done.shards.n),
             shards_reused=float(done.reused), holders=done.holders, load_s=done.load_s,
             completions=n, prompts=len(prompts),
             mean_tokens=sum(r.n_tokens for r in rows) / max(n, 1),
             truncated_frac=sum(r.finish_reason == "length" for r in rows) / max(n, 1))
    m.update(cfg.rollout.metrics(m))
    return req.finish(store, outputs={"samples.jsonl": n}, metrics=m, info={"backend": req.config.sampler.backend, "units": done.placement},
                      scratch=("shards",))


def sample(store: ArtifactStore, policy: StageManifest, prompts: StageManifest, cfg: SampleConfig,
           sampler: SamplerConfig, seed: int, round: int, isolate: bool = True,
           run: str | None = None, executor: ExecutorConfig | None = None) -> Made:
    return STAGE.run(store, round=round, config=SampleJob(sample=cfg, sampler=sampler, seed=seed),
                     parents=[policy, prompts], isolate=isolate, keep_partial=True, run=run, executor=executor)


def sample_step(at: At, k: int, policy: StageManifest, prompts: StageManifest) -> Made:
    """Round k's samples of `policy` on its train prompts (sample:, sampler:)."""
    cfg = at.cfg
    return sample(at.store, policy, prompts, cfg.sample, cfg.sampler, at.seed(k), k, isolate=cfg.isolate, run=at.run,
                  executor=cfg.executor)


STAGE = Stage("sample", "data", sample_body, sample_step, Records(datasets=(("samples.jsonl", "samples"),)))
