from pathlib import Path

import pytest

from data.errors import ConfigError
from flows.config import load_config

CONFIGS = Path(__file__).parents[2] / "flows" / "configs"


@pytest.mark.parametrize("name", ["default.yaml", "gpu.yaml", "consistency_rft.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.rounds >= 1 and cfg.label.kind == ("consistency" if "consistency" in name else "verifier")


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
    assert "data.kind='nope' is not a known kind; use one of 'addition', 'file'" in text
    assert "sampler.dtype='int8'" in text


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
