"""label: give every sampled completion a reward, with the configured kind (tasks/label_kinds/).

    verifier     the task's answer check (RFT / ReST-EM / STaR)
    consistency  majority vote of a prompt's own samples (label-free)
    vote         majority vote across models: the round's policy and its voters (label-free)
    judge        the policy rates its own completions (Self-Rewarding; tasks/label_kinds/judging.py), or a
                 fixed judge model does (label.model), or a served one (label.endpoint)
    reward_model a sequence-classification reward model scores them (label.model)
    mcts         step-level tree search from the prompts (tasks/label_kinds/tree_search.py)
    turn_mcts    tree search over the turns of environment episodes (tasks/label_kinds/turn_search.py)

A kind says what it consumes (the sample stage's completions, or the prompts) and whether
it runs a model: the round's policy, or a fixed model of its own (`label.model`: a judge
or a reward model, linked into the store as a `label-model` stage so its digest keys the
label and its lineage names it). Those that run a model run in a worker process through
the unit loop, so a resumed stage labels only what is missing. Where reference answers exist, every kind
records the verifier's verdict next to its reward, and the label-free kinds log how well
their reward ranks right above wrong answers (AUC, overall and within prompts): whether
self-reward is informative for this model.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import events
from ratchet.data.checkers import form_refusals
from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import SourceConfig
from ratchet.data.records import Completion, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.models.sampler import SamplerConfig
from ratchet.tasks.label_kinds import Label, reward_stats
from ratchet.tasks.label_kinds.consistency import ConsistencyLabel
from ratchet.tasks.label_kinds.judge import JudgeLabel
from ratchet.tasks.label_kinds.mcts import MctsLabel
from ratchet.tasks.label_kinds.reward_model import RewardModelLabel
from ratchet.tasks.label_kinds.turn_mcts import TurnMctsLabel
from ratchet.tasks.label_kinds.verifier import VerifierLabel
from ratchet.tasks.label_kinds.vote import VoteLabel
from ratchet.tasks.prepare import train_prompts
from ratchet.tasks.sample import RolloutConfig
from ratchet.data.kinds import members
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest
from ratchet.tasks.runner.units import ExecutorConfig

# The registration of every label kind (data/kinds.py): its module's class, one member each. The
# dispatch and every check the flow makes ask these classes.
LabelConfig = Annotated[VerifierLabel | ConsistencyLabel | VoteLabel | JudgeLabel | RewardModelLabel | MctsLabel |
                        TurnMctsLabel, Field(discriminator="kind")]
KINDS: dict[str, type[Label]] = members(LabelConfig)


class LabelJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    label: LabelConfig
    data: SourceConfig
    sampler: SamplerConfig | None = Field(default=None, description="for kinds that run the policy")
    seed: int = 0
    rollout: RolloutConfig | None = Field(default=None, description="sample.rollout, for a kind that plays its "
                                          "episodes itself")
    turn_tokens: int | None = Field(default=None, description="sample.max_tokens (one model turn), for a kind that "
                                    "plays episodes itself")

    def summary(self, m: dict[str, float]) -> list[str]:
        """The kind's own result, then what any label may add: how the verifier sees the samples,
        the label's agreement with it, rows a user's check failed on, texts that spoke to a judge."""
        out = self.label.summary(m)
        if "pass_at_n" in m:
            out.append(f"pass@n {m['pass_at_n']:.0%}")
        if "verifier_auc" in m:
            out.append(f"AUC vs verifier {m['verifier_auc']:.2f}")
        if m.get("check_failed"):
            out.append(f"{events.count(m['check_failed'])} rows the check failed on (unscored)")
        out += form_refusals(m, m.get("labeled"), self.label.scores_with(self.data.check).place)
        if m.get("injection_suspects"):
            out.append(f"{events.count(m['injection_suspects'])} injection suspects")
        return out


def label_body(req: StageRequest[LabelJob], store: ArtifactStore) -> StageManifest:
    cfg = req.config.label
    if cfg.consumes == "prompts":
        items = train_prompts(req, store)
    else:
        items = read_jsonl(store.path(req.holding("samples.jsonl"), "samples.jsonl"), Completion)
    out = cfg.run(req, store, items, req.config.data.check)
    n = write_jsonl(store.stage_dir(req.stage, req.key) / "labels.jsonl", out.rows)
    return req.finish(store, outputs={"labels.jsonl": n, **out.outputs},
                      metrics={**reward_stats(out.rows), **out.metrics}, info=out.info or None, scratch=("shards",))


def label(store: ArtifactStore, source: StageManifest, cfg: LabelConfig, data_cfg: SourceConfig, round: int,
          policy: StageManifest | None = None, sampler: SamplerConfig | None = None, seed: int = 0,
          isolate: bool = True, run: str | None = None, executor: ExecutorConfig | None = None,
          rollout: RolloutConfig | None = None, turn_tokens: int | None = None,
          voted: list[StageManifest] | tuple = ()) -> Made:
    """Label `source`: the samples, or the prompts for a kind that consumes prompts (a tree search).
    A kind that runs a model needs it as `policy` (the round's starting model, or the label's fixed
    `label-model` stage), the sampler settings and a seed, and runs in a worker process like
    sampling; one that plays episodes itself needs the sample stage's `rollout` and `turn_tokens`
    (they key it). `voted`: the voters' sample stages of a vote across models, read beside `source`."""
    want = "samples.jsonl" if cfg.consumes == "samples" else "train.jsonl"
    if source.outputs and want not in source.outputs:  # (a stage the plan only expects has no outputs yet)
        raise ValueError(f"label.kind={cfg.kind!r} labels {cfg.consumes}: the {source.stage} stage holds no {want}")
    if cfg.served():  # its model is elsewhere: called from here, resumable call by call
        return STAGE.run(store, round=round, config=LabelJob(label=cfg, data=data_cfg, seed=seed), parents=[source],
                         keep_partial=True, run=run)
    if not cfg.uses_policy:
        return STAGE.run(store, round=round, config=LabelJob(label=cfg, data=data_cfg), parents=[source, *voted],
                         keep_partial=True, run=run)
    if policy is None or sampler is None:
        raise ValueError(f"label.kind={cfg.kind!r} needs the round's policy and the sampler settings")
    if cfg.plays_rollout and (rollout is None or turn_tokens is None):
        raise ValueError(f"label.kind={cfg.kind!r} plays episodes: it needs the sample stage's rollout and turn_tokens")
    job = LabelJob(label=cfg, data=data_cfg, sampler=sampler, seed=seed, rollout=rollout if cfg.plays_rollout else None,
                   turn_tokens=turn_tokens if cfg.plays_rollout else None)
    return STAGE.run(store, round=round, config=job, parents=[source, policy], isolate=isolate, keep_partial=True,
                     run=run, executor=executor)


def label_step(at: At, k: int, source: StageManifest, policy: StageManifest,
               label_model: StageManifest | None = None, voted: tuple = ()) -> Made:
    """Round k's labels of `source` (its samples, or its prompts), with the label's fixed model
    (`label_model`) where it has one, else the round's `policy`; `voted`: the voters' samples of a
    vote across models."""
    cfg = at.cfg
    return label(at.store, source, cfg.label, cfg.data.pool(), k, policy=label_model or policy, sampler=cfg.sampler,
                 seed=at.seed(k), isolate=cfg.isolate, run=at.run, executor=cfg.executor, rollout=cfg.sample.rollout,
                 turn_tokens=cfg.sample.max_tokens, voted=voted)


# a kind's own files (the search trees), for inspection
STAGE = Stage("label", "data", label_body, label_step, Records(
    artifacts=tuple(dict.fromkeys(n for kind in KINDS.values() for n in kind.outputs)), artifact_path="label"))
