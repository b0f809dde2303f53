"""MCTS over turns (Agent Q): a tree per episode start whose nodes are the model's turns.

A node is one model turn and what the environment answered it: the observation, the step's
reward, whether the episode ended. Each simulation wave does, for every tree of a unit at once:

1. selection: from the root, follow the child with the highest UCT or PUCT score
   (tasks/label_kinds/tree_search.py's tree policy) to a leaf that can still grow;
2. expansion: sample k next turns from the policy at the leaf's context (the start, then every
   turn and observation on its path, as token ids); identical turns merge into one child whose
   prior is their share of the k;
3. evaluation: for every new child, an episode replays the path's turns and the child's own in
   a fresh episode of the environment (reset with the same seed, the same actions), then the
   policy plays on to the episode's end; its return, through the task's check, is the child's
   value. A replayed step that answers otherwise than it did is a nondeterministic
   environment: that episode fails and says so;
4. backup: the value is added to the child and every node above it (N += 1, W += value).

A node is final where its episode ended (the environment said done, or its tokens or turns ran
out), at `max_depth`, or where its episode failed. Every node that was evaluated carries a
complete episode (its path and its rollout): the label rows, best first. The step_pairs filter
reads the trees: at a node, the highest-Q child against the lowest-Q child, each completed by
its best (worst) episode, the shared path as the prompt's token ids and the turns that part
as the trained segments, so DPO learns which turn to take in that state.

Why replay and not a copy of the state: an environment is the user's object in a process of
its own; replaying its actions from reset needs nothing of it but determinism (checked on every
replay), where a copy would need every environment to pickle or fork cleanly mid-episode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ratchet.data.records import Outcome, Prompt, Segment
from ratchet.tasks.label_kinds.tree_search import Node, Tree, backup, select

if TYPE_CHECKING:
    from ratchet.tasks.label_kinds.turn_mcts import TurnMctsLabel
    from ratchet.tasks.rollouts.environment import EnvironmentRollout


@dataclass
class Turn(Node):
    """A node: the model's turn (`step`, with its ids) and the environment's answer to it."""

    ids: list[int] = field(default_factory=list)  # the turn's token ids, as the engine wrote them
    obs: str | None = None  # the environment's observation after it, as it gave it (None: no step)
    obs_text: str = ""  # that observation as the model read it: the next user turn, its markers included
    obs_ids: list[int] = field(default_factory=list)  # empty where the episode ended at this turn
    reward: float = 0.0  # the step's reward
    done: bool = False  # the environment ended the episode at this turn
    tail: list[dict] = field(default_factory=list)  # the evaluating episode's segments after this turn
    tail_rewards: list[float] = field(default_factory=list)
    final_reward: float | None = None
    how: str | None = None  # how the evaluating episode ended: done, max_turns, length, failed
    failure: str | None = None


@dataclass
class TurnTree(Tree):
    """The search from one episode start: its row, its first observation and that as token ids."""

    fields: dict = field(default_factory=dict)
    start: str | None = None  # the first observation (None until the episode was opened)
    prompt_ids: list[int] = field(default_factory=list)
    failure: str | None = None  # the start failed in the environment: nothing to search

    def __post_init__(self):
        if not self.nodes:
            self.nodes.append(Turn(id=0, parent=None, depth=0))

    def source(self) -> Prompt:
        return Prompt(id=self.prompt_id, prompt=self.prompt, answer=self.answer, fields=self.fields)

    def context(self, node: Node) -> list[int]:
        """The ids the model reads after `node`: the start, then every turn and observation on its path."""
        out = list(self.prompt_ids)
        for x in self.path(node)[1:]:
            out += x.ids + x.obs_ids
        return out

    def path_segments(self, node: Node) -> list[Segment]:
        out = []
        for x in self.path(node)[1:]:
            out.append(Segment(role="model", text=x.step, token_ids=tuple(x.ids)))
            if x.obs_ids:
                out.append(Segment(role="env", text=x.obs_text, token_ids=tuple(x.obs_ids)))
        return out

    def segments(self, node: Node) -> list[Segment]:
        """The whole episode that evaluated `node`: its path, then its rollout."""
        return self.path_segments(node) + [Segment(**s) for s in node.tail]

    def trajectory(self, node: Node) -> str:
        return "".join(s.text for s in self.segments(node))

    def tokens(self, node: Node) -> int:
        """The model's tokens in the episode through `node`."""
        return sum(len(s.token_ids) for s in self.segments(node) if s.role == "model")

    def outcome(self, node: Node) -> Outcome:
        rewards = (*(x.reward for x in self.path(node)[1:]), *node.tail_rewards)
        ret = None if node.how == "failed" else sum(rewards) + (node.final_reward or 0.0)
        return Outcome(start=self.start or "", rewards=rewards, final=node.final_reward, ret=ret,
                       ended=node.how or "failed", failure=node.failure)

    def part(self, node: Node, end: Node) -> dict:
        """The episode through `end` after `node`'s path (an ancestor's): the turns a preference
        pair trains on, with the path as its prompt's ids."""
        return {"prompt_ids": tuple(self.context(node)), "segments": tuple(self.segments(end)[len(
            self.path_segments(node)):]), "outcome": self.outcome(end)}

    def add_turn(self, parent: Node, text: str, ids: list[int], prior: float, spent: int) -> Turn:
        child = Turn(id=len(self.nodes), parent=parent.id, depth=parent.depth + 1, step=text, prior=prior,
                     step_tokens=len(ids), spent=spent, ids=ids)
        self.nodes.append(child)
        parent.children.append(child.id)
        return child

    def to_json(self) -> dict:
        return {"turns": True, "prompt_id": self.prompt_id, "prompt": self.prompt, "answer": self.answer,
                "fields": self.fields, "start": self.start, "prompt_ids": self.prompt_ids, "failure": self.failure,
                "nodes": [{**asdict(x), "q": x.q} for x in self.nodes]}

    @classmethod
    def from_json(cls, d: dict) -> TurnTree:
        nodes = [Turn(**{k: v for k, v in x.items() if k != "q"}) for x in d["nodes"]]
        return cls(prompt_id=d["prompt_id"], prompt=d["prompt"], answer=d["answer"], nodes=nodes,
                   fields=d.get("fields") or {}, start=d.get("start"), prompt_ids=d.get("prompt_ids") or [],
                   failure=d.get("failure"))


