from pathlib import Path

import pytest

from ratchet.data.errors import ConfigError
from ratchet.flows.config import load_config

CONFIGS = Path(__file__).parents[2] / "flows" / "configs"


@pytest.mark.parametrize("name, label, train", [
    ("default.yaml", "verifier", "rft"), ("gpu.yaml", "verifier", "rft"), ("consistency_rft.yaml", "consistency", "rft"),
    ("self_reward_dpo.yaml", "judge", "dpo"), ("consistency_dpo.yaml", "consistency", "dpo"),
    ("guess_number_rft.yaml", "verifier", "rft"), ("guess_env_rft.yaml", "verifier", "rft"),
    ("guess_env_mcts.yaml", "turn_mcts", "dpo"),
])
def test_shipped_configs_validate(name, label, train):
    cfg = load_config(CONFIGS / name)
    assert cfg.rounds >= 1 and (cfg.label.kind, cfg.train.kind) == (label, train)
    assert cfg.filter.kind == ("step_pairs" if "mcts" in label else "pairs" if train == "dpo" else "rft")


def test_dpo_implies_pairs_and_mismatches_name_the_fix():
    cfg = load_config(None, ["train.kind=dpo"])
    assert cfg.filter.kind == "pairs" and cfg.train.beta == 0.1
    assert load_config(None, ["filter.kind=pairs"]).train.kind == "dpo"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.kind=dpo", "filter.kind=rft", "label.kind=judge", "label.mode=p_yes",
                           "label.top_logprobs=50"])
    text = "\n".join(e.value.problems)
    assert "train.kind='dpo' needs preference pairs, but filter.kind='rft'" in text and "set filter.kind='pairs'" in text
    assert "filter.min_reward=1.0" not in text  # p_yes rewards reach 1.0
    assert "label.top_logprobs=50: vLLM returns at most 20" in text
    with pytest.raises(ConfigError, match=r"filter.min_reward=2.0 can never be reached: label.kind='judge' "
                                          r"mode='p_yes' gives rewards in \[0, 1\]"):
        load_config(None, ["label.kind=judge", "label.mode=p_yes", "filter.min_reward=2"])
    with pytest.raises(ConfigError, match=r"filter.margin=2.0 is wider than the reward range"):
        load_config(None, ["train.kind=dpo", "filter.margin=2"])


def test_default_yaml_is_the_defaults_plus_documented_choices():
    cfg = load_config(CONFIGS / "default.yaml")
    assert (cfg.model.path, cfg.sampler.backend, cfg.train.adapter) == ("default", "vllm", "lora")
    assert (cfg.data.a_max, cfg.data.b_max, cfg.data.eval_size) == (20, 10, 50)


def test_overrides_are_typed():
    cfg = load_config(CONFIGS / "default.yaml", ["rounds=5", "train.learning_rate=1e-4", "isolate=false",
                                                 "train.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.rounds == 5 and cfg.train.learning_rate == 1e-4 and cfg.isolate is False
    assert cfg.train.lora.target_modules == ["q_proj", "v_proj"]


def test_every_problem_is_reported_at_once_with_field_value_and_fix():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "default.yaml", ["rounds=0", "train.lr=3", "sample.n=x", "data.kind=nope",
                                               "sampler.dtype=int8", "noequals"])
    p = e.value.problems
    assert len(p) == 6, p
    text = "\n".join(p)
    assert "override 'noequals' is not key=value" in text
    assert "rounds=0: Input should be greater than or equal to 1" in text and "(self-improvement rounds to run)" in text
    assert "train.lr: unknown field (value 3); remove it or fix its spelling" in text
    assert "sample.n='x'" in text
    assert "data.kind='nope' is not a known kind; use one of 'addition', 'chain', 'file'" in text
    assert "sampler.dtype='int8'" in text


def test_a_misspelt_field_is_named_with_the_fields_it_may_mean():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "default.yaml", ["sample.temperatur=0.5", "train={kind: grpo, stepz: 3}",
                                               "sample.top_k=0", "bogus=1"])
    assert e.value.problems == [
        "sample.temperatur: unknown field (value 0.5); remove it or fix its spelling (did you mean temperature?)",
        "train.stepz: unknown field (value 3); remove it or fix its spelling (did you mean steps?)",
        "bogus: unknown field (value 1); remove it or fix its spelling"]


def test_a_key_given_twice_in_a_flow_mapping_is_refused_in_a_file_and_an_override(tmp_path):
    (tmp_path / "flow.yaml").write_text("data: {eval_size: 10, eval_size: 5}\nsample: {n: 4}\n")
    with pytest.raises(ConfigError, match=r"key 'eval_size' is given twice \(both on line 1\)"):
        load_config(tmp_path / "flow.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data={eval_size: 10, eval_size: 5}", "rounds=2"])
    assert e.value.problems == ["override data: key 'eval_size' is given twice (both on line 1); YAML would keep "
                                "the last one silently. Keep one of them"]
    assert load_config(None, ["data={eval_size: 10}", "sample={n: 4, max_tokens: 40}"]).data.eval_size == 10


