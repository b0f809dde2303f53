"""The root stages of every pipeline: the prompt split and the base model, and each
round's draw of prompts.

`prompts` writes train.jsonl and eval.jsonl from the configured source.
`slice` writes the train prompts one round draws from that pool (data.prompts_per_round),
so the lineage of every model names the prompts it was trained on.
`base` links the starting model's files into the store, so a model is always a
stage directory with digests, whatever its origin.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import events
from ratchet.data.digest import batched, known_sha256, link_or_copy
from ratchet.data.errors import ConfigError
from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import SourceConfig, Split, load_split, pool_slice
from ratchet.data.records import LabeledCompletion, Prompt, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.models.prompt_format import TEMPLATE_FILE
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest

# A run's sources (the digests of the files its data reads, as the run checked them): the task's
# own under their config fields, a held-out set's under SETS<name>.<field>, the demonstrations' DEMOS.
SETS = "evaluate."
DEMOS = "cold_start.demonstrations"


def sources_of(sources: dict[str, str], name: str | None = None) -> dict[str, str]:
    """The file digests of the task's data (name None) or of one held-out set, out of a run's
    `sources` (flows/inputs.py check_inputs's digests)."""
    if name is None:
        return {k: v for k, v in sources.items() if not k.startswith(SETS) and k != DEMOS}
    head = f"{SETS}{name}."
    return {k[len(head):]: v for k, v in sources.items() if k.startswith(head)}



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
            run: str | None = None) -> Made:
    """The train/eval split. `sources`: the content digest of every file the data config reads
    (load_split's digests), so an edited file, directory or dataset is a new stage."""
    return PROMPTS.run(store, round=0, config=PromptsJob(data=data_cfg, seed=seed, sources=sources), parents=[],
                       run=run)


def prompts_step(at: At, k: int = 0) -> Made:
    """The run's split of the task's data (data:, its pool), by the digests the run checked."""
    return prompts(at.store, at.cfg.data.pool(), at.cfg.seed, sources_of(at.sources), run=at.run)


PROMPTS = Stage("prompts", "data", prompts_body, prompts_step, Records(
    on="run", datasets=(("train.jsonl", "train-prompts"), ("eval.jsonl", "eval-prompts")), log=False))


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
             run: str | None = None) -> Made:
    """An extra held-out set's prompts (evaluate.sets): stage `prompts.<name>`, eval.jsonl only."""
    return HELD_OUT.run(store, name=f"prompts.{name}", round=0, parents=[], run=run,
                        config=PromptsJob(data=data_cfg, seed=seed, sources=sources))


def held_out_step(at: At, k: int, name: str, data_cfg: SourceConfig) -> Made:
    """A held-out set's own prompts in a run (evaluate.sets[i].data), by the digests the run checked."""
    return held_out(at.store, name, data_cfg, at.cfg.seed, sources_of(at.sources, name), run=at.run)


HELD_OUT = Stage("prompts", "data", held_out_body, held_out_step, Records(
    on="run", datasets=(("eval.jsonl", "eval-prompts-{suffix}"),), log=False))


def slice_body(req: StageRequest[SliceJob], store: ArtifactStore) -> StageManifest:
    pool = read_jsonl(store.path(pool_of(req), "train.jsonl"), Prompt)
    rows, where = pool_slice(pool, req.config.start, req.config.count, req.config.seed)
    n = write_jsonl(store.stage_dir(req.stage, req.key) / "train.jsonl", rows)
    return req.finish(store, outputs={"train.jsonl": n}, info=where,
                      metrics={"prompts": n, "pool": len(pool), "stream_start": req.config.start,
                               "pass": where["passes"][1]})


def round_prompts(store: ArtifactStore, prompts: StageManifest, start: int, count: int, seed: int, round: int,
                  run: str | None = None) -> Made:
    """One round's train prompts: `count` of the pool's stream from position `start`."""
    return SLICE.run(store, round=round, config=SliceJob(start=start, count=count, seed=seed), parents=[prompts],
                     run=run)


def slice_step(at: At, k: int, first: int, prompts: StageManifest) -> Made:
    """Round k's train prompts: the next data.prompts_per_round of the pool's stream (the run starts
    at `at.pool_start`; its first round is first + 1)."""
    count = at.cfg.data.prompts_per_round
    return round_prompts(at.store, prompts, at.pool_start + (k - first - 1) * count, count, at.cfg.seed, k, run=at.run)


SLICE = Stage("slice", "data", slice_body, slice_step, Records(datasets=(("train.jsonl", "round-prompts"),), log=False),
              tags=lambda m: {"ratchet.prompts": m.info["summary"]})


