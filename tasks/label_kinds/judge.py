"""judge: the round's policy rates its own completions (Self-Rewarding), or a fixed judge
model does (label.model), or a served one (label.endpoint: any OpenAI-compatible server).

The rubric and the scoring modes (text verdicts, or token-probability modes for small
models) are in tasks/label_kinds/judging.py, and every judged text passes the guard (tasks/label_kinds/guard.py)
first. A local judge runs through the unit loop (tasks/runner/units.py), so a resumed stage judges
only the missing units; a served one is called from the label stage's own process, and each
finished call is journaled as it arrives (models/endpoint.py), so a resumed stage asks only
for the calls it lacks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ratchet.data import events
from ratchet.data.checkers import extract
from ratchet.data.prompts import check_placeholders
from ratchet.data.records import Completion, LabeledCompletion
from ratchet.data.userfiles import UserFile
from ratchet.models.endpoint import EndpointConfig
from ratchet.tasks.label_kinds.guard import GuardConfig
from ratchet.tasks.label_kinds.judging import DEFAULT_TEMPLATES, judge_batch, template_wrap
from ratchet.tasks.label_kinds import Budget, Label, Labeled, agreement, injection_stats, labeled_row, truths
from ratchet.tasks.sample import PolicyWork, policy_of
from ratchet.tasks.runner.units import run_units


class JudgeLabel(Label):
    """Reward = the current policy's own judgement of each completion (self-rewarding), or a
    fixed judge model's (`model`)."""

    uses_policy: ClassVar[bool] = True  # the policy, or its fixed judge model, in a worker
    chats: ClassVar[bool] = True
    generates: ClassVar[bool] = True
    kind: Literal["judge"] = "judge"
    online: ClassVar[str | None] = (  # why it cannot be train.kind=grpo's reward
        'has the policy (or a judge model) grade each completion with a generation of its own; a reward '
        'that moves with the policy it trains is the reward hacking GRPO invites')
    model: Annotated[str, UserFile(keep=("default",))] | None = Field(
        default=None, description="a fixed judge: a local Hugging Face model directory ('default' for the embedded "
        "model), run with the sampler settings; unset: the round's policy judges its own samples (Self-Rewarding)")
    endpoint: EndpointConfig | None = Field(
        default=None, description="a served judge: a model behind an OpenAI-compatible API (vllm serve, SGLang, "
        "TGI, a hosted API), called from this process; no model is loaded for it")
    mode: Literal["text", "p_yes", "rating"] = Field(
        default="text",
        description="text = the rubric's written verdict averaged over k samples (0-5); p_yes = probability of "
        "'Yes' to 'is the answer correct?' (0-1); rating = expected rubric points from digit probabilities (0-5)",
    )
    template: str | None = Field(
        default=None,
        description="judge prompt with {prompt} and {response} placeholders; default: the additive 5-point "
        "rubric (text, rating) or a yes/no correctness question (p_yes)",
    )
    k: int = Field(default=3, ge=1, description="judge samples per completion, averaged (text mode)")
    temperature: float = Field(default=0.7, ge=0, description="judge sampling temperature (text mode)")
    max_tokens: int = Field(default=160, ge=8, description="token limit of a written verdict (text mode)")
    top_logprobs: int = Field(
        default=20, ge=2,
        description="next-token candidates read (p_yes, rating); a candidate outside them counts as probability 0; "
        "vLLM returns at most 20",
    )
    shard_size: int = Field(default=256, ge=1, description="completions judged per shard (the unit of resume)")
    guard: GuardConfig = Field(default_factory=GuardConfig, description="what happens to a response that speaks to "
                               "its judge (scores, verdicts, instructions, fences, roles in its text)")

    @model_validator(mode="after")
    def _one_judge(self):
        if self.endpoint is not None and self.model is not None:
            raise ValueError("label.model and label.endpoint both name a judge; keep one (model: a local directory "
                             "run here; endpoint: a served one)")
        if self.endpoint is not None and self.mode != "text" and self.top_logprobs > 20:
            raise ValueError(f"label.top_logprobs={self.top_logprobs}: an OpenAI-compatible API returns at most 20 "
                             "candidates; set it to 20 or less")
        return self

    @field_validator("template")
    @classmethod
    def _template_fields(cls, v: str | None) -> str | None:
        return v if v is None else check_placeholders(v, {"prompt", "response"})

    def prompt_template(self) -> str:
        return self.template if self.template is not None else DEFAULT_TEMPLATES[self.mode]

    @property
    def scale(self) -> tuple[float, float]:
        return (0.0, 1.0) if self.mode == "p_yes" else (0.0, 5.0)

    def run(self, req, store, rows: list[Completion], check_cfg) -> Labeled:
        """Score rows with the policy as judge, unit by unit (resumable), or with a served judge."""
        if self.endpoint is not None:
            return run_served(req, store, rows, check_cfg, self)
        return run_local(req, store, rows, check_cfg, self)

    def reward_range(self) -> tuple[float, float]:
        return self.scale

    def fixed_model(self) -> str | None:
        return self.model

    def title(self) -> str:
        who = self.endpoint.model + " served" if self.endpoint else "the policy" if self.model is None else self.model
        return f"judge ({self.mode}, {who})"

    def setting(self) -> str:
        return f"label.kind='judge' mode={self.mode!r}"

    def budgets(self, pipeline) -> dict[str, Budget]:
        """Each judged text is the prompt and a sampled completion inside the judge's template,
        followed by its verdict."""
        if self.endpoint is not None:  # its context and tokenizer are the server's: it says when a prompt is too long
            return {}
        verdict = self.max_tokens if self.mode == "text" else 4
        return {"the judge": Budget(template_wrap(self), pipeline.sample.max_tokens + verdict,
                                    pipeline.sampler.max_model_len,
                                    "raise sampler.max_model_len or lower sample.max_tokens", "label")}

    def checks(self, pipeline) -> list[str]:
        most = pipeline.sampler.backend_kind.top_logprobs
        if self.endpoint is None and most is not None and self.top_logprobs > most:
            return [f"label.top_logprobs={self.top_logprobs}: {pipeline.sampler.backend_kind.title} returns at "
                    f"most {most} candidates; set it to {most} or less (or sampler.backend='hf', which reads the "
                    "whole vocabulary)"]
        return []

    def served(self) -> bool:
        return self.endpoint is not None

    def ready(self) -> list[str]:
        return self.endpoint.problems("label.endpoint") if self.endpoint else []

    def summary(self, m: dict[str, float]) -> list[str]:
        out = super().summary(m)
        if "judge_calls" in m:  # a served judge: what the calls cost
            out.append(f"{events.count(m['judge_calls'])} calls ({events.count(m['judge_calls_reused'])} reused) · "
                       f"p95 {m['judge_latency_p95_s']:.2f} s · {events.count(m['judge_retries'])} retries")
        return out


