"""Answer checks: read a response's final answer and compare it with the reference.

Each kind is one module of data/checks/ (its config model carries its behaviour); this module
registers them and gives the stages one way to call any of them. The built-in checks must
not be easy to game: `number` reads the last number and refuses enumerations, `steps` also
wants every running value stated (see their modules).

    number   the last number equals the reference
    exact    the whole response, normalized, equals it
    regex    group 1 of the pattern's last match equals it
    steps    a worked answer: every listed value stated in order, the last one last
    math     the final answer equals the reference mathematically (LaTeX, sets, intervals; math-verify)
    python   the user's own scoring function (a file or an installed module), in a process of its own
    code     the response's program passes the row's tests, in a sandbox
    return   an environment episode's return (sample.rollout.kind=environment)
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ratchet.data.checks.base import Check, Item, Tally, Verdict
from ratchet.data.events import count
from ratchet.data.checks.code import CodeCheck
from ratchet.data.checks.episode_return import ReturnCheck
from ratchet.data.checks.exact import ExactCheck
from ratchet.data.checks.math_answer import MathCheck
from ratchet.data.checks.number import NumberCheck
from ratchet.data.checks.python import PythonCheck
from ratchet.data.checks.regex import RegexCheck
from ratchet.data.checks.steps import StepsCheck, listed_values, shown_steps, worked

# The registration of every check kind: one member each.
AnyCheck = NumberCheck | ExactCheck | RegexCheck | StepsCheck | MathCheck | PythonCheck | CodeCheck | ReturnCheck
CheckConfig = Annotated[AnyCheck, Field(discriminator="kind")]

__all__ = ["AnyCheck", "Check", "CheckConfig", "CodeCheck", "ExactCheck", "Item", "MathCheck", "NumberCheck", "PythonCheck",
           "RegexCheck", "ReturnCheck",
           "StepsCheck", "Tally", "Verdict", "answer_key", "check", "check_many", "extract", "form_refusals", "graded",
           "listed_values", "score_metrics", "score_sums", "shown_steps", "worked"]


def check(cfg: Check, response: str, answer: str, prompt: str | None = None) -> Verdict:
    """One response's verdict; `prompt` is what a user's function may read beside it."""
    return cfg.check_many([Item(response, answer, prompt)])[0]


def check_many(cfg: Check, items: list[Item], tally: Tally | None = None) -> list[Verdict]:
    """Every item's verdict (None where it has no reference); a check that runs code outside this
    process does it in batches, with its own time bound. Its failed rows are held against its
    budget per call, or, given a `tally`, counted there until `cfg.settle(tally)`."""
    return cfg.check_many(items, tally)


def extract(cfg: Check, response: str) -> str | None:
    """The response's final answer as a comparable key, or None if it gives none."""
    return cfg.extract(response)


def answer_key(cfg: Check, answer: str) -> str | None:
    """A reference answer in the same canonical form `extract` gives responses."""
    return cfg.answer_key(answer)


def graded(cfg: Check, response: str, answer: str, partial: float) -> float:
    """A tree search's value of a response: 1 right, else the kind's partial credit (0 where it has none)."""
    return cfg.graded(response, answer, partial)


def score_sums(verdicts: list[Verdict]) -> dict[str, float]:
    """What a unit adds up of its verdicts: a scoring check's scores (a user's function), the metrics
    it returned, its failures, and any check's refusals for form by rule (`check_form_no_number`);
    summed over units like any unit cost, then `score_metrics`."""
    out: dict[str, float] = {}
    for v in verdicts:
        if v.form is not None:
            out[f"check_form_{v.form}"] = out.get(f"check_form_{v.form}", 0.0) + 1
        if v.score is not None:
            out["check_scored"] = out.get("check_scored", 0.0) + 1
            out["check_score_sum"] = out.get("check_score_sum", 0.0) + v.score
        for k, x in v.metrics.items():
            out[f"check_sum_{k}"] = out.get(f"check_sum_{k}", 0.0) + x
    return out


def score_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Stage metrics from summed `score_sums`: the mean score and each returned metric's mean over
    scored rows; failed and unscored rows as counts."""
    n = sums.get("check_scored", 0.0)
    out = {"score_mean": sums["check_score_sum"] / n} if n else {}
    for k, x in sums.items():
        if k.startswith("check_form_"):  # answers refused for their form, by rule: counts
            out[k[len("check_"):]] = x
        if k.startswith("check_sum_"):
            name = k[len("check_sum_"):]
            out[f"check_{name}" if name in ("failed", "unscored") else f"score_{name}_mean"] = (
                x if name in ("failed", "unscored") else x / max(n, 1))
    return out


# a check's rules of form, as the console says them, and what to say when most answers break one
FORM_RULES = {"no_number": ("no number", "most answers give no number: does the prompt ask for one?"),
              "too_many_numbers": ("over max_numbers numbers",
                                   "most answers state more numbers than {place}.max_numbers: raise it"),
              "no_match": ("no pattern match", "most answers miss {place}.pattern: check it")}


def form_refusals(m: dict[str, float], rows: float | None, place: str = "data.check") -> list[str]:
    """What a stage's metrics say of answers read as wrong for their form (`form_<rule>` counts): a
    line naming each rule and its count, and, when they are most of the `rows`, what to do to the
    check at `place` (its place in the config)."""
    found = {k[len("form_"):]: v for k, v in m.items() if k.startswith("form_") and v}
    if not found:
        return []
    total = sum(found.values())
    parts = ", ".join(f"{FORM_RULES.get(k, (k,))[0]}: {count(v)}" for k, v in sorted(found.items(), key=lambda x: -x[1]))
    out = [f"{count(total)}{f'/{count(rows)}' if rows else ''} wrong for their form ({parts})"]
    if rows and total >= rows / 2:
        worst = max(found, key=found.get)
        said = FORM_RULES[worst][1] if worst in FORM_RULES else f"most answers broke the check's rule {worst}"
        out.append(said.replace("{place}", place))
    return out
