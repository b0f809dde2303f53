"""train: the accepted set -> the next round's policy (a full model directory).

The train kind (models/train_kinds/: rft, dpo) reads the filter's rows and trains on them;
this stage names none. An online kind (grpo) trains from the round's prompts instead: it
samples on the run's engine through the run's rollout (sample.rollout), and the label kind
scores what it sampled (label.kind=verifier: data.check). Both are handed to it from here
(`Online`), so models/ never imports the rollouts or the checks above it.

LoRA through PEFT by default, merged into full weights. The stage checkpoints
inside (train.checkpoint_steps); a resumed stage continues from its last checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ratchet.data.manifest import StageManifest
from ratchet.data.procs.entry import entry
from ratchet.data.prompts import SourceConfig
from ratchet.data.records import Prompt
from ratchet.data.store import ArtifactStore
from ratchet.models.train_kinds import RFTTrainConfig, TrainConfig  # noqa: F401 - the default kind, from here
from ratchet.models.sampler import SamplerConfig
from ratchet.tasks.label import LabelConfig
from ratchet.tasks.sample import SampleConfig
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest


class TrainJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    train: TrainConfig
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        return self.train.summary(m)


def train_body(req: StageRequest[TrainJob], store: ArtifactStore) -> StageManifest:
    from ratchet.models.trainer import train
    from ratchet.tasks.prepare import model_dir

    d = store.stage_dir(req.stage, req.key)
    data = store.path(req.holding("train_set.jsonl"), "train_set.jsonl")
    base = model_dir(store, req.parent_model)
    cfg = req.config.train
    rows = cfg.rows_of(data)
    metrics = train(base, rows, cfg, d, req.seed)
    outputs = {p.relative_to(d).as_posix(): None for p in sorted(d.rglob("*"))
               if p.is_file() and p.parts[len(d.parts)] in ("model", "adapter")}
    outputs["train_log.jsonl"] = None
    return req.finish(store, outputs=outputs, metrics=metrics,
                      info={"adapter": cfg.adapter, "objective": cfg.kind, **cfg.info(req.parent_model.dir)},
                      scratch=("checkpoints",))


class OnlineJob(TrainJob):
    """An online kind's job: what it trains with, and the sampling, rollout, reward and data it
    samples and scores its steps with (all keyed: a change to any of them is another stage). The
    data section, as a label stage holds it: its check is whatever kind the source scores with
    (a source's own, such as reasoning-gym's, included)."""

    sample: SampleConfig
    sampler: SamplerConfig
    label: LabelConfig
    data: SourceConfig

    def summary(self, m: dict[str, float]) -> list[str]:
        """The kind's figures, and a warning where its engine and its trainer disagreed."""
        from ratchet.models.dtype import resolve_dtype, resolve_precision
        from ratchet.models.train_kinds.grpo import gap_warning

        said = gap_warning(m, resolve_dtype(self.sampler.dtype), resolve_precision(self.train.precision))
        return super().summary(m) + ([said] if said else [])


def online_of(job: OnlineJob, seed: int, label_model: Path | None = None):
    """What an online kind samples and scores with (models/train_kinds/grpo.py: Online): the run's
    engine, its rollout with each token's log-probability, and the label kind's scorer (on its
    fixed model, `label_model`, where it has one: a reward model), opened at the first step."""
    import time

    from ratchet.models.sampler import open_sampler
    from ratchet.models.train_kinds.grpo import Online

    params = job.sample.params().model_copy(update={"logprobs": True})
    scorer = []

    def roll(engine, batch: list[dict], step_seed: int) -> tuple[list, dict[str, float]]:
        t = time.time()
        rows, _ = job.sample.rollout.roll(engine, [Prompt.model_validate(p) for p in batch], params, step_seed)
        scoring = time.time()
        if not scorer:
            scorer.append(job.label.scorer(label_model))
        scored = scorer[0](rows, job.data.check)
        return scored, {"gen_s": scoring - t, "score_s": time.time() - scoring}

    return Online(open_engine=lambda path: open_sampler(path, job.sampler, seed=seed), roll=roll,
                  group=job.sample.n, max_completion=job.sample.rollout.budget(job.sample.max_tokens),
                  process=online_process, spec={"job": job.model_dump(mode="json"), "seed": seed,
                                                "label_model": str(label_model) if label_model else None})


