"""evaluate: held-out accuracy of a policy, greedy, with the task's answer check.

Runs for round 0 (the starting model) too, so every round has a comparable number.
Every evaluation names its eval set (`info.eval_set`): the held-out prompts' digest and
everything that scores them (answer check, token limit, engine and dtype). Two
accuracies are comparable exactly when their eval sets are equal; the champion gate
compares nothing else.

A round can be evaluated on several held-out sets (`evaluate.sets`): the task's own split
and, say, a regression set from another task, each its own stage (`evaluate` for the first,
`evaluate.<name>` for the others) with its own eval set. The champion gate decides on one
of them (`evaluate.gate`) and can refuse a model that drops any other by more than
`evaluate.max_drop` (flows/tracking.py: `verdict`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ratchet.data.checkers import CheckConfig, Item, check_many, form_refusals, score_metrics, score_sums
from ratchet.data.digest import sha256_json
from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import SourceConfig
from ratchet.data.records import LabeledCompletion, Prompt, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.models.sampler import SamplerConfig, SamplingParams
from ratchet.tasks.label_kinds import labeled_row
from ratchet.tasks.rollouts.single import SingleRollout
from ratchet.tasks.sample import PolicyWork, RolloutConfig, SparseRollout, policy_of
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest
from ratchet.tasks.runner.units import ExecutorConfig, run_units



class EvalRun(BaseModel):
    """What the evaluate stage reads of `evaluate:` (its key); the rest belongs to the gate."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(default=48, ge=1, description="completion token limit for held-out answers")
    shard_size: int = Field(default=64, ge=1, description="held-out prompts per unit (the unit of resume)")


class EvalSet(BaseModel):
    """One held-out set: the task's own split (no `data`), or another source's held-out prompts
    (a file's every row, unless it names an eval_path), scored by `check` or the source's own."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$", description="the set's name in metrics, tables and "
                      "evaluate.gate (lower-case letters, digits, _)")
    data: SourceConfig | None = Field(default=None, description="a prompt source whose held-out prompts this set "
                                      "is; unset: the task's own held-out split (data:)")
    check: CheckConfig | None = Field(default=None, description="how this set's answers are scored; unset: the "
                                      "source's own check")
    allow_overlap: bool = Field(default=False, description="allow prompts that are also train prompts of the task "
                                "(normally an error: accuracy on trained prompts is not held out)")
    rollout: RolloutConfig | None = Field(default=None, description="how this set's answers are rolled out; unset: "
                                          "as the samples are (sample.rollout). {kind: single} beside a tool "
                                          "rollout's set shows what the tool adds")

    def source(self, task: SourceConfig) -> SourceConfig:
        """The source this set's prompts come from and are scored by."""
        src = (self.data or task).pool()
        return src if self.check is None else src.model_copy(update={"check": self.check})


class EvaluateConfig(EvalRun):
    """Held-out evaluation every round, and the champion gate that reads it."""

    sets: list[EvalSet] = Field(
        default_factory=lambda: [EvalSet(name="heldout")], min_length=1,
        description="the held-out sets every round is evaluated on; the first is the `evaluate` stage, the others "
        "`evaluate.<name>`")
    gate: str | None = Field(default=None, description="the set the champion gate and next_round_from decide on "
                             "(unset: the first)")
    max_drop: float | None = Field(
        default=None, ge=0, le=1, description="refuse a model whose accuracy on any other set falls more than this "
        "below the model it is compared with (0.05 = 5 points); unset: the other sets are reported, not gated")
    min_improvement: float = Field(
        default=0.0, ge=0, description="champion moves only if accuracy beats the champion's by more than this"
    )
    dtype: Literal["auto", "sampler", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="the dtype held-out answers are generated in. auto: float32 where the base model "
        "is stored in float32 (the default model is), so every round and every run from that model is measured in "
        "one dtype whatever sampler.dtype picks for speed on this machine; else what sampler.dtype resolves to. "
        "sampler: as the samples are drawn. A dtype: that one. A served policy answers in its own")
    next_round_from: Literal["last", "best"] = Field(
        default="last", description="the model each next round trains: 'last', the round before's whatever its "
        "accuracy, or 'best', the best this run has evaluated: a round that does not beat the model it trained "
        "from by more than min_improvement is set aside, and the next round trains from that model again")

    @model_validator(mode="after")
    def _sets(self) -> "EvaluateConfig":
        names = [x.name for x in self.sets]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"evaluate.sets names {dup} more than once; give every set its own name")
        if self.gate is not None and self.gate not in names:
            raise ValueError(f"evaluate.gate={self.gate!r} is not a set; name one of {names}")
        for i, x in enumerate(self.sets):  # each check's messages name where it sits
            if x.check is not None:
                x.check.placed(f"evaluate.sets[{i}].check")
            if x.data is not None:
                x.data.check.placed(f"evaluate.sets[{i}].data.check")
        return self

    @property
    def gate_set(self) -> str:
        return self.gate or self.sets[0].name

    def stages(self) -> list[tuple[EvalSet, str]]:
        """Every set with its stage name: `evaluate` for the first, `evaluate.<name>` for the others."""
        return [(x, "evaluate" if i == 0 else f"evaluate.{x.name}") for i, x in enumerate(self.sets)]


