"""search: PromptAgent's tree search over prompts, from error feedback.

A node is a prompt (tasks/text.py: a template with one {prompt}). Expanding a node runs the
policy under it on a batch of train prompts, shows the optimiser the answers the check finds
wrong, asks it why the prompt got them wrong (the feedback), then asks it, from that feedback,
for `width` revised prompts: the node's children. A node's reward is the check's accuracy on
the score prompts, the same for every node, so scores compare. Selection is UCT over the
children's mean returns; a simulation expands the best child down to `depth`; backpropagation
adds to each node on the path the mean score of the path below it (itself included).

After `iterations`, the chosen prompt is the best-scoring node on the path whose mean score is
highest. It and the base prompt are then scored on the reward prompts, which the search never
scored; the chosen replaces the base only where it scores higher there. The held-out
evaluation is never read.

What the optimiser writes is untrusted text. A revision that is empty, longer than
`max_chars`, past the engine's context with the longest prompt in it, with more than one
{prompt}, the same as a prompt already in the tree, or with text aimed at a judge (the guard,
tasks/label_kinds/guard.py) is refused; each refusal is kept in the tree with its reason and counted.

Every computed result (a node's score, an expansion's batch, answers, feedback and revisions)
is appended to journal.jsonl as it is made and read back on a resume, so a killed search
continues at the node where it stopped and, seeded, makes the same tree byte for byte. The
stage writes nodes.jsonl (the tree: each node's text, parent, feedback, batch and score) and
prompt.json (the pair: the chosen text over the weights searched with).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.checks.base import Item
from ratchet.data.digest import sha256_json
from ratchet.data.errors import ConfigError
from ratchet.data.manifest import StageManifest
from ratchet.data.records import Prompt, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.data.userfiles import UserFile
from ratchet.models.endpoint import EndpointConfig
from ratchet.models.sampler import SamplingParams
from ratchet.tasks.runner.stage import StageRequest
from ratchet.tasks.text import SLOT, PromptText, read_text, weights_of, write_pair

SHOWN = "[question]"  # how the optimiser sees the slot, and may write it


class PolicyOptimiser(BaseModel):
    """The run's own policy writes the feedback and the revisions, on the search's engine."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["policy"] = "policy"

    def identity(self) -> str:
        return "the policy"

    def own_model(self) -> str | None:
        """The model this optimiser loads as a stage of the run (None: none of its own)."""
        return None


class ServedOptimiser(BaseModel):
    """A model served elsewhere (any OpenAI-compatible API, models/endpoint.py) writes the feedback
    and the revisions: its key from the environment, never in a file; its calls retried, and
    journaled by content in the stage's directory, so a resumed search pays for none twice."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["served"] = "served"
    endpoint: EndpointConfig = Field(description="where the optimiser is served: base_url, model, api_key_env, ...")

    def identity(self) -> str:
        return self.endpoint.where()

    def own_model(self) -> str | None:
        return None


class ModelOptimiser(BaseModel):
    """Another local model writes, on an engine of its own beside the policy's: its weights are a
    stage of the run (optimiser-model), so the search is keyed by their digest, not the path."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["model"] = "model"
    path: Annotated[str, UserFile(keep=("default",))] = Field(
        description="the optimiser's model: 'default' (the embedded model), a local directory, or a hub id in the "
        "local cache")
    backend: Literal["hf", "vllm"] = Field(default="hf", description="its engine: hf (transformers' generate, "
                                           "beside any policy engine) or vllm (a second vLLM engine in the search "
                                           "stage's process, with the run's sampler settings)")

    def identity(self) -> str:
        return f"the model {self.path}"

    def own_model(self) -> str | None:
        return self.path


# who writes the feedback and the revisions: one member per kind
OptimiserConfig = Annotated[PolicyOptimiser | ServedOptimiser | ModelOptimiser, Field(discriminator="kind")]


OPTIMISER = ("who writes the search's text (feedback and revisions, or beliefs): policy (the run's own model, on the "
             "search's engine), model (another local model, on an engine of its own: path) or served (a model behind "
             "an OpenAI-compatible API: endpoint)")


class Optimised:
    """What every search kind's settings share: an optimiser (`optimiser`, OptimiserConfig)."""

    def ready(self) -> list[str]:
        """What keeps this machine from calling a served optimiser, before any model loads."""
        o = self.optimiser
        return o.endpoint.problems("prompt.search.optimiser.endpoint") if isinstance(o, ServedOptimiser) else []


