"""Prompt sources: where a task's prompts (and reference answers) come from. Each kind is one
module of data/sources/, a config model whose `load(seed, train_answers)` gives the checked
split; `SourceConfig` below is their registration.

    addition       built-in: "What is a + b?", split by pair
    chain          built-in: several dependent additions and subtractions
    file           the user's own prompts (JSONL, JSON, CSV, Parquet, a datasets dataset)
    reasoning_gym  a reasoning-gym procedural dataset, scored by its own scorer
    episodes       seeded starts for an environment rollout, scored by the episode's return

`load_split` also returns a digest of the rows it read from each file: the prompts stage keys
on it, so an edited file is a new stage, never a stale reuse. `pool_slice` is each round's
draw from the train pool (data.prompts_per_round).
"""

from __future__ import annotations

import random
from typing import Annotated

from pydantic import Field

from ratchet.data.digest import sha256_json
from ratchet.data.errors import ConfigError
from ratchet.data.records import Prompt
from ratchet.data.sources.addition import AdditionSource
from ratchet.data.sources.base import PoolSource, Split, check_placeholders, prompt_key  # noqa: F401 - from here
from ratchet.data.sources.chain import ChainSource, chain_values  # noqa: F401 - imported from here
from ratchet.data.sources.episodes import EpisodesSource
from ratchet.data.sources.file import FileSource
from ratchet.data.sources.reasoning_gym import ReasoningGymSource

# The registration of every prompt source: one member each.
SourceConfig = Annotated[AdditionSource | ChainSource | FileSource | ReasoningGymSource | EpisodesSource,
                         Field(discriminator="kind")]


def load_split(cfg: PoolSource, seed: int, *, train_answers: bool = False) -> Split:
    """(train, eval), deterministic in seed, disjoint, every row checked: the train path's.

    `train_answers`: every train prompt needs a reference answer (the verifier labels). Eval
    prompts always need one: held-out accuracy, and so the champion gate, is computed from them.
    A train prompt of a level without labels (data.labeled_levels) comes without its answer:
    from here on, no stage of the train path can read it (`references` can). Raises one
    ConfigError listing every problem.
    """
    split = cfg.load(seed, train_answers)
    hidden = set(cfg.unlabeled_levels())
    if not hidden:
        return split
    train = [p.model_copy(update={"answer": None}) if p.level in hidden else p for p in split.train]
    return Split(train, split.eval, split.digests, split.places)


def references(cfg: PoolSource, seed: int) -> dict[str, str]:
    """The reference answers a run keeps from its train path (data.labeled_levels): each train prompt
    of an unlabeled level that has one, by id. Read only to measure the labels a round made itself
    (label precision); nothing a stage reads or keys on."""
    hidden = set(cfg.unlabeled_levels())
    if not hidden:
        return {}
    return {p.id: p.answer for p in cfg.load(seed, False).train if p.level in hidden and p.answer is not None}


def check_draw(count: int, pool: int) -> None:
    """A round's draw must fit in the pool: a ConfigError with the fix if it does not."""
    if not 0 < count <= pool:
        raise ConfigError([f"data.prompts_per_round={count} exceeds the {pool} train prompts; lower it, "
                           "or unset it to train every round on the whole pool"])


def pool_slice(pool: list[Prompt], start: int, count: int, seed: int) -> tuple[list[Prompt], dict]:
    """`count` prompts from position `start` of the pool's stream, and where they lie.

    The stream is the pool in its order, then the pool again in a new order (seeded by
    `seed` and the pass), and so on; a pipeline run's rounds take consecutive stretches of
    it, so no prompt repeats until the pool is spent. A stretch across the end of a pass
    drops any prompt it already holds.
    """
    check_draw(count, len(pool))
    order: dict[int, list[int]] = {}

    def at(pos: int) -> Prompt:
        epoch, i = divmod(pos, len(pool))
        if epoch not in order:
            order[epoch] = list(range(len(pool)))
            if epoch:
                random.Random(sha256_json(["pool-pass", seed, epoch])).shuffle(order[epoch])
        return pool[order[epoch][i]]

    rows, seen = [], set()
    for pos in range(start, start + count):
        p = at(pos)
        if p.id not in seen:
            seen.add(p.id)
            rows.append(p)
    (p0, i0), (p1, i1) = divmod(start, len(pool)), divmod(start + count - 1, len(pool))
    passes = f"pass {p0 + 1}" if p0 == p1 else f"passes {p0 + 1}-{p1 + 1}"
    return rows, {"stream": [start, start + count], "pool": len(pool), "passes": [p0 + 1, p1 + 1],
                  "summary": f"train prompts {i0}-{i1} of a pool of {len(pool)} ({passes})"}
