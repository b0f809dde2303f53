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
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from data.checkers import answer_key, check, extract
from data.errors import ConfigError
from data.manifest import StageManifest
from data.prompts import SourceConfig
from data.records import Completion, LabeledCompletion, read_jsonl, write_jsonl
from data.store import ArtifactStore
from tasks.stage import StageRequest, code_version, run_stage

CODE = code_version("tasks.label", "data.checkers", "data.records")


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


LabelConfig = Annotated[VerifierLabel | ConsistencyLabel, Field(discriminator="kind")]


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
                                     extracted=v.extracted))
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
                                         reward=float(label is not None and k == label), extracted=k))
    n = max(len(by_prompt), 1)
    metrics = {"labeled_prompts_frac": labeled / n, "agreement_mean": sum(agreement) / n}
    if with_ref:
        metrics["pseudo_label_accuracy"] = right / with_ref
    return out, metrics


def reward_stats(rows: list[LabeledCompletion]) -> dict[str, float]:
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        by_prompt[r.prompt_id].append(r.reward)
    n = max(len(rows), 1)
    return {
        "reward_mean": sum(r.reward for r in rows) / n,
        "pass_at_n": sum(max(v) > 0 for v in by_prompt.values()) / max(len(by_prompt), 1),
        "all_correct_frac": sum(min(v) > 0 for v in by_prompt.values()) / max(len(by_prompt), 1),
        "labeled": float(len(rows)),
    }


def label_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    src = TypeAdapter(SourceConfig).validate_python(req.config["data"])
    cfg = TypeAdapter(LabelConfig).validate_python(req.config["label"])
    rows = read_jsonl(store.path(req.parent("sample"), "samples.jsonl"), Completion)
    match cfg.kind:
        case "verifier":
            labeled, extra = verify(rows, src.check), {}
        case "consistency":
            labeled, extra = majority_vote(rows, src.check, cfg)
    d = store.stage_dir(req.stage, req.key)
    n = write_jsonl(d / "labels.jsonl", labeled)
    return store.finish(stage=req.stage, round=req.round, key=req.key, code_version=req.code_version,
                        config=req.config, parents=req.parents, outputs={"labels.jsonl": n},
                        metrics={**reward_stats(labeled), **extra}, started=req.started)


def label(store: ArtifactStore, samples: StageManifest, cfg: VerifierLabel | ConsistencyLabel, data_cfg: dict,
          round: int) -> tuple[StageManifest, bool]:
    config = {"label": cfg.model_dump(), "data": data_cfg}
    return run_stage(store, stage="label", round=round, body="tasks.label:label_body", code=CODE,
                     config=config, parents=[samples])