def open_writer(optimiser, req: StageRequest, store: ArtifactStore, sampler, calls: Path):
    """The optimiser's writer for a search stage, and what to close after: the policy's own sampler,
    a served endpoint (its calls journaled in `calls`), or the optimiser-model parent's engine."""
    if isinstance(optimiser, ServedOptimiser):
        from ratchet.models.endpoint import Endpoint

        served = Endpoint(optimiser.endpoint, calls, at="prompt.search.optimiser.endpoint")
        return ServedWriter(served), served, None
    if isinstance(optimiser, ModelOptimiser):
        from ratchet.models.sampler import open_sampler
        from ratchet.tasks.prepare import model_dir

        own = req.parent("optimiser-model")
        cfg = req.config.sampler.model_copy(update={"backend": optimiser.backend, "endpoint": None})
        engine = open_sampler(model_dir(store, own), cfg, seed=req.seed + 1)
        return PolicyWriter(engine), None, engine
    return PolicyWriter(sampler), None, None


class PromptAgentSearch(Optimised, BaseModel):
    """PromptAgent: Monte Carlo tree search over prompts, each revision written from the errors
    of the prompt it revises."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["prompt_agent"] = "prompt_agent"
    iterations: int = Field(default=3, ge=1, description="selection, expansion, simulation and backpropagation "
                            "passes over the tree")
    width: int = Field(default=2, ge=1, description="revised prompts the optimiser writes from each expansion's "
                       "feedback: a node's children")
    depth: int = Field(default=2, ge=1, description="most revisions on a path from the base prompt")
    batch: int = Field(default=8, ge=1, description="train prompts an expansion runs its node's prompt on, to find "
                       "the answers it gets wrong")
    errors: int = Field(default=3, ge=1, description="wrong answers (at most) the optimiser reads per expansion")
    score_prompts: int = Field(default=16, ge=1, description="train prompts every node is scored on (the same for "
                               "every node, so scores compare)")
    reward_prompts: int = Field(default=16, ge=1, description="train prompts the search never scores: the chosen "
                                "prompt and the base are scored on them at the end, and the chosen replaces the base "
                                "only where it scores higher")
    exploration: float = Field(default=2.5, ge=0, description="UCT's exploration constant")
    temperature: float = Field(default=0.8, ge=0, description="the optimiser's sampling temperature (its "
                               "revisions of one feedback differ by it)")
    feedback_tokens: int = Field(default=96, ge=1, description="most tokens of one feedback")
    revision_tokens: int = Field(default=128, ge=1, description="most tokens of one revision")
    max_chars: int = Field(default=1200, ge=16, description="a revision longer than this is refused")
    optimiser: OptimiserConfig = Field(default_factory=PolicyOptimiser, description=OPTIMISER)

    def needs_prompts(self) -> int:
        """The fewest train prompts a search can split (each with a reference answer, where the check
        compares with one)."""
        return self.reward_prompts + self.score_prompts + 1

    def rollout_problems(self, at: str, rollout) -> list[str]:
        """What keeps this search from putting its prompts in `rollout` (at `at` in the config)."""
        if rollout.text_refused is not None:
            return [f"prompt.search.kind='prompt_agent' puts text around each task prompt, and {at}.kind="
                    f"{rollout.kind!r} {rollout.text_refused}"]
        return []

    def describe(self, draw: int) -> str:
        """The search and how a round's `draw` of train prompts splits, for `ratchet check`."""
        s = self
        return (f"prompt search: {s.kind}, {s.iterations} iteration(s), {s.width} revision(s) per expansion, depth "
                f"{s.depth}; optimiser: {s.optimiser.identity()}; each round's {draw} train prompts: "
                f"{s.reward_prompts} to reward the chosen prompt, {s.score_prompts} to score every node, "
                f"{draw - s.reward_prompts - s.score_prompts} for the expansions' batches of {s.batch}")

    def summary(self, m: dict[str, float]) -> list[str]:
        kept = "the chosen prompt replaced it" if m.get("replaced") else "the round's prompt kept"
        return [f"{m.get('nodes', 0):.0f} prompts, {m.get('refused', 0):.0f} revisions refused",
                f"reward prompts {m.get('base_reward', 0):.0%} -> {m.get('chosen_reward', 0):.0%}: {kept}",
                f"{m.get('tokens_per_s', 0):.0f} tok/s"]

    def problems(self, train_prompts: int) -> list[str]:
        if train_prompts < self.needs_prompts():
            return [f"prompt.search needs {self.needs_prompts()} train prompts its check can score "
                    f"(reward_prompts={self.reward_prompts} + score_prompts={self.score_prompts} + 1 for the "
                    f"expansions' batches), and a round has {train_prompts}; lower prompt.search.reward_prompts "
                    "or score_prompts, or give more train prompts"]
        return []


