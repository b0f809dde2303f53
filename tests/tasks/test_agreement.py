"""The agreement gate: a round trains on labels that agree with the reference answers, stops
with a message that says why when they do not, or trains anyway and says so."""

import pytest

from ratchet.tasks.agreement import AgreementConfig, LabelDisagreesError, check

LABEL = {"verifier_within_prompt_auc": 0.51, "verifier_auc": 0.49, "verifier_auc_prompts": 40.0}
FILTER = {"pairs": 116.0, "pair_accuracy": 0.24}


def test_off_by_default_and_passes_at_or_above_the_minimum():
    assert check(AgreementConfig(), "judge", 1, LABEL, FILTER).note == ""
    v = check(AgreementConfig(min=0.5), "judge", 1, LABEL, FILTER)
    assert v.passed and v.value == 0.51 and "verifier_within_prompt_auc=0.510 over 40 prompts" in v.note
    assert check(AgreementConfig(min=0.24, metric="pair_accuracy"), "judge", 1, LABEL, FILTER).passed


def test_below_the_minimum_the_round_stops_with_what_was_measured_and_the_ways_on():
    with pytest.raises(LabelDisagreesError) as e:
        check(AgreementConfig(min=0.6, metric="pair_accuracy"), "judge (rating, the policy)", 2, LABEL, FILTER)
    msg = str(e.value)
    assert e.value.round == 2 and msg.startswith("round 2 stopped before training: the judge (rating, the policy) "
                                                 "label agrees with the reference answers too little")
    assert "pair_accuracy=0.240 over 116 pairs" in msg and "below agreement.min=0.6" in msg
    assert "agreement.on_below=train" in msg and "finished stages are reused" in msg


def test_on_below_train_trains_and_says_so():
    v = check(AgreementConfig(min=0.6, on_below="train"), "consistency", 1, LABEL, FILTER)
    assert v.passed and v.note.startswith("agreement BELOW the gate: verifier_within_prompt_auc=0.510")
    assert "trained anyway (agreement.on_below=train)" in v.note


def test_a_measure_that_is_missing_or_too_thin_is_not_judged_and_says_why():
    v = check(AgreementConfig(min=0.9), "judge", 1, {}, {})
    assert v.passed and v.value is None and "no labeled prompt has a reference answer" in v.note
    v = check(AgreementConfig(min=0.9, min_prompts=50), "judge", 1, LABEL, FILTER)
    assert v.passed and "covers 40 prompts with right and wrong samples, fewer than agreement.min_prompts=50" in v.note


def test_config_refuses_a_gate_on_the_verifier_and_checks_its_fields():
    from ratchet.data.errors import ConfigError
    from ratchet.flows.config import config_from_dict

    with pytest.raises(ConfigError, match="agreement.min=0.7: label.kind='verifier' scores with the reference"):
        config_from_dict({"agreement": {"min": 0.7}})
    with pytest.raises(ConfigError, match=r"agreement.metric='auc'"):
        config_from_dict({"label": {"kind": "consistency"}, "agreement": {"min": 0.7, "metric": "auc"}})
    cfg = config_from_dict({"label": {"kind": "consistency"}, "agreement": {"min": 0.7}})
    assert cfg.agreement.min == 0.7 and cfg.agreement.on_below == "stop"
