"""Label kinds: what gives each sampled completion (or each searched prompt) its reward.

Every kind lives in one module of this package, as one class: its config model, a subclass
of `Label`, whose methods describe it: what it consumes (the sample stage's completions, or
the prompts, for a kind that generates its own rollouts), whether it runs the policy (then
the label stage runs in a worker with the sampler settings and a seed), how it labels, and
what the config and input checks need of it (reward range, references, budgets, cross-checks). The
label stage (tasks/label.py), the config and the round flow ask the kind; none of them has
a special case for one.

    verifier     the task's answer check (RFT / ReST-EM / STaR)
    consistency  majority vote of a prompt's own samples (label-free)
    vote         majority vote across models: the policy and its voters (label-free)
    judge        the policy rates its own completions (Self-Rewarding), or a fixed judge does
    reward_model a sequence-classification reward model scores them
    mcts         step-level tree search from the prompts (MCTS-DPO / ReST-MCTS*)
    turn_mcts    tree search over the turns of environment episodes (Agent Q)

Beside the kinds, the algorithms they run, each a module of its own that no stage but theirs
imports: the step-level tree search (tree_search.py: mcts, and the step pairs filter), the search
over turns (turn_search.py: turn_mcts), and judging (judging.py: prompts, verdicts, ratings;
judge and mcts's judged values).
"""

from __future__ import annotations

from abc import abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from ratchet.data import events
from ratchet.data.events import Shows
from ratchet.data.checkers import Item, check_many
from ratchet.data.records import Completion, LabeledCompletion


@dataclass
class Labeled:
    """What a kind returns: every labeled row, its own metrics, any further output files
    (name -> row count) it wrote into the stage directory, and what its manifest's info holds
    (for a kind run in units: which holder, process and node computed each unit)."""

    rows: list[LabeledCompletion]
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, int | None] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Budget:
    """A prompt's token budget in a stage that reads it: the prompt (wrapped as that stage wraps
    it) plus `extra` tokens must fit `limit`, measured by the tokenizer of `reader` ('policy',
    or 'label': the label's fixed model where it has one)."""

    wrap: Callable[[str], str]
    extra: int
    limit: int
    fix: str  # how to raise the limit, in config terms
    reader: Literal["policy", "label"] = "policy"


class Label(BaseModel):
    """A label kind: its config (a member of LabelConfig's union) and everything the flow, the
    config checks and the input checks ask of it. `pipeline` below is the whole pipeline config,
    for budgets and checks that cross sections."""

    model_config = ConfigDict(extra="forbid")
    consumes: ClassVar[Literal["samples", "prompts"]] = "samples"  # the parent stage it reads
    uses_policy: ClassVar[bool] = False  # runs a model (the round's policy, or its fixed one): a worker, a seed
    plays_rollout: ClassVar[bool] = False  # plays the episodes of sample.rollout itself (its job carries the rollout)
    outputs: ClassVar[tuple[str, ...]] = ()  # files it writes beside labels.jsonl (that a filter kind may read)
    shows: ClassVar[Shows] = Shows()  # what the report draws of its metrics
    chats: ClassVar[bool] = False  # its fixed model reads prompts as a chat (a base model: the plain format)
    generates: ClassVar[bool] = False  # its fixed model generates on the run's sampler (sampler.backend)
    # why it cannot be an online trainer's reward (train.kind=grpo), said after "label.kind=K"; None: it can (`score`)
    online: ClassVar[str | None] = "labels a finished sample stage, and an online trainer has none"
    kind: str

    @abstractmethod
    def run(self, req, store, items: list, check_cfg) -> Labeled:
        """Label `items` (completions, or prompts for a kind that consumes prompts)."""

    def scorer(self, model_dir: Path | None) -> Callable[[list[Completion], Any], list[LabeledCompletion]]:
        """What labels one online training step's completions (train.kind=grpo), in the training
        process: called once a stage (`model_dir`: the label's fixed model, where it has one), then
        with each step's rows and data.check. A kind that cannot says why in `online`, and the
        config is refused before this is reached."""
        raise NotImplementedError(f"label.kind={self.kind!r} {self.online}")

    def reward_range(self) -> tuple[float, float]:
        return (0.0, 1.0)

    def scores_with(self, data_check: Any) -> Any:
        """The answer check behind this kind's rewards and verdicts, given the task's (data.check):
        that one, unless the kind has a check of its own (the verifier's label.check)."""
        return data_check

    def needs_reference(self) -> bool:
        """Whether every train prompt needs a reference answer."""
        return False

    def fixed_model(self) -> str | None:
        """A model it runs instead of the policy (the config's value), if any."""
        return None

    def voters(self) -> int:
        """Models beside the round's policy whose samples it reads (a vote across models): each samples
        the round's prompts, and its samples are the label stage's parents too."""
        return 0

    def trains_voters(self) -> bool:
        """Whether its voters are trained beside the policy, each with its own seed (else they are the
        versions before the policy)."""
        return False

    @classmethod
    def check_model(cls, path: Path) -> str | None:
        """What is wrong with that model's directory, if anything."""
        return None

    def title(self) -> str:
        """The label in a few words, for the console and the gate."""
        return self.kind

    def setting(self) -> str:
        """The same, in config terms."""
        return f"label.kind={self.kind!r}"

    def budgets(self, pipeline) -> dict[str, Budget]:
        """Prompt budgets of the stages it runs."""
        return {}

    def checks(self, pipeline) -> list[str]:
        """Problems across sections, each with its fix."""
        return []

    def served(self) -> bool:
        """Calls a served model instead: this process, a seed, no policy."""
        return False

    def ready(self) -> list[str]:
        """What this machine lacks to run it (a key, a server), up front."""
        return []

    def summary(self, m: dict[str, float]) -> list[str]:
        """Its result in a few words, for the console."""
        return [f"{events.count(m.get('labeled', 0))} labeled", f"mean reward {m.get('reward_mean', 0):.2f}"]


