"""search kind beliefs: FinCon's verbal reinforcement over a roles rollout's beliefs.

A roles rollout (tasks/rollouts/roles.py) plays an environment with agents in roles, each given
its beliefs before its instructions. An iteration of the search:

1. plays `episodes` episodes of each of `starts` train starts under the current beliefs
   (sampled at `temperature`, so two episodes of one start differ);
2. pairs, per start, its best episode with its worst where their returns differ by more than
   `margin` (as DPO pairs samples of one prompt), the `pairs` most different first;
3. shows the optimiser each pair: every turn's reports, the acting role's action and the
   step's reward, and the two returns; it writes what separates them as beliefs, one per line,
   `ROLE: BELIEF`;
4. adds each belief to the role it names only (the newest `max_beliefs` of a role kept), so
   a belief about reading the closes changes the analyst that reads them and no other role.

After `iterations`, the final beliefs and the ones the search began with are both played
greedily on the reward starts, which no iteration played; the final replace them only where they
score higher there (the check's accuracy, then the mean return). The held-out evaluation is
never read.

A belief concerns the role it is written for (`ROLE: BELIEF`), or, in prose, the roles its
sentence names; a sentence that names no role is not a belief. What the optimiser writes is
untrusted text: a belief for the format's placeholder (`ROLE:`), one that is empty, longer than
`max_chars`, one its role already holds, past `per_pair`, or aimed at a judge (tasks/label_kinds/guard.py) is
refused; each refusal is kept with its reason and counted. Every computed result (an
iteration's episodes, the optimiser's text, the reward scores) is appended to journal.jsonl as
it is made, so a killed search continues where it stopped and, seeded, writes the same beliefs.
The stage writes versions.jsonl (each iteration's pairs, what the optimiser wrote, what was kept
and refused, and the beliefs after it) and prompt.json (the pair: the chosen beliefs over the
weights searched with).
"""

from __future__ import annotations

import json
import random
import re
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.checks.base import Item
from ratchet.data.digest import sha256_json
from ratchet.data.manifest import StageManifest
from ratchet.data.records import Prompt
from ratchet.data.store import ArtifactStore
from ratchet.models.sampler import SamplingParams
from ratchet.tasks.searches.prompt_agent import (OPTIMISER, Journal, Optimised, OptimiserConfig, PolicyOptimiser,
                                         open_writer, writer_fits)
from ratchet.tasks.runner.stage import StageRequest
from ratchet.tasks.text import PromptText, read_text, weights_of, write_pair

CLIP = 120  # characters of one report or action shown to the optimiser
LINE = re.compile(r"^\s*(?:[-*•]|\d+[.)])?\s*\**\s*([A-Za-z][A-Za-z0-9_-]{0,31})\s*\**\s*:\s*(.*)$")