def test_a_kind_switched_over_a_files_section_says_how_to_start_from_the_new_kinds_defaults():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "self_reward_dpo.yaml", ["train.kind=grpo"])
    assert e.value.problems[0].startswith("train.loss_type=['sigmoid']: Input should be 'grpo'")
    assert e.value.problems[-1].startswith("train.kind=grpo keeps the settings ['adapter', 'batch_size', 'beta'")
    assert e.value.problems[-1].endswith("give a whole new section: \"train={kind: grpo}\"")
    with pytest.raises(ConfigError) as e:  # a cross-field check of the switched section gets it too
        load_config(CONFIGS / "default.yaml", ["train.kind=grpo", "sample.top_k=0", "sample.top_p=1.0"])
    assert "remove train.epochs" in e.value.problems[0] and "train={kind: grpo}" in e.value.problems[-1]
    with pytest.raises(ConfigError) as e:  # a problem elsewhere: no such line
        load_config(CONFIGS / "default.yaml", ["train={kind: grpo}", "sample.top_k=50"])
    assert not [p for p in e.value.problems if "keeps the settings" in p]


def test_cross_field_checks_quote_the_numbers():
    with pytest.raises(ConfigError, match=r"train.max_length=40 cannot hold a prompt plus sample.max_tokens=48"):
        load_config(None, ["train.max_length=40"])
    with pytest.raises(ConfigError, match=r"sample.max_tokens=480 leaves under 64 prompt tokens"):
        load_config(None, ["sample.max_tokens=480", "train.max_length=1024"])


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "bad.yaml")


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    """YAML keeps the last of two equal keys without a word; a config that gives `rounds` twice (or a
    nested key twice) is refused, naming each key and both its lines."""
    (tmp_path / "twice.yaml").write_text("name: twice\nrounds: 1\nsample:\n  n: 4\n  n: 8\nrounds: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "twice.yaml")
    assert sorted(e.value.problems) == [
        f"{tmp_path / 'twice.yaml'}: key 'n' is given twice (lines 4 and 5); YAML would keep the last one silently. "
        "Keep one of them",
        f"{tmp_path / 'twice.yaml'}: key 'rounds' is given twice (lines 2 and 6); YAML would keep the last one "
        "silently. Keep one of them"]
    (tmp_path / "once.yaml").write_text("name: once\nrounds: 2\nsample:\n  max_tokens: 4\nevaluate:\n  max_tokens: 2\n")
    assert load_config(tmp_path / "once.yaml").rounds == 2  # the same key in two sections is no repeat


def test_executor_settings_are_checked_before_anything_runs():
    cfg = load_config(CONFIGS / "default.yaml", ["executor.kind=ray", "executor.address=10.0.0.5:6379",
                                                 "executor.engines=8", "executor.gpus_per_engine=1"])
    assert cfg.executor.address == "10.0.0.5:6379" and cfg.executor.gpus_per_engine == 1
    with pytest.raises(ConfigError, match=r"executor.address only applies to "
                                          r"executor.kind=ray \(kind is 'local'\); set executor.kind=ray"):
        load_config(CONFIGS / "default.yaml", ["executor.address=10.0.0.5:6379", "executor.gpus_per_engine=1"])
    with pytest.raises(ConfigError, match="executor.kind='slurm'"):
        load_config(CONFIGS / "default.yaml", ["executor.kind=slurm"])


def test_settings_a_library_would_refuse_late_are_refused_when_the_config_is_read():
    """What a trainer or an engine would only reject when a stage builds it (rounds in), or never
    reject at all, is refused with the field, the value and the fix before anything runs."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.lr_scheduler=cosin", "seed=-1"])
    text = str(e.value)
    assert "train.lr_scheduler='cosin'" in text and "'cosine'" in text and "seed=-1" in text
    with pytest.raises(ConfigError, match=r"seed=5000000.*0 to 4,000,000"):
        load_config(None, ["seed=5000000"])
    # a NaN or infinite number anywhere in the config, however deep, whatever its bounds
    with pytest.raises(ConfigError) as e:
        load_config(None, ["filter.min_reward=.nan", "evaluate.min_improvement=.inf"])
    assert [p.split(":")[0] for p in e.value.problems] == ["filter.min_reward=nan", "evaluate.min_improvement=inf"]
    with pytest.raises(ConfigError, match=r"evaluate.sets.0.check.number.tolerance=nan"):
        load_config(None, ["evaluate.sets=[{name: own, check: {kind: number, tolerance: .nan}}]"])
    load_config(None, ["seed=4000000", "train.lr_scheduler=cosine"])  # the ends of the ranges are fine
