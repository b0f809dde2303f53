"""label: give every sampled completion a reward.

kind=verifier: the task's answer check, reward 1.0 (correct) or 0.0 (wrong), for
RFT / ReST-EM / STaR style loops. Completions of prompts without a reference
answer cannot be verified and are an error here, with the fix named.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from data.checkers import check
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


LabelConfig = Annotated[VerifierLabel, Field(discriminator="kind")]


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
    rows = read_jsonl(store.path(req.parent("sample"), "samples.jsonl"), Completion)
    labeled = verify(rows, src.check)
    d = store.stage_dir(req.stage, req.key)
    n = write_jsonl(d / "labels.jsonl", labeled)
    return store.finish(stage=req.stage, round=req.round, key=req.key, code_version=req.code_version,
                        config=req.config, parents=req.parents, outputs={"labels.jsonl": n},
                        metrics=reward_stats(labeled), started=req.started)


def label(store: ArtifactStore, samples: StageManifest, cfg: VerifierLabel, data_cfg: dict,
          round: int) -> tuple[StageManifest, bool]:
    config = {"label": cfg.model_dump(), "data": data_cfg}
    return run_stage(store, stage="label", round=round, body="tasks.label:label_body", code=CODE,
                     config=config, parents=[samples])
