"""The cold start: supervised fine-tuning on a user's demonstrations before the first round, for a
task where the model cannot yet succeed and its own samples hold nothing to learn from.

    cold_start:
      demonstrations: demos.jsonl      # data/demonstrations.py: text, or turns with a tool or an environment
      train: {epochs: 3}               # TRL's SFTTrainer, as train.kind=rft

Two stages, before round 1's: `demonstrations` (the checked rows, keyed by the file's sha256, in
the lineage like any data) and, as generation 1, a `train` stage on them from the base model. Its
model is evaluated and registered like a round's; the rounds after it (2, 3, ...) improve on the
model's own samples by whatever train.kind the config names. A run that continues from a
registered version (`--from`, a schedule) starts past it and does not repeat it.

Every row is checked before any model loads (`check`): its shape, its final answer accepted by the
run's check, a tool turn equal to what the sandbox prints for its program, an environment's
observations equal to what the environment answers when the row's turns are replayed. The cold
start trains on each row in the context a sampled episode has (Rollout.demo_row): the prompt in
the rollout's template, the tool's and the environment's tokens masked.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data import demonstrations as demos_mod
from ratchet.data.demonstrations import Demonstration
from ratchet.data.errors import ConfigError
from ratchet.data.manifest import StageManifest
from ratchet.data.records import read_jsonl, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.data.userfiles import UserPath
from ratchet.models.train_kinds import RFTTrainConfig
from ratchet.tasks.sample import RolloutConfig
from ratchet.tasks.runner.declare import At, Made, Records, Stage
from ratchet.tasks.runner.stage import StageRequest

FIELD = "cold_start.demonstrations"


def _sft_defaults() -> RFTTrainConfig:
    return RFTTrainConfig(epochs=3.0, max_length=512)


class ColdStartConfig(BaseModel):
    """Supervised fine-tuning on the user's demonstrations before round 1."""

    model_config = ConfigDict(extra="forbid")
    demonstrations: UserPath = Field(description="a JSONL file of worked examples: `prompt` and `completion`, or "
                                     "`messages` (user, assistant, tool turns; an environment's observations as user "
                                     "turns), with the `answer` the run's check accepts")
    train: RFTTrainConfig = Field(default_factory=_sft_defaults, description="how the base model is fine-tuned on "
                                  "them: the settings of train.kind=rft (TRL's SFTTrainer, LoRA or full)")


class DemonstrationsJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    digest: str = Field(description="the file's sha256 as the run checked it")

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"{m.get('demonstrations', 0):.0f} demonstrations ({m.get('with_turns', 0):.0f} of several turns)"]


class ColdStartJob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    train: RFTTrainConfig
    rollout: RolloutConfig  # the context each row is trained in: its template, its turns' markers
    seed: int

    def summary(self, m: dict[str, float]) -> list[str]:
        return [f"cold start on {m.get('rows', 0):.0f} demonstrations", *self.train.summary(m)]


# before any model loads --------------------------------------------------------------------------

def check(cfg: ColdStartConfig, rollout, answer_check, held_out: list | None = None) -> tuple[list[Demonstration], str]:
    """The rows and the file's sha256, every problem raised at once (ConfigError): a row that does
    not parse, turns the rollout does not have, a tool's or an environment's turn that is not what it
    gives, a final answer the run's check (`answer_check`, data.check) does not accept, a prompt
    that is one of the held-out prompts (`held_out`)."""
    from ratchet.data.checkers import check_many
    from ratchet.data.sources.base import prompt_key

    path = cfg.demonstrations
    rows, digest, report = demos_mod.read(path, FIELD)
    items = rollout.demonstrations(rows, report, path)
    if answer_check.needs_answer:
        for d in rows:
            if d.id in items and d.answer is None:
                report.add(path, "rows without an answer", d.place, f"id {d.id!r}", "give the reference `answer` "
                           f"the check ({answer_check.kind}) compares the last assistant turn with")
                items.pop(d.id)
    ids = list(items)
    by_id = {d.id: d for d in rows}
    if ids:
        for i, v in zip(ids, check_many(answer_check, [items[i] for i in ids])):
            if v.correct is not True:
                d = by_id[i]
                report.add(path, "rows whose answer the check does not accept", d.place,
                           f"data.check ({answer_check.kind}) read {v.extracted!r} where the answer is {d.answer!r}"
                           if d.answer is not None else f"data.check ({answer_check.kind}) scored it "
                           + ("nothing" if v.score is None else f"{v.score:g}") + ", which it does not accept",
                           "fix the last assistant turn (or the answer): a cold start on wrong answers teaches "
                           "them")
    held = {prompt_key(p.prompt): p.id for p in held_out or []}
    for d in rows:
        if (twin := held.get(prompt_key(d.prompt))) is not None:
            report.add(path, "rows that are held-out prompts", d.place, f"the task holds out {twin!r}",
                       "drop the row, or give demonstrations of train prompts only: held-out accuracy on trained "
                       "prompts is not held out")
    report.raise_if_any(FIELD)
    return rows, digest


