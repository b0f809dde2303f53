"""filter.kind=step_pairs: step-level preference pairs from the tree search's trees
(label.kind='mcts', tasks/label_kinds/tree_search.py; or turn-level ones, label.kind='turn_mcts',
tasks/label_kinds/turn_search.py): at each expanded node, the highest-Q child against the lowest-Q child
when their Q gap reaches `margin`, each completed by its best (resp. worst) trajectory, so the
pair shares the prefix up to the node and differs from the step where the values part. Of a
search over turns, the shared path is the pair's prompt (token ids, never trained on) and the
turns from the node on its segments, the environment's masked in training."""

from __future__ import annotations

import json
from typing import ClassVar, Literal

from pydantic import Field

from ratchet.data.events import Shows
from ratchet.data.errors import EmptyStageError
from ratchet.data.records import PairRow
from ratchet.tasks.filter_kinds import PAIRS_SHOWN, Filter, Rows, pair_summary, verifier_view


class StepPairFilter(Filter):
    """Step-level preference pairs from the trees of label.kind='mcts' for DPO."""

    builds: ClassVar[Rows] = "pairs"
    shows: ClassVar[Shows] = PAIRS_SHOWN
    reads: ClassVar[tuple[str, str] | None] = ("trees.jsonl", "search trees")  # a label kind's extra output
    kind: Literal["step_pairs"] = "step_pairs"
    margin: float = Field(default=0.3, ge=0, description="least Q gap between the preferred and the dispreferred "
                          "sibling step, in the values' units (0-1 for label.kind='mcts'; an episode's return for "
                          "'turn_mcts'); equal Q never pairs")
    min_visits: int = Field(default=1, ge=1, description="both siblings need at least this many visits")
    max_pairs_per_prompt: int = Field(default=2, ge=1, description="pairs per prompt, widest gap first")
    min_pairs: int = Field(default=16, ge=1, description="fewer pairs than this stops the round")

    def build(self, req, store) -> tuple[list[PairRow], dict[str, float]]:
        from ratchet.tasks.label_kinds.turn_search import load_tree

        lab = req.parent("label")
        if "trees.jsonl" not in lab.outputs:
            raise EmptyStageError(f"filter.kind='step_pairs' needs the trees of label.kind='mcts' or 'turn_mcts'; the "
                                  f"label stage {lab.dir} has none. Set label.kind='mcts' or filter.kind='pairs'")
        trees = [load_tree(json.loads(x)) for x in store.path(lab, "trees.jsonl").read_text().splitlines()]
        kept, metrics = tree_pairs(trees, self)
        if len(kept) < self.min_pairs:
            raise EmptyStageError(
                f"round {req.round}: the trees of {len(trees)} prompts gave {len(kept)} step pairs < "
                f"filter.min_pairs={self.min_pairs} with filter.margin={self.margin} and "
                f"filter.min_visits={self.min_visits}. Raise label.simulations or label.k, lower filter.margin or "
                "filter.min_visits, add prompts, or lower filter.min_pairs."
            )
        return kept, metrics

    def reward_checks(self, lo: float, hi: float, label: str) -> list[str]:
        if self.margin > hi - lo:
            return [f"filter.margin={self.margin:g} can never be reached: {label} gives values in [{lo:g}, {hi:g}]; "
                    f"set filter.margin to at most {hi - lo:g}"]
        return []

    def summary(self, m: dict[str, float]) -> list[str]:
        return pair_summary(m)


def tree_pairs(trees: list, cfg: StepPairFilter) -> tuple[list[PairRow], dict[str, float]]:
    from ratchet.tasks.label_kinds.tree_search import step_pairs
    from ratchet.tasks.label_kinds.turn_search import TurnTree

    pairs: list[PairRow] = []
    gaps, depths = [], []
    for t in trees:
        for p in step_pairs(t, cfg.margin, cfg.min_visits, cfg.max_pairs_per_prompt):
            turns = {}
            if isinstance(t, TurnTree):  # the path to the node is the prompt; the turns from it on are trained
                node = t.nodes[p["node"]]
                chosen, rejected = t.part(node, t.nodes[p["chosen_node"]]), t.part(node, t.nodes[p["rejected_node"]])
                turns = {"prompt_ids": chosen["prompt_ids"], "chosen_segments": chosen["segments"],
                         "rejected_segments": rejected["segments"], "chosen_outcome": chosen["outcome"],
                         "rejected_outcome": rejected["outcome"],
                         "chosen": "".join(s.text for s in chosen["segments"]),
                         "rejected": "".join(s.text for s in rejected["segments"]),
                         "chosen_tokens": sum(len(s.token_ids) for s in chosen["segments"] if s.role == "model"),
                         "rejected_tokens": sum(len(s.token_ids) for s in rejected["segments"] if s.role == "model")}
            pairs.append(PairRow(**{**dict(prompt_id=t.prompt_id, prompt=t.prompt, chosen=p["chosen"],
                                           rejected=p["rejected"], chosen_reward=p["chosen_q"],
                                           rejected_reward=p["rejected_q"], chosen_tokens=p["chosen_tokens"],
                                           rejected_tokens=p["rejected_tokens"], chosen_correct=p["chosen_correct"],
                                           rejected_correct=p["rejected_correct"]), **turns}))
            gaps.append(p["gap"])
            depths.append(p["depth"])
    n = max(len(pairs), 1)
    metrics = {"pairs": float(len(pairs)), "prompts": float(len(trees)),
               "prompts_covered": float(len({p.prompt_id for p in pairs})), "q_gap_mean": sum(gaps) / n,
               "pair_depth_mean": sum(depths) / n, "root_pairs": float(sum(d == 0 for d in depths)),
               "chosen_tokens_mean": sum(p.chosen_tokens for p in pairs) / n,
               "rejected_tokens_mean": sum(p.rejected_tokens for p in pairs) / n}
    metrics.update(verifier_view(pairs))
    return pairs, metrics
