"""MCTS labeling: a step-level tree search per prompt whose rollouts become training data.

A response is a sequence of steps (a step ends at `step_delimiter`, after
`step_max_tokens` tokens, or at the end of the response). Each prompt grows one
tree; every simulation wave does, for all prompts of a shard at once:

1. selection: from the root, follow the child with the highest UCT
   (Q + c * sqrt(ln N_parent / N)) or PUCT (Q + c * P * sqrt(N_parent) / (1 + N))
   score to a leaf;
2. expansion: sample k candidate next steps from the policy (one batched call for
   all prompts); identical candidates merge into one child whose prior P is their
   share of the k;
3. evaluation: roll every new child out to a final answer (one batched call) and
   score the whole response with the task's verifier (0/1, or graded: partial credit
   for a wrong number by its distance from the reference, or for the steps a worked
   answer got right), or the self-reward judge
   where there is no reference;
4. backup: each rollout's value is added to the new child and to every node on the
   path to the root (N += 1, W += value; Q = W / N).

A final node (the response ended, or max_depth) cannot grow, nor can a node whose
children all cannot: selection passes them by, so every wave spends on every tree that
can still grow, and a node's visits count distinct rollouts. (`revisit_final` gives the
textbook rule instead: a selected final leaf has its value backed up again, with no
model call; a tree whose best path ends in one spends nothing that wave.) A tree with
nothing left to grow sits the wave out. Outputs: the trees (every node's visits, Q, prior,
step and rollout, for inspection), every complete trajectory as a labeled
completion (best first per prompt, for RFT), and step-level preference pairs
(the highest- and lowest-Q children of a node, each completed by its best or worst
trajectory, sharing the prefix up to that node) built by the step_pairs filter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tree search kind's config (tasks/label_kinds/mcts.py)
    from ratchet.tasks.label_kinds.mcts import MctsLabel


@dataclass
class Node:
    id: int
    parent: int | None
    depth: int
    step: str = ""  # this node's step text (empty at the root)
    prior: float = 1.0
    n: int = 0  # visits: rollouts backed up through this node
    w: float = 0.0  # total value of those rollouts
    final: bool = False  # the response ends here (end of sequence) or max_depth
    ended: bool = False  # the step itself ended the response
    rollout: str = ""  # the completion that evaluated this node (empty if it ended the response)
    value: float | None = None  # score of this node's own trajectory
    correct: bool | None = None  # the verifier's verdict on it, where a reference exists
    step_tokens: int = 0  # tokens of the step
    rollout_tokens: int = 0  # tokens of the rollout
    spent: int = 0  # tokens generated to make this node: all k samples that merged into it + its rollout
    children: list[int] = field(default_factory=list)

    @property
    def q(self) -> float:
        return self.w / self.n if self.n else 0.0


@dataclass
class Tree:
    prompt_id: str
    prompt: str
    answer: str | None
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self):
        if not self.nodes:
            self.nodes.append(Node(id=0, parent=None, depth=0))

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def path(self, node: Node) -> list[Node]:
        out = [node]
        while out[-1].parent is not None:
            out.append(self.nodes[out[-1].parent])
        return out[::-1]

    def prefix(self, node: Node) -> str:
        return "".join(x.step for x in self.path(node))

    def trajectory(self, node: Node) -> str:
        return self.prefix(node) + node.rollout

    def add_child(self, parent: Node, step: str, prior: float, step_tokens: int, spent: int, ended: bool,
                  max_depth: int) -> Node:
        child = Node(id=len(self.nodes), parent=parent.id, depth=parent.depth + 1, step=step, prior=prior,
                     step_tokens=step_tokens, spent=spent, ended=ended,
                     final=ended or parent.depth + 1 >= max_depth)
        self.nodes.append(child)
        parent.children.append(child.id)
        return child

    def tokens(self, node: Node) -> int:
        """Tokens of the trajectory through `node`: its path's steps and its rollout."""
        return sum(x.step_tokens for x in self.path(node)) + node.rollout_tokens

    def gen_tokens(self) -> int:
        return sum(x.spent for x in self.nodes)

    def to_json(self) -> dict:
        return {"prompt_id": self.prompt_id, "prompt": self.prompt, "answer": self.answer,
                "nodes": [{**asdict(x), "q": x.q} for x in self.nodes]}

    @classmethod
    def from_json(cls, d: dict) -> Tree:
        nodes = [Node(**{k: v for k, v in x.items() if k != "q"}) for x in d["nodes"]]
        return cls(prompt_id=d["prompt_id"], prompt=d["prompt"], answer=d["answer"], nodes=nodes)


