"""The shape of a run, written once (flows/shape.py): the flow and `ratchet plan` both walk it, so
what a round runs, and in what order, is decided in one place. Walked here with steps that record
what they are asked to do."""

from dataclasses import dataclass

import pytest

from ratchet.flows.config import load_config
from ratchet.flows.shape import round_shape, round_stage_names, run_shape


@pytest.mark.parametrize("config, overrides, names", [
    ("flows/configs/default.yaml", [], ["sample", "label", "filter", "train", "evaluate"]),
    ("flows/configs/grpo.yaml", [], ["train", "evaluate"]),  # it samples and scores inside its stage
    ("flows/configs/mcts_dpo.yaml", [], ["label", "filter", "train", "evaluate"]),  # the search samples its own
    ("flows/configs/default.yaml", ["improve=prompt", "prompt.search={kind: prompt_agent}"], ["search", "evaluate"]),
    ("flows/configs/default.yaml", ["improve=both", "prompt.search={kind: prompt_agent}"],  # the text stays with the
     ["search", "sample", "label", "filter", "train", "template", "evaluate"]),  # weights trained under it
    ("flows/configs/grpo.yaml", ["prompt.template='Q: {prompt}'"], ["train", "template", "evaluate"]),
    ("flows/configs/default.yaml", ["data.prompts_per_round=16", "data.retire_solved=true",
                                    "evaluate.sets=[{name: task}, {name: more, data: {kind: addition}}]"],
     ["pool", "slice", "sample", "label", "filter", "train", "evaluate", "evaluate.more"]),
    ("flows/configs/default.yaml", ["label={kind: vote, models: 3}"],  # the policy and two voters sample, and train
     ["sample", "sample", "sample", "label", "filter", "train", "train", "train", "evaluate"]),
    ("flows/configs/default.yaml", ["label={kind: vote, models: 3, of: versions}"],  # the versions before: no training
     ["sample", "sample", "sample", "label", "filter", "train", "evaluate"]),
])
def test_a_round_s_stages_follow_its_kinds(config, overrides, names):
    assert round_stage_names(load_config(config, overrides)) == names


@dataclass
class R:
    round: int
    policy: str
    scored: str | None = None
    voters: tuple = ()


class Recorder:
    """RunSteps and RoundSteps at once: each call is recorded as (what, round), a stage by its name."""

    def __init__(self, started=False, waits_from=None):
        self.calls, self.started, self.waits_from, self.optimisers = [], started, waits_from, []

    def _did(self, what, k=None, out=None):
        self.calls.append((what, k))
        return out if out is not None else f"{what}-{k}"

    def run(self, stage, k, *inputs):
        if stage.name == "search":
            self.optimisers.append(inputs[-1])
        if stage.role == "text":
            return self._did(stage.name, k, Pair(stage.name, k))
        if stage.name == "base":
            self._did("base")
            return R(0, "base")
        if k == 0 and stage.name in ("prompts", "label-model", "optimiser-model", "demonstrations"):
            return self._did(stage.name)
        return self._did(stage.name, k)

    def start(self):
        self._did("start")
        return R(5, "base")

    def known(self, m):
        return True

    def round_zero(self, base, targets, k):
        return self._did("round-zero", k, R(k, base.policy))

    def cold_start_round(self, k, base, demos, targets, before):
        return self._did("cold-start", k, R(k, "cold"))

    def begin(self, k, results):
        self._did("begin", k)
        return None if self.waits_from is not None and k >= self.waits_from else results[-1]

    def round(self, k, start, pool, targets, first, label_model, optimiser_model, voters):
        made = round_shape(self.cfg, self, k, start.policy, pool, first, label_model, optimiser_model, voters)
        return self._did("round", k, R(k, made.candidate, made.scored, tuple(made.voters)))

    def waits(self, k):
        self._did("waits", k)

    def ends(self, k, taught):
        self._did("ends", k)

    def agreement(self, k, labels, train_set):
        self._did("agreement", k)
        return ""


@dataclass
class Pair:
    """A text stage's manifest (its stage), standing also for the round result of round 0."""

    stage: str
    round: int
    role: str = "text"

    @property
    def policy(self):
        return self


def walk(overrides, **kw):
    r = Recorder(**kw)
    r.cfg = load_config("flows/configs/default.yaml", ["rounds=2", *overrides])
    results = run_shape(r.cfg, r)
    return [f"{w}" if k is None else f"{w}@{k}" for w, k in r.calls], results


def test_a_run_walks_round_zero_then_each_round_on_the_model_begin_picks():
    calls, results = walk([])
    assert calls == ["prompts", "base", "round-zero@0",
                     "begin@1", "sample@1", "label@1", "filter@1", "agreement@1", "train@1", "round@1",
                     "begin@2", "sample@2", "label@2", "filter@2", "agreement@2", "train@2", "round@2"]
    assert [r.round for r in results] == [0, 1, 2] and results[-1].scored == "label-2"


