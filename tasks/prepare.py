"""The root stages of every pipeline: the prompt split and the base model, and each
round's draw of prompts.

`prompts` writes train.jsonl and eval.jsonl from the configured source.
`slice` writes the train prompts one round draws from that pool (data.prompts_per_round),
so the lineage of every model names the prompts it was trained on.
`base` links the starting model's files into the store, so a model is always a
stage directory with digests, whatever its origin.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import events
from ratchet.data.digest import sha256_file
from ratchet.data.errors import ConfigError
from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import SourceConfig, Split, load_split, pool_slice
from ratchet.data.records import LabeledCompletion, Prompt, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.models.prompt_format import TEMPLATE_FILE
from ratchet.tasks.runner.stage import StageRequest, run_stage



class PromptsJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    data: SourceConfig
    seed: int
    sources: dict[str, str] = Field(description="content digest of every file the data config reads")

    def summary(self, m: dict[str, float]) -> list[str]:
        if "train_prompts" not in m:  # a held-out set's prompts (prompts.<name>)
            return [f"{events.count(m.get('eval_prompts', 0))} held-out prompts"]
        n = events.count
        return [f"{n(m['train_prompts'])} train / {n(m.get('eval_prompts', 0))} held-out prompts"]


class SliceJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    start: int = Field(description="position in the pool's stream where this round's prompts begin")
    count: int = Field(description="data.prompts_per_round")
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        n = events.count
        return [f"{n(m.get('prompts', 0))} prompts from position {n(m.get('stream_start', 0))} of the pool "
                f"({n(m.get('pool', 0))}, pass {n(m.get('pass', 1))})"]


class BaseJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str = Field(description="model.path as the user gave it")
    path: str = Field(description="the model directory it resolved to")
    files: dict[str, str] = Field(description="sha256 of every file in it: the key, whatever the path")
    template: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                 description="the plain prompt format's chat template, written into the copy "
                                 "(model.prompt_format resolved to plain); None keeps the model's own")


def prompts_body(req: StageRequest[PromptsJob], store: ArtifactStore) -> StageManifest:
    src = req.config.data
    split = unchanged(req, load_split(src, req.seed), "data")
    if not split.train:
        raise ConfigError([f"data: the source {src.kind!r} yielded no train prompts; check data.path / data.train_size"])
    d = store.stage_dir(req.stage, req.key)
    n_tr = write_jsonl(d / "train.jsonl", split.train)
    n_ev = write_jsonl(d / "eval.jsonl", split.eval)
    with_answer = sum(p.answer is not None for p in split.train)
    return req.finish(store, outputs={"train.jsonl": n_tr, "eval.jsonl": n_ev},
                      metrics={"train_prompts": n_tr, "eval_prompts": n_ev, "train_with_answer": with_answer})


def prompts(store: ArtifactStore, data_cfg: SourceConfig, seed: int, sources: dict[str, str],
            run: str | None = None) -> tuple[StageManifest, bool]:
    """The train/eval split. `sources`: the content digest of every file the data config reads
    (load_split's digests), so an edited file, directory or dataset is a new stage."""
    return run_stage(store, stage="prompts", round=0, body=prompts_body,
                     config=PromptsJob(data=data_cfg, seed=seed, sources=sources), parents=[], run=run)


def unchanged(req: StageRequest[PromptsJob], split: Split, field: str) -> Split:
    """`split`, if every file it read still has the digest the run checked (req.config.sources);
    else a ConfigError naming each changed file's config field under `field`."""
    if split.digests != req.config.sources:
        changed = sorted(k for k in split.digests if split.digests[k] != req.config.sources.get(k))
        raise ConfigError([f"{field}.{k}={getattr(req.config.data, k)!r} changed after this run checked it; re-run "
                           "the command to start from the new content" for k in changed])
    return split


def held_out_body(req: StageRequest[PromptsJob], store: ArtifactStore) -> StageManifest:
    split = unchanged(req, req.config.data.held_out(req.seed), f"evaluate.sets ({req.stage.split('.', 1)[1]}).data")
    n = write_jsonl(store.stage_dir(req.stage, req.key) / "eval.jsonl", split.eval)
    return req.finish(store, outputs={"eval.jsonl": n}, metrics={"eval_prompts": n})


def held_out(store: ArtifactStore, name: str, data_cfg: SourceConfig, seed: int, sources: dict[str, str],
             run: str | None = None) -> tuple[StageManifest, bool]:
    """An extra held-out set's prompts (evaluate.sets): stage `prompts.<name>`, eval.jsonl only."""
    return run_stage(store, stage=f"prompts.{name}", round=0, body=held_out_body,
                     config=PromptsJob(data=data_cfg, seed=seed, sources=sources), parents=[], run=run)


def slice_body(req: StageRequest[SliceJob], store: ArtifactStore) -> StageManifest:
    pool = read_jsonl(store.path(pool_of(req), "train.jsonl"), Prompt)
    rows, where = pool_slice(pool, req.config.start, req.config.count, req.config.seed)
    n = write_jsonl(store.stage_dir(req.stage, req.key) / "train.jsonl", rows)
    return req.finish(store, outputs={"train.jsonl": n}, info=where,
                      metrics={"prompts": n, "pool": len(pool), "stream_start": req.config.start,
                               "pass": where["passes"][1]})


def round_prompts(store: ArtifactStore, prompts: StageManifest, start: int, count: int, seed: int, round: int,
                  run: str | None = None) -> tuple[StageManifest, bool]:
    """One round's train prompts: `count` of the pool's stream from position `start`."""
    return run_stage(store, stage="slice", round=round, body=slice_body,
                     config=SliceJob(start=start, count=count, seed=seed), parents=[prompts], run=run)


def train_prompts(req: StageRequest, store: ArtifactStore, as_read: bool = True) -> list[Prompt]:
    """The train prompts a round's stage works on: its round's draw, or the whole pool (what is left
    of it, where solved prompts leave it); `as_read`: each in the policy's text (else as the task
    gives it, for a search that puts each node's text around them)."""
    from ratchet.tasks.text import read_text, render

    drawn = ("slice", "pool", "curriculum")  # the round's own draw, what is left of the pool, or the curriculum's
    source = next((p for p in req.parents if p.stage in drawn), None) or req.parent("prompts")
    rows = read_jsonl(store.path(source, "train.jsonl"), Prompt)
    return render(rows, read_text(req, store)) if as_read else rows


def pool_of(req: StageRequest) -> StageManifest:
    """The pool a stage draws from: what is left of it (a `pool` stage), or the prompts stage's."""
    return next((p for p in req.parents if p.stage == "pool"), None) or req.parent("prompts")


# solved prompts leave the pool (data.retire_solved) -----------------------------------------------

class RetireJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    top: float = Field(description="the label's top reward: a prompt all of whose samples earned it is solved")

    def summary(self, m: dict[str, float]) -> list[str]:
        n = events.count
        return [f"{n(m.get('retired', 0))} of {n(m.get('pool', 0))} prompts solved by every sample leave the pool; "
                f"{n(m.get('left', 0))} left"]


def solved(rows, top: float) -> set[str]:
    """The prompts every one of whose rows (a round's samples) earned `top` or more."""
    best: dict[str, bool] = {}
    for r in rows:
        best[r.prompt_id] = best.get(r.prompt_id, True) and r.reward is not None and r.reward >= top
    return {k for k, v in best.items() if v}


def scored_rows(store: ArtifactStore, scored: StageManifest) -> list[LabeledCompletion]:
    """A round's samples with their rewards: its label stage's rows, or every step's rollouts of an
    online train stage."""
    names = [n for n in scored.outputs if n == "labels.jsonl" or (n.startswith("rollouts/") and n.endswith(".jsonl"))]
    return [r for n in sorted(names) for r in read_jsonl(store.path(scored, n), LabeledCompletion)]


def retire_body(req: StageRequest[RetireJob], store: ArtifactStore) -> StageManifest:
    from ratchet.data.errors import EmptyStageError

    pool = read_jsonl(store.path(pool_of(req), "train.jsonl"), Prompt)
    scored = next(p for p in req.parents if p.stage in ("label", "train"))
    done = solved(scored_rows(store, scored), req.config.top)
    left = [p for p in pool if p.id not in done]
    if not left:
        raise EmptyStageError(f"every one of the pool's {len(pool)} train prompts was solved by every sample in round "
                              f"{scored.round}: nothing is left to learn from them. The model is done with this task: "
                              "give it harder prompts, or set data.retire_solved=false to train on solved ones")
    d = store.stage_dir(req.stage, req.key)
    n = write_jsonl(d / "train.jsonl", left)
    gone = write_jsonl(d / "retired.jsonl", [p for p in pool if p.id in done])
    return req.finish(store, outputs={"train.jsonl": n, "retired.jsonl": gone},
                      metrics={"pool": len(pool), "retired": gone, "left": n})


def retire(store: ArtifactStore, pool: StageManifest, scored: StageManifest, top: float, round: int,
           run: str | None = None) -> tuple[StageManifest, bool]:
    """Round `round`'s pool: `pool` without the prompts every sample of the round before solved
    (`scored`: its label stage, or its online train stage), keyed by that stage."""
    return run_stage(store, stage="pool", round=round, body=retire_body, config=RetireJob(top=top),
                     parents=[pool, scored], run=run)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def model_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def base_body(req: StageRequest[BaseJob], store: ArtifactStore) -> StageManifest:
    src = Path(req.config.path)
    d = store.stage_dir(req.stage, req.key) / "model"
    d.mkdir(parents=True, exist_ok=True)
    for f in model_files(src):
        _link_or_copy(f, d / f.name)
    if req.config.template is not None:  # a new file: a linked one is the user's own, never written
        (d / TEMPLATE_FILE).unlink(missing_ok=True)
        (d / TEMPLATE_FILE).write_text(req.config.template, encoding="utf-8")
    return req.finish(store, outputs={f"model/{f.name}": None for f in model_files(d)},
                      info={"source": req.config.source, "origin_path": str(src)})


def base_model(store: ArtifactStore, source: str, model_dir: Path, run: str | None = None,
               stage: str = "base", field: str = "model.path", template: str | None = None,
               ) -> tuple[StageManifest, bool]:
    """The starting policy as a store stage; keyed by the weights' digest, not the path.
    stage="label-model": a label's fixed model (a judge or a reward model), the same way.
    `template`: a chat template the copy reads prompts with instead of its own (the plain format)."""
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not weights:
        raise ConfigError([f"{field}={str(model_dir)!r} has no *.safetensors or *.bin weights; "
                           f"point {field} at a Hugging Face model directory"])
    digests = {f.name: sha256_file(f) for f in model_files(model_dir)}
    return run_stage(store, stage=stage, round=0, body=base_body,
                     config=BaseJob(source=source, path=str(model_dir), files=digests, template=template),
                     parents=[], run=run)


SERVED = "served.json"  # a served policy's base stage holds this, not weights


class ServedJob(BaseModel):
    """A served policy as the run's base stage (sampler.backend=served): its identity is its
    endpoint and model name (what keys every stage after it); no weights are here."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str = Field(default="served", description="where the policy comes from")
    base_url: str = Field(description="the server's API root")
    model: str = Field(description="the model name it serves")


def served_body(req: StageRequest[ServedJob], store: ArtifactStore) -> StageManifest:
    import json

    d = store.stage_dir(req.stage, req.key)
    (d / SERVED).write_text(json.dumps({"base_url": req.config.base_url, "model": req.config.model}, indent=2) + "\n")
    return req.finish(store, outputs={SERVED: None}, info={
        "source": "served", "summary": f"the policy {req.config.model!r} served at {req.config.base_url} (its "
                                       "weights are not here: a round improves its text alone)"})


def served_model(store: ArtifactStore, base_url: str, model: str, run: str | None = None) -> tuple[StageManifest, bool]:
    """The base stage of a run whose policy is served elsewhere: keyed by its endpoint and model
    name, as a local base is by its weights' digests."""
    return run_stage(store, stage="base", round=0, body=served_body,
                     config=ServedJob(base_url=base_url, model=model), parents=[], run=run)


def is_served(store: ArtifactStore, m: StageManifest) -> bool:
    """Whether a policy (a model, or a pair) is a served one: its weights are elsewhere."""
    from ratchet.tasks.text import weights_of

    return SERVED in weights_of(store, m).outputs


def open_policy(store: ArtifactStore, policy: StageManifest, sampler, seed: int, calls: Path):
    """An engine on the policy: a local one on its weights, or, for a served policy, its endpoint,
    each call journaled in `calls` (models/served.py)."""
    if (sampler.backend == "served") != is_served(store, policy):
        raise ConfigError([served_mismatch(sampler.backend, store.dir_of(policy))])
    if sampler.backend == "served":
        from ratchet.models.served import ServedSampler

        return ServedSampler(sampler.endpoint, calls)
    from ratchet.models.sampler import open_sampler

    return open_sampler(model_dir(store, policy), sampler, seed=seed)


def served_mismatch(backend: str, where) -> str:
    """What is wrong when the policy and the sampler disagree on where the policy is."""
    if backend == "served":
        return (f"sampler.backend='served', and the policy in {where} has weights of its own here: a run from a "
                "local model samples it here; set sampler.backend: vllm (or hf), or start the run from the served "
                "policy's own versions")
    return (f"sampler.backend={backend!r}, and the policy in {where} is served elsewhere (its weights are not "
            "here); set sampler.backend: served with its endpoint")


def model_dir(store: ArtifactStore, m: StageManifest, remake_here: bool = True) -> Path:
    """The model directory a base or train stage produced (a pair's: its weights'); its merged
    weights made again first where `ratchet gc --models` dropped them (see `remade`)."""
    from ratchet.tasks.text import weights_of

    m = weights_of(store, m)
    if store.dropped(m):
        remade(store, m, here=remake_here)
    return store.dir_of(m) / "model"


def remade(store: ArtifactStore, m: StageManifest, here: bool = True) -> None:
    """Make a train stage's dropped merged weights again from its adapter and the model it trained
    from (itself made again first where dropped), under the stage's lock, and check every file
    against the manifest's digests: the stage is whole again, byte for byte, or this raises.
    `here`: merge in this process (a stage worker, which has torch); else in a child of its own."""
    from ratchet.data.errors import ArtifactError
    from ratchet.data.manifest import read_manifest
    from ratchet.models.trainer import remake
    from ratchet.tasks.runner.stage import MODEL_STAGES, TEXT_STAGES

    parent = next((p for p in m.parents if p.stage in MODEL_STAGES or p.stage in TEXT_STAGES), None)
    if m.stage != "train" or parent is None or not (store.dir_of(m) / "adapter").is_dir():
        raise ArtifactError(f"{store.dir_of(m)}: its dropped outputs {store.dropped(m)['outputs']} cannot be made "
                            "again (only a LoRA train stage's merged weights can)")
    base = read_manifest(store.root / parent.dir)
    if base is None:
        raise ArtifactError(f"{store.dir_of(m)} was trained from {store.root / parent.dir}, which is gone: its "
                            "dropped weights cannot be made again")
    base_dir = model_dir(store, base, here)
    with store.lock(m.stage, m.key):
        if not store.dropped(m):  # another process made them meanwhile
            return
        if here:
            remake.main(str(base_dir), str(store.dir_of(m)))
        else:
            from ratchet.data.procs import forkserver

            forkserver.call_apart(remake, str(base_dir), str(store.dir_of(m)))
        try:
            store.restored(m)
        except ArtifactError as e:
            raise ArtifactError(f"{store.dir_of(m)}: its merged weights were made again but differ from what "
                                f"training wrote ({e}); this machine's merge is not the one that made them. "
                                "Run the stage again: delete the stage directory and re-run the command") from e