class EvaluateJob(SparseRollout):
    model_config = ConfigDict(extra="forbid", frozen=True)
    evaluate: EvalRun
    sampler: SamplerConfig
    data: SourceConfig
    seed: int
    rollout: RolloutConfig = Field(default_factory=SingleRollout)

    def summary(self, m: dict[str, float]) -> list[str]:
        out = [f"held-out accuracy {m.get('accuracy', 0):.1%}" + _in(self.sampler)] + self.rollout.summary(m)
        if "worked_accuracy" in m:
            out.append(f"{m['worked_accuracy']:.1%} with every step shown")
        if "score_mean" in m:  # a check that scores (a user's function): its mean beside the accuracy
            out.append(f"mean score {m['score_mean']:.3g}")
        return out + form_refusals(m, m.get("eval_prompts"), self.data.check.place)


def _in(sampler: SamplerConfig) -> str:
    """The dtype a held-out figure was taken in, as the console and the report say it beside it."""
    from ratchet.models.sampler import resolve_dtype

    return f" in {resolve_dtype(sampler.dtype)}" if sampler.backend_kind.local else ""


def eval_dtype_info(sampler: SamplerConfig) -> dict[str, str]:
    """The evaluate manifest's word on the dtype its answers were generated in (none for a served policy)."""
    from ratchet.models.sampler import resolve_dtype

    return {"dtype": resolve_dtype(sampler.dtype)} if sampler.backend_kind.local else {}


def eval_sampler(evaluate: EvaluateConfig, sampler: SamplerConfig, model_path: str) -> SamplerConfig:
    """The sampler held-out answers are generated with: the run's, in `evaluate.dtype` resolved
    (auto: float32 where the base model `model_path` is stored in float32, else the run's sampling
    dtype). The run's own where that is the same dtype, so the warm engine is kept."""
    from ratchet.models.dtype import resolve_dtype, stored_in_float32

    if evaluate.dtype == "sampler" or not sampler.backend_kind.local:
        return sampler
    dtype = evaluate.dtype
    if dtype == "auto":  # a 16-bit model: as the samples are drawn
        dtype = "float32" if stored_in_float32(model_path) else resolve_dtype(sampler.dtype)
    return sampler if dtype == resolve_dtype(sampler.dtype) else sampler.model_copy(update={"dtype": dtype})


def eval_set_id(prompts: StageManifest, job: EvaluateJob) -> str:
    """What makes two held-out accuracies comparable: the same prompts, scored the same way."""
    from ratchet.models.sampler import resolve_dtype

    rollout = {"rollout": job.rollout.model_dump(mode="json")} if job.rollout.multi_turn else {}
    return sha256_json({"eval": prompts.outputs["eval.jsonl"].sha256, "check": job.data.check.model_dump(mode="json"),
                        "max_tokens": job.evaluate.max_tokens, "backend": job.sampler.backend,
                        "dtype": resolve_dtype(job.sampler.dtype), **rollout})[:16]


@dataclass
class EvaluateWork(PolicyWork):
    """A unit: greedy answers (or episodes) to `size` held-out prompts, checked against their references."""

    stage = "evaluate"
    rate = ("gen_tokens", "gen_s", "tok/s")
    max_tokens: int
    check: object  # the data source's answer check
    rollout: object  # the rollout kind (tasks/rollouts/)

    def run(self, sampler, chunk: list[Prompt], seed: int):
        t = time.time()
        done, cost = self.rollout.roll(sampler, chunk, SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens),
                                       seed)
        gen_s = time.time() - t
        verdicts = check_many(self.check, [Item(c.final, c.answer, c.prompt, c.prompt_id, c.fields,
                                                c.outcome and c.outcome.ret, c.outcome and c.outcome.ended)
                                           for c in done])
        rows = [labeled_row(c, reward=float(v.correct) if v.correct is not None else 0.0, extracted=v.extracted,
                            correct=v.correct)
                for c, v in zip(done, verdicts)]
        return rows, {"gen_s": gen_s, **cost, **score_sums(verdicts)}


