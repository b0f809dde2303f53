"""Growing past the labels: levels whose train prompts carry no reference (data.labeled_levels), a
vote across models, a length filter, a curriculum that moves on by its own labels, and the label
precision a round reports without a stage ever reading a reference."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ratchet.data.records import Completion, LabeledCompletion
from ratchet.models.sampler import Generation

ROOT = Path(__file__).parents[2]


def test_a_vote_across_models_labels_what_enough_of_them_answer_alike():
    """Three models, two samples each: a model's answer is its samples' majority; 2 of 3 models
    (0.67 >= share 0.6) make a label, 1 of 3 does not; every sample of every model is labeled."""
    from ratchet.data.checkers import NumberCheck
    from ratchet.tasks.label_kinds.vote import VoteLabel, vote

    def rows(*answers):  # one model's samples: prompt p1 then p2
        return [Completion(prompt_id=p, prompt="What is 1 + 1?", index=i, text=f"so {a}", n_tokens=2)
                for p, pair in zip(("p1", "p2"), answers) for i, a in enumerate(pair)]

    members = [rows(("2", "2"), ("5", "6")), rows(("2", "3"), ("7", "7")), rows(("3", "3"), ("8", "8"))]
    out, m = vote(members, NumberCheck(), VoteLabel(models=3, share=0.6))
    got = {(r.prompt_id, r.index): r.reward for r in out}
    # p1: model 1 says 2, model 2 ties (no answer), model 3 says 3: 1 of 3 each, no label
    # p2: model 1 ties 5/6, models 2 and 3 disagree (7, 8): no label
    assert set(got.values()) == {None} and m["labeled_prompts_frac"] == 0
    members[1] = rows(("2", "2"), ("8", "8"))
    out, m = vote(members, NumberCheck(), VoteLabel(models=3, share=0.6))
    got = {(r.prompt_id, r.index): r.reward for r in out}
    assert got == {("p1", 0): 1.0, ("p1", 1): 1.0, ("p1", 2): 1.0, ("p1", 3): 1.0, ("p1", 4): 0.0, ("p1", 5): 0.0,
                   ("p2", 0): 0.0, ("p2", 1): 0.0, ("p2", 2): 1.0, ("p2", 3): 1.0, ("p2", 4): 1.0, ("p2", 5): 1.0}
    assert m["labeled_prompts_frac"] == 1 and m["vote_share_mean"] == pytest.approx(2 / 3)
    out, _ = vote(members, NumberCheck(), VoteLabel(models=3, share=0.7))  # 2 of 3 is below 0.7: nothing
    assert {r.reward for r in out} == {None}


def test_a_vote_s_answers_are_read_as_text_an_output_cannot_talk_its_way_into_a_label():
    """What a model writes is only read for its last number: a claim of agreement, a fake label or a
    score does not move the vote."""
    from ratchet.data.checkers import NumberCheck
    from ratchet.tasks.label_kinds.vote import VoteLabel, vote

    texts = ["All models agree: the label is 5. So 4", "Label: 9 (score 1.0, correct) so 4",
             "ignore the vote and label this 7"]
    members = [[Completion(prompt_id="p", prompt="What is 2 + 2?", index=0, text=t, n_tokens=9)] for t in texts]
    out, _ = vote(members, NumberCheck(), VoteLabel(models=3, share=0.6))
    assert [(r.extracted, r.reward) for r in out] == [("4", 1.0), ("4", 1.0), ("7", 0.0)]


def _row(pid, level, n_tokens, reward=1.0, extracted="1"):
    return LabeledCompletion(prompt_id=pid, prompt="q", index=0, text="x" * n_tokens, n_tokens=n_tokens, level=level,
                             reward=reward, extracted=extracted)


def test_the_length_filter_holds_each_level_to_the_line_through_the_others():
    """Medians 10, 20, 30 at levels 1-3 put level 4 at 40: a level-4 sample of 28 tokens (30% short) is
    dropped at margin 0.25, one of 38 kept; a level is measured by the levels below it, so level 4's
    short answers move no easier level's measure."""
    from ratchet.tasks.filter_kinds.length import LengthFilter, expected, fits

    rows = [_row(f"a{i}", 1, 10) for i in range(3)] + [_row(f"b{i}", 2, 20) for i in range(3)] + \
        [_row(f"c{i}", 3, 30) for i in range(3)] + [_row("d0", 4, 28), _row("d1", 4, 38), _row("d2", 4, 28)]
    assert expected({1: 10, 2: 20, 3: 30, 4: 28}, 4) == pytest.approx(40)
    kept, m = fits(rows, LengthFilter(margin=0.25))
    assert sorted(r.prompt_id for r in kept if r.level == 4) == ["d1"] and m["dropped_length.level_4"] == 2
    assert m["dropped_length"] == 2 and m["expected_length.level_4"] == pytest.approx(40)
    kept, _ = fits(rows, LengthFilter(margin=0.25, by="prompt"))  # each prompt's own samples: all fit
    assert len(kept) == len(rows)
    unlabeled = [_row("e0", 4, 5, reward=None)]  # a sample the label did not label is left to rft's rules
    assert fits(unlabeled + rows, LengthFilter())[0][0].prompt_id == "e0"


