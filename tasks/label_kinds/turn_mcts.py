"""turn_mcts: no sample stage; a tree search over the turns of environment episodes (Agent Q,
tasks/label_kinds/turn_search.py) from each start, with the environment of `sample.rollout`. Every episode it
played is a labeled row (its return through the task's check, best first per start), and the
trees go to the step_pairs filter for turn-level preference pairs. Runs through the unit loop
(tasks/runner/units.py) in units of starts, so a resumed stage searches only what is missing.

    sample:
      rollout: {kind: environment, env: {kind: textarena, game: GuessTheNumber-v0}, max_turns: 6}
    label: {kind: turn_mcts, simulations: 8, k: 3}
    filter: {kind: step_pairs, margin: 0.5}
    train: {kind: dpo}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.checkers import Tally, check_many
from ratchet.data.events import Figure, Shows, count
from ratchet.data.records import LabeledCompletion, Prompt
from ratchet.tasks.label_kinds import Budget, Label, Labeled, item_of
from ratchet.tasks.sample import PolicyWork, policy_of
from ratchet.tasks.runner.units import run_units


class TurnMctsLabel(Label):
    """Reward = the return of each episode found by a tree search over an environment's turns (Agent Q)."""

    consumes: ClassVar[Literal["samples", "prompts"]] = "prompts"  # no sample stage: it plays its own episodes
    uses_policy: ClassVar[bool] = True
    plays_rollout: ClassVar[bool] = True
    outputs: ClassVar[tuple[str, ...]] = ("trees.jsonl",)
    shows: ClassVar[Shows] = Shows(throughput="mcts_tokens_per_s", figures=(Figure(
        "Tree search per round", "mcts.png", "generated tokens per start", ("mcts_tokens_per_prompt", "tokens per start"),
        ("mcts_solved_frac", "solved (%)", "starts the search solved (%)")),))
    kind: Literal["turn_mcts"] = "turn_mcts"
    online: ClassVar[str | None] = (  # why it cannot be train.kind=grpo's reward
        "searches an environment's turns with rollouts of its own and labels steps, not a completion's "
        'reward')
    simulations: int = Field(default=6, ge=1, description="simulation waves per start (each selects and expands one "
                             "leaf that can grow)")
    k: int = Field(default=3, ge=2, description="candidate next turns sampled per expansion")
    max_depth: int | None = Field(default=None, ge=1, description="deepest turn the search branches at (a node this "
                                  "deep is final; its episode still plays to the end); unset: sample.rollout.max_turns")
    selection: Literal["uct", "puct"] = Field(default="puct", description="tree policy")
    c_explore: float = Field(default=1.0, ge=0, description="exploration constant of UCT/PUCT (in the return's units)")
    temperature: float = Field(default=0.8, gt=0, description="sampling temperature of expansions and rollouts")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling of expansions and rollouts")
    top_k: int = Field(default=50, ge=0, description="0 = off")
    shard_size: int = Field(default=8, ge=1, description="starts per resumable unit")

    def run(self, req, store, prompts: list[Prompt], check_cfg) -> Labeled:
        return search_all(req, store, prompts, check_cfg, self)

    def reward_range(self) -> tuple[float, float]:
        import math

        return (-math.inf, math.inf)  # an environment's return has no fixed scale

    def budgets(self, pipeline) -> dict[str, Budget]:
        ro = pipeline.sample.rollout
        return {"the tree search": Budget(ro.wrap, ro.budget(pipeline.sample.max_tokens), pipeline.sampler.max_model_len,
                                          "raise sampler.max_model_len or lower sample.rollout.episode_tokens")}

    def checks(self, pipeline) -> list[str]:
        ro = pipeline.sample.rollout
        if ro.kind != "environment":
            what = "plays its own attempts and reflections" if ro.plays else "plays none"
            return [f"label.kind='turn_mcts' searches over the turns of environment episodes, but sample.rollout.kind="
                    f"{ro.kind!r} {what}; set sample.rollout: {{kind: environment, ...}} (or label.kind='mcts' "
                    "for a search over the steps of one answer)"]
        if self.max_depth is not None and self.max_depth > ro.max_turns:
            return [f"label.max_depth={self.max_depth} is deeper than an episode's sample.rollout.max_turns="
                    f"{ro.max_turns}; lower label.max_depth (or leave it unset: every turn)"]
        return []

    def summary(self, m: dict[str, float]) -> list[str]:
        out = [f"{count(m.get('mcts_prompts', 0))} trees", f"{count(m.get('episodes', 0))} episodes",
               f"mean return {m.get('return_mean', 0):.3g}"]
        return out + ([f"solved {m['mcts_solved_frac']:.0%}"] if "mcts_solved_frac" in m else [])


