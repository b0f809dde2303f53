"""Keys over all the code a stage runs, tested by mutation: tests/key_mutations.py edits a copy of
the package and a user's project, one edit at a time, and takes every planned stage's key again
(the real package is never touched). The suite runs a fixed sample of it:

- behaviour edits (a constant, a comparison, a returned value) to definitions drawn at random
  from those the planned stages reach: exactly the stages that reach each re-key;
- code named by hand that runs in a stage's child processes (math-verify's check and
  reasoning-gym's scorer in the scorer host, the TextArena adapter and the environment host, the
  engine room's host loop, a training process of several): the stages that run it re-key;
- layout edits (a function written out again, a comment, a reworded docstring): nothing re-keys;
- the user's files: a reward file with helpers one and two levels deep (a relative import
  inside a helper package), a helper in a sibling folder, an environment with a helper module,
  a prompt file, a held-out set's file, a demonstration file, the model's chat template: exactly
  the stages that read each re-key."""

import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "key_mutations.py"
# the shipped configs whose stages the hand-named child code runs in, and the cold start's demonstrations
CONFIGS = ["reasoning_gym.yaml", "guess_number_rft.yaml", "grpo.yaml", "default.yaml", "cold_start_tool.yaml"]


@pytest.mark.integration
def test_a_fixed_sample_of_edits_rekeys_exactly_the_stages_that_run_the_edited_code(tmp_path):
    """Guards keys over all the code a stage runs (the module's promise), on a fixed sample of edits:
    each behaviour edit re-keys exactly the planned stages that reach it, hand-named child-process
    code re-keys its stages, layout edits re-key nothing, each user-file edit re-keys. Slow: every
    edit re-plans every shipped config's stages on a copy of the package."""
    done = runpy.run_path(str(BENCH))["run"](sample=8, seed=0, keep=tmp_path / "copy", shipped=CONFIGS)
    results = done["results"]
    kinds = {r.get("kind") for r in results}
    assert {"behaviour", "layout", "user"} <= kinds, kinds
    hand_named = [r for r in results if "(" in r["edit"] and r.get("kind") == "behaviour"]
    assert len(hand_named) == 8, [r["edit"] for r in hand_named]  # each had a planned stage that runs it
    users = {r["edit"]: r for r in results if r.get("kind") == "user"}
    assert len(users) == 11 and all(r["rekeyed"] > 0 for r in users.values()), users
    assert all(r["rekeyed"] > 0 for r in results if r.get("kind") == "behaviour")
    assert done["misses"] == [], "\n".join(f"{r['edit']} [{r.get('how')}]: missed {r['missed']}, "
                                           f"spurious {r['spurious']}" for r in done["misses"])


def test_a_library_upgrade_rekeys_the_stages_whose_code_imports_it(monkeypatch):
    """math-verify's version is in the key of a stage that checks with it, not of one that does not."""
    from ratchet.data.checks.math_answer import MathCheck
    from ratchet.data.checks.number import NumberCheck
    from ratchet.data.prompts import AdditionSource
    from ratchet.tasks import label
    from ratchet.tasks.runner import code_reach
    from ratchet.tasks.runner.stage import body_code

    def version(check):
        return body_code(label.label_body, config=label.LabelJob(label=label.VerifierLabel(),
                                                                 data=AdditionSource(check=check)))

    math, number = version(MathCheck()), version(NumberCheck())
    real = code_reach.installed
    monkeypatch.setattr(code_reach, "installed", lambda n: "math-verify==99.0" if n == "math_verify" else real(n))
    assert version(MathCheck()) != math and version(NumberCheck()) == number