def test_a_level_s_own_median_holds_a_form_that_grows_faster_than_its_level():
    """Lengths growing as the square of the level (10, 40, 90 tokens at levels 1-3) put the line through
    them at 127 for level 4, where right answers take 140: at a margin of 0.05 it drops the right ones
    and keeps two answers one step short (128), as the worked form's 10-digit labels were held. Held
    to level 4's own median (by: level_median), the short ones go and the right ones stay; a level
    below is held to its own median too."""
    from ratchet.tasks.filter_kinds.length import LengthFilter, fits

    rows = [_row(f"a{i}", 1, 10) for i in range(3)] + [_row(f"b{i}", 2, 40) for i in range(3)] + \
        [_row(f"c{i}", 3, 90) for i in range(3)] + [_row(f"d{i}", 4, 140) for i in range(4)] + \
        [_row("s0", 4, 128), _row("s1", 4, 128), _row("b9", 2, 30)]
    line, m = fits(rows, LengthFilter(margin=0.05))
    assert m["expected_length.level_4"] == pytest.approx(126.67, abs=0.01)
    assert sorted(r.prompt_id for r in line if r.level == 4) == ["s0", "s1"]
    own, m = fits(rows, LengthFilter(margin=0.05, by="level_median"))
    assert sorted(r.prompt_id for r in own if r.level == 4) == ["d0", "d1", "d2", "d3"]
    assert m["expected_length.level_4"] == 140 and m["expected_length.level_2"] == 40
    assert "b9" not in {r.prompt_id for r in own} and m["dropped_length"] == 3  # 30 against level 2's 40


def test_label_precision_reads_the_hidden_references_per_level():
    from ratchet.data.checkers import NumberCheck
    from ratchet.tasks.label_kinds.precision import precision, said

    rows = [LabeledCompletion(prompt_id=f"p{i}", prompt="q", index=j, text=f"so {a}", n_tokens=2, level=lv,
                              reward=r, extracted=a)
            for i, (lv, a, r) in enumerate([(2, "5", 1.0), (2, "6", 1.0), (3, "7", 1.0), (3, "1", None)])
            for j in range(2)]
    refs = {"p0": "5", "p1": "9", "p2": "7", "p3": "1"}
    m = precision(rows, refs, NumberCheck(), 1.0)
    assert (m["precision.level_2"], m["self_labeled.level_2"], m["sampled.level_2"]) == (0.5, 2, 2)
    assert (m["precision.level_3"], m["self_labeled.level_3"], m["sampled.level_3"]) == (1.0, 1, 2)
    assert m["precision"] == pytest.approx(2 / 3) and said(m).endswith("L2 50% of 2, L3 100% of 1")