@entry
def online_process(spec_path: str) -> None:
    """One training process of an online kind in several (train.num_processes): the stage's Online
    made again from the training spec (`online_of`'s spec), its own engine and scorer, then the
    trainer (models/trainer.py fit_in_process)."""
    import json

    from ratchet.models.trainer import fit_in_process

    spec = json.loads(Path(spec_path).read_text())
    mine = spec["online"]
    job = OnlineJob.model_validate(mine["job"])
    fit_in_process(spec, online=online_of(job, mine["seed"], Path(mine["label_model"]) if mine["label_model"]
                                          else None))


def online_body(req: StageRequest[OnlineJob], store: ArtifactStore) -> StageManifest:
    from ratchet.models.trainer import train
    from ratchet.tasks.prepare import model_dir, train_prompts
    from ratchet.tasks.text import read_text

    job = req.config
    rollout = job.sample.rollout.with_text(read_text(req, store))  # a roles rollout's beliefs, from the policy's text
    job = job.model_copy(update={"sample": job.sample.model_copy(update={"rollout": rollout})})
    d = store.stage_dir(req.stage, req.key)
    base = model_dir(store, req.parent_model)
    prompts = train_prompts(req, store)
    fixed = req.find("label-model")
    metrics = train(base, [p.model_dump(mode="json") for p in prompts], job.train, d, req.seed,
                    online=online_of(job, req.seed, model_dir(store, fixed) if fixed else None))
    outputs = {p.relative_to(d).as_posix(): None for p in sorted(d.rglob("*"))
               if p.is_file() and p.parts[len(d.parts)] in ("model", "adapter", "rollouts")}
    outputs["train_log.jsonl"] = None
    if (d / "ledger.jsonl").is_file():  # the online kind's ledger of its steps (models/train_kinds/grpo.py)
        outputs["ledger.jsonl"] = None
    return req.finish(store, outputs=outputs, metrics=metrics,
                      info={"adapter": job.train.adapter, "objective": job.train.kind,
                            **job.train.info(req.parent_model.dir)},
                      scratch=("checkpoints",))


def train(store: ArtifactStore, policy: StageManifest, train_set: StageManifest, cfg: TrainConfig,
          seed: int, round: int, isolate: bool = True, run: str | None = None) -> Made:
    return STAGE.run(store, round=round, config=TrainJob(train=cfg, seed=seed), parents=[policy, train_set],
                     isolate=isolate, keep_partial=True, run=run)


def train_step(at: At, k: int, policy: StageManifest, train_set: StageManifest, voter: int = 0) -> Made:
    """Round k's model: `policy` trained on its training set (train:); a voter of a vote across
    models (`voter` > 0) with a seed of its own."""
    return train(at.store, policy, train_set, at.cfg.train, at.seed(k, voter), k, isolate=at.cfg.isolate,
                 run=at.run)


def train_online(store: ArtifactStore, policy: StageManifest, prompts: StageManifest, cfg: TrainConfig,
                 sample: SampleConfig, sampler: SamplerConfig, label: LabelConfig, data: SourceConfig, seed: int,
                 round: int, isolate: bool = True, run: str | None = None,
                 label_model: StageManifest | None = None) -> Made:
    """An online kind's train stage: its parents are the policy, the round's prompts and the
    label's fixed model where it has one (a reward model)."""
    return ONLINE.run(store, round=round,
                      config=OnlineJob(train=cfg, seed=seed, sample=sample, sampler=sampler, label=label, data=data),
                      parents=[policy, prompts, *([label_model] if label_model else [])], isolate=isolate,
                      keep_partial=True, run=run)


def online_step(at: At, k: int, policy: StageManifest, prompts: StageManifest,
                label_model: StageManifest | None = None) -> Made:
    """An online kind's stage in round k (train.kind=grpo): it samples the round's prompts on the
    run's engine, scores them with the label kind (on its fixed model, if any) and trains."""
    cfg = at.cfg
    return train_online(at.store, policy, prompts, cfg.train, cfg.sample, cfg.sampler, cfg.label, cfg.data, at.seed(k),
                        k, isolate=cfg.isolate, run=at.run, label_model=label_model)


STAGE = Stage("train", "model", train_body, train_step, Records(curve=True))
ONLINE = Stage("train", "model", online_body, online_step, Records(curve=True))