def held_out_of(req: StageRequest) -> StageManifest:
    """The parent holding the held-out prompts: the task's split (`prompts`) or a set's (`prompts.<name>`)."""
    return req.holding("eval.jsonl")


def evaluate_body(req: StageRequest[EvaluateJob], store: ArtifactStore) -> StageManifest:
    cfg, src = req.config.evaluate, req.config.data
    from ratchet.tasks.text import read_text, render

    text = read_text(req, store)
    prompts = render(read_jsonl(store.path(held_out_of(req), "eval.jsonl"), Prompt), text)
    d = store.stage_dir(req.stage, req.key)
    done = run_units(EvaluateWork(items=prompts, size=cfg.shard_size, max_tokens=cfg.max_tokens, check=src.check,
                                  rollout=req.config.rollout.with_text(text), **policy_of(req, store)), d / "shards", req.executor, req.engine)
    rows = [LabeledCompletion.model_validate_json(x) for x in done.shards.lines()]
    n = write_jsonl(d / "eval.jsonl", rows)
    scored = [r for r in rows if r.correct is not None]
    cost = done.cost
    metrics = {"accuracy": sum(r.reward for r in scored) / max(len(scored), 1), "eval_prompts": float(n),
               "mean_tokens": cost.get("gen_tokens", 0.0) / max(n, 1), "gen_s": cost.get("gen_s", 0.0),
               "load_s": done.load_s, "shards_reused": float(done.reused), "holders": done.holders,
               "tokens_per_s": cost["gen_tokens"] / cost["gen_s"] if cost.get("gen_s") else 0.0}
    metrics.update(req.config.rollout.metrics(cost))
    metrics.update(score_metrics(cost))  # a user's check: its mean score and metrics beside the accuracy
    metrics.update(src.eval_metrics(prompts, rows))  # what the source measures beside (chain: worked_accuracy)
    return req.finish(store, outputs={"eval.jsonl": n}, metrics=metrics,
                      info={"eval_set": eval_set_id(held_out_of(req), req.config), "units": done.placement,
                            **eval_dtype_info(req.config.sampler)},
                      scratch=("shards",))


@dataclass(frozen=True)
class EvalTarget:
    """One held-out set as a run evaluates it (evaluate.sets, and one per level of data.levels): its
    name, its evaluation stage's name, the stage holding its prompts, the source that scores them,
    how its prompts are rolled out, and the level it is (None: no level's)."""

    name: str
    stage: str
    prompts: StageManifest
    source: SourceConfig
    rollout: RolloutConfig  # the set's own, or the samples' (sample.rollout)
    level: int | None = None


def level_set(n: int) -> str:
    """The name of level `n`'s held-out set (data.levels): its stage is `evaluate.level_<n>`."""
    return f"level_{n}"


def evaluate(store: ArtifactStore, policy: StageManifest, prompts: StageManifest, cfg: EvaluateConfig,
             sampler: SamplerConfig, data_cfg: SourceConfig, seed: int, round: int,
             isolate: bool = True, run: str | None = None, executor: ExecutorConfig | None = None,
             stage: str = "evaluate", rollout: RolloutConfig | None = None) -> Made:
    """Held-out accuracy of `policy` on the held-out prompts of `prompts`, scored by `data_cfg`'s check,
    rolled out by `rollout` (unset: single answers), as stage `stage` (`evaluate.<set>`)."""
    run_cfg = EvalRun.model_validate(cfg.model_dump(include=set(EvalRun.model_fields)))  # the gate's keys stay out
    job = EvaluateJob(evaluate=run_cfg, sampler=sampler, data=data_cfg, seed=seed, rollout=rollout or SingleRollout())
    return STAGE.run(store, name=stage, round=round, config=job, parents=[policy, prompts], isolate=isolate,
                     keep_partial=True, run=run, executor=executor)


def evaluate_step(at: At, k: int, policy: StageManifest, target: EvalTarget) -> Made:
    """Round k's model on a held-out set, seeded by the run's seed alone: every round and every run
    answers the same prompts the same way where the model is the same."""
    cfg = at.cfg
    sampler = eval_sampler(cfg.evaluate, cfg.sampler, cfg.model.path)
    return evaluate(at.store, policy, target.prompts, cfg.evaluate, sampler, target.source, cfg.seed, k,
                    isolate=cfg.isolate, run=at.run, executor=cfg.executor, stage=target.stage, rollout=target.rollout)


STAGE = Stage("evaluate", "eval", evaluate_body, evaluate_step, Records(metrics=("accuracy",), prefix="eval."))
