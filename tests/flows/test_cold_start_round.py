"""What a run's checks say of demonstrations (cold_start) before any model loads. The cold start in
a run, on the tiny model, is tests/flows/test_grpo_round.py's round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchet.data.errors import ConfigError
from ratchet.flows.config import load_config

CONFIG = Path(__file__).parents[2] / "flows" / "configs" / "grpo.yaml"
SMALL = ("data.a_max=6", "data.b_max=4", "data.train_size=12", "data.eval_size=4")


def demonstrations(path: Path, config: Path, overrides: tuple[str, ...] = SMALL, n: int = 6) -> Path:
    """Demonstrations of the first `n` of the run's own train prompts, each answer right."""
    from ratchet.data.prompts import load_split

    cfg = load_config(config, list(overrides))
    split = load_split(cfg.data, cfg.seed, train_answers=True)
    path.write_text("".join(json.dumps({"id": p.id, "prompt": p.prompt, "completion": f"It is {p.answer}.",
                                        "answer": p.answer}) + "\n" for p in split.train[:n]))
    return path


def test_demonstrations_of_held_out_prompts_are_refused_before_any_model_loads(tmp_path):
    from ratchet.data.prompts import load_split
    from ratchet.flows.inputs import check_data

    held = load_split(load_config(CONFIG, list(SMALL)).data, 0, train_answers=True).eval[0]
    demos = tmp_path / "d.jsonl"
    demos.write_text(json.dumps({"prompt": held.prompt, "completion": held.answer, "answer": held.answer}) + "\n")
    with pytest.raises(ConfigError) as e:
        check_data(load_config(CONFIG, [*SMALL, f"cold_start.demonstrations={demos}"]))
    assert f"line 1: the task holds out {held.id!r}" in str(e.value), str(e.value)


def test_a_run_s_sources_carry_the_file_s_digest_apart_from_the_task_s(tmp_path):
    """The demonstrations key their own stage; the prompts stage's key (the task's digests) does not move
    when they change."""
    from ratchet.flows.inputs import DEMOS, check_data, sources_of

    path = demonstrations(tmp_path / "d.jsonl", CONFIG)
    split, _ = check_data(load_config(CONFIG, [*SMALL, f"cold_start.demonstrations={path}"]))
    plain, _ = check_data(load_config(CONFIG, list(SMALL)))
    import hashlib

    assert split.digests[DEMOS] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sources_of(split.digests) == sources_of(plain.digests)