# the tree ----------------------------------------------------------------------------------

@dataclass
class Node:
    id: int
    parent: int | None
    depth: int
    template: str
    feedback: str = ""  # the parent's expansion's feedback, which this revision was written from
    batch: list[str] = field(default_factory=list)  # the ids of the parent's expansion batch
    score: float | None = None  # accuracy on the score prompts
    children: list[int] = field(default_factory=list)
    expanded: bool = False
    visits: int = 0
    value: float = 0.0  # the sum of the returns backpropagated through it

    def row(self) -> dict:
        return {"id": self.id, "parent": self.parent, "depth": self.depth, "template": self.template,
                "feedback": self.feedback, "batch": self.batch, "score": self.score, "children": self.children,
                "visits": self.visits, "value": self.value}


class Journal:
    """Every result the search computed, appended as it is made (fsynced), read back on a resume:
    `get(key, make)` returns the recorded value, or makes, records and returns it."""

    def __init__(self, path: Path):
        self.path, self.done, self.reused = path, {}, 0
        if path.exists():
            good = 0  # bytes of whole records: a line a kill cut short is cut off, and made again
            data = path.read_bytes()
            for line in data.splitlines(keepends=True):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break
                if not line.endswith(b"\n"):
                    break
                self.done[rec["key"]] = rec["value"]
                good += len(line)
            if good < len(data):
                with path.open("r+b") as f:
                    f.truncate(good)

    def get(self, key: str, make):
        if key in self.done:
            self.reused += 1
            return self.done[key]
        value = make()
        with self.path.open("a") as f:
            f.write(json.dumps({"key": key, "value": value}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[key] = value
        return value


def shown(template: str) -> str:
    return template.replace(SLOT, SHOWN)


def examples_text(wrong: list[dict]) -> str:
    return "\n\n".join(f"Question: {_clip(w['prompt'])}\nAnswer given: {_clip(w['answer'].strip())}\n"
                       f"Correct answer: {_clip(str(w['reference']))}" for w in wrong)


def _clip(text: str, n: int = 300) -> str:
    """A shown example's text, cut where it is long: the optimiser's context holds them all."""
    return text if len(text) <= n else text[:n] + " [...]"


def feedback_prompt(template: str, wrong: list[dict]) -> str:
    return (f"I am writing a prompt for a language model. {SHOWN} marks where each question goes. My prompt is:\n"
            f"\"{shown(template)}\"\n\nWith it, the model got these examples wrong:\n\n{examples_text(wrong)}\n\n"
            "Give brief reasons why the prompt could have led to these wrong answers.")


def revision_prompt(template: str, wrong: list[dict], feedback: str) -> str:
    return (f"I am writing a prompt for a language model. {SHOWN} marks where each question goes. My prompt is:\n"
            f"\"{shown(template)}\"\n\nWith it, the model got these examples wrong:\n\n{examples_text(wrong)}\n\n"
            f"Reasons the prompt got them wrong: {feedback.strip()}\n\nBased on these reasons, write an improved "
            f"prompt, with {SHOWN} where the question goes. Put the new prompt between <START> and <END>.")


def revised(text: str) -> str:
    """The prompt a revision gives: what it wrote between <START> and <END> (or all of it), the
    slot written as {prompt} or [question], added at the end where it wrote none."""
    m = re.search(r"<START>(.*?)(?:<END>|$)", text, re.S)
    body = (m.group(1) if m else text).strip().strip('"').strip()
    body = body.replace(SHOWN, SLOT)
    if not body:
        return ""
    return body if SLOT in body else f"{body}\n\n{SLOT}"


def refusal(template: str, seen: set[str], max_chars: int, too_long) -> str | None:
    """Why a revision is refused (None: it is a node)."""
    from ratchet.tasks.label_kinds.guard import scan

    if not template.replace(SLOT, "").strip():
        return "empty"
    if len(template) > max_chars:
        return f"longer than max_chars={max_chars} ({len(template)} characters)"
    if template.count(SLOT) > 1:
        return f"{template.count(SLOT)} {{prompt}} slots"
    if template in seen:
        return "the same as a prompt in the tree"
    if (findings := scan(template.replace(SLOT, ""))):
        return f"speaks to a judge ({findings[0].kind}: {findings[0].text[:40]!r})"
    if too_long(template):
        return "past the engine's context with the longest prompt in it"
    return None


class Engine:
    """What the search runs: the policy's answers under a prompt, checked; and the optimiser's
    text. The stage's is a sampler (EngineOnSampler); a test's may be anything."""

    def answers(self, template: str, prompts: list[Prompt], seed: int) -> list[dict]: ...
    def write(self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int) -> list[str]: ...
    def too_long(self, template: str) -> bool: ...  # the policy's context cannot hold it with the longest prompt
    def fits(self, prompt: str, max_tokens: int) -> bool: ...  # the optimiser's context holds it and its answer


class Search:
    """The tree search, replayable from its journal."""

    def __init__(self, cfg: PromptAgentSearch, engine: Engine, journal: Journal, base: str,
                 prompts: list[Prompt], seed: int):
        self.cfg, self.engine, self.journal, self.seed = cfg, engine, journal, seed
        order = sorted(prompts, key=lambda p: sha256_json(["search-split", seed, p.id]))
        self.reward = order[:cfg.reward_prompts]
        self.score_set = order[cfg.reward_prompts:cfg.reward_prompts + cfg.score_prompts]
        self.pool = order[cfg.reward_prompts + cfg.score_prompts:]
        self.nodes = [Node(0, None, 0, base)]
        self.refused: list[dict] = []  # revisions refused, each with its parent, why and its text
        self.unexpanded: list[dict] = []  # nodes an expansion could not revise, and why
        self.counts = {"answers": 0, "gen_s": 0.0, "answer_tokens": 0}

    # results, each through the journal
    def _answers(self, key: str, template: str, prompts: list[Prompt], seed: int) -> list[dict]:
        def make():
            t = time.time()
            rows = self.engine.answers(template, prompts, seed)
            self.counts["gen_s"] += time.time() - t
            self.counts["answer_tokens"] += sum(r.get("tokens", 0) for r in rows)
            return rows

        rows = self.journal.get(key, make)
        self.counts["answers"] += len(rows)
        return rows

    def score(self, node: Node) -> float:
        rows = self._answers(f"score/{node.id}", node.template, self.score_set, self.seed)
        node.score = sum(r["correct"] for r in rows) / max(len(rows), 1)
        return node.score

    def expand(self, node: Node) -> None:
        node.expanded = True
        cfg, rng = self.cfg, random.Random(sha256_json(["search-batch", self.seed, node.id]))
        batch = rng.sample(self.pool, min(cfg.batch, len(self.pool)))
        rows = self._answers(f"batch/{node.id}", node.template, batch, self.seed)
        wrong = [r for r in rows if not r["correct"]][:cfg.errors]
        if not wrong:
            self.unexpanded.append({"node": node.id, "why": "no wrong answers in its batch: nothing to revise"})
            return
        # as many of the wrong answers as the optimiser's context holds with the feedback it writes
        while len(wrong) > 1 and not self.engine.fits(revision_prompt(node.template, wrong, "x" * 4 * cfg.feedback_tokens),
                                                      cfg.revision_tokens):
            wrong = wrong[:-1]
        if not self.engine.fits(revision_prompt(node.template, wrong, "x" * 4 * cfg.feedback_tokens),
                                cfg.revision_tokens):
            self.unexpanded.append({"node": node.id, "why": "its prompt and one wrong answer do not fit the "
                                    "optimiser's context"})
            return
        seed = self.seed * 7919 + node.id
        feedback = self.journal.get(f"feedback/{node.id}", lambda: self.engine.write(
            feedback_prompt(node.template, wrong), 1, cfg.feedback_tokens, cfg.temperature, seed)[0])
        texts = self.journal.get(f"revisions/{node.id}", lambda: self.engine.write(
            revision_prompt(node.template, wrong, feedback), cfg.width, cfg.revision_tokens, cfg.temperature, seed + 1))
        seen = {n.template for n in self.nodes}
        for text in texts:
            template = revised(text)
            why = refusal(template, seen, cfg.max_chars, self.engine.too_long)
            if why is not None:
                self.refused.append({"parent": node.id, "why": why, "text": text[:cfg.max_chars]})
                continue
            seen.add(template)
            child = Node(len(self.nodes), node.id, node.depth + 1, template, feedback=feedback,
                         batch=[p.id for p in batch])
            self.nodes.append(child)
            node.children.append(child.id)
            self.score(child)

    def uct(self, parent: Node, child: Node) -> float:
        if child.visits == 0:
            return math.inf
        return child.value / child.visits + self.cfg.exploration * math.sqrt(math.log(max(parent.visits, 1))
                                                                             / child.visits)

    def run(self) -> None:
        root = self.nodes[0]
        self.score(root)
        for _ in range(self.cfg.iterations):
            path, node = [root], root
            while node.children and node.depth < self.cfg.depth:  # selection
                node = max((self.nodes[c] for c in node.children), key=lambda c: (self.uct(node, c), -c.id))
                path.append(node)
            while node.depth < self.cfg.depth:  # expansion and simulation: the best child, down to depth
                if not node.expanded:
                    self.expand(node)
                if not node.children:
                    break
                node = max((self.nodes[c] for c in node.children), key=lambda c: (c.score, -c.id))
                path.append(node)
            for i, n in enumerate(path):  # backpropagation: the mean score of the path below
                below = [m.score for m in path[i:]]
                n.visits += 1
                n.value += sum(below) / len(below)

    def chosen(self) -> Node:
        """The best-scoring node of the path (root to a leaf) whose mean score is highest."""
        best, best_mean = [self.nodes[0]], -1.0
        for leaf in self.nodes:
            if leaf.children:
                continue
            path, n = [], leaf
            while n is not None:
                path.append(n)
                n = self.nodes[n.parent] if n.parent is not None else None
            mean = sum(x.score for x in path) / len(path)
            if mean > best_mean:
                best, best_mean = path, mean
        return max(reversed(best), key=lambda x: (x.score, -x.depth))

    def final(self) -> tuple[Node, dict[str, float]]:
        """The prompt the search gives (the chosen one where it beats the base on the reward
        prompts, else the base) and the figures of that comparison."""
        root, pick = self.nodes[0], self.chosen()
        rate = lambda n: sum(r["correct"] for r in self._answers(  # noqa: E731
            f"reward/{n.id}", n.template, self.reward, self.seed)) / max(len(self.reward), 1)
        base_reward = rate(root)
        pick_reward = rate(pick) if pick is not root else base_reward
        won = pick_reward > base_reward
        return (pick if won else root), {"base_reward": base_reward, "chosen_reward": pick_reward,
                                         "chosen_score": pick.score, "base_score": root.score,
                                         "replaced": float(won), "chosen_node": float(pick.id)}


# the stage ---------------------------------------------------------------------------------

class PolicyWriter:
    """The optimiser as the run's own policy: its sampler writes."""

    def __init__(self, sampler):
        self.sampler = sampler

    def write(self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int) -> list[str]:
        gens = self.sampler.generate([prompt], SamplingParams(n=n, temperature=temperature, top_k=50,
                                                               max_tokens=max_tokens), seed=seed)
        return [g.text for g in gens[0]]


class ServedWriter:
    """The optimiser served elsewhere: one call per revision (not every server gives n choices),
    journaled by the endpoint as each arrives; a call the server refused writes nothing ("empty")."""

    def __init__(self, endpoint):
        self.endpoint = endpoint

    def write(self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int) -> list[str]:
        replies = self.endpoint.chat([{"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                                       "temperature": temperature, "seed": seed + i} for i in range(n)])
        return [r.texts[0] if r is not None and r.texts else "" for r in replies]


def writer_fits(writer, prompt: str, max_tokens: int, max_model_len: int) -> bool:
    """Whether the optimiser's context holds `prompt` and `max_tokens` more (a served one's server
    decides: a request past its context is refused, and counted)."""
    if isinstance(writer, ServedWriter):
        return True
    from ratchet.models.sampler import fits

    return fits(writer.sampler, prompt, max_tokens, max_model_len)


class EngineOnSampler(Engine):
    """The search's engine: the policy (a sampler) answers greedily through the rollout, the
    task's check scores; the optimiser (`writer`) writes."""

    def __init__(self, sampler, rollout, check, max_tokens: int, max_model_len: int, longest: str, writer):
        self.sampler, self.rollout, self.check, self.writer = sampler, rollout, check, writer
        self.max_tokens, self.max_model_len, self.longest = max_tokens, max_model_len, longest

    def answers(self, template: str, prompts: list[Prompt], seed: int) -> list[dict]:
        from ratchet.data.checkers import check_many

        text = PromptText(template=template)
        ps = [p.model_copy(update={"prompt": text.render(p.prompt)}) for p in prompts]
        done, _ = self.rollout.roll(self.sampler, ps, SamplingParams(n=1, temperature=0.0,
                                                                     max_tokens=self.max_tokens), seed)
        verdicts = check_many(self.check, [Item(c.final, c.answer, c.prompt, c.prompt_id, c.fields) for c in done])
        return [{"id": c.prompt_id, "prompt": p.prompt, "answer": c.final, "reference": p.answer,
                 "correct": bool(v.correct), "tokens": c.n_tokens} for p, c, v in zip(prompts, done, verdicts)]

    def write(self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int) -> list[str]:
        return self.writer.write(prompt, n, max_tokens, temperature, seed)

    def fits(self, prompt: str, max_tokens: int) -> bool:
        return writer_fits(self.writer, prompt, max_tokens, self.max_model_len)

    def too_long(self, template: str) -> bool:
        from ratchet.models.sampler import fits

        return not fits(self.sampler, PromptText(template=template).render(self.longest), self.max_tokens,
                        self.max_model_len)


def prompt_agent_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    from ratchet.tasks.prepare import open_policy, train_prompts

    job, d = req.config, store.stage_dir(req.stage, req.key)  # a text_search.SearchJob
    policy = req.parent_model
    base = read_text(req, store) or PromptText(template=SLOT)
    prompts = [p for p in train_prompts(req, store, as_read=False)  # the search puts each node's text around them
               if p.answer is not None or not job.data.check.needs_answer]
    if problems := job.search.problems(len(prompts)):
        raise ConfigError(problems)
    t0 = time.time()
    sampler = open_policy(store, policy, job.sampler, req.seed, d / "policy-calls")  # a served policy's calls journaled
    load_s = time.time() - t0
    own = None
    try:
        longest = max((p.prompt for p in prompts), key=len)
        writer, served, own = open_writer(job.search.optimiser, req, store, sampler, d / "calls.jsonl")
        engine = EngineOnSampler(sampler, job.rollout, job.data.check, job.max_tokens, job.sampler.max_model_len,
                                 longest, writer)
        journal = Journal(d / "journal.jsonl")
        search = Search(job.search, engine, journal, base.template, prompts, req.seed)
        search.run()
        pick, figures = search.final()
    finally:
        sampler.close()
        if own is not None:
            own.close()
    write_jsonl(d / "nodes.jsonl", [_NodeRow(**n.row()) for n in search.nodes])
    (d / "refused.json").write_text(json.dumps({"refused": search.refused, "unexpanded": search.unexpanded},
                                               indent=2) + "\n")
    c = search.counts
    metrics = {**figures, **(served.metrics("optimiser_") if served is not None else {}),
               **(sampler.metrics("policy_") if hasattr(sampler, "metrics") else {}),
               "nodes": float(len(search.nodes)), "refused": float(len(search.refused)),
               "unexpanded": float(len(search.unexpanded)),
               "answers": float(c["answers"]), "journal_reused": float(journal.reused), "load_s": load_s,
               "tokens_per_s": c["answer_tokens"] / c["gen_s"] if c["gen_s"] else 0.0}
    return write_pair(req, store, PromptText(template=pick.template), weights_of(store, policy), metrics=metrics,
                      info={"optimiser": job.search.optimiser.identity(), "chosen": pick.id},
                      outputs={"nodes.jsonl": len(search.nodes), "refused.json": None, "journal.jsonl": None,
                               **({"calls.jsonl": None} if served is not None else {})})


class _NodeRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: int
    parent: int | None
    depth: int
    template: str
    feedback: str
    batch: list[str]
    score: float | None
    children: list[int]
    visits: int
    value: float