class BeliefsSearch(Optimised, BaseModel):
    """FinCon: episodes compared in better and worse pairs, and the beliefs that separate them
    written into the roles they concern."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["beliefs"] = "beliefs"
    iterations: int = Field(default=2, ge=1, description="episodes played, compared and turned into beliefs, this "
                            "many times in one search")
    starts: int = Field(default=4, ge=1, description="train starts an iteration plays")
    episodes: int = Field(default=2, ge=2, description="episodes of each start an iteration plays (sampled, so they "
                          "differ); its best and worst are compared")
    temperature: float = Field(default=1.0, gt=0, description="the policy's sampling temperature in the compared "
                               "episodes")
    pairs: int = Field(default=2, ge=1, description="better-and-worse pairs the optimiser reads in an iteration (the "
                       "most different first; one call each)")
    margin: float = Field(default=0.0, ge=0, description="two episodes of a start are compared only where their "
                          "returns differ by more than this")
    reward_starts: int = Field(default=8, ge=1, description="train starts the iterations never play: the final "
                               "beliefs and the first are played on them greedily at the end, and the final replace "
                               "the first only where they score higher")
    belief_tokens: int = Field(default=96, ge=1, description="most tokens the optimiser writes for one pair")
    max_beliefs: int = Field(default=3, ge=1, description="beliefs a role keeps (the newest)")
    per_pair: int = Field(default=3, ge=1, description="most beliefs one comparison adds (the first written)")
    max_chars: int = Field(default=300, ge=8, description="a belief longer than this is refused")
    optimiser_temperature: float = Field(default=0.7, ge=0, description="the optimiser's sampling temperature")
    optimiser: OptimiserConfig = Field(default_factory=PolicyOptimiser, description=OPTIMISER)

    def needs_prompts(self) -> int:
        return self.reward_starts + 1

    def problems(self, train_prompts: int) -> list[str]:
        if train_prompts < self.needs_prompts():
            return [f"prompt.search needs {self.needs_prompts()} train starts (reward_starts={self.reward_starts} + 1 "
                    f"for the iterations to play), and a round has {train_prompts}; lower prompt.search.reward_starts "
                    "or give more starts (data.train_size)"]
        return []

    def rollout_problems(self, at: str, rollout) -> list[str]:
        if not rollout.has_roles:
            return [f"prompt.search.kind='beliefs' writes the beliefs of agents in roles, and {at}.kind="
                    f"{rollout.kind!r} has none; set {at}.kind: roles (tasks/rollouts/roles.py), or "
                    "prompt.search.kind: prompt_agent"]
        return []

    def describe(self, draw: int) -> str:
        return (f"beliefs search: {self.iterations} iteration(s) of {self.starts} start(s) x {self.episodes} episodes, "
                f"{self.pairs} pair(s) compared per iteration; optimiser: {self.optimiser.identity()}; each round's "
                f"{draw} train starts: {self.reward_starts} to reward the final beliefs, {draw - self.reward_starts} "
                "for the iterations to play")

    def summary(self, m: dict[str, float]) -> list[str]:
        kept = "the final beliefs replaced them" if m.get("replaced") else "the round's beliefs kept"
        return [f"{m.get('beliefs_written', 0):.0f} beliefs written, {m.get('refused', 0):.0f} refused",
                f"reward starts {m.get('base_reward', 0):.0%} -> {m.get('chosen_reward', 0):.0%}: {kept}",
                f"{m.get('tokens_per_s', 0):.0f} tok/s"]


# the comparison ----------------------------------------------------------------------------

def _clip(text: str, n: int = CLIP) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + " [...]"


def episode_text(ep: dict, turns: int) -> str:
    """An episode as the optimiser reads it: each turn's reports, the action and its reward (the
    first `turns` of them)."""
    lines = []
    for i, s in enumerate(ep["steps"][:turns], 1):
        said = "; ".join(f"{role} reported \"{_clip(r)}\"" for role, r in s["reports"].items())
        lines.append(f"Turn {i}: {said + '; ' if said else ''}the {ep['acts']} did \"{_clip(s['action'])}\", "
                     f"reward {s['reward']:+.4g}")
    if len(ep["steps"]) > turns:
        lines.append(f"({len(ep['steps']) - turns} more turns)")
    return "\n".join(lines) or "(no turns)"


def comparison_prompt(roles: dict[str, str], acts: str, beliefs: dict[str, str], better: dict, worse: dict,
                      turns: int) -> str:
    """What the optimiser reads for one pair: the roles, their beliefs, the two episodes."""
    team = "\n".join(f"- {name}: {what}" for name, what in roles.items())
    held = "\n".join(f"- {name}: {' / '.join(beliefs[name].splitlines()) if beliefs.get(name) else '(nothing yet)'}"
                     for name in roles)
    return (f"A team of agents plays episodes together. The roles:\n{team}\n\nWhat each role believes now:\n{held}\n\n"
            f"Two episodes from the same start ended differently.\n\nBetter episode (return {better['ret']:+.4g}):\n"
            f"{episode_text(better, turns)}\n\nWorse episode (return {worse['ret']:+.4g}):\n"
            f"{episode_text(worse, turns)}\n\nCompare them. Write what the better episode did that the worse did not, "
            f"as short beliefs for the roles whose behaviour made the difference, each on its own line as "
            f"ROLE: BELIEF, where ROLE is one of {', '.join(roles)}.")


def beliefs_of(text: str, names: list[str], held: dict[str, str], max_chars: int,
               most: int) -> tuple[list[tuple[str, str]], list[dict]]:
    """The beliefs a comparison wrote, each with the role it concerns, and the refused ones with why.
    A line `ROLE: BELIEF` concerns its role; in any other line, a sentence that names roles
    concerns each role it names, and one that names none is prose around the beliefs. At most
    `most` are kept; the rest are refused."""
    from ratchet.tasks.label_kinds.guard import scan

    by_name = {n.casefold(): n for n in names}
    named = re.compile(r"\b(" + "|".join(re.escape(n) for n in names) + r")\b", re.I)
    found: list[tuple[str | None, str, str]] = []  # (role, or None for the placeholder ROLE; belief; line)
    for line in text.splitlines():
        if not line.strip():
            continue
        m = LINE.match(line)
        if m is not None and (m.group(1).casefold() in by_name or m.group(1).casefold() == "role"):
            found.append((by_name.get(m.group(1).casefold()), m.group(2), line))  # "ROLE:": the format's own word
            continue
        for sentence in re.split(r"(?<=[.!?])\s+", line.strip()):
            for role in dict.fromkeys(by_name[x.casefold()] for x in named.findall(sentence)):
                found.append((role, sentence, sentence))
    kept, refused, seen = [], [], {(r, b) for r in names for b in held.get(r, "").splitlines()}
    for role, belief, line in found:
        belief = belief.strip().strip('"').strip()
        why = ("names no role (the format's placeholder ROLE)" if role is None else "empty" if not belief else
               f"longer than max_chars={max_chars} ({len(belief)} characters)" if len(belief) > max_chars else
               "already held by the role" if (role, belief) in seen else
               f"past the {most} beliefs one comparison may add" if len(kept) >= most else None)
        if why is None and (findings := scan(belief)):
            why = f"speaks to a judge ({findings[0].kind}: {findings[0].text[:40]!r})"
        if why is not None:
            refused.append({"why": why, **({"role": role} if role else {}), "text": line[: max_chars + 40]})
            continue
        seen.add((role, belief))
        kept.append((role, belief))
    return kept, refused


def updated(beliefs: dict[str, str], new: list[tuple[str, str]], keep: int) -> dict[str, str]:
    """Each named role's beliefs with its new ones added (its newest `keep` kept); the others as they were."""
    out = dict(beliefs)
    for role, belief in new:
        lines = [x for x in out.get(role, "").splitlines() if x.strip()] + [belief]
        out[role] = "\n".join(lines[-keep:])
    return {r: b for r, b in out.items() if b}


