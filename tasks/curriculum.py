"""The curriculum: each round's train prompts, chosen from what the run already knows of every
prompt, from easy to hard (`curriculum:` in the config, on a task with levels: data.levels).

Round k's `curriculum` stage reads the round before's: the level it was at, and a table of every
prompt scored so far with how many of its samples passed (its latest round's). To that table it
adds the round before's scored samples (its label stage, or its online train stage's rollouts),
and it reads that round's held-out accuracy on the current level (its `evaluate.level_<N>`
stage). Then:

- **the level**: where that accuracy reached `advance_at`, the next level (the run ends when
  the top level reaches it); else the same, and where the level's accuracy has not risen above
  its best for `patience` rounds, the run ends there;
- **the prompts**: the band first, the prompts of the levels reached whose samples passed
  sometimes (0 < passed < n), then prompts of the current level no round has sampled yet, up to
  `prompts`, each part in a seeded order; where both are spent, the current level's prompts
  that no sample passed yet. With `review` (a share of `prompts`), that share comes first from
  the levels below the current one, outside the band: prompts whose samples all passed, or none
  sampled yet, each level an even share of it (drawn by prompt, the levels with the most prompts
  would take it all: 1-digit sums are a hundred, 4-digit ones millions). A model trained on one
  level's prompts alone forgets the levels before it (a worked answer of 2 lines comes to be
  written for 1-digit sums too); RFT keeps their right samples, so the rounds go on rehearsing
  them. (DPO and GRPO learn nothing from a prompt whose samples all pass: no pair, no advantage.)

The stage is keyed by what it read (the round before's curriculum, its scored samples and its
evaluation, by their digests) and its settings, so `ratchet plan` and a resume treat it as any
other: it runs again only where one of those changed.
"""

from __future__ import annotations

import itertools
import json
import random

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import events
from ratchet.data.errors import EmptyStageError
from ratchet.data.manifest import StageManifest
from ratchet.data.records import Prompt, read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest

STATE = "state.json"


class CurriculumConfig(BaseModel):
    """From easy to hard: each round's train prompts chosen from earlier rounds' labels."""

    model_config = ConfigDict(extra="forbid")
    start: int | None = Field(default=None, description="the level the first round trains at (unset: data.levels' "
                              "first)")
    advance_at: float = Field(default=0.8, gt=0, le=1, description="held-out accuracy on the current level at which "
                              "the next round moves to the next level (0.8 = 80%); the run ends when the top level "
                              "reaches it")
    prompts: int = Field(default=64, ge=1, description="train prompts a round draws: the band (prompts whose samples "
                         "passed sometimes) first, then prompts of the current level not sampled yet")
    patience: int = Field(default=3, ge=1, description="rounds a level may go without its held-out accuracy rising "
                          "above its best before the run ends there")
    review: float = Field(default=0.0, ge=0, lt=1, description="share of a round's prompts drawn first from the levels "
                          "below the current one, outside the band (all samples passed, or not sampled yet), each "
                          "level an even share, so RFT goes on rehearsing them; 0: none")
    advance_by: Literal["accuracy", "labels", "rounds"] = Field(
        default="accuracy", description="what moves a round to the next level: accuracy (the current level's held-out "
        "accuracy reaches advance_at), labels (the share of the current level's sampled prompts that the round's "
        "label labeled, a vote's agreement, reaches advance_at: no reference answer is read, for levels without "
        "labels, data.labeled_levels) or rounds (one level a round, the run ending after the top level's round)")


class CurriculumJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    curriculum: CurriculumConfig
    levels: list[int] = Field(description="the task's levels, easiest first")
    top: float = Field(description="the label's top reward: a sample that earned it passed")
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        n = events.count
        if m.get("done"):
            return [f"the run ends at level {int(m['level'])}: {_why(m, self.curriculum.advance_by)}"]
        moved = f" (up from level {int(m['from_level'])})" if m.get("advanced") else ""
        review = f", {n(m['review'])} reviewed" if m.get("review") else ""
        return [f"level {int(m['level'])}{moved} · {n(m.get('band', 0))} prompt(s) in the band, "
                f"{n(m.get('unseen', 0))} unseen, {n(m.get('retried', 0))} retried{review}"]


def describe(cfg: CurriculumConfig, levels: dict[int, int]) -> str:
    """What a run with `cfg` will do, for `ratchet check`: `levels` maps each level to its train prompts.
    (A function, not a method: a curriculum stage keys CurriculumConfig's code, which this does not change.)"""
    start = cfg.start if cfg.start is not None else min(levels)
    each = ", ".join(f"{n}: {c}" for n, c in sorted(levels.items()))
    moves = {"accuracy": f"once the current level's held-out accuracy reaches {cfg.advance_at:.0%} (the starting "
                         "model's counts)",
             "labels": f"once the round's label labels {cfg.advance_at:.0%} of the level's sampled prompts (no "
                       "reference answer read)",
             "rounds": "each round"}[cfg.advance_by]
    return (f"curriculum: levels {sorted(levels)} (train prompts {each}); starts at level {start} and moves to the "
            f"next {moves}; {cfg.prompts} prompts a round: " + (f"{round(cfg.review * cfg.prompts)} of the levels below "
            "(review), " if cfg.review else "") + "the band, then the level's unseen, then its not yet passed; the "
            f"run ends at the top level or after {cfg.patience} round(s) without a rise")