@dataclass
class TurnMctsWork(PolicyWork):
    """A unit: one search over turns per start for `size` starts (tasks/label_kinds/turn_search.py)."""

    stage = "label"
    rate = ("tokens", "mcts_s", "tok/s")
    cfg: TurnMctsLabel
    check: object
    rollout: object  # the environment rollout (sample.rollout)
    turn_tokens: int  # one model turn's limit (sample.max_tokens)

    def run(self, sampler, chunk: list[Prompt], seed: int):
        from ratchet.tasks.label_kinds.turn_search import TurnTree, search_turns

        tally = Tally()  # a user's check's failures, held against its budget over the whole unit

        def score(rows) -> list[tuple[float | None, bool | None]]:
            return [(v.reward, v.correct) for v in check_many(self.check, [item_of(c) for c in rows], tally)]

        trees = [TurnTree(prompt_id=p.id, prompt=p.prompt, answer=p.answer, fields=p.fields) for p in chunk]
        t = time.time()
        cost = search_turns(trees, sampler, self.cfg, self.rollout, self.turn_tokens, seed, score)
        self.check.settle(tally)
        return [tr.to_json() for tr in trees], {**cost, "mcts_s": time.time() - t,
                                                 "tokens": sum(tr.gen_tokens() for tr in trees)}


def search_all(req, store, prompts: list[Prompt], check_cfg, cfg: TurnMctsLabel) -> Labeled:
    """The search over every start, unit by unit; trees.jsonl, and every episode it played as a row."""
    from ratchet.tasks.label_kinds.tree_search import complete_nodes, tree_stats
    from ratchet.tasks.label_kinds.turn_search import TurnTree

    job = req.config
    d = store.stage_dir(req.stage, req.key)
    done = run_units(TurnMctsWork(items=prompts, size=cfg.shard_size, cfg=cfg, check=check_cfg, rollout=job.rollout,
                                  turn_tokens=job.turn_tokens, **policy_of(req, store)), d / "shards", req.executor, req.engine)
    trees = [TurnTree.from_json(json.loads(line)) for line in done.shards.lines()]
    (d / "trees.jsonl").write_text("".join(json.dumps(tr.to_json(), sort_keys=True) + "\n" for tr in trees))
    rows = []
    for tr in trees:
        for rank, x in enumerate(complete_nodes(tr)):
            rows.append(LabeledCompletion(prompt_id=tr.prompt_id, prompt=tr.prompt, answer=tr.answer, index=rank,
                                          text=tr.trajectory(x), n_tokens=tr.tokens(x), reward=x.value,
                                          correct=x.correct, prompt_ids=tuple(tr.prompt_ids),
                                          segments=tuple(tr.segments(x)), outcome=tr.outcome(x)))
    cost = done.cost
    returns = [r.outcome.ret for r in rows if r.outcome.ret is not None]
    metrics = {**tree_stats(trees), "mcts_s": cost.get("mcts_s", 0.0), "mcts_load_s": done.load_s,
               "mcts_shards_reused": float(done.reused), "holders": done.holders,
               "mcts_tokens_per_s": cost["tokens"] / cost["mcts_s"] if cost.get("mcts_s") else 0.0,
               "episodes": cost.get("episodes", 0.0), "env_failed": cost.get("env_failed", 0.0),
               "env_wait_s": cost.get("env_wait_s", 0.0), "starts_failed": float(sum(t.failure is not None for t in trees)),
               "return_mean": sum(returns) / len(returns) if returns else 0.0}
    return Labeled(rows, metrics, outputs={"trees.jsonl": len(trees)}, info={"units": done.placement})
