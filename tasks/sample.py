"""sample: n completions per train prompt from the current policy.

Prompts are cut into shards; each finished shard is written atomically to
shards/NNNNN.jsonl, seeded by (seed, shard index), so a resumed stage generates
only the missing shards and gets the same text it would have.

    ratchet run flows/configs/default.yaml   # runs this as part of a round
"""

from __future__ import annotations

import shutil
import time

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import failpoints
from ratchet.data.digest import sha256_json
from ratchet.data.manifest import StageManifest
from ratchet.data.records import Completion, Prompt, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.models.sampler import SamplerConfig, SamplingParams
from ratchet.tasks.stage import StageRequest, code_version, run_stage

CODE = code_version("ratchet.tasks.sample", "ratchet.models.sampler", "ratchet.data.records")


class SampleConfig(BaseModel):
    """How the policy's completions are drawn each round."""

    model_config = ConfigDict(extra="forbid")
    n: int = Field(default=8, ge=1, description="completions per prompt")
    temperature: float = Field(default=0.8, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling; <1 costs a full-vocab sort per step")
    top_k: int = Field(default=50, ge=0, description="top-k sampling (0 = off)")
    max_tokens: int = Field(default=48, ge=1, description="completion token limit")
    shard_size: int = Field(default=64, ge=1, description="prompts per shard (the unit of resume)")

    def params(self) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens
        )


def shard_seed(seed: int, shard: int) -> int:
    return int(sha256_json([seed, shard])[:8], 16)


def generate_shards(sampler, prompts: list[Prompt], params: SamplingParams, seed: int, shard_size: int,
                    shard_dir, progress: bool = True) -> dict[str, float]:
    """Fill shard_dir with every missing shard; returns generation metrics for this call."""
    from tqdm import tqdm

    shard_dir.mkdir(exist_ok=True)
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    tokens, gen_s, done_before = 0, 0.0, 0
    bar = tqdm(total=n_shards, desc="sample", unit="shard", disable=not progress)
    for s in range(n_shards):
        path = shard_dir / f"{s:05d}.jsonl"
        if path.exists():
            done_before += 1
            bar.update(1)
            continue
        chunk = prompts[s * shard_size : (s + 1) * shard_size]
        t = time.time()
        gens = sampler.generate([p.prompt for p in chunk], params, seed=shard_seed(seed, s))
        gen_s += time.time() - t
        rows = [
            Completion(prompt_id=p.id, prompt=p.prompt, answer=p.answer, index=i,
                       text=g.text, n_tokens=g.n_tokens, finish_reason=g.finish_reason)
            for p, gs in zip(chunk, gens) for i, g in enumerate(gs)
        ]
        tokens += sum(r.n_tokens for r in rows)
        write_jsonl(path, rows)
        failpoints.hit("sample:shard")
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / gen_s:.0f}" if gen_s else "-")
    bar.close()
    return {"gen_tokens": tokens, "gen_s": gen_s, "tokens_per_s": tokens / gen_s if gen_s else 0.0,
            "shards": n_shards, "shards_reused": done_before}


def sample_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    from ratchet.models.sampler import open_sampler
    from ratchet.tasks.prepare import model_dir

    cfg = SampleConfig.model_validate(req.config["sample"])
    prompts = read_jsonl(store.path(req.parent("prompts"), "train.jsonl"), Prompt)
    d = store.stage_dir(req.stage, req.key)
    t = time.time()
    sampler = open_sampler(model_dir(store, req.parent_model), SamplerConfig.model_validate(req.config["sampler"]),
                           seed=req.seed)
    load_s = time.time() - t
    m = generate_shards(sampler, prompts, cfg.params(), req.seed, cfg.shard_size, d / "shards")
    sampler.close()
    rows = [r for f in sorted((d / "shards").glob("*.jsonl")) for r in read_jsonl(f, Completion)]
    n = write_jsonl(d / "samples.jsonl", rows)
    shutil.rmtree(d / "shards")
    m.update(load_s=load_s, completions=n, prompts=len(prompts),
             mean_tokens=sum(r.n_tokens for r in rows) / max(n, 1),
             truncated_frac=sum(r.finish_reason == "length" for r in rows) / max(n, 1))
    return store.finish(stage=req.stage, round=req.round, key=req.key, code_version=req.code_version,
                        config=req.config, parents=req.parents, outputs={"samples.jsonl": n}, metrics=m,
                        info={"backend": req.config["sampler"]["backend"]}, started=req.started)


def sample(store: ArtifactStore, policy: StageManifest, prompts: StageManifest, cfg: SampleConfig,
           sampler: SamplerConfig, seed: int, round: int, isolate: bool = True) -> tuple[StageManifest, bool]:
    config = {"sample": cfg.model_dump(), "sampler": sampler.model_dump(), "seed": seed}
    return run_stage(store, stage="sample", round=round, body="ratchet.tasks.sample:sample_body", code=CODE,
                     config=config, parents=[policy, prompts], isolate=isolate, keep_partial=True)