MEASURE = {"accuracy": "held-out accuracy", "labels": "share of prompts labeled", "rounds": "round"}


def _why(m: dict[str, float], by: str = "accuracy") -> str:
    if m.get("done") == 1:
        if by == "rounds":
            return "the top level's round is done (curriculum.advance_by=rounds)"
        return f"the top level's {MEASURE[by]} {m['accuracy']:.1%} reached curriculum.advance_at"
    return f"its {MEASURE[by]} has not risen above {m['best']:.1%} for {int(m['stale'])} round(s)"


def passes(rows, top: float) -> dict[str, list[int]]:
    """Each prompt's [samples that earned `top`, samples] in a round's scored rows."""
    out: dict[str, list[int]] = {}
    for r in rows:
        c = out.setdefault(r.prompt_id, [0, 0])
        c[0] += int(r.reward is not None and r.reward >= top)
        c[1] += 1
    return out


def decide(cfg: CurriculumConfig, levels: list[int], state: dict, accuracy: float | None) -> dict:
    """The next state from the last (`state`: level, best, stale) and what the round before said of
    the level (`accuracy`: its held-out accuracy, or the share of its prompts labeled, as
    `advance_by` reads it; None: not measured there). `done`: 0, 1 (the top level is mastered) or
    2 (patience spent)."""
    level, best, stale = state["level"], state.get("best"), state.get("stale", 0)
    out = {"from_level": level, "level": level, "advanced": 0, "done": 0, "accuracy": accuracy}
    if accuracy is not None and accuracy >= cfg.advance_at:
        if level == levels[-1]:
            return {**out, "done": 1, "best": accuracy, "stale": 0}
        return {**out, "level": levels[levels.index(level) + 1], "advanced": 1, "best": None, "stale": 0}
    if accuracy is not None and (best is None or accuracy > best):
        return {**out, "best": accuracy, "stale": 0}
    stale += accuracy is not None
    return {**out, "best": best, "stale": stale, "done": 2 if stale >= cfg.patience else 0}


def choose(pool: list[Prompt], seen: dict[str, list[int]], level: int, levels: list[int], count: int,
           seed: int, review: float = 0.0) -> tuple[list[Prompt], dict[str, int]]:
    """The round's prompts: `review` x `count` of the levels below `level` outside the band (each level
    an even share), then the band, then the unseen of `level`, then its never-passed ones."""
    reached = set(levels[: levels.index(level) + 1])
    band = [p for p in pool if p.level in reached and p.id in seen and 0 < seen[p.id][0] < seen[p.id][1]]
    unseen = [p for p in pool if p.level == level and p.id not in seen]
    hard = [p for p in pool if p.level == level and p.id in seen and seen[p.id][0] == 0]
    below = [p for p in pool if p.level in reached and p.level != level
             and (p.id not in seen or seen[p.id][0] == seen[p.id][1])]
    rng = random.Random(seed)
    out, counts = [], {}
    for name, part, limit in (("review", below, round(review * count)), ("band", band, count),
                              ("unseen", unseen, count), ("retried", hard, count)):
        if not limit:  # no review: the seeded order of the rest is what it was without the setting
            counts[name] = 0
            continue
        if name == "review":  # an even share of each level below, whatever its size
            part = by_level(part, rng)
        else:
            rng.shuffle(part)
        took = part[: min(limit, count - len(out))]
        counts[name] = len(took)
        out += took
    return out, counts


def by_level(prompts: list[Prompt], rng: random.Random) -> list[Prompt]:
    """`prompts` a level at a time, lowest first, each level's in a seeded order: the first k of them
    share k evenly between the levels (a level that runs out leaves its share to the rest), however
    many prompts each level holds (1-digit sums are a hundred, 8-digit ones millions)."""
    levels = sorted({p.level for p in prompts})
    each = [[p for p in prompts if p.level == n] for n in levels]
    for part in each:
        rng.shuffle(part)
    return [p for row in itertools.zip_longest(*each) for p in row if p is not None]