def train_prompts(req: StageRequest, store: ArtifactStore, as_read: bool = True) -> list[Prompt]:
    """The train prompts a round's stage works on: its round's draw, or the whole pool (what is left
    of it, where solved prompts leave it); `as_read`: each in the policy's text (else as the task
    gives it, for a search that puts each node's text around them)."""
    from ratchet.tasks.text import read_text, render

    source = req.holding("train.jsonl")  # the round's draw, what is left of the pool, its curriculum's, or the pool
    rows = read_jsonl(store.path(source, "train.jsonl"), Prompt)
    return render(rows, read_text(req, store)) if as_read else rows


def pool_of(req: StageRequest) -> StageManifest:
    """The pool a stage draws from: what is left of it (a `pool` stage), or the prompts stage's."""
    return req.holding("train.jsonl")


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


def _scored_files(m: StageManifest) -> list[str]:
    return sorted(n for n in m.outputs if n == "labels.jsonl" or (n.startswith("rollouts/") and n.endswith(".jsonl")))


def scored_rows(store: ArtifactStore, scored: StageManifest) -> list[LabeledCompletion]:
    """A round's samples with their rewards: its label stage's rows, or every step's rollouts of an
    online train stage."""
    return [r for n in _scored_files(scored) for r in read_jsonl(store.path(scored, n), LabeledCompletion)]


def scored_parent(req: StageRequest) -> StageManifest | None:
    """The parent holding a round's samples with their rewards (`scored_rows`), if one was given."""
    return next((p for p in req.parents if _scored_files(p)), None)


def retire_body(req: StageRequest[RetireJob], store: ArtifactStore) -> StageManifest:
    from ratchet.data.errors import EmptyStageError

    pool = read_jsonl(store.path(pool_of(req), "train.jsonl"), Prompt)
    scored = scored_parent(req)
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
           run: str | None = None) -> Made:
    """Round `round`'s pool: `pool` without the prompts every sample of the round before solved
    (`scored`: its label stage, or its online train stage), keyed by that stage."""
    return POOL.run(store, round=round, config=RetireJob(top=top), parents=[pool, scored], run=run)


def retire_step(at: At, k: int, pool: StageManifest, scored: StageManifest) -> Made:
    """Round k's pool (data.retire_solved): a prompt whose every sample earned the label's top reward
    is solved."""
    return retire(at.store, pool, scored, at.cfg.label.reward_range()[1], k, run=at.run)


POOL = Stage("pool", "data", retire_body, retire_step, Records(on="run", metrics=("retired", "left"), prefix="pool.",
                                                          log=False))


def model_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def base_body(req: StageRequest[BaseJob], store: ArtifactStore) -> StageManifest:
    src = Path(req.config.path)
    d = store.stage_dir(req.stage, req.key) / "model"
    d.mkdir(parents=True, exist_ok=True)
    with batched():  # the stat cache written once
        for f in model_files(src):
            link_or_copy(f, d / f.name)
    if req.config.template is not None:  # a new file: a linked one is the user's own, never written
        (d / TEMPLATE_FILE).unlink(missing_ok=True)
        (d / TEMPLATE_FILE).write_text(req.config.template, encoding="utf-8")
    return req.finish(store, outputs={f"model/{f.name}": None for f in model_files(d)},
                      info={"source": req.config.source, "origin_path": str(src)})


def base_model(store: ArtifactStore, source: str, model_dir: Path, run: str | None = None,
               stage: Stage | None = None, field: str = "model.path", template: str | None = None) -> Made:
    """A model as a store stage (BASE, or a label's or search's own model: LABEL_MODEL,
    OPTIMISER_MODEL); keyed by the weights' digest, not the path. `template`: a chat template the
    copy reads prompts with instead of its own (the plain format)."""
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not weights:
        raise ConfigError([f"{field}={str(model_dir)!r} has no *.safetensors or *.bin weights; "
                           f"point {field} at a Hugging Face model directory"])
    with batched():
        digests = {f.name: known_sha256(f) for f in model_files(model_dir)}
    return (stage or BASE).run(store, round=0, parents=[], run=run,
                               config=BaseJob(source=source, path=str(model_dir), files=digests, template=template))


def model_stage(at: At, stage: Stage, src: str, field: str, fmt: str | None) -> Made:
    """A model the config names (`src`, at config field `field`) as its stage: found (made or
    fetched by a run; looked for by the plan), keyed by its weights and by the template its copy
    reads prompts with: `fmt` (model.prompt_format, or "auto" for a model that chats; None: its
    own, unread)."""
    from ratchet.models.locate import find_model

    path = find_model(src, field, fetch=not at.planning)
    if path is None:
        return at.unknown(stage, 0, f"{field}={src!r} is converted (the embedded default) or fetched on first "
                                    "use; nothing of it is here yet")
    template = None if fmt is None else written_template(path, fmt, at.cfg.model.plain_layout)
    return base_model(at.store, src, path, run=at.run, stage=stage, field=field, template=template)


