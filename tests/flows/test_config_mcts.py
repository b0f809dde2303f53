import pytest

from ratchet.data.errors import ConfigError
from ratchet.flows.config import load_config

MCTS = "flows/configs/mcts_dpo.yaml"


def test_mcts_dpo_config_resolves():
    cfg = load_config(MCTS)
    assert (cfg.label.kind, cfg.filter.kind, cfg.train.kind) == ("mcts", "step_pairs", "dpo")


def test_step_pairs_imply_dpo_and_need_the_trees():
    cfg = load_config(None, ["label.kind=mcts", "filter.kind=step_pairs"])
    assert cfg.train.kind == "dpo"
    with pytest.raises(ConfigError, match="filter.kind='step_pairs' reads the search trees of label.kind='mcts'"):
        load_config(None, ["filter.kind=step_pairs"])
    with pytest.raises(ConfigError, match="train.kind='rft' needs accepted samples, but filter.kind='step_pairs' builds preference pairs"):
        load_config(None, ["label.kind=mcts", "filter.kind=step_pairs", "train.kind=rft"])


def test_search_longer_than_the_context_is_refused():
    with pytest.raises(ConfigError, match=r"max_depth=8 x step_max_tokens=64.*sampler.max_model_len=512"):
        load_config(MCTS, ["label.max_depth=8", "label.step_max_tokens=64"])


def test_graded_value_needs_a_number_check():
    cfg = load_config("flows/configs/chain_mcts_dpo.yaml", ["label.value=graded"])
    assert cfg.label.uses_reference
    with pytest.raises(ConfigError, match=r"label.value='graded'.*data.check.kind='exact' does not read numbers"):
        load_config("flows/configs/chain_mcts_dpo.yaml", ["label.value=graded", "data.check.kind=exact"])
    steps = load_config("flows/configs/chain_mcts_dpo.yaml", ["label.value=graded", "data.check.kind=steps"])
    assert steps.data.check.kind == "steps" and steps.data.check.max_numbers == 9  # credit by the steps shown
