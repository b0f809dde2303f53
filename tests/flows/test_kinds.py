"""Kinds are declared where they live: the flow asks them and names none."""

import ast
import typing
from pathlib import Path

import pytest

from ratchet.data.checkers import AnyCheck
from ratchet.flows.config import kinds_of, load_config
from ratchet.tasks.label import KINDS, LabelConfig, kind_of

FLOWS = Path(__file__).parents[2] / "flows"
# These two still recognise a stage's kind by the names of the metrics it publishes.
NOT_YET = {"console.py", "report.py"}


def _kind_names() -> set[str]:
    names = set(KINDS)
    for section in ("filter", "train", "data"):
        names |= set(kinds_of(section))
    names |= {m.model_fields["kind"].default for m in typing.get_args(AnyCheck)}
    return names


def test_flows_name_no_kind():
    names = _kind_names()
    assert {"verifier", "judge", "mcts", "rft", "dpo", "pairs", "step_pairs", "file", "number"} <= names
    found = []
    for path in sorted(FLOWS.glob("*.py")):
        if path.name in NOT_YET:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not found, "flows/ names kinds; ask the kind's declaration instead: " + ", ".join(found)


def test_the_label_union_is_the_registered_kinds():
    members = typing.get_args(typing.get_args(LabelConfig)[0])
    assert {m.model_fields["kind"].default for m in members} == set(KINDS)
    assert all(KINDS[m.model_fields["kind"].default].config is m for m in members)


def test_an_unregistered_label_config_is_an_error():
    from typing import Literal

    from pydantic import BaseModel

    class PRMLabel(BaseModel):
        kind: Literal["prm"] = "prm"

    with pytest.raises(ValueError, match="'prm' is not a registered label kind"):
        kind_of(PRMLabel())


def test_what_the_kinds_declare_reaches_the_checks():
    cfg = load_config(None, ["label.kind=judge", "label.mode=rating"])
    k = kind_of(cfg.label)
    assert k.reward_range(cfg.label) == (0.0, 5.0) and k.title(cfg.label) == "judge (rating, the policy)"
    assert not k.needs_reference(cfg.label) and k.fixed_model(cfg.label) is None
    assert set(k.budgets(cfg)) == {"the judge"}
    mcts = load_config("flows/configs/mcts_dpo.yaml")
    assert kind_of(mcts.label).needs_reference(mcts.label) and "trees.jsonl" in kind_of(mcts.label).outputs
    assert set(kind_of(mcts.label).budgets(mcts)) == {"the tree search"}
    # a filter kind and a train kind find each other by what one builds and the other consumes
    assert load_config(None, ["train.kind=dpo"]).filter.kind == "pairs"
    assert load_config(None, ["filter.kind=pairs"]).train.kind == "dpo"
    assert load_config(None, []).filter.kind == "rft"