def written_template(path: Path, fmt: str, layout: str) -> str | None:
    """models/prompt_format.written_template: the template a model's copy reads prompts with. For
    `auto`, where its files do not say the tokenizer chats, from its tokenizer, loaded in another
    process (a child of the run's fork server, or a fresh one for `ratchet plan`): transformers
    imports torch, which the run's own process never does."""
    from ratchet.models import prompt_format

    if fmt != "auto":  # no tokenizer read
        return prompt_format.written_template(path, fmt, layout)
    if prompt_format.chats_by_its_files(path):  # what loading its tokenizer would say
        return None
    return apart(prompt_format.written_template, path, fmt, layout)


def apart(fn, *args):
    """`fn(*args)` in another process: a child of the run's fork server where there is one (`ratchet
    run`), else a fresh one (`ratchet plan`)."""
    from ratchet.data.procs import forkserver
    from ratchet.tasks.runner.stage import READS_MODELS

    if forkserver.current() is not None:
        return forkserver.call(fn, *args, after=READS_MODELS)
    return forkserver.call_apart(fn, *args)


def base_step(at: At, k: int = 0) -> Made:
    """The run's starting policy: the model.path model, or a served one (its endpoint)."""
    cfg = at.cfg
    if (served := cfg.sampler.endpoint) is not None:
        return served_model(at.store, served.base_url, served.model, run=at.run)
    return model_stage(at, BASE, cfg.model.path, "model.path", cfg.model.prompt_format)


def label_model_step(at: At, k: int = 0) -> Made:
    """The label's own fixed model (a judge or a reward model, label.model)."""
    cfg = at.cfg
    return model_stage(at, LABEL_MODEL, cfg.label.fixed_model(), "label.model", "auto" if cfg.label.chats else None)


def optimiser_model_step(at: At, k: int = 0) -> Made:
    """The search's optimiser model (prompt.search.optimiser.kind=model)."""
    return model_stage(at, OPTIMISER_MODEL, at.cfg.prompt.optimiser_model(), "prompt.search.optimiser.path", "auto")


SERVED_FILE = "served.json"  # a served policy's base stage holds this, not weights


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
    (d / SERVED_FILE).write_text(json.dumps({"base_url": req.config.base_url, "model": req.config.model}, indent=2) + "\n")
    return req.finish(store, outputs={SERVED_FILE: None}, info={
        "source": "served", "summary": f"the policy {req.config.model!r} served at {req.config.base_url} (its "
                                       "weights are not here: a round improves its text alone)"})


def served_model(store: ArtifactStore, base_url: str, model: str, run: str | None = None) -> Made:
    """The base stage of a run whose policy is served elsewhere: keyed by its endpoint and model
    name, as a local base is by its weights' digests."""
    return SERVED.run(store, round=0, config=ServedJob(base_url=base_url, model=model), parents=[], run=run)


NO_RECORDS = Records(on="none")
BASE = Stage("base", "model", base_body, base_step, NO_RECORDS)
SERVED = Stage("base", "model", served_body, None, NO_RECORDS)  # made by BASE's call for a served policy
LABEL_MODEL = Stage("label-model", "model", base_body, label_model_step, NO_RECORDS)
OPTIMISER_MODEL = Stage("optimiser-model", "model", base_body, optimiser_model_step, NO_RECORDS)


def is_served(store: ArtifactStore, m: StageManifest) -> bool:
    """Whether a policy (a model, or a pair) is a served one: its weights are elsewhere."""
    from ratchet.tasks.text import weights_of

    return SERVED_FILE in weights_of(store, m).outputs


def open_policy(store: ArtifactStore, policy: StageManifest, sampler, seed: int, calls: Path):
    """An engine on the policy: a local one on its weights, or, for a served policy, its endpoint,
    each call journaled in `calls` (models/served.py)."""
    from ratchet.models.sampler import open_sampler

    sampler_fits(store, policy, sampler)
    return open_sampler(model_dir(store, policy) if sampler.backend_kind.local else calls, sampler, seed, calls=calls)


def sampler_fits(store: ArtifactStore, policy: StageManifest, sampler) -> None:
    """The policy and the sampler agree on where the policy is: here, or served elsewhere."""
    kind = sampler.backend_kind
    if kind.local == is_served(store, policy):
        raise ConfigError([kind.policy_mismatch(store.dir_of(policy))])


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

    parent = next((p for p in m.parents if p.role in ("model", "text")), None)
    if parent is None or not (store.dir_of(m) / "adapter").is_dir():
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