# the tree policy -------------------------------------------------------------

def uct(child: Node, parent_n: int, c: float) -> float:
    if child.n == 0:
        return math.inf
    return child.q + c * math.sqrt(math.log(max(parent_n, 1)) / child.n)


def puct(child: Node, parent_n: int, c: float) -> float:
    return child.q + c * child.prior * math.sqrt(parent_n) / (1 + child.n)


def select(tree: Tree, selection: str, c: float, past_final: bool = False) -> Node | None:
    """Descend by the tree policy to an unexpanded or final node; ties go to the older child.
    With `past_final`, only among nodes that can still grow (see `growable`): the node reached
    is unexpanded and not final, or None when the whole tree is spent."""
    score = uct if selection == "uct" else puct
    open_ = growable(tree) if past_final else None
    if open_ is not None and not open_[0]:
        return None
    node = tree.root
    while node.children and not node.final:
        kids = [tree.nodes[i] for i in node.children if open_ is None or open_[i]]
        node = max(kids, key=lambda ch: (score(ch, node.n, c), -ch.id))
    return node


def growable(tree: Tree) -> list[bool]:
    """Per node id: whether a wave could still expand something at or below it, i.e. it is
    not final and is unexpanded or has a child that can grow. Children are made after their
    parents, so one pass from the newest node up settles every node."""
    out = [False] * len(tree.nodes)
    for x in reversed(tree.nodes):
        out[x.id] = not x.final and (not x.children or any(out[i] for i in x.children))
    return out


def backup(tree: Tree, node: Node, value: float) -> None:
    for x in tree.path(node):
        x.n += 1
        x.w += value


# one wave across many trees ----------------------------------------------------

def wave(trees: list[Tree], sampler, cfg: MctsLabel, seed: int, score) -> None:
    """One simulation for every tree: select, expand k steps (batched), roll out the new
    children (batched), score, back up. `score(items)` takes [(tree, text)] and returns
    [(value in [0, 1], correct or None)]."""
    from ratchet.models.sampler import SamplingParams

    leaves = [select(t, cfg.selection, cfg.c_explore, past_final=not cfg.revisit_final) for t in trees]
    for t, x in zip(trees, leaves):
        if x is not None and x.final:  # revisit_final: nothing to expand, its value again, no model call
            backup(t, x, x.value)
    grow = [(t, x) for t, x in zip(trees, leaves) if x is not None and not x.final]
    if not grow:
        return
    common = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    steps = sampler.generate([t.prompt for t, _ in grow],
                             SamplingParams(n=cfg.k, max_tokens=cfg.step_max_tokens, stop=(cfg.step_delimiter,),
                                            **common),
                             seed=seed, prefixes=[t.prefix(x) for t, x in grow])
    new: list[tuple[Tree, Node]] = []
    for (t, leaf), gens in zip(grow, steps):
        merged: dict[tuple[str, bool], list] = {}
        for g in gens:
            ended = g.finish_reason == "stop" and g.stop is None  # the end of the response, not of a step
            merged.setdefault((step_text(g.text, g.stop), ended), []).append(g)
        for (text, ended), group in merged.items():
            child = t.add_child(leaf, text, prior=len(group) / cfg.k, step_tokens=group[0].n_tokens,
                                spent=sum(g.n_tokens for g in group), ended=ended, max_depth=cfg.max_depth)
            new.append((t, child))
    roll = [(t, x) for t, x in new if not x.ended]
    if roll:
        outs = sampler.generate([t.prompt for t, _ in roll],
                                SamplingParams(n=1, max_tokens=cfg.rollout_tokens, **common),
                                seed=seed + 1, prefixes=[t.prefix(x) for t, x in roll])
        for (t, x), (g,) in zip(roll, outs):
            x.rollout, x.rollout_tokens = g.text, g.n_tokens
            x.spent += g.n_tokens
    values = score([(t, t.trajectory(x)) for t, x in new])
    for (t, x), (v, correct) in zip(new, values):
        x.value, x.correct = v, correct
        backup(t, x, v)


