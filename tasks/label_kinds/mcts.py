"""mcts: no sample stage; a step-level tree search per prompt (tasks/label_kinds/tree_search.py) generates its
own rollouts, scores them with the verifier (or the judge), and writes the trees next to
every trajectory it found (MCTS-DPO / ReST-MCTS* style). Runs through the unit loop
(tasks/runner/units.py), in units of prompts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ratchet.data.checkers import Item, Tally, check_many, extract, graded
from ratchet.data.events import Figure, Shows, count
from ratchet.data.errors import ConfigError
from ratchet.data.records import LabeledCompletion, Prompt
from ratchet.tasks.label_kinds import Budget, Label, Labeled, agreement, injection_stats
from ratchet.tasks.label_kinds.judge import JudgeLabel
from ratchet.tasks.sample import PolicyWork, policy_of
from ratchet.tasks.runner.units import run_units


class MctsLabel(Label):
    """Reward = the value of each trajectory found by a step-level tree search (MCTS)."""

    consumes: ClassVar[Literal["samples", "prompts"]] = "prompts"  # no sample stage: it samples its own rollouts
    uses_policy: ClassVar[bool] = True
    outputs: ClassVar[tuple[str, ...]] = ("trees.jsonl",)
    shows: ClassVar[Shows] = Shows(throughput="mcts_tokens_per_s", figures=(Figure(
        "Tree search per round", "mcts.png", "generated tokens per prompt", ("mcts_tokens_per_prompt", "tokens per prompt"),
        ("mcts_solved_frac", "solved (%)", "prompts solved by the search (%)")),))
    kind: Literal["mcts"] = "mcts"
    online: ClassVar[str | None] = (  # why it cannot be train.kind=grpo's reward
        "searches from the prompts with rollouts of its own and labels steps, not a completion's reward")
    simulations: int = Field(default=6, ge=1, description="simulation waves per prompt (each selects and expands "
                             "one leaf that can grow)")
    k: int = Field(default=4, ge=2, description="candidate next steps sampled per expansion")
    max_depth: int = Field(default=4, ge=1, description="most steps in a tree path; a node this deep is final")
    step_delimiter: str = Field(default="\n", min_length=1, description="a step ends after this string (e.g. "
                                "'\\n' for lines, '. ' for sentences)")
    step_max_tokens: int = Field(default=24, ge=1, description="a step also ends after this many tokens")
    rollout_tokens: int = Field(default=96, ge=1, description="token limit of a rollout to the final answer")
    selection: Literal["uct", "puct"] = Field(default="puct", description="tree policy")
    c_explore: float = Field(default=1.0, ge=0, description="exploration constant of UCT/PUCT")
    revisit_final: bool = Field(default=False, description="a wave whose selection reaches a final leaf backs its "
                                "value up again and expands nothing (textbook MCTS), instead of selecting past "
                                "final leaves to a node that can grow")
    temperature: float = Field(default=0.8, gt=0, description="sampling temperature of expansions and rollouts")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling of expansions and rollouts")
    top_k: int = Field(default=50, ge=0, description="0 = off")
    value: Literal["verifier", "graded", "judge"] = Field(
        default="verifier", description="what scores a rollout: the task's answer check (1 or 0; needs reference "
        "answers), 'graded' (the same check, and a wrong number earns partial / (1 + its distance from the "
        "reference), or with a 'steps' check partial x the share of the running values stated in order, so a tree "
        "has a value to follow before its first correct rollout; number and steps checks only), or "
        "the self-reward judge (label-free; a probability mode, rescaled to 0-1)",
    )
    partial: float = Field(default=0.5, gt=0, lt=1, description="value='graded': the most a wrong answer earns "
                           "(an answer one away from the reference earns half of it)")
    judge: JudgeLabel = Field(default_factory=lambda: JudgeLabel(mode="rating"),
                              json_schema_extra={"without": ("model", "endpoint")},  # refused below: not listed
                              description="the judge used when value='judge' (mode p_yes or rating)")
    shard_size: int = Field(default=32, ge=1, description="prompts per resumable shard")

    @property
    def uses_reference(self) -> bool:
        """Whether rollouts are scored against reference answers (every prompt needs one)."""
        return self.value in ("verifier", "graded")

    @model_validator(mode="after")
    def _judge_mode(self):
        if self.judge.model is not None:
            raise ValueError("label.judge.model: the tree search scores rollouts with the policy it searches with; "
                             "a fixed judge model is not supported inside the search yet (unset label.judge.model, "
                             "or use label.kind='judge' with label.model on sampled completions)")
        if self.judge.endpoint is not None:
            raise ValueError("label.judge.endpoint: the tree search scores rollouts inside its engine holders, "
                             "with the policy it searches with; a served judge is not supported inside the search "
                             "(unset it, or use label.kind='judge' with label.endpoint on sampled completions)")
        if self.value == "judge" and self.judge.mode == "text":
            raise ValueError("label.judge.mode='text' cannot score rollouts inside the search (unreadable verdicts "
                             "would leave nodes without a value); use mode 'rating' or 'p_yes'")
        return self

    def run(self, req, store, prompts: list[Prompt], check_cfg) -> Labeled:
        return search_all(req, store, prompts, check_cfg, self)

    def needs_reference(self) -> bool:
        return self.uses_reference

    def budgets(self, pipeline) -> dict[str, Budget]:
        """A search path (every step, then the rollout) follows the prompt; a judged value reads it
        inside the judge's template."""
        from ratchet.tasks.label_kinds.judging import template_wrap

        ctx, raise_ctx = pipeline.sampler.max_model_len, "raise sampler.max_model_len"
        path = self.max_depth * self.step_max_tokens + self.rollout_tokens
        out = {"the tree search": Budget(lambda p: p, path, ctx, f"{raise_ctx} or shorten the search "
                                         "(label.max_depth, label.step_max_tokens, label.rollout_tokens)")}
        if self.value == "judge":
            out["the judge"] = Budget(template_wrap(self.judge), path + 4, ctx, raise_ctx, "label")
        return out

    def checks(self, pipeline) -> list[str]:
        problems = []
        if self.value == "graded" and not pipeline.data.check.reads_numbers:
            problems.append(f"label.value='graded' gives partial credit by a wrong number's distance from the "
                            f"reference (or, with data.check.kind='steps', by the steps shown), but data.check.kind="
                            f"{pipeline.data.check.kind!r} does not read numbers; use label.value='verifier' "
                            "(or data.check.kind='number')")
        need = self.max_depth * self.step_max_tokens + self.rollout_tokens + 64
        if need > pipeline.sampler.max_model_len:
            problems.append(f"label: a search path of max_depth={self.max_depth} x step_max_tokens="
                            f"{self.step_max_tokens} plus rollout_tokens={self.rollout_tokens} and a prompt needs "
                            f"~{need} tokens > sampler.max_model_len={pipeline.sampler.max_model_len}; raise "
                            "sampler.max_model_len or shorten the search")
        return problems

    def summary(self, m: dict[str, float]) -> list[str]:
        out = [f"{count(m.get('mcts_prompts', 0))} trees", f"{m.get('mcts_tokens_per_prompt', 0):.0f} tokens/prompt"]
        return out + ([f"solved {m['mcts_solved_frac']:.0%}"] if "mcts_solved_frac" in m else [])


