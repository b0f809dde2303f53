"""judge: the round's policy rates its own completions (Self-Rewarding), or a fixed judge
model does (label.model), or a served one (label.endpoint: any OpenAI-compatible server).

The rubric and the scoring modes (text verdicts, or token-probability modes for small
models) are in tasks/judge.py, and every judged text passes the guard (tasks/guard.py)
first. A local judge runs through the unit loop (tasks/units.py), so a resumed stage judges
only the missing units; a served one is called from the label stage's own process, and each
finished call is journaled as it arrives (models/endpoint.py), so a resumed stage asks only
for the calls it lacks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ratchet.data.checkers import extract
from ratchet.data.records import Completion, LabeledCompletion
from ratchet.data import events
from ratchet.tasks.judge import JudgeLabel, judge_batch
from ratchet.tasks.labels import Budget, Labeled, LabelKind, agreement, injection_stats, truths
from ratchet.tasks.sample import PolicyWork, policy_of
from ratchet.tasks.units import run_units


@dataclass
class JudgeWork(PolicyWork):
    """A unit: `size` completions rated by the policy as judge (tasks/judge.py)."""

    stage = "label"
    cfg: JudgeLabel
    check: object  # the data source's answer check (the verifier's verdict is kept beside the reward)

    def open(self):
        sampler = super().open()
        if self.sampler.backend == "vllm":  # every judge prompt must fit the engine's context
            from ratchet.tasks.judge import check_fits

            check_fits(sampler.tokenizer, self.cfg, [(c.prompt, c.text) for c in self.items],
                       self.sampler.max_model_len)
        return sampler

    def run(self, sampler, chunk: list[Completion], seed: int):
        t = time.time()
        rows = _rows(chunk, judge_batch(sampler, self.cfg, [(c.prompt, c.text) for c in chunk], seed), self.check)
        return rows, {"judge_s": time.time() - t, "judged": len(chunk)}


def _rows(chunk: list[Completion], scores, check) -> list[LabeledCompletion]:
    return [LabeledCompletion(prompt_id=c.prompt_id, prompt=c.prompt, answer=c.answer, index=c.index, text=c.text,
                              n_tokens=c.n_tokens, reward=reward, votes=votes, flags=flags or None,
                              extracted=extract(check, c.text), correct=right)
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


def run(req, store, rows: list[Completion], check_cfg, cfg: JudgeLabel) -> Labeled:
    """Score rows with the policy as judge, unit by unit (resumable)."""
    if cfg.endpoint is not None:
        return run_served(req, store, rows, check_cfg, cfg)
    done = run_units(JudgeWork(items=rows, size=cfg.shard_size, cfg=cfg, check=check_cfg, **policy_of(req, store)),
                     store.stage_dir(req.stage, req.key) / "shards", req.executor)
    out = [LabeledCompletion.model_validate_json(x) for x in done.shards.lines()]
    cost = done.cost
    metrics = {
        **_metrics(out),
        "judge_s": cost.get("judge_s", 0.0), "judge_load_s": done.load_s,
        "judge_shards_reused": float(done.reused), "holders": done.holders,
        "judgements_per_s": cost["judged"] / cost["judge_s"] if cost.get("judge_s") else 0.0,
    }
    return Labeled(out, metrics, info={"units": done.placement})


def budgets(pipeline) -> dict[str, Budget]:
    """Each judged text is the prompt and a sampled completion inside the judge's template,
    followed by its verdict."""
    from ratchet.tasks.judge import template_wrap

    cfg, ctx = pipeline.label, pipeline.sampler.max_model_len
    if cfg.endpoint is not None:  # its context and tokenizer are the server's: it says when a prompt is too long
        return {}
    verdict = cfg.max_tokens if cfg.mode == "text" else 4
    return {"the judge": Budget(template_wrap(cfg), pipeline.sample.max_tokens + verdict, ctx,
                                "raise sampler.max_model_len or lower sample.max_tokens", "label")}


def checks(pipeline) -> list[str]:
    if pipeline.label.endpoint is None and pipeline.sampler.backend == "vllm" and pipeline.label.top_logprobs > 20:
        return [f"label.top_logprobs={pipeline.label.top_logprobs}: vLLM returns at most 20 candidates; set it to 20 "
                "or less (or sampler.backend='hf', which reads the whole vocabulary)"]
    return []


def title(cfg: JudgeLabel) -> str:
    who = cfg.endpoint.model + " served" if cfg.endpoint else "the policy" if cfg.model is None else cfg.model
    return f"judge ({cfg.mode}, {who})"


def summary(m: dict[str, float]) -> list[str]:
    out = LabelKind.summary(m)
    if "judge_calls" in m:  # a served judge: what the calls cost
        out.append(f"{events.count(m['judge_calls'])} calls ({events.count(m['judge_calls_reused'])} reused) · "
                   f"p95 {m['judge_latency_p95_s']:.2f} s · {events.count(m['judge_retries'])} retries")
    return out


KIND = LabelKind(name="judge", config=JudgeLabel, consumes="samples", uses_policy=True, run=run,
                 reward_range=lambda cfg: cfg.scale, fixed_model=lambda cfg: cfg.model, title=title,
                 setting=lambda cfg: f"label.kind='judge' mode={cfg.mode!r}", budgets=budgets, checks=checks,
                 served=lambda cfg: cfg.endpoint is not None, summary=summary,
                 ready=lambda cfg: cfg.endpoint.problems("label.endpoint") if cfg.endpoint else [])