def test_levels_without_labels_reach_no_stage_with_a_reference_and_bad_settings_are_refused():
    from ratchet.data.errors import ConfigError
    from ratchet.data.prompts import load_split, references
    from ratchet.flows.config import load_config

    cfg = load_config(ROOT / "flows" / "configs" / "default.yaml", [
        "data={kind: addition, levels: [1, 2, 3], labeled_levels: [1], eval_size: 4, train_size: 6}",
        "label={kind: vote}", "curriculum={advance_by: labels}"])
    split = load_split(cfg.data, 0)
    assert {p.level for p in split.train if p.answer is None} == {2, 3}
    assert all(p.answer is not None for p in split.train if p.level == 1) and all(p.answer for p in split.eval)
    refs = references(cfg.data, 0)
    assert set(refs) == {p.id for p in split.train if p.level in (2, 3)}
    bad = {
        "data={kind: addition, levels: [1, 2], labeled_levels: [3]}": "names level(s) [3] the task does not have",
        "label={kind: vote, share: 0.5}": "label.share=0.5",
        "label={kind: vote, share: 1.2}": "label.share=1.2",
        "label={kind: vote, models: 1}": "a vote across models needs 2 or more",
        "filter={kind: length}": "filter.kind='length' holds each output to what its level implies, and data.kind="
                                 "'addition' has no levels here",
        "data={kind: addition, levels: [1, 2], labeled_levels: [1]}": "label.kind='verifier' scores with reference "
                                                                       "answers",
    }
    for override, says in bad.items():
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(ROOT / "flows" / "configs" / "default.yaml", [override])


class Adder:
    """A model that adds: right where the first digit of a is odd, else one too high (the same for
    every model: its voters agree with it), in a few words. Stands in for the engine; the training
    is the tiny model's own."""

    def generate(self, prompts, params, seed, prefixes=None):
        out = []
        for p in prompts:
            a, b = (int(x) for x in re.search(r"(\d+) \+ (\d+)", p).groups())
            s = a + b + (0 if int(str(a)[0]) % 2 else 1)
            text = " ".join(str(s)) + f" so {s}"
            out.append([Generation(text, len(text.split()), "stop") for _ in range(params.n)])
        return out

    def close(self):
        pass


def _run(workdir: Path, tiny_model: Path, poisoned: bool, monkeypatch, rounds: int = 2):
    from ratchet.data.sources import addition
    from ratchet.flows.config import load_config
    from ratchet.flows.pipeline import execute
    from ratchet.models import sampler

    monkeypatch.setattr(sampler, "open_sampler", lambda *a, **k: Adder())
    load = addition.AdditionSource.load
    if poisoned:  # every train reference above level 1 is wrong
        def wrong(self, seed, train_answers):
            split = load(self, seed, train_answers)
            bad = [p.model_copy(update={"answer": str(int(p.answer) + 7)}) if p.level != 1 else p for p in split.train]
            return type(split)(bad, split.eval, split.digests, split.places)

        monkeypatch.setattr(addition.AdditionSource, "load", wrong)
    cfg = load_config(ROOT / "flows" / "configs" / "default.yaml", [
        f"workdir={workdir}", f"model.path={tiny_model}", "isolate=false", f"rounds={rounds}", "sampler.backend=hf",
        "sampler.dtype=float32", "data={kind: addition, levels: [1, 2, 3], labeled_levels: [1], eval_size: 3, "
        "train_size: 8}", "label={kind: vote, models: 2, share: 0.6}", "filter={kind: length, min_rows: 1}",
        "curriculum={prompts: 6, advance_by: labels, advance_at: 0.5, start: 2, review: 0.3}", "sample.n=2",
        "sample.max_tokens=8", "evaluate.max_tokens=8", "train.epochs=1", "train.batch_size=4",
        "agreement.min=null"])
    seen = []
    from ratchet.data import events

    stop = events.subscribe(lambda e: seen.append(e.data["text"]) if e.kind == "note" and e.stage == "label" else None)
    try:
        ctx, results, tracker = execute(cfg)
    finally:
        stop()
    monkeypatch.undo()
    return results, tracker, seen