@dataclass
class JudgeWork(PolicyWork):
    """A unit: `size` completions rated by the policy as judge (tasks/label_kinds/judging.py)."""

    stage = "label"
    rate = ("judged", "judge_s", "judgements/s")
    cfg: JudgeLabel
    check: object  # the data source's answer check (the verifier's verdict is kept beside the reward)

    def open(self, lent=None):
        sampler = super().open(lent)
        if self.sampler.backend_kind.bounded_context:  # every judge prompt must fit the engine's context
            from ratchet.tasks.label_kinds.judging import check_fits

            check_fits(sampler.tokenizer, self.cfg, [(c.prompt, c.text) for c in self.items],
                       self.sampler.max_model_len)
        return sampler

    def run(self, sampler, chunk: list[Completion], seed: int):
        t = time.time()
        rows = _rows(chunk, judge_batch(sampler, self.cfg, [(c.prompt, c.text) for c in chunk], seed), self.check)
        return rows, {"judge_s": time.time() - t, "judged": len(chunk)}


def _rows(chunk: list[Completion], scores, check) -> list[LabeledCompletion]:
    return [labeled_row(c, reward=reward, votes=votes, flags=flags or None, extracted=extract(check, c.final),
                        correct=right)
            for c, (reward, votes, flags), right in zip(chunk, scores, truths(check, chunk))]


def _metrics(out: list[LabeledCompletion]) -> dict[str, float]:
    votes = [v for r in out for v in (r.votes or [])]
    return {
        "judge_scored_frac": sum(r.reward is not None for r in out) / max(len(out), 1),
        "judge_verdicts_read_frac": sum(v is not None for v in votes) / max(len(votes), 1),
        "judge_verdicts": float(len(votes)),
        **injection_stats([r.flags or [] for r in out]),
        **agreement(out),
    }


def run_served(req, store, rows: list[Completion], check_cfg, cfg: JudgeLabel) -> Labeled:
    """Score rows with a served judge: every call journaled as it arrives (resumable call by call)."""
    from ratchet.models.endpoint import Endpoint

    endpoint = Endpoint(cfg.endpoint, store.stage_dir(req.stage, req.key) / "shards" / "calls.jsonl")
    t = time.time()
    out = _rows(rows, judge_batch(endpoint, cfg, [(c.prompt, c.text) for c in rows], req.seed), check_cfg)
    judge_s = time.time() - t
    metrics = {**_metrics(out), **endpoint.metrics("judge_"), "judge_s": judge_s,
               "judgements_per_s": len(out) / judge_s if judge_s > 0 else 0.0}
    return Labeled(out, metrics, info={"summary": f"judged by {cfg.endpoint.where()} ({cfg.mode})"})


def run_local(req, store, rows: list[Completion], check_cfg, cfg: JudgeLabel) -> Labeled:
    """Score rows with the policy (or the fixed judge model) as judge, unit by unit (resumable)."""
    done = run_units(JudgeWork(items=rows, size=cfg.shard_size, cfg=cfg, check=check_cfg, **policy_of(req, store)),
                     store.stage_dir(req.stage, req.key) / "shards", req.executor, req.engine)
    out = [LabeledCompletion.model_validate_json(x) for x in done.shards.lines()]
    cost = done.cost
    metrics = {
        **_metrics(out),
        "judge_s": cost.get("judge_s", 0.0), "judge_load_s": done.load_s,
        "judge_shards_reused": float(done.reused), "holders": done.holders,
        "judgements_per_s": cost["judged"] / cost["judge_s"] if cost.get("judge_s") else 0.0,
    }
    return Labeled(out, metrics, info={"units": done.placement})