class Engine:
    """What the search runs: episodes under beliefs, scored by the check; the optimiser's text."""

    def play(self, beliefs: dict[str, str], prompts: list[Prompt], n: int, temperature: float,
             seed: int) -> dict: ...  # {"rows": each episode's dict, "tokens": what the policy generated}
    def write(self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int) -> list[str]: ...
    def fits(self, prompt: str, max_tokens: int) -> bool: ...


class Search:
    """The iterations, replayable from the journal."""

    def __init__(self, cfg: BeliefsSearch, engine: Engine, journal: Journal, roles: dict[str, str], acts: str,
                 beliefs: dict[str, str], prompts: list[Prompt], seed: int):
        self.cfg, self.engine, self.journal, self.seed = cfg, engine, journal, seed
        self.roles, self.acts, self.base = roles, acts, {r: b for r, b in beliefs.items() if b}
        order = sorted(prompts, key=lambda p: sha256_json(["beliefs-split", seed, p.id]))
        self.reward, self.pool = order[:cfg.reward_starts], order[cfg.reward_starts:]
        self.beliefs = dict(self.base)
        self.versions: list[dict] = []
        self.counts = {"episodes": 0, "gen_s": 0.0, "tokens": 0}

    def _play(self, key: str, beliefs: dict[str, str], prompts: list[Prompt], n: int, temperature: float) -> list[dict]:
        def make():
            t = time.time()
            played = self.engine.play(beliefs, prompts, n, temperature, self.seed)
            self.counts["gen_s"] += time.time() - t
            self.counts["tokens"] += played["tokens"]
            return played

        rows = self.journal.get(key, make)["rows"]
        self.counts["episodes"] += len(rows)
        return rows

    def pairs_of(self, eps: list[dict]) -> list[tuple[dict, dict]]:
        by: dict[str, list[dict]] = {}
        for e in eps:
            if e["ret"] is not None:
                by.setdefault(e["id"], []).append(e)
        out = []
        for group in by.values():
            ranked = sorted(group, key=lambda e: (-e["ret"], e["index"]))
            if len(ranked) > 1 and ranked[0]["ret"] - ranked[-1]["ret"] > self.cfg.margin:
                out.append((ranked[0], ranked[-1]))
        out.sort(key=lambda p: (-(p[0]["ret"] - p[1]["ret"]), p[0]["id"]))
        return out[: self.cfg.pairs]

    def iterate(self, i: int) -> None:
        cfg = self.cfg
        rng = random.Random(sha256_json(["beliefs-batch", self.seed, i]))
        batch = rng.sample(self.pool, min(cfg.starts, len(self.pool)))
        eps = self._play(f"play/{i}", self.beliefs, batch, cfg.episodes, cfg.temperature)
        version = {"iteration": i, "starts": [p.id for p in batch], "before": dict(self.beliefs),
                   "mean_return": _mean([e["ret"] for e in eps if e["ret"] is not None]), "compared": [],
                   "kept": [], "refused": []}
        pairs = self.pairs_of(eps)
        if not pairs:
            version["why"] = (f"no start's episodes differed in return by more than margin={cfg.margin:g}: nothing "
                              "to compare")
        for j, (better, worse) in enumerate(pairs):
            turns = max(len(better["steps"]), len(worse["steps"]))
            prompt = comparison_prompt(self.roles, self.acts, self.beliefs, better, worse, turns)
            while turns > 1 and not self.engine.fits(prompt, cfg.belief_tokens):  # the turns its context holds
                turns -= 1
                prompt = comparison_prompt(self.roles, self.acts, self.beliefs, better, worse, turns)
            shown = {"start": better["id"], "better": better["ret"], "worse": worse["ret"], "turns_shown": turns}
            if not self.engine.fits(prompt, cfg.belief_tokens):
                version["compared"].append({**shown, "why": "one turn of each episode does not fit the optimiser's "
                                            "context"})
                continue
            text = self.journal.get(f"write/{i}/{j}", lambda: self.engine.write(
                prompt, 1, cfg.belief_tokens, cfg.optimiser_temperature, self.seed * 7919 + i * 31 + j)[0])
            kept, refused = beliefs_of(text, list(self.roles), self.beliefs, cfg.max_chars, cfg.per_pair)
            self.beliefs = updated(self.beliefs, kept, cfg.max_beliefs)
            version["compared"].append({**shown, "wrote": text})
            version["kept"] += [{"role": r, "belief": b} for r, b in kept]
            version["refused"] += refused
        version["after"] = dict(self.beliefs)
        self.versions.append(version)

    def run(self) -> None:
        for i in range(self.cfg.iterations):
            self.iterate(i)

    def final(self) -> tuple[dict[str, str], dict[str, float]]:
        """The beliefs the search gives (the final where they beat the first on the reward starts,
        else the first) and the figures of that comparison."""
        def rate(key: str, beliefs: dict[str, str]) -> tuple[float, float]:
            rows = self._play(key, beliefs, self.reward, 1, 0.0)
            return (_mean([float(r["correct"]) for r in rows]),
                    _mean([r["ret"] for r in rows if r["ret"] is not None]))

        base = rate("reward/base", self.base)
        pick = rate("reward/final", self.beliefs) if self.beliefs != self.base else base
        won = pick > base
        return (self.beliefs if won else self.base), {
            "base_reward": base[0], "chosen_reward": pick[0], "base_return": base[1], "chosen_return": pick[1],
            "replaced": float(won)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# the stage ---------------------------------------------------------------------------------

class EngineOnSampler(Engine):
    """The policy (a sampler) plays through the roles rollout, the task's check scores; the
    optimiser (`writer`) writes."""

    def __init__(self, sampler, rollout, check, max_tokens: int, max_model_len: int, writer):
        self.sampler, self.rollout, self.check, self.writer = sampler, rollout, check, writer
        self.max_tokens, self.max_model_len = max_tokens, max_model_len

    def play(self, beliefs: dict[str, str], prompts: list[Prompt], n: int, temperature: float, seed: int) -> dict:
        from ratchet.data.checkers import check_many

        ro = self.rollout.with_text(PromptText(beliefs={r: beliefs.get(r, "") for r in self.rollout.beliefs()}))
        done, cost = ro.roll(self.sampler, prompts, SamplingParams(n=n, temperature=temperature, top_k=50 if temperature
                                                                 else 0, max_tokens=self.max_tokens), seed)
        verdicts = check_many(self.check, [Item(c.final, c.answer, c.prompt, c.prompt_id, c.fields,
                                                c.outcome and c.outcome.ret, c.outcome and c.outcome.ended)
                                           for c in done])
        out = []
        for c, v in zip(done, verdicts):
            o = c.outcome
            actions = [s.text for s in c.segments or () if s.role == "model"]
            reports = list(o.reports or ()) if o is not None else []
            steps = [{"reports": reports[k] if k < len(reports) else {}, "action": a,
                      "reward": o.rewards[k] if o is not None and k < len(o.rewards) else 0.0}
                     for k, a in enumerate(actions)]
            out.append({"id": c.prompt_id, "index": c.index, "ret": o.ret if o is not None else None,
                        "correct": bool(v.correct), "ended": o.ended if o is not None else None,
                        "acts": ro.manager.name, "steps": steps})
        return {"rows": out, "tokens": cost.get("gen_tokens", 0)}

    def write(self, prompt: str, n: int, max_tokens: int, temperature: float, seed: int) -> list[str]:
        return self.writer.write(prompt, n, max_tokens, temperature, seed)

    def fits(self, prompt: str, max_tokens: int) -> bool:
        return writer_fits(self.writer, prompt, max_tokens, self.max_model_len)


def beliefs_body(req: StageRequest, store: ArtifactStore) -> StageManifest:
    from ratchet.data.errors import ConfigError
    from ratchet.tasks.prepare import open_policy, train_prompts

    job, d = req.config, store.stage_dir(req.stage, req.key)
    cfg: BeliefsSearch = job.search
    policy = req.parent_model
    base = read_text(req, store) or PromptText()
    rollout = job.rollout.with_text(base)
    prompts = train_prompts(req, store, as_read=False)
    if problems := cfg.problems(len(prompts)):
        raise ConfigError(problems)
    t0 = time.time()
    sampler = open_policy(store, policy, job.sampler, req.seed, d / "policy-calls")
    load_s = time.time() - t0
    own = None
    try:
        writer, served, own = open_writer(cfg.optimiser, req, store, sampler, d / "calls.jsonl")
        engine = EngineOnSampler(sampler, rollout, job.data.check, job.max_tokens, job.sampler.max_model_len, writer)
        roles = {r.name: ("reads the observation and acts" if r.acts else
                          "reads " + ("all of each observation" if r.reads is None else "part of each observation")
                          + " and reports to " + rollout.manager.name) for r in rollout.roles}
        journal = Journal(d / "journal.jsonl")
        search = Search(cfg, engine, journal, roles, rollout.manager.name, rollout.beliefs(), prompts, req.seed)
        search.run()
        pick, figures = search.final()
    finally:
        sampler.close()
        if own is not None:
            own.close()
    (d / "versions.jsonl").write_text("".join(json.dumps(v) + "\n" for v in search.versions))
    c = search.counts
    written = sum(len(v["kept"]) for v in search.versions)
    refused = sum(len(v["refused"]) for v in search.versions)
    metrics = {**figures, **(served.metrics("optimiser_") if served is not None else {}),
               "iterations": float(len(search.versions)), "beliefs_written": float(written),
               "refused": float(refused), "pairs": float(sum(len(v["compared"]) for v in search.versions)),
               "episodes": float(c["episodes"]), "journal_reused": float(journal.reused), "load_s": load_s,
               "tokens_per_s": c["tokens"] / c["gen_s"] if c["gen_s"] else 0.0}
    text = base.model_copy(update={"beliefs": pick})
    held = ", ".join(f"{role} ({len(b.splitlines())})" for role, b in sorted(pick.items())) or "none"
    summary = (f"beliefs of {held}, written by {cfg.optimiser.identity()} from {metrics['pairs']:.0f} compared pair(s) "
               f"of episodes; reward starts {figures['chosen_reward']:.1%} against the round's "
               f"{figures['base_reward']:.1%}" + ("" if figures["replaced"] else ": the round's beliefs kept"))
    return write_pair(req, store, text, weights_of(store, policy), metrics=metrics,
                      info={"optimiser": cfg.optimiser.identity(), "summary": summary},
                      outputs={"versions.jsonl": len(search.versions), "journal.jsonl": None,
                               **({"calls.jsonl": None} if served is not None else {})})
