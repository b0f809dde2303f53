"""Kinds are declared where they live: the flow asks them and names none."""

import ast
import typing
from pathlib import Path

import pytest

from ratchet.data.checkers import AnyCheck
from ratchet.data.kinds import members
from ratchet.flows.config import kinds_of, load_config
from ratchet.tasks.environments.kinds import EnvKind
from ratchet.tasks.label import KINDS, LabelConfig
from ratchet.tasks.label_kinds import Label

FLOWS = Path(__file__).parents[2] / "flows"


def _kind_names() -> set[str]:
    names = set(KINDS)
    for section in ("filter", "train", "data"):
        names |= set(kinds_of(section))
    names |= {m.model_fields["kind"].default for m in typing.get_args(AnyCheck)}
    names |= set(members(EnvKind))  # what an environment rollout plays
    return names


def test_flows_name_no_kind():
    names = _kind_names()
    assert {"verifier", "judge", "mcts", "rft", "dpo", "pairs", "step_pairs", "file", "number"} <= names
    found = []
    for path in sorted(FLOWS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not found, "flows/ names kinds; ask the kind's declaration instead: " + ", ".join(found)


def _kind_metrics() -> set[str]:
    """The metric keys a kind declares (what it shows), and the ones its summary reads."""
    from ratchet.tasks.sample import ROLLOUTS

    keys = set()
    for kinds in [kinds_of("label"), kinds_of("filter"), ROLLOUTS]:
        for kind in kinds.values():
            s = kind.shows
            keys |= {k for k, _ in s.agreement} | ({s.rows[0]} if s.rows else set())
            keys |= {s.throughput} if s.throughput else set()
            keys |= {k for f in s.figures for k in (f.bars[0], *(f.line[:1] if f.line else ()))}
    return keys


def test_flows_name_no_metric_of_a_kind():
    """The report and the console ask the kinds what to draw: no kind's metric is named in flows/."""
    keys = _kind_metrics()
    assert {"pairs", "accepted", "pair_accuracy", "mcts_tokens_per_s", "mcts_solved_frac", "tool_used_frac"} <= keys
    found = []
    for path in sorted(FLOWS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in keys or any(node.value.endswith("." + k) for k in keys) or "judge_s" in node.value:
                    found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not found, "flows/ names a kind's metric; declare it in the kind's `shows`: " + ", ".join(found)


def test_the_label_union_holds_each_label_kind_a_config_can_name():
    """Written out here, not read from the registry under test: a kind that fell out of the
    registration (or one registered twice under another name) fails it."""
    members = typing.get_args(typing.get_args(LabelConfig)[0])
    names = [m.model_fields["kind"].default for m in members]
    assert sorted(names) == ["consistency", "judge", "mcts", "reward_model", "turn_mcts", "verifier", "vote"]
    assert all(KINDS[m.model_fields["kind"].default] is m for m in members)  # the union is the registration


def test_the_environment_family_holds_each_adapter_a_config_can_name():
    """Written out, as above: a user's class and the two libraries' adapters, each its own kind
    (tasks/environments/kinds.py), registered the way every family is."""
    assert sorted(members(EnvKind)) == ["gymnasium", "python", "textarena"]


def test_a_label_kind_is_one_class_that_must_say_how_it_labels():
    """Every kind is a `Label` subclass; one that does not say how it labels cannot be made."""
    from typing import Literal

    assert all(issubclass(k, Label) for k in KINDS.values())

    class PRMLabel(Label):
        kind: Literal["prm"] = "prm"

    with pytest.raises(TypeError, match="abstract"):
        PRMLabel()


def test_what_the_kinds_declare_reaches_the_checks():
    cfg = load_config(None, ["label.kind=judge", "label.mode=rating"])
    k = cfg.label
    assert k.reward_range() == (0.0, 5.0) and k.title() == "judge (rating, the policy)"
    assert not k.needs_reference() and k.fixed_model() is None
    assert set(k.budgets(cfg)) == {"the judge"}
    mcts = load_config("flows/configs/mcts_dpo.yaml")
    assert mcts.label.needs_reference() and "trees.jsonl" in mcts.label.outputs
    assert set(mcts.label.budgets(mcts)) == {"the tree search"}
    # a filter kind and a train kind find each other by what one builds and the other consumes
    assert load_config(None, ["train.kind=dpo"]).filter.kind == "pairs"
    assert load_config(None, ["filter.kind=pairs"]).train.kind == "dpo"
    assert load_config(None, []).filter.kind == "rft"


def test_each_stage_words_its_result_as_its_kind_does():
    """A finished stage's line on the console is its job's summary, which asks its kind."""
    from ratchet.data.events import summary_of
    from ratchet.data.prompts import AdditionSource
    from ratchet.models.sampler import SamplerConfig
    from ratchet.tasks.evaluate import EvalRun, EvaluateJob
    from ratchet.tasks.filter import FilterJob
    from ratchet.tasks.filter_kinds.pairs import PairFilter
    from ratchet.tasks.filter_kinds.rft import RFTFilter
    from ratchet.tasks.filter_kinds.step_pairs import StepPairFilter
    from ratchet.tasks.label import LabelJob
    from ratchet.tasks.label_kinds.verifier import VerifierLabel
    from ratchet.tasks.label_kinds.mcts import MctsLabel

    def label(cfg, m):
        return summary_of(LabelJob(label=cfg, data=AdditionSource()), m)

    assert summary_of(FilterJob(filter=PairFilter(), seed=0),
                      {"pairs": 40, "pair_accuracy": 0.75, "prompts": 50, "prompts_covered": 40}) == \
        "40 pairs · pair accuracy 75% · 40/50 prompts"
    assert summary_of(FilterJob(filter=StepPairFilter(), seed=0), {"pairs": 7}) == "7 pairs"
    assert summary_of(FilterJob(filter=RFTFilter(), seed=0), {"accepted": 185, "prompts": 150,
                                                              "prompts_covered": 106}) == \
        "185 rows accepted · 106/150 prompts"
    assert label(VerifierLabel(), {"labeled": 1200, "reward_mean": 0.25, "pass_at_n": 0.71, "verifier_auc": 0.62,
                                   "injection_suspects": 3}) == \
        "1,200 labeled · mean reward 0.25 · pass@n 71% · AUC vs verifier 0.62 · 3 injection suspects"
    assert label(MctsLabel(), {"mcts_prompts": 48, "mcts_tokens_per_prompt": 410.2, "mcts_solved_frac": 0.5}) == \
        "48 trees · 410 tokens/prompt · solved 50%"
    assert label(VerifierLabel(), {"labeled": 30, "reward_mean": 0.5, "check_failed": 2}) == \
        "30 labeled · mean reward 0.50 · 2 rows the check failed on (unscored)"
    ev = EvaluateJob(evaluate=EvalRun(), sampler=SamplerConfig(dtype="float32"), data=AdditionSource(), seed=0)
    assert summary_of(ev, {"accuracy": 0.2, "worked_accuracy": 0.04}) == \
        "held-out accuracy 20.0% in float32 · 4.0% with every step shown"  # the dtype its answers were made in
    assert summary_of(ev, {"accuracy": 0.4, "score_mean": 0.5314}) == \
        "held-out accuracy 40.0% in float32 · mean score 0.531"
    served = EvaluateJob(evaluate=EvalRun(), sampler=SamplerConfig(backend="served", endpoint={"base_url": "http://127.0.0.1:9/v1", "model": "p"}),
                         data=AdditionSource(), seed=0)
    assert summary_of(served, {"accuracy": 0.4}) == "held-out accuracy 40.0%"  # a served policy's own, unknown
    # an online stage whose engine sampled from another policy than its trainer scored says so
    from ratchet.data.prompts import AdditionSource as Add
    from ratchet.models.train_kinds.grpo import GRPOTrainConfig
    from ratchet.tasks.sample import SampleConfig
    from ratchet.tasks.train import OnlineJob

    def online(dtype, precision, m):
        job = OnlineJob(train=GRPOTrainConfig(precision=precision), seed=0, sample=SampleConfig(),
                        sampler=SamplerConfig(dtype=dtype), label=VerifierLabel(), data=Add())
        return summary_of(job, {"steps": 20, "first_reward": 0.25, "last_reward": 0.5, **m})
    bf16 = {"logp_gap_mean": 0.042, "logp_gap_peak": 0.94}
    assert online("bfloat16", "bf16", bf16) == (
        "20 steps · reward 0.25 -> 0.50 · warning: the engine sampled from another policy than the trainer scored, "
        "log-prob gap 0.042 a token, up to 0.94 in a step (the engine in bfloat16 and the trainer in bf16: float32 "
        "for both closes it, sampler.dtype and train.precision)")
    assert online("float32", "bf16", bf16).endswith("(the trainer in bf16: float32 for both closes it, sampler.dtype "
                                                    "and train.precision)")
    assert online("float32", "fp32", {"logp_gap_mean": 8e-6}) == "20 steps · reward 0.25 -> 0.50"  # agreed
    assert online("bfloat16", "bf16", {"logp_gap_mean": "nan?"}) == "20 steps · reward 0.25 -> 0.50"
    # a summary that fails is left out, never raised: a display bug never fails a run
    assert summary_of(FilterJob(filter=PairFilter(), seed=0), {"pairs": "many"}) == ""
    assert summary_of(object(), {}) == ""


def test_every_family_registers_its_kinds_one_way():
    """A family is one `Annotated[A | B, Field(discriminator="kind")]` in its module, read back by
    data/kinds.py; no module makes a table of kinds any other way."""
    import re
    import typing

    from ratchet.data.checkers import CheckConfig
    from ratchet.data.kinds import members
    from ratchet.data.prompts import SourceConfig
    from ratchet.models.train_kinds import TrainConfig
    from ratchet.tasks.filter import FilterConfig
    from ratchet.tasks.label import LabelConfig
    from ratchet.tasks.sample import RolloutConfig
    from ratchet.tasks.runner.units import ExecutorConfig

    families = {"check": CheckConfig, "source": SourceConfig, "rollout": RolloutConfig, "label": LabelConfig,
                "filter": FilterConfig, "train": TrainConfig, "executor": ExecutorConfig}
    for name, family in families.items():
        assert typing.get_origin(family) is typing.Annotated, name
        assert typing.get_args(family)[1].discriminator == "kind", name
        assert len(members(family)) >= 2, name
    assert set(members(ExecutorConfig)) == {"local", "ray"}
    package = Path(__file__).parents[2]
    readers = [f"{p.relative_to(package)}:{text[:m.start()].count(chr(10)) + 1}"
               for top in ("data", "tasks", "models", "flows") for p in sorted((package / top).rglob("*.py"))
               if p.name != "kinds.py" for text in [p.read_text()]
               for m in re.finditer(r'model_fields\["kind"\]', text)]
    assert readers == [], "read a family's kinds with data/kinds.py (members, kind_of): " + ", ".join(readers)
