"""Every stage, registered: one line each. Its module declares it (tasks/runner/declare.py says
what a declaration holds); the flow, `ratchet plan`, lineage, gc and the report read them here or
from the manifests they wrote (each manifest carries its stage's role).

A stage a round places itself (`after`: it runs right after another stage, on its output) is
one module and one line here; flows/shape.py places the built-in ones.
"""

from __future__ import annotations

from ratchet.tasks import cold_start, curriculum, evaluate, filter, label, prepare, sample, text, text_search, train
from ratchet.tasks.runner.declare import Stage

# the run's data and models first, then a round's stages in the order a round runs them
STAGES: tuple[Stage, ...] = (
    prepare.PROMPTS,
    prepare.HELD_OUT,
    prepare.BASE,
    prepare.SERVED,
    prepare.LABEL_MODEL,
    prepare.OPTIMISER_MODEL,
    cold_start.DEMONSTRATIONS,
    prepare.POOL,
    curriculum.STAGE,
    prepare.SLICE,
    text_search.STAGE,
    sample.STAGE,
    label.STAGE,
    filter.STAGE,
    train.STAGE,
    train.ONLINE,
    cold_start.COLD_START,
    text.STAGE,
    evaluate.STAGE,
)


def of(name: str) -> Stage | None:
    """The stage a manifest's `stage` names (`evaluate.<set>` is the evaluate stage's)."""
    family = name.partition(".")[0]
    return next((s for s in STAGES if s.name == name), None) or next((s for s in STAGES if s.name == family), None)


def following(name: str, cfg) -> list[Stage]:
    """The stages a round runs right after stage `name`, on its output, where `cfg` asks for them."""
    return [s for s in STAGES if s.after == name and (s.when is None or s.when(cfg))]


def names(on: str | None = None) -> list[str]:
    """Every stage's name, once each, in the registry's order; `on`: only those recorded on that
    MLflow run (`round`: what a round's run holds the wall time of, the report's legend)."""
    return list(dict.fromkeys(s.name for s in STAGES if on is None or s.records.on == on))