def curriculum_body(req: StageRequest[CurriculumJob], store: ArtifactStore) -> StageManifest:
    from ratchet.tasks.prepare import scored_parent, scored_rows

    job, cfg = req.config, req.config.curriculum
    pool = read_jsonl(store.path(req.parent("prompts"), "train.jsonl"), Prompt)
    before = req.find(req.stage)  # the round before's choice, where there was one
    state = json.loads(store.path(before, STATE).read_text()) if before is not None else \
        {"level": cfg.start if cfg.start is not None else job.levels[0], "best": None, "stale": 0, "seen": {}}
    seen = dict(state["seen"])
    scored = scored_parent(req)
    rows = scored_rows(store, scored) if scored is not None else None
    if rows is not None:
        seen.update(passes(rows, job.top))
    now = decide(cfg, job.levels, state, measured(cfg, req, state["level"], pool, rows, seen))
    rows, counts = ([], {"review": 0, "band": 0, "unseen": 0, "retried": 0}) if now["done"] else \
        choose(pool, seen, now["level"], job.levels, cfg.prompts, job.seed, cfg.review)
    if not rows and not now["done"]:
        raise EmptyStageError(f"level {now['level']} has no train prompt left to draw: every one was sampled and "
                              "none is in the band. Give the level more prompts (data.train_size), or lower "
                              "curriculum.advance_at")
    d = store.stage_dir(req.stage, req.key)
    n = write_jsonl(d / "train.jsonl", rows)
    (d / STATE).write_text(json.dumps({"level": now["level"], "best": now["best"], "stale": now["stale"],
                                       "seen": seen}, sort_keys=True))
    metrics = {"level": float(now["level"]), "from_level": float(now["from_level"]),
               "advanced": float(now["advanced"]), "done": float(now["done"]), "prompts": float(n),
               "stale": float(now["stale"]), "seen": float(len(seen)), **{k: float(v) for k, v in counts.items()}}
    if now["accuracy"] is not None:
        metrics["accuracy"] = now["accuracy"]
    if now["best"] is not None:
        metrics["best"] = now["best"]
    return req.finish(store, outputs={"train.jsonl": n, STATE: 1}, metrics=metrics)


def measured(cfg: CurriculumConfig, req: StageRequest, level: int, pool: list[Prompt], rows: list | None,
             seen: dict[str, list[int]]) -> float | None:
    """What the round before said of `level`, as `advance_by` reads it: its evaluation's held-out
    accuracy; or of the level's prompts it sampled (`rows`: its scored samples), the share its label
    labeled (a sample earned the top reward: a vote reached its share); or 1 (one level a round).
    None: nothing was measured there (the first round, or an evaluation not given)."""
    if cfg.advance_by == "accuracy":
        held = next((p for p in req.parents if p.role == "eval"), None)  # the round before's level, evaluated
        return None if held is None else held.metrics["accuracy"]
    if rows is None:
        return None
    if cfg.advance_by == "rounds":
        return 1.0
    at_level = {p.id for p in pool if p.level == level}
    sampled = {r.prompt_id for r in rows} & at_level
    return sum(seen[i][0] > 0 for i in sampled) / len(sampled) if sampled else None


def curriculum(store: ArtifactStore, cfg: CurriculumConfig, levels: list[int], top: float, prompts: StageManifest,
               before: StageManifest | None, scored: StageManifest | None, held: StageManifest | None, seed: int,
               round: int, run: str | None = None) -> Made:
    """Round `round`'s train prompts and level, from the round before's curriculum (`before`), its
    scored samples (`scored`) and its evaluation of the current level (`held`)."""
    parents = [prompts] + [p for p in (before, scored, held) if p is not None]
    return STAGE.run(store, round=round, config=CurriculumJob(curriculum=cfg, levels=levels, top=top, seed=seed),
                     parents=parents, run=run)


def curriculum_step(at: At, k: int, prompts: StageManifest, before: StageManifest | None, last) -> Made:
    """Round k's train prompts and level (curriculum:), from the round before's curriculum stage
    (`before`; None for the first), and what the round before (`last`: its result) made: its
    scored samples and its evaluation of the level it trained at."""
    from ratchet.tasks.evaluate import level_set

    cfg, levels = at.cfg.curriculum, at.cfg.data.level_list()
    held = (getattr(last, "evaluations", None) or {}).get(level_set(level_of(before, cfg, levels))) \
        if cfg.advance_by == "accuracy" else None  # a level's held-out answers decide nothing else
    return curriculum(at.store, cfg, levels, at.cfg.label.reward_range()[1], prompts, before,
                      getattr(last, "scored", None), held, at.seed(k), k, run=at.run)


SHOWN = ("level", "band", "unseen", "retried", "review", "advanced")  # on the run's parent, at step k
STAGE = Stage("curriculum", "data", curriculum_body, curriculum_step,
              Records(on="run", metrics=SHOWN, prefix="curriculum.", log=False),
              tags=lambda m: {"ratchet.level": str(int(m.metrics["level"]))})


def level_of(m: StageManifest | None, cfg: CurriculumConfig, levels: list[int]) -> int:
    """The level a curriculum stage chose (None: the run's start)."""
    if m is None:
        return cfg.start if cfg.start is not None else levels[0]
    return int(m.metrics["level"])


def ends(m: StageManifest) -> bool:
    return bool(m.metrics.get("done"))
