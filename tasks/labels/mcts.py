"""mcts: no sample stage; a step-level tree search per prompt (tasks/mcts.py) generates its
own rollouts, scores them with the verifier (or the judge), and writes the trees next to
every trajectory it found (MCTS-DPO / ReST-MCTS* style). Runs through the unit loop
(tasks/units.py), in units of prompts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ratchet.data.checkers import Item, Tally, check_many, extract, graded
from ratchet.data.events import count
from ratchet.data.errors import ConfigError
from ratchet.data.records import LabeledCompletion, Prompt
from ratchet.tasks.labels import Budget, Labeled, LabelKind, agreement, injection_stats
from ratchet.tasks.mcts import MctsLabel
from ratchet.tasks.sample import PolicyWork, policy_of
from ratchet.tasks.units import run_units


@dataclass
class MctsWork(PolicyWork):
    """A unit: one tree search per prompt for `size` prompts (tasks/mcts.py), scored by the
    verifier or by the policy as judge."""

    stage = "label"
    cfg: MctsLabel
    check: object

    def run(self, sampler, chunk: list[Prompt], seed: int):
        from ratchet.tasks.judge import judge_values
        from ratchet.tasks.mcts import Tree, search

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


def run(req, store, prompts: list[Prompt], check_cfg, cfg: MctsLabel) -> Labeled:
    """MCTS over the prompts, unit by unit (a resumed stage searches only missing units).
    Writes trees.jsonl; labels every scored trajectory (best first per prompt)."""
    from ratchet.tasks.mcts import Tree, complete_nodes, tree_stats

    if cfg.uses_reference and (missing := [p.id for p in prompts if p.answer is None]):
        raise ConfigError([f"label.kind='mcts' with value={cfg.value!r} needs reference answers, but "
                           f"{len(missing)} prompt(s) have none (first: {missing[0]!r}); set data.answer_field, "
                           "or label.value='judge'"])
    d = store.stage_dir(req.stage, req.key)
    done = run_units(MctsWork(items=prompts, size=cfg.shard_size, cfg=cfg, check=check_cfg, **policy_of(req, store)),
                     d / "shards", req.executor)
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
        from ratchet.tasks.guard import guard

        flagged = [guard(tr.prompt, tr.trajectory(x))[1] for tr in trees for x in tr.nodes if x.value is not None]
    metrics = {**tree_stats(trees), "mcts_s": cost.get("mcts_s", 0.0), "mcts_load_s": done.load_s,
               "mcts_shards_reused": float(done.reused), "holders": done.holders,
               "mcts_tokens_per_s": cost["tokens"] / cost["mcts_s"] if cost.get("mcts_s") else 0.0}
    if cfg.value == "judge":  # label-free: how well the judge's values agree with the verifier, where it can tell
        metrics.update(injection_stats(flagged), **agreement(rows))
    return Labeled(rows, metrics, outputs={"trees.jsonl": len(trees)}, info={"units": done.placement})


def budgets(pipeline) -> dict[str, Budget]:
    """A search path (every step, then the rollout) follows the prompt; a judged value reads it
    inside the judge's template."""
    from ratchet.tasks.judge import template_wrap

    cfg, ctx, raise_ctx = pipeline.label, pipeline.sampler.max_model_len, "raise sampler.max_model_len"
    path = cfg.max_depth * cfg.step_max_tokens + cfg.rollout_tokens
    out = {"the tree search": Budget(lambda p: p, path, ctx, f"{raise_ctx} or shorten the search (label.max_depth, "
                                     "label.step_max_tokens, label.rollout_tokens)")}
    if cfg.value == "judge":
        out["the judge"] = Budget(template_wrap(cfg.judge), path + 4, ctx, raise_ctx, "label")
    return out


def checks(pipeline) -> list[str]:
    cfg, problems = pipeline.label, []
    if cfg.value == "graded" and not pipeline.data.check.reads_numbers:
        problems.append(f"label.value='graded' gives partial credit by a wrong number's distance from the reference "
                        f"(or, with data.check.kind='steps', by the steps shown), but data.check.kind="
                        f"{pipeline.data.check.kind!r} does not read numbers; use label.value='verifier' "
                        "(or data.check.kind='number')")
    need = cfg.max_depth * cfg.step_max_tokens + cfg.rollout_tokens + 64
    if need > pipeline.sampler.max_model_len:
        problems.append(f"label: a search path of max_depth={cfg.max_depth} x step_max_tokens={cfg.step_max_tokens} "
                        f"plus rollout_tokens={cfg.rollout_tokens} and a prompt needs ~{need} tokens > "
                        f"sampler.max_model_len={pipeline.sampler.max_model_len}; raise sampler.max_model_len or "
                        "shorten the search")
    return problems


def summary(m: dict[str, float]) -> list[str]:
    out = [f"{count(m.get('mcts_prompts', 0))} trees", f"{m.get('mcts_tokens_per_prompt', 0):.0f} tokens/prompt"]
    return out + ([f"solved {m['mcts_solved_frac']:.0%}"] if "mcts_solved_frac" in m else [])


KIND = LabelKind(name="mcts", config=MctsLabel, consumes="prompts", uses_policy=True, run=run,
                 needs_reference=lambda cfg: cfg.uses_reference, budgets=budgets, checks=checks,
                 outputs=("trees.jsonl",), summary=summary)