@dataclass
class MctsWork(PolicyWork):
    """A unit: one tree search per prompt for `size` prompts (tasks/label_kinds/tree_search.py), scored by the
    verifier or by the policy as judge."""

    stage = "label"
    rate = ("tokens", "mcts_s", "tok/s")
    cfg: MctsLabel
    check: object

    def run(self, sampler, chunk: list[Prompt], seed: int):
        from ratchet.tasks.label_kinds.judging import judge_values
        from ratchet.tasks.label_kinds.tree_search import Tree, search

        fields = {p.id: p.fields for p in chunk}  # the rows' other columns, for a check that reads them
        tally = Tally()  # a user's check's failures, held against its budget over the whole unit

        def score(items: list[tuple[Tree, str]]) -> list[tuple[float, bool | None]]:
            if self.cfg.uses_reference:
                return reference_values(self.cfg, self.check, items, fields, tally)
            truth = [v.correct for v in check_many(self.check, [Item(text, t.answer, t.prompt, t.prompt_id,
                                                                      fields.get(t.prompt_id, {}))
                                                                 for t, text in items], tally)]
            values = judge_values(sampler, self.cfg.judge, [(t.prompt, text) for t, text in items], self.seed)
            return list(zip(values, truth))

        trees = [Tree(prompt_id=p.id, prompt=p.prompt, answer=p.answer) for p in chunk]
        t = time.time()
        search(trees, sampler, self.cfg, seed, score)
        self.check.settle(tally)
        return [tr.to_json() for tr in trees], {"mcts_s": time.time() - t,
                                                 "tokens": sum(tr.gen_tokens() for tr in trees)}