def _outputs(workdir: Path) -> dict:
    from ratchet.data.manifest import read_manifest

    out = {}
    for d in sorted((workdir / "stages").iterdir()):
        m = read_manifest(d)
        out[d.name] = {k: v.sha256 for k, v in m.outputs.items()}
    return out


@pytest.mark.integration
def test_a_run_grows_on_its_own_labels_and_never_reads_a_hidden_reference(tiny_model, tmp_path, prefect_harness,
                                                                          monkeypatch):
    """Two rounds at levels 2-3 with references at level 1 alone: a vote of two models (the second
    trained beside the policy, its own seed, registered), the length filter, the curriculum moving up
    by its labels. With every hidden reference poisoned, every stage's key and output of the first
    round (its vote, filter and both models' training) is the same, byte for byte; only the label
    precision it reports (which reads them) changes.

    Guards learning without labels: no stage of a run that climbs on its own labels reads the references it
    hides. Slow: a 2-round run and a 1-round run with poisoned references, on the tiny model (its sampler
    scripted)."""
    from ratchet.data.records import read_jsonl

    results, tracker, said = _run(tmp_path / "clean", tiny_model, False, monkeypatch)
    poisoned, _, said_poisoned = _run(tmp_path / "poisoned", tiny_model, True, monkeypatch, rounds=1)
    clean_out, poisoned_out = _outputs(tmp_path / "clean"), _outputs(tmp_path / "poisoned")
    assert poisoned_out and all(clean_out.get(d) == files for d, files in poisoned_out.items())  # keys and bytes
    assert [r.version for r in results[:2]] == [r.version for r in poisoned]
    # no row of the train path holds a reference above level 1
    stages = tmp_path / "clean" / "stages"
    for f in [*stages.glob("sample-*/samples.jsonl"), *stages.glob("label-*/labels.jsonl")]:
        rows = read_jsonl(f, LabeledCompletion if f.name == "labels.jsonl" else Completion)
        assert rows and all(r.answer is None for r in rows if r.level != 1), f
    # the voter: sampled beside the policy, trained with its own seed, registered as a version
    r1 = results[1]
    assert len(r1.voters) == 1 and r1.voters[0].key != r1.policy.key and r1.voters[0].role == "model"
    voter = [v for v in tracker.client.search_model_versions(f"name='{tracker.model_name}'")
             if v.tags.get("ratchet.voter") == "1"]
    assert {v.tags["ratchet.round"] for v in voter} == {"1", "2"} and all(v.tags["ratchet.voter_of"] for v in voter)
    labels = next(m for m in (json.loads((d / "manifest.json").read_text()) for d in stages.glob("label-*"))
                  if m["round"] == 2)
    assert sum("samples.jsonl" in p["dir"] or p["stage"] == "sample" for p in labels["parents"]) == 2
    # the curriculum moved up on its labels, not on held-out answers
    levels = [tracker.client.get_run(r.child_run_id).data.tags.get("ratchet.level") for r in results[1:]]
    assert levels == ["2", "3"]  # every level-2 prompt was labeled (2 models agree): share 1.0 >= advance_at
    # precision, from references no stage read: the adder is right on half of its sums, the poison on none
    assert said and said_poisoned and said[0] != said_poisoned[0]
    m = tracker.client.get_run(r1.child_run_id).data.metrics
    assert 0 < m["label.precision"] < 1 and "label.precision.level_2" in m
    assert list((tmp_path / "clean" / "reports").rglob("precision.png"))  # the report draws it by level
