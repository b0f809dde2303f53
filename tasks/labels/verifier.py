"""verifier: reward = the task's answer check, 1.0 right or 0.0 wrong (RFT / ReST-EM / STaR).

Completions of prompts without a reference answer cannot be verified and are an error,
with the fix named.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from ratchet.data.checkers import check
from ratchet.data.errors import ConfigError
from ratchet.data.records import Completion, LabeledCompletion
from ratchet.tasks.labels import Labeled, LabelKind


class VerifierLabel(BaseModel):
    """Reward = the data source's answer check (data.check)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["verifier"] = "verifier"


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


def run(req, store, rows: list[Completion], check_cfg, cfg: VerifierLabel) -> Labeled:
    return Labeled(verify(rows, check_cfg))


KIND = LabelKind(name="verifier", config=VerifierLabel, consumes="samples", uses_policy=False, run=run,
                 needs_reference=lambda cfg: True)
