"""label: give every sampled completion a reward.

kind=verifier: the task's answer check, reward 1.0 (correct) or 0.0 (wrong), for
RFT / ReST-EM / STaR style loops. Completions of prompts without a reference
answer cannot be verified and are an error here, with the fix named.

kind=consistency: no reference answers needed. A prompt's sampled answers vote;
a unique majority holding at least `min_agreement` of the samples becomes the
pseudo-label, and completions that agree with it get reward 1.0. Ties and weak
majorities label nothing rather than guess. Where references exist, the share
of pseudo-labels that are right is logged: it says whether self-consistency is
informative for this model.

kind=mcts: no sample stage; a step-level tree search per prompt (tasks/mcts.py)
generates its own rollouts, scores them with the verifier (or the judge), and
writes the trees next to every trajectory it found. In worker processes, in
resumable shards of prompts.

kind=judge: the current policy rates its own completions (tasks/judge.py: the
additive 5-point rubric in text, or token-probability modes for small models).
It runs in a worker process through the sampler backend, in shards, so a resumed
stage judges only what is missing.

Where reference answers exist, every kind records the verifier's verdict next to
its reward, and the label-free kinds log how well their reward ranks right above
wrong answers (AUC, overall and within prompts): whether self-reward is
informative for this model.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ratchet.data.checkers import answer_key, check, extract
from ratchet.data.errors import ConfigError
from ratchet.data.manifest import StageManifest
from ratchet.data.prompts import SourceConfig
from ratchet.data.records import Completion, LabeledCompletion, Prompt, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.tasks.judge import JudgeLabel
from ratchet.tasks.mcts import MctsLabel
from ratchet.tasks.sample import PolicyWork, policy_of
from ratchet.tasks.stage import StageRequest, code_version, run_stage
from ratchet.tasks.units import run_units

CODE = code_version("ratchet.tasks.label", "ratchet.tasks.judge", "ratchet.tasks.guard", "ratchet.data.checkers",
                    "ratchet.data.records")
JUDGE_CODE = code_version("ratchet.tasks.label", "ratchet.tasks.judge", "ratchet.tasks.guard", "ratchet.tasks.sample",
                          "ratchet.tasks.units", "ratchet.models.sampler", "ratchet.data.checkers",
                          "ratchet.data.records", "ratchet.data.shards")
MCTS_CODE = code_version("ratchet.tasks.label", "ratchet.tasks.mcts", "ratchet.tasks.judge", "ratchet.tasks.guard",
                         "ratchet.tasks.sample", "ratchet.tasks.units", "ratchet.models.sampler",
                         "ratchet.data.checkers", "ratchet.data.records", "ratchet.data.shards")


class VerifierLabel(BaseModel):
    """Reward = the data source's answer check (data.check)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["verifier"] = "verifier"