def voting_check(kind: str, pipeline) -> list[str]:
    """What a kind that votes with the answers a check reads needs of data.check: that it reads one."""
    if pipeline.data.check.extracts:
        return []
    return [f"label.kind={kind!r} votes with the answers a check reads, but data.check.kind="
            f"{pipeline.data.check.kind!r} reads none; {pipeline.data.check.vote_fix()}"]


def item_of(c: Completion) -> Item:
    """What a check reads of a completion: its final answer (a trajectory's last model turn),
    the reference, the prompt, the row's id, its other columns and an episode's return."""
    return Item(c.final, c.answer, c.prompt, f"{c.prompt_id}#{c.index}", c.fields, c.outcome and c.outcome.ret,
                c.outcome and c.outcome.ended)


def labeled_row(c: Completion, **label) -> LabeledCompletion:
    """A completion with its label (`reward`, and what else the kind records), its turns kept."""
    return LabeledCompletion(prompt_id=c.prompt_id, prompt=c.prompt, answer=c.answer, index=c.index, text=c.text,
                             n_tokens=c.n_tokens, level=c.level, **c.turns(), **label)


def truths(check_cfg: Any, rows: list[Completion]) -> list[bool | None]:
    """The verifier's verdict on each completion whose prompt has a reference answer (the audit
    of a label that does not use it), checked as the verifier label checks: in one batch, the
    row's id and other columns beside it, a user's check's failures held against its budget
    over the batch (a failed row is unaudited, None)."""
    answered = [c for c in rows if c.answer is not None]
    verdicts = iter(check_many(check_cfg, [item_of(c) for c in answered]))
    return [next(verdicts).correct if c.answer is not None else None for c in rows]


def injection_stats(flags: list[list[str]]) -> dict[str, float]:
    """How many judged texts spoke to their judge, by kind: a rising count is a policy drifting
    toward reward hacking."""
    from ratchet.tasks.label_kinds.guard import KINDS

    n = max(len(flags), 1)
    out = {"injection_suspects": float(sum(bool(f) for f in flags))}
    out["injection_suspect_frac"] = out["injection_suspects"] / n
    out.update({f"injection_{k}": float(sum(k in f for f in flags)) for k in KINDS})
    return out


# what every kind's labels are measured by --------------------------------------

def auc(scores: list[float], truth: list[bool]) -> float | None:
    """P(score of a right answer > score of a wrong one), ties counting half; None without both."""
    pos = sorted(s for s, t in zip(scores, truth) if t)
    neg = sorted(s for s, t in zip(scores, truth) if not t)
    if not pos or not neg:
        return None
    import bisect

    wins = sum(bisect.bisect_left(neg, p) + 0.5 * (bisect.bisect_right(neg, p) - bisect.bisect_left(neg, p))
               for p in pos)
    return wins / (len(pos) * len(neg))


def agreement(rows: list[LabeledCompletion]) -> dict[str, float]:
    """How well the label's reward ranks verifier-correct completions above wrong ones.

    verifier_auc pools all completions; verifier_within_prompt_auc averages the AUC of
    each prompt that has both right and wrong samples, which is what best-vs-worst pair
    building relies on. Unscored completions are left out.
    """
    scored = [r for r in rows if r.correct is not None and r.reward is not None]
    out: dict[str, float] = {}
    if (a := auc([r.reward for r in scored], [r.correct for r in scored])) is not None:
        out["verifier_auc"] = a
    by_prompt: dict[str, list[LabeledCompletion]] = defaultdict(list)
    for r in scored:
        by_prompt[r.prompt_id].append(r)
    per = [a for g in by_prompt.values() if (a := auc([r.reward for r in g], [r.correct for r in g])) is not None]
    if per:
        out["verifier_within_prompt_auc"] = sum(per) / len(per)
        out["verifier_auc_prompts"] = float(len(per))
    return out


def reward_stats(rows: list[LabeledCompletion]) -> dict[str, float]:
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r.reward is not None:
            by_prompt[r.prompt_id].append(r.reward)
    scored = [r.reward for r in rows if r.reward is not None]
    n = max(len(scored), 1)
    mean = sum(scored) / n
    out = {
        "reward_mean": mean,
        "reward_std": (sum((x - mean) ** 2 for x in scored) / n) ** 0.5,
        "labeled": float(len(rows)),
        "unscored": float(len(rows) - len(scored)),
    }
    truth = [r.correct for r in rows if r.correct is not None]
    if truth:  # the verifier's view of the samples, whatever the label kind
        per: dict[str, list[bool]] = defaultdict(list)
        for r in rows:
            if r.correct is not None:
                per[r.prompt_id].append(r.correct)
        out["correct_frac"] = sum(truth) / len(truth)
        out["pass_at_n"] = sum(any(v) for v in per.values()) / len(per)
        out["all_correct_frac"] = sum(all(v) for v in per.values()) / len(per)
    return out