def reference_values(cfg: MctsLabel, check_cfg, items: list, fields: dict | None = None,
                     tally: Tally | None = None) -> list[tuple[float, bool]]:
    """(value, correct) of each (tree, trajectory) by the reference answer: the verdict (value
    'verifier') or the verdict with partial credit for a near number (value 'graded'). `fields`:
    each prompt's other columns by prompt id, for a check that reads them."""
    fields = fields or {}
    verdicts = check_many(check_cfg, [Item(text, t.answer, t.prompt, t.prompt_id, fields.get(t.prompt_id, {}))
                                      for t, text in items], tally)
    return [(graded(check_cfg, text, t.answer, cfg.partial) if cfg.value == "graded" else float(bool(v.correct)),
             bool(v.correct)) for (t, text), v in zip(items, verdicts)]


def search_all(req, store, prompts: list[Prompt], check_cfg, cfg: MctsLabel) -> Labeled:
    """MCTS over the prompts, unit by unit (a resumed stage searches only missing units).
    Writes trees.jsonl; labels every scored trajectory (best first per prompt)."""
    from ratchet.tasks.label_kinds.tree_search import Tree, complete_nodes, tree_stats

    if cfg.uses_reference and (missing := [p.id for p in prompts if p.answer is None]):
        raise ConfigError([f"label.kind='mcts' with value={cfg.value!r} needs reference answers, but "
                           f"{len(missing)} prompt(s) have none (first: {missing[0]!r}); set data.answer_field, "
                           "or label.value='judge'"])
    d = store.stage_dir(req.stage, req.key)
    done = run_units(MctsWork(items=prompts, size=cfg.shard_size, cfg=cfg, check=check_cfg, **policy_of(req, store)),
                     d / "shards", req.executor, req.engine)
    trees = [Tree.from_json(json.loads(line)) for line in done.shards.lines()]
    (d / "trees.jsonl").write_text("".join(json.dumps(tr.to_json(), sort_keys=True) + "\n" for tr in trees))
    cost = done.cost
    rows = []
    for tr in trees:
        for rank, x in enumerate(complete_nodes(tr)):
            text = tr.trajectory(x)
            rows.append(LabeledCompletion(prompt_id=tr.prompt_id, prompt=tr.prompt, answer=tr.answer, index=rank,
                                          text=text, n_tokens=tr.tokens(x), reward=x.value,
                                          extracted=extract(check_cfg, text), correct=x.correct))
    if cfg.value == "judge":  # what the guard found in the judged trajectories, reused shards included
        from ratchet.tasks.label_kinds.guard import guard

        flagged = [guard(tr.prompt, tr.trajectory(x))[1] for tr in trees for x in tr.nodes if x.value is not None]
    metrics = {**tree_stats(trees), "mcts_s": cost.get("mcts_s", 0.0), "mcts_load_s": done.load_s,
               "mcts_shards_reused": float(done.reused), "holders": done.holders,
               "mcts_tokens_per_s": cost["tokens"] / cost["mcts_s"] if cost.get("mcts_s") else 0.0}
    if cfg.value == "judge":  # label-free: how well the judge's values agree with the verifier, where it can tell
        metrics.update(injection_stats(flagged), **agreement(rows))
    return Labeled(rows, metrics, outputs={"trees.jsonl": len(trees)}, info={"units": done.placement})