def step_text(text: str, stop: str | None) -> str:
    """A step cut at a delimiter, without the delimiter's trailing spaces ("6. " -> "6."): the
    next step brings its own. A prefix ending in a bare space is tokenized as a lone space
    token, which the model rarely sees before a word ("6.", " Then" is how it writes, not "6. ",
    "Then"), so continuations of such prefixes drift: after sentence steps ending in ". ", none
    of 751 next steps began with a capital letter."""
    if stop and text.endswith(stop) and (pad := len(stop) - len(stop.rstrip(" \t"))) and pad < len(text):
        return text[:-pad]
    return text


def search(trees: list[Tree], sampler, cfg: MctsLabel, seed: int, score) -> None:
    from ratchet.tasks.runner.units import unit_seed

    for w in range(cfg.simulations):
        wave(trees, sampler, cfg, unit_seed(seed, w), score)


# what the trees give -------------------------------------------------------------

def complete_nodes(tree: Tree) -> list[Node]:
    """Nodes that carry a scored complete trajectory, best first: value, then Q, then visits."""
    done = [x for x in tree.nodes if x.value is not None]
    return sorted(done, key=lambda x: (-x.value, -x.q, -x.n, x.id))


def subtree(tree: Tree, node: Node) -> list[Node]:
    out, todo = [], [node]
    while todo:
        x = todo.pop()
        out.append(x)
        todo += [tree.nodes[i] for i in x.children]
    return out


def step_pairs(tree: Tree, margin: float, min_visits: int, max_pairs: int) -> list[dict]:
    """Step-level preferences: at every expanded node, its highest-Q child against its
    lowest-Q child when both have min_visits and their Q gap is at least margin (> 0).
    Chosen = the best trajectory through the better child, rejected = the worst through
    the worse one; both share the prefix up to the node. Widest gap first, then the
    shallowest, at most max_pairs per tree."""
    found = []
    for node in tree.nodes:
        kids = [tree.nodes[i] for i in node.children if tree.nodes[i].n >= min_visits]
        if len(kids) < 2:
            continue
        hi = max(kids, key=lambda x: (x.q, -x.id))
        lo = min(kids, key=lambda x: (x.q, x.id))
        gap = hi.q - lo.q
        if gap <= 0 or gap < margin:
            continue
        best = min((x for x in subtree(tree, hi) if x.value is not None),
                   key=lambda x: (-x.value, -x.q, x.id), default=None)
        worst = min((x for x in subtree(tree, lo) if x.value is not None),
                    key=lambda x: (x.value, x.q, x.id), default=None)
        if best is None or worst is None:
            continue
        chosen, rejected = tree.trajectory(best), tree.trajectory(worst)
        if chosen == rejected or not chosen.strip() or not rejected.strip():
            continue
        found.append({"node": node.id, "depth": node.depth, "gap": gap, "chosen_q": hi.q, "rejected_q": lo.q,
                      "chosen": chosen, "rejected": rejected, "chosen_node": best.id, "rejected_node": worst.id,
                      "chosen_correct": best.correct, "rejected_correct": worst.correct,
                      "chosen_tokens": tree.tokens(best), "rejected_tokens": tree.tokens(worst)})
    found.sort(key=lambda p: (-p["gap"], p["depth"], p["node"]))
    return found[:max_pairs]


def tree_stats(trees: list[Tree]) -> dict[str, float]:
    n = max(len(trees), 1)
    nodes = [x for t in trees for x in t.nodes[1:]]
    verified = [t for t in trees if any(x.correct is not None for x in t.nodes)]
    out = {
        "mcts_prompts": float(len(trees)),
        "mcts_nodes_mean": len(nodes) / n,
        "mcts_depth_max_mean": sum(max(x.depth for x in t.nodes) for t in trees) / n,
        "mcts_root_visits_mean": sum(t.root.n for t in trees) / n,
        "mcts_root_q_mean": sum(t.root.q for t in trees) / n,
        "mcts_gen_tokens": float(sum(t.gen_tokens() for t in trees)),
        "mcts_tokens_per_prompt": sum(t.gen_tokens() for t in trees) / n,
        "mcts_trajectories_mean": sum(len(complete_nodes(t)) for t in trees) / n,
        "mcts_branching_mean": (sum(len(x.children) for t in trees for x in t.nodes if x.children)
                                / max(sum(1 for t in trees for x in t.nodes if x.children), 1)),
    }
    if verified:
        out["mcts_solved_frac"] = sum(any(x.correct for x in t.nodes) for t in verified) / len(verified)
    return out