def load_tree(d: dict) -> Tree:
    """A tree from its JSON: a search over turns, or over the steps of one answer."""
    return TurnTree.from_json(d) if d.get("turns") else Tree.from_json(d)


# the search ----------------------------------------------------------------------------------

def open_trees(trees: list[TurnTree], rollout: EnvironmentRollout, tokenizer) -> None:
    """Each tree's first observation (an episode opened and dropped) and its ids; a start the
    environment fails on leaves its tree with nothing to search, and says why."""
    from ratchet.tasks.rollouts.environment import EnvironmentFailedError, first_ids

    fresh = [t for t in trees if t.start is None and t.failure is None]
    for t, reply in zip(fresh, rollout.starts([t.source() for t in fresh]) if fresh else []):
        if reply.failure is not None:
            t.failure, t.root.final = reply.failure, True
        else:
            t.start = reply.observation or ""
            t.prompt_ids = list(first_ids(tokenizer, rollout.wrap(t.start)))
    failed = [t for t in fresh if t.failure]
    if failed and len(failed) > rollout.max_failed_frac * len(fresh):
        raise EnvironmentFailedError(
            f"{rollout.name} failed to start episode {failed[0].prompt_id!r}: {failed[0].failure}\n({len(failed)} of "
            f"{len(fresh)} starts of the unit failed; sample.rollout.max_failed_frac={rollout.max_failed_frac:g}). Fix "
            "the environment and re-run the same command: finished units are kept")