def length_problems(cfg: ColdStartConfig, rollout, tokenizer, rows: list[Demonstration]) -> list[str]:
    """Rows longer than cold_start.train.max_length, which training would cut before their answer."""
    limit, out = cfg.train.max_length, []
    for d in rows:
        row = rollout.demo_row(tokenizer, d)
        if "input_ids" in row:
            n = len(row["input_ids"])
        else:  # as TRL templates and tokenizes a text row
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                                  {"role": "assistant", "content": row["completion"]}], tokenize=False)
            n = len(tokenizer.encode(text, add_special_tokens=False))
        if n > limit:
            out.append(f"{cfg.demonstrations} {d.place}: {n} tokens in the context an episode gives it > "
                       f"cold_start.train.max_length={limit}, which would cut it before its answer; raise "
                       "cold_start.train.max_length or shorten the row")
    return out


# the stages ---------------------------------------------------------------------------------------

def demonstrations_body(req: StageRequest[DemonstrationsJob], store: ArtifactStore) -> StageManifest:
    job = req.config
    rows, digest, report = demos_mod.read(job.path, FIELD)
    report.raise_if_any(FIELD)
    if digest != job.digest:
        raise ConfigError([f"{FIELD}={job.path!r} changed after this run checked it (sha256 {job.digest[:12]} then, "
                           f"{digest[:12]} now); run the same command again to check and use it as it is now"])
    d = store.stage_dir(req.stage, req.key)
    n = write_jsonl(d / "demonstrations.jsonl", rows)
    return req.finish(store, outputs={"demonstrations.jsonl": n},
                      metrics={"demonstrations": n, "with_turns": sum(len(r.turns) > 1 for r in rows)})


def cold_start_body(req: StageRequest[ColdStartJob], store: ArtifactStore) -> StageManifest:
    from ratchet.models import tokenizer
    from ratchet.models.trainer import train
    from ratchet.tasks.prepare import model_dir

    job = req.config
    d = store.stage_dir(req.stage, req.key)
    base = model_dir(store, req.parent_model)
    from ratchet.tasks.text import read_text

    rows = read_jsonl(store.path(req.holding("demonstrations.jsonl"), "demonstrations.jsonl"), Demonstration)
    if (text := read_text(req, store)) is not None:  # the demonstrations as the policy reads its prompts
        rows = [r.model_copy(update={"prompt": text.render(r.prompt)}) for r in rows]
    tok = tokenizer.load(base)
    metrics = train(base, [job.rollout.demo_row(tok, r) for r in rows], job.train, d, req.seed)
    outputs = {p.relative_to(d).as_posix(): None for p in sorted(d.rglob("*"))
               if p.is_file() and p.parts[len(d.parts)] in ("model", "adapter")}
    outputs["train_log.jsonl"] = None
    return req.finish(store, outputs=outputs, metrics=metrics,
                      info={"adapter": job.train.adapter, "objective": "cold-start"}, scratch=("checkpoints",))


def demonstrations(store: ArtifactStore, path: str, digest: str, run: str | None = None) -> Made:
    """The checked rows of the demonstrations file, keyed by its sha256 (`digest`, as checked)."""
    return DEMONSTRATIONS.run(store, round=0, parents=[], run=run,
                              config=DemonstrationsJob(path=str(Path(path).expanduser().resolve()), digest=digest))


def demonstrations_step(at: At, k: int = 0) -> Made:
    """The run's demonstrations (cold_start.demonstrations), by the digest the run checked."""
    from ratchet.tasks.prepare import DEMOS

    return demonstrations(at.store, at.cfg.cold_start.demonstrations, at.sources[DEMOS], run=at.run)


def cold_start(store: ArtifactStore, policy: StageManifest, demos: StageManifest, cfg: ColdStartConfig,
               rollout: RolloutConfig, seed: int, round: int, isolate: bool = True, run: str | None = None) -> Made:
    """Generation `round`'s model: the base model fine-tuned on the demonstrations. A train stage,
    so that everything that reads a round's model (evaluation, registration, `ratchet gc`) reads it."""
    return COLD_START.run(store, round=round, config=ColdStartJob(train=cfg.train, rollout=rollout, seed=seed),
                          parents=[policy, demos], isolate=isolate, keep_partial=True, run=run)


def cold_start_step(at: At, k: int, policy: StageManifest, demos: StageManifest, voter: int = 0) -> Made:
    """Generation k (the run's first): `policy` fine-tuned on the run's demonstrations; a voter of a
    vote across models (`voter` > 0) with a seed of its own."""
    cfg = at.cfg
    return cold_start(at.store, policy, demos, cfg.cold_start, cfg.sample.rollout, at.seed(k, voter), k,
                      isolate=cfg.isolate, run=at.run)


DEMONSTRATIONS = Stage("demonstrations", "data", demonstrations_body, demonstrations_step, Records(
    on="run", datasets=(("demonstrations.jsonl", "demonstrations"),), log=False))
COLD_START = Stage("train", "model", cold_start_body, cold_start_step, Records(curve=True))