class ConsistencyLabel(BaseModel):
    """Reward = agreement with the majority answer of the prompt's own samples (label-free)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["consistency"] = "consistency"
    min_agreement: float = Field(
        default=0.5, gt=0, le=1,
        description="share of a prompt's samples the majority answer needs; below it the prompt stays unlabeled",
    )
    min_votes: int = Field(default=2, ge=1, description="fewest samples that must agree on the majority answer")


LabelConfig = Annotated[VerifierLabel | ConsistencyLabel | JudgeLabel | MctsLabel, Field(discriminator="kind")]


def reward_range(cfg) -> tuple[float, float]:
    return cfg.scale if cfg.kind == "judge" else (0.0, 1.0)


def _truth(check_cfg, c: Completion) -> bool | None:
    return check(check_cfg, c.text, c.answer).correct if c.answer is not None else None


def verify(rows: list[Completion], check_cfg) -> list[LabeledCompletion]:
    missing = sorted({r.prompt_id for r in rows if r.answer is None})
    if missing:
        raise ConfigError(
            [f"label.kind='verifier' needs reference answers, but {len(missing)} prompt(s) have none "
             f"(first: {missing[0]!r}); set data.answer_field to the answer column"]
        )
    out = []
    for r in rows:
        v = check(check_cfg, r.text, r.answer)
        out.append(LabeledCompletion(prompt_id=r.prompt_id, prompt=r.prompt, answer=r.answer, index=r.index,
                                     text=r.text, n_tokens=r.n_tokens, reward=float(v.correct),
                                     extracted=v.extracted, correct=v.correct))
    return out


def majority_vote(rows: list[Completion], check_cfg, cfg: ConsistencyLabel
                  ) -> tuple[list[LabeledCompletion], dict[str, float]]:
    by_prompt: dict[str, list[Completion]] = defaultdict(list)
    for r in rows:
        by_prompt[r.prompt_id].append(r)
    out: list[LabeledCompletion] = []
    labeled, agreement, right, with_ref = 0, [], 0, 0
    for pid in sorted(by_prompt):
        comps = sorted(by_prompt[pid], key=lambda r: r.index)
        keys = [extract(check_cfg, c.text) for c in comps]
        votes = Counter(k for k in keys if k is not None)
        label = None
        if votes:
            top = max(votes.values())
            winners = [k for k, v in votes.items() if v == top]
            agreement.append(top / len(comps))
            if len(winners) == 1 and top >= cfg.min_votes and top / len(comps) >= cfg.min_agreement:
                label = winners[0]
        else:
            agreement.append(0.0)
        if label is not None:
            labeled += 1
            ref = comps[0].answer
            if ref is not None:
                with_ref += 1
                right += answer_key(check_cfg, ref) == label
        for c, k in zip(comps, keys):
            out.append(LabeledCompletion(prompt_id=c.prompt_id, prompt=c.prompt, answer=c.answer, index=c.index,
                                         text=c.text, n_tokens=c.n_tokens,
                                         reward=float(label is not None and k == label), extracted=k,
                                         correct=_truth(check_cfg, c)))
    n = max(len(by_prompt), 1)
    metrics = {"labeled_prompts_frac": labeled / n, "agreement_mean": sum(agreement) / n}
    if with_ref:
        metrics["pseudo_label_accuracy"] = right / with_ref
    return out, metrics


def auc(scores: list[float], truth: list[bool]) -> float | None:
    """P(score of a right answer > score of a wrong one), ties counting half; None without both."""
    pos = sorted(s for s, t in zip(scores, truth) if t)
    neg = sorted(s for s, t in zip(scores, truth) if not t)
    if not pos or not neg:
        return None
    import bisect

    wins = sum(bisect.bisect_left(neg, p) + 0.5 * (bisect.bisect_right(neg, p) - bisect.bisect_left(neg, p))
               for p in pos)
    return wins / (len(pos) * len(neg))


def agreement(rows: list[LabeledCompletion]) -> dict[str, float]:
    """How well the label's reward ranks verifier-correct completions above wrong ones.

    verifier_auc pools all completions; verifier_within_prompt_auc averages the AUC of
    each prompt that has both right and wrong samples, which is what best-vs-worst pair
    building relies on. Unscored completions are left out.
    """
    scored = [r for r in rows if r.correct is not None and r.reward is not None]
    out: dict[str, float] = {}
    if (a := auc([r.reward for r in scored], [r.correct for r in scored])) is not None:
        out["verifier_auc"] = a
    by_prompt: dict[str, list[LabeledCompletion]] = defaultdict(list)
    for r in scored:
        by_prompt[r.prompt_id].append(r)
    per = [a for g in by_prompt.values() if (a := auc([r.reward for r in g], [r.correct for r in g])) is not None]
    if per:
        out["verifier_within_prompt_auc"] = sum(per) / len(per)
        out["verifier_auc_prompts"] = float(len(per))
    return out


def reward_stats(rows: list[LabeledCompletion]) -> dict[str, float]:
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r.reward is not None:
            by_prompt[r.prompt_id].append(r.reward)
    scored = [r.reward for r in rows if r.reward is not None]
    n = max(len(scored), 1)
    mean = sum(scored) / n
    out = {
        "reward_mean": mean,
        "reward_std": (sum((x - mean) ** 2 for x in scored) / n) ** 0.5,
        "labeled": float(len(rows)),
        "unscored": float(len(rows) - len(scored)),
    }
    truth = [r.correct for r in rows if r.correct is not None]
    if truth:  # the verifier's view of the samples, whatever the label kind
        per: dict[str, list[bool]] = defaultdict(list)
        for r in rows:
            if r.correct is not None:
                per[r.prompt_id].append(r.correct)
        out["correct_frac"] = sum(truth) / len(truth)
        out["pass_at_n"] = sum(any(v) for v in per.values()) / len(per)
        out["all_correct_frac"] = sum(all(v) for v in per.values()) / len(per)
    return out


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

            check_fits(sampler.tokenizer, self.cfg, [(c.prompt, c.text) for c in self.items], self.sampler.max_model_len)
        return sampler

    def run(self, sampler, chunk: list[Completion], seed: int):
        from ratchet.tasks.judge import judge_batch

        t = time.time()
        scores = judge_batch(sampler, self.cfg, [(c.prompt, c.text) for c in chunk], seed)
        rows = [LabeledCompletion(prompt_id=c.prompt_id, prompt=c.prompt, answer=c.answer, index=c.index,
                                  text=c.text, n_tokens=c.n_tokens, reward=reward, votes=votes, flags=flags or None,
                                  extracted=extract(self.check, c.text), correct=_truth(self.check, c))
                for c, (reward, votes, flags) in zip(chunk, scores)]
        return rows, {"judge_s": time.time() - t, "judged": len(chunk)}


def judge(req: StageRequest, store: ArtifactStore, rows: list[Completion], check_cfg, cfg: JudgeLabel
          ) -> tuple[list[LabeledCompletion], dict[str, float]]:
    """Score rows with the policy as judge, unit by unit (resumable); returns rows and judge metrics."""
    done = run_units(JudgeWork(items=rows, size=cfg.shard_size, cfg=cfg, check=check_cfg, **policy_of(req, store)),
                     store.stage_dir(req.stage, req.key) / "shards")
    out = [LabeledCompletion.model_validate_json(x) for x in done.shards.lines()]
    cost = done.cost
    votes = [v for r in out for v in (r.votes or [])]
    metrics = {
        "judge_scored_frac": sum(r.reward is not None for r in out) / max(len(out), 1),
        "judge_verdicts_read_frac": sum(v is not None for v in votes) / max(len(votes), 1),
        "judge_verdicts": float(len(votes)),
        "judge_s": cost.get("judge_s", 0.0), "judge_load_s": done.load_s,
        "judge_shards_reused": float(done.reused),
        "judgements_per_s": cost["judged"] / cost["judge_s"] if cost.get("judge_s") else 0.0,
        **injection_stats([r.flags or [] for r in out]),
    }
    return out, metrics


def injection_stats(flags: list[list[str]]) -> dict[str, float]:
    """How many judged texts spoke to their judge, by kind: a rising count is a policy drifting
    toward reward hacking."""
    from ratchet.tasks.guard import KINDS

    n = max(len(flags), 1)
    out = {"injection_suspects": float(sum(bool(f) for f in flags))}
    out["injection_suspect_frac"] = out["injection_suspects"] / n
    out.update({f"injection_{k}": float(sum(k in f for f in flags)) for k in KINDS})
    return out


@dataclass
class MctsWork(PolicyWork):
    """A unit: one tree search per prompt for `size` prompts (tasks/mcts.py), scored by the
    verifier or by the policy as judge."""

    stage = "label"
    cfg: MctsLabel
    check: object

    def run(self, sampler, chunk: list[Prompt], seed: int):
        from ratchet.tasks.judge import judge_values
        from ratchet.tasks.mcts import Tree, search

        def score(items: list[tuple[Tree, str]]) -> list[tuple[float, bool | None]]:
            truth = [check(self.check, text, t.answer).correct if t.answer is not None else None
                     for t, text in items]
            if self.cfg.value == "verifier":
                return [(float(c), c) for c in truth]
            values = judge_values(sampler, self.cfg.judge, [(t.prompt, text) for t, text in items], self.seed)
            return list(zip(values, truth))

        trees = [Tree(prompt_id=p.id, prompt=p.prompt, answer=p.answer) for p in chunk]
        t = time.time()
        search(trees, sampler, self.cfg, seed, score)
        return [tr.to_json() for tr in trees], {"mcts_s": time.time() - t,
                                                 "tokens": sum(tr.gen_tokens() for tr in trees)}


def tree_search(req: StageRequest, store: ArtifactStore, prompts: list[Prompt], check_cfg, cfg: MctsLabel
                ) -> tuple[list[LabeledCompletion], dict[str, float]]:
    """MCTS over the prompts, unit by unit (a resumed stage searches only missing units).
    Writes trees.jsonl; returns every scored trajectory (best first per prompt) and metrics."""
    import json

    from ratchet.tasks.mcts import Tree, complete_nodes, tree_stats

    d = store.stage_dir(req.stage, req.key)
    done = run_units(MctsWork(items=prompts, size=cfg.shard_size, cfg=cfg, check=check_cfg, **policy_of(req, store)),
                     d / "shards")
    trees = [Tree.from_json(json.loads(line)) for line in done.shards.lines()]
    (d / "trees.jsonl").write_text("".join(json.dumps(tr.to_json(), sort_keys=True) + "\n" for tr in trees))
    cost = done.cost
    rows = []
    for tr in trees:
        for rank, x in enumerate(complete_nodes(tr)):
            text = tr.trajectory(x)
            rows.append(LabeledCompletion(prompt_id=tr.prompt_id, prompt=tr.prompt, answer=tr.answer, index=rank,
                                          text=text, n_tokens=tr.tokens(x), reward=x.value,
                                          extracted=extract(check_cfg, text), correct=x.correct))
    if cfg.value == "judge":  # what the guard found in the judged trajectories, reused shards included
        from ratchet.tasks.guard import guard

        flagged = [guard(tr.prompt, tr.trajectory(x))[1] for tr in trees for x in tr.nodes if x.value is not None]
    metrics = {**tree_stats(trees), **(injection_stats(flagged) if cfg.value == "judge" else {}),
               "mcts_s": cost.get("mcts_s", 0.0), "mcts_load_s": done.load_s,
               "mcts_shards_reused": float(done.reused),
               "mcts_tokens_per_s": cost["tokens"] / cost["mcts_s"] if cost.get("mcts_s") else 0.0}
    return rows, metrics


def label_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    src = TypeAdapter(SourceConfig).validate_python(req.config["data"])
    cfg = TypeAdapter(LabelConfig).validate_python(req.config["label"])
    if cfg.kind == "mcts":
        prompts = read_jsonl(store.path(req.parent("prompts"), "train.jsonl"), Prompt)
        if cfg.value == "verifier" and (missing := [p.id for p in prompts if p.answer is None]):
            raise ConfigError([f"label.kind='mcts' with value='verifier' needs reference answers, but "
                               f"{len(missing)} prompt(s) have none (first: {missing[0]!r}); set data.answer_field, "
                               "or label.value='judge'"])
        labeled, extra = tree_search(req, store, prompts, src.check, cfg)
        extra.update(agreement(labeled) if cfg.value == "judge" else {})
        d = store.stage_dir(req.stage, req.key)
        n = write_jsonl(d / "labels.jsonl", labeled)
        return store.finish(stage=req.stage, round=req.round, key=req.key, code_version=req.code_version,
                            config=req.config, parents=req.parents,
                            outputs={"labels.jsonl": n, "trees.jsonl": len(prompts)},
                            metrics={**reward_stats(labeled), **extra}, started=req.started, scratch=("shards",))
    rows = read_jsonl(store.path(req.parent("sample"), "samples.jsonl"), Completion)
    match cfg.kind:
        case "verifier":
            labeled, extra = verify(rows, src.check), {}
        case "consistency":
            labeled, extra = majority_vote(rows, src.check, cfg)
        case "judge":
            labeled, extra = judge(req, store, rows, src.check, cfg)
    if cfg.kind != "verifier":
        extra.update(agreement(labeled))
    d = store.stage_dir(req.stage, req.key)
    n = write_jsonl(d / "labels.jsonl", labeled)
    return store.finish(stage=req.stage, round=req.round, key=req.key, code_version=req.code_version,
                        config=req.config, parents=req.parents, outputs={"labels.jsonl": n},
                        metrics={**reward_stats(labeled), **extra}, started=req.started, scratch=("shards",))


def label(store: ArtifactStore, samples: StageManifest,
          cfg: VerifierLabel | ConsistencyLabel | JudgeLabel | MctsLabel, data_cfg: dict, round: int,
          policy: StageManifest | None = None, sampler: dict | None = None, seed: int = 0,
          isolate: bool = True, run: str | None = None) -> tuple[StageManifest, bool]:
    """Label a sample stage (for mcts: search from a prompts stage). The judge and the
    search need the policy (the round's starting model), the sampler settings and a seed;
    they run in a worker process like sampling."""
    config = {"label": cfg.model_dump(), "data": data_cfg}
    if cfg.kind == "mcts":
        if policy is None or sampler is None or samples.stage != "prompts":
            raise ValueError("label.kind='mcts' searches from the prompts stage with the policy and sampler settings")
        config.update(sampler=sampler, seed=seed)
        return run_stage(store, stage="label", round=round, body="ratchet.tasks.label:label_body", code=MCTS_CODE,
                         config=config, parents=[samples, policy], isolate=isolate, keep_partial=True,
                         run=run)
    if cfg.kind != "judge":
        return run_stage(store, stage="label", round=round, body="ratchet.tasks.label:label_body", code=CODE,
                         config=config, parents=[samples], run=run)
    if policy is None or sampler is None:
        raise ValueError("label.kind='judge' needs the judging policy and the sampler settings")
    config.update(sampler=sampler, seed=seed)
    return run_stage(store, stage="label", round=round, body="ratchet.tasks.label:label_body", code=JUDGE_CODE,
                     config=config, parents=[samples, policy], isolate=isolate, keep_partial=True, run=run)