def turn_wave(trees: list[TurnTree], sampler, cfg: TurnMctsLabel, rollout: EnvironmentRollout, turn_tokens: int,
              seed: int, score) -> dict[str, float]:
    """One simulation for every tree that can grow: select, expand k turns (batched), play every
    new child's episode to its end (batched, replaying its path), score, back up. `score(rows)`
    takes the episodes' completions and returns [(value or None, correct or None)]."""
    from ratchet.models.sampler import SamplingParams
    from ratchet.tasks.rollouts import turn_of, turn_params

    grow = [(t, x) for t in trees if (x := select(t, cfg.selection, cfg.c_explore, past_final=True)) is not None]
    if not grow:
        return {}
    common = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    rooms: dict[int, list[tuple[TurnTree, Turn]]] = {}
    for t, x in grow:  # a turn may take what the episode has left
        rooms.setdefault(min(turn_tokens, rollout.episode_tokens - (len(t.context(x)) - len(t.prompt_ids))),
                         []).append((t, x))
    new: list[tuple[TurnTree, Turn]] = []
    tok = sampler.tokenizer
    for room, group in sorted(rooms.items()):
        params = turn_params(tok, SamplingParams(n=cfg.k, max_tokens=room, **common))
        gens = sampler.generate_ids([t.context(x) for t, x in group], params, seed=(seed + room) % (1 << 62))
        for (t, leaf), outs in zip(group, gens):
            merged: dict[tuple[int, ...], list] = {}
            for g in outs:
                merged.setdefault(turn_of(tok, g), []).append(g)
            for (text, ids), same in merged.items():
                new.append((t, t.add_turn(leaf, text, list(ids), prior=len(same) / cfg.k,
                                          spent=sum(len(g.token_ids) for g in same))))
    eps = [rollout.replay(t.source(), t.path_segments(x), [(y.obs, y.reward, y.done) for y in t.path(x)[1:-1]],
                          t.start) for t, x in new]
    waited = rollout.play(sampler, eps, SamplingParams(n=1, max_tokens=turn_tokens, **common), seed + 1)
    rollout.settle(eps)  # past max_failed_frac of the wave's episodes the stage stops, finished units kept
    rows = rollout.rows(eps)
    for (t, x), e, (value, correct) in zip(new, eps, score(rows)):
        settle_turn(t, x, e, cfg.max_depth or rollout.max_turns)
        if x.how == "failed" or value is None:
            x.final = True  # nothing to back up: an episode without a return sits out the search
            continue
        x.value, x.correct = value, correct
        backup(t, x, value)
    return {"episodes": len(eps), "env_failed": sum(e.ended == "failed" for e in eps), "env_wait_s": waited}


def settle_turn(tree: TurnTree, x: Turn, e, max_depth: int) -> None:
    """A new child's part of the episode that evaluated it: its step's answer, the rollout after it."""
    d = x.depth
    x.how, x.failure, x.final_reward = e.ended, e.failure, e.final
    x.rollout_tokens = e.generated
    x.spent += e.generated
    if len(e.rewards) >= d:  # the child's own step was answered
        x.reward, x.obs = e.rewards[d - 1], e.observations[d - 1]
        x.done = e.ended == "done" and len(e.rewards) == d
    after = e.segments[2 * d - 1:]  # the child's turn is segment 2(d-1): every turn before it was answered
    if after and after[0].role == "env":
        x.obs_text, x.obs_ids = after[0].text, list(after[0].token_ids)
        after = after[1:]
    x.tail = [{"role": s.role, "text": s.text, "token_ids": list(s.token_ids)} for s in after]
    x.tail_rewards = list(e.rewards[d:])
    x.rollout = "".join(s.text for s in after)
    x.ended = not x.obs_ids
    x.final = x.ended or x.depth >= max_depth or e.ended == "failed"


def search_turns(trees: list[TurnTree], sampler, cfg: TurnMctsLabel, rollout: EnvironmentRollout, turn_tokens: int,
                 seed: int, score) -> dict[str, float]:
    from ratchet.tasks.runner.units import unit_seed

    open_trees(trees, rollout, sampler.tokenizer)
    cost = {"episodes": 0.0, "env_failed": 0.0, "env_wait_s": 0.0}
    for w in range(cfg.simulations):
        for k, v in turn_wave(trees, sampler, cfg, rollout, turn_tokens, unit_seed(seed, w), score).items():
            cost[k] += v
    return cost