def test_a_cold_start_is_generation_1_and_a_continuation_numbers_on_past_it(tmp_path):
    demos = tmp_path / "d.jsonl"
    demos.write_text('{"prompt": "What is 1 + 1?", "completion": "2"}\n')
    calls, results = walk([f"cold_start.demonstrations={demos}"])
    assert calls[2:6] == ["round-zero@0", "demonstrations", "cold-start@1", "begin@2"]
    assert [r.round for r in results] == [0, 1, 2, 3]
    calls, results = walk([f"cold_start.demonstrations={demos}"], started=True)  # from version of round 5
    assert "demonstrations" not in calls and [r.round for r in results] == [5, 6, 7]


def test_the_pool_retires_what_the_round_before_solved_and_a_round_that_waits_stops_the_walk():
    calls, _ = walk(["data.retire_solved=true"])
    assert [c for c in calls if c.startswith(("pool", "begin"))] == ["begin@1", "begin@2", "pool@2"]  # round 0: none
    calls, results = walk(["rounds=3"], waits_from=2)  # the plan, before round 1 is evaluated
    assert calls[-4:] == ["round@1", "begin@2", "waits@2", "waits@3"] and len(results) == 2


def test_a_text_is_version_1_and_stays_with_the_weights_trained_under_it():
    """prompt.template: the base weights are paired with it before round 0; each round's search starts
    from the pair, samples and trains under the text it found, and pairs the new weights with it."""
    calls, results = walk(["prompt.template='Q: {prompt}'", "improve=both", "prompt.search={kind: prompt_agent}"])
    assert calls[:4] == ["prompts", "base", "template@0", "round-zero@0"]
    assert calls[4:12] == ["begin@1", "search@1", "sample@1", "label@1", "filter@1", "agreement@1", "train@1",
                           "template@1"]
    assert results[1].policy.stage == "template"
    calls, results = walk(["improve=prompt", "prompt.search={kind: prompt_agent}"])  # the prompt alone
    assert calls == ["prompts", "base", "round-zero@0", "begin@1", "search@1", "round@1", "begin@2",
                     "search@2", "round@2"]
    assert results[2].policy.stage == "search" and results[2].scored is None


def test_a_search_s_own_optimiser_model_is_a_stage_of_the_run_given_to_every_round_s_search():
    r = Recorder()
    r.cfg = load_config("flows/configs/default.yaml", ["rounds=2", "improve=prompt",
                                                       "prompt.search={kind: prompt_agent, optimiser: {kind: model, "
                                                       "path: default}}"])
    run_shape(r.cfg, r)
    assert [w for w, _ in r.calls].count("optimiser-model") == 1 and r.optimisers == ["optimiser-model-None"] * 2
    assert walk(["improve=prompt", "prompt.search={kind: prompt_agent}"])[0].count("optimiser-model") == 0


def test_a_vote_s_voters_are_trained_beside_the_policy_or_are_the_versions_before_it():
    """of: seeds: every round trains each voter too (train@k once per model), and the next round's
    voters are those; of: versions: the voters are the policies the rounds before started from."""
    calls, results = walk(["label={kind: vote, models: 3}", "rounds=2"])
    assert calls.count("train@1") == 3 and calls.count("sample@2") == 3
    assert results[2].voters == ("train-2", "train-2")  # the recorder names each stage by its round
    calls, results = walk(["label={kind: vote, models: 3, of: versions}", "rounds=2"])
    assert calls.count("train@1") == 1 and calls.count("sample@2") == 3
    assert results[1].voters == ("base", "base") and results[2].voters == ("train-1", "base")


def test_the_run_flows_are_declared_without_a_schema_of_their_parameters():
    """A flow's parameter schema is for a deployment's form; the flows a run only calls (a round's
    parameters are the whole config and its manifests) are declared without one, 0.5 s of every
    run's start, while the one a schedule deploys keeps its own. Prefect still binds their
    parameters by name and default, and the functions keep their annotations."""
    from prefect import Flow

    from ratchet.flows import pipeline

    flows = {name: f for name, f in vars(pipeline).items() if isinstance(f, Flow)}
    called = {name: f for name, f in flows.items() if name != "continue_improve"}
    assert set(called) == {"round_flow", "round_zero", "cold_start_round", "self_improve"}
    for name, f in called.items():
        assert f.parameters.definitions == {} and all(set(p) == {"position", "title"} or "default" in p
                                                      for p in f.parameters.properties.values()), name
        assert f.fn.__annotations__["cfg"] == "PipelineConfig", name
    assert list(pipeline.round_zero.parameters.properties) == ["cfg", "ctx", "base", "targets", "k"]
    assert pipeline.round_zero.parameters.properties["k"]["default"] == 0
    assert flows["continue_improve"].parameters.properties["config"]["type"] == "object"
