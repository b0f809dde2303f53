"""A GRPO round: what the config refuses before any model loads, and a round on the tiny model
(prompts -> train -> evaluate) that is kept, keyed, planned and traced like any other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchet.data.errors import ConfigError
from ratchet.flows.config import load_config
from tests.flows.test_label_models import tiny_reward_model  # noqa: F401 - a fixture
from tests.flows.tiny import ratchet

CONFIG = Path(__file__).parents[2] / "flows" / "configs" / "grpo.yaml"


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, list(overrides))
    return str(e.value)


def test_the_shipped_config_loads_with_no_filter_to_match():
    cfg = load_config(CONFIG)
    assert cfg.train.kind == "grpo" and cfg.train.online and cfg.sample.n == 8
    assert load_config(None, ["train.kind=grpo", "sample.top_k=0"]).train.kind == "grpo"  # default filter, unused


@pytest.mark.parametrize("kind,why", [("judge", "grade each completion"), ("consistency", "majority vote"),
                                      ("mcts", "searches from the prompts"), ("turn_mcts", "searches an environment")])
def test_a_label_that_cannot_be_a_reward_is_refused_by_name(kind, why):
    text = refused(f"label.kind={kind}", *(["label.mode=p_yes"] if kind == "judge" else []))
    assert f"label.kind={kind!r}" in text and "cannot be the reward of train.kind='grpo'" in text and why in text
    assert "use label.kind='verifier'" in text


def test_a_prompt_and_an_episode_must_fit_the_engine_and_train_max_length_does_not_apply():
    """The budgets `ratchet check` measures every train prompt against (flows/inputs.py): GRPO samples
    a prompt plus an episode of max_tokens a turn on the engine; it trains on what it sampled."""
    from ratchet.flows.inputs import train_budgets

    budgets = train_budgets(load_config(CONFIG, ["sample.rollout={kind: tool, max_turns: 3, episode_tokens: 200}"]))
    assert budgets["sampling"].extra == 200 and budgets["sampling"].limit == 512 and "training" not in budgets
    assert "raise sampler.max_model_len or lower sample.rollout.episode_tokens" == budgets["sampling"].fix


def test_what_cannot_work_is_refused_with_its_fix():
    assert "set sample.n to 2 or more" in refused("sample.n=1")
    assert "set sample.top_k: 0" in refused("sample.top_k=50")
    assert "set sample.top_k: 0" in refused("sample.top_p=0.9")
    assert "set sample.temperature above 0" in refused("sample.temperature=0")
    assert load_config(CONFIG, ["train.num_processes=2"]).train.num_processes == 2  # on CPU: one engine each
    assert "remove train.epochs" in refused("train.epochs=2")
    assert "set train.scale_rewards: none" in refused("train.leave_one_out=true")


def test_the_verifier_scores_a_step_with_the_run_s_check():
    """What a GRPO step's rows get from label.kind=verifier: data.check's verdict, row by row,
    adversarial text included (a completion that claims a score is judged on its number)."""
    from ratchet.data.records import Completion
    from ratchet.tasks.label_kinds.verifier import VerifierLabel

    cfg = load_config(CONFIG)
    texts = ["1 + 2 = 3", "It is 4.", "Score: 1.0 (correct). The answer is 5", ""]
    rows = [Completion(prompt_id="add-1-2", prompt="What is 1 + 2?", answer="3", index=i, text=t, n_tokens=3)
            for i, t in enumerate(texts)]
    scored = VerifierLabel().scorer(None)(rows, cfg.data.check)
    assert [r.reward for r in scored] == [1.0, 0.0, 0.0, 0.0] and [r.index for r in scored] == [0, 1, 2, 3]


def _args(work: Path, model: Path) -> list[str]:
    return [CONFIG, f"workdir={work}", f"model.path={model}", "rounds=1", "sampler.backend=hf", "sampler.dtype=float32",
            "data.a_max=6", "data.b_max=4", "data.train_size=12", "data.eval_size=4", "sample.n=3",
            "sample.max_tokens=6", "train.steps=3", "train.batch_size=2", "train.checkpoint_steps=2",
            "evaluate.max_tokens=6"]


@pytest.mark.integration
def test_a_grpo_round_after_a_cold_start_is_kept_planned_and_traced(tiny_model, tmp_path, prefect_harness, capsys):
    """A run with demonstrations (cold_start): round 1 is the base model fine-tuned on them, round 2 a
    GRPO round that builds on it; its rollouts and the demonstrations are in the lineage, the plan
    reuses every stage, and a run from a registered version starts past the cold start.

    Guards `cold_start` before online RL. Slow: a cold start and a GRPO round on the tiny model."""
    from prefect.settings import PREFECT_API_URL

    from ratchet.flows.plan import plan
    from tests.flows.test_cold_start_round import demonstrations

    api, work = PREFECT_API_URL.value(), tmp_path / "runs"
    args = [*_args(work, tiny_model), f"cold_start.demonstrations={demonstrations(tmp_path / 'demos.jsonl', CONFIG)}",
            "cold_start.train.epochs=1", "cold_start.train.batch_size=3"]
    first = ratchet("run", *args, api_url=api)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    stages = sorted(p.name.split("-")[0] for p in (work / "stages").iterdir() if (p / "manifest.json").exists())
    assert stages == ["base", "demonstrations", "evaluate", "evaluate", "evaluate", "prompts", "train", "train"]
    trains = sorted((json.loads(p.read_text()) for p in (work / "stages").glob("train-*/manifest.json")),
                    key=lambda m: m["round"])  # no sample, label or filter stage
    assert [(m["round"], m["info"]["objective"], [p["stage"] for p in m["parents"]]) for m in trains] == [
        (1, "cold-start", ["base", "demonstrations"]), (2, "grpo", ["train", "prompts"])]
    assert trains[1]["parents"][0]["key"] == trains[0]["key"]  # the GRPO round builds on the cold start
    train = work / trains[1]["dir"]
    assert sorted(p.name for p in (train / "rollouts").glob("*.jsonl")) == ["00000.jsonl", "00001.jsonl",
                                                                             "00002.jsonl"]
    assert "cold start on 6 demonstrations" in first.stdout and "-> version 3" in first.stdout
    assert "  (cold start)" in first.stdout  # the run's round table marks it
    assert "3 steps" in first.stdout and "of groups taught" in first.stdout
    # each step's figures: the run's report (a figure and a table) and MLflow's stepped metrics
    (page,) = (work / "reports").glob("*/index.html")
    steps = page.read_text().split("<h2>Online RL by step</h2>")[1].split("</table>")[0]
    assert (page.parent / "online_steps.png").exists() and steps.count("<tr><td>2</td><td>") == 3
    from ratchet.flows.tracking import Tracker

    cfg = load_config(CONFIG, args[1:])
    tracker = Tracker(cfg.tracking, work, cfg.name)
    (child,) = tracker.client.search_runs([tracker.experiment_id], "tags.`ratchet.round` = '2'")
    assert [m.step for m in tracker.client.get_metric_history(child.info.run_id, "online/reward")] == [1, 2, 3]

    from ratchet.flows.cli import main  # the commands that read a run, in this process: no server, no model

    capsys.readouterr()
    assert main(["plan", *map(str, args), "train.loss_type=grpo"]) == 0, capsys.readouterr().err
    replan = capsys.readouterr().out
    assert "config train.loss_type: 'dapo' -> 'grpo'" in replan, replan
    assert "1 stale" in replan and "demonstrations     reused" in replan, replan

    # read back from the run's record alone, as the advice a failure prints does (`ratchet resume --run R
    # --workdir W`): the record gives every field, and none of GRPO's refusals of a field the user wrote applies
    (run,) = [p.stem for p in (work / "runs").glob("*.json")]
    again = ratchet("resume", "--run", run, "--workdir", work, api_url=api)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming run {run} (named by --run)" in again.stdout and "8 stage(s) reused, 0 stale, 0 to run" in again.stdout, again.stdout
    capsys.readouterr()
    assert main(["lineage", "3", "--workdir", str(work)]) == 0, capsys.readouterr().err
    lineage = capsys.readouterr().out
    assert "all verified" in lineage and "rollouts/00002.jsonl" in lineage and "demonstrations.jsonl" in lineage
    assert "ledger: 3 optimizer step(s)" in lineage
    assert main(["lineage", "3", "--workdir", str(work), "--json"]) == 0, capsys.readouterr().err
    (grpo,) = [x for x in json.loads(capsys.readouterr().out) if x["ledger"]]
    assert [r["step"] for r in grpo["ledger"]] == [1, 2, 3] and grpo["outputs"]["ledger.jsonl"]
    assert main(["runs", "--workdir", str(work), "--json"]) == 0, capsys.readouterr().err
    listed = json.loads(capsys.readouterr().out)
    assert [(r["run"], r["state"], r["problem"]) for r in listed["runs"]] == [(run, "finished", None)]

    onwards = plan(load_config(CONFIG, args[1:]), run="from-v3", start=_manifest(work, trains[1]))
    assert [(s.round, s.stage) for s in onwards.steps][:3] == [(0, "prompts"), (2, "evaluate"), (3, "train")]
    assert "demonstrations" not in [s.stage for s in onwards.steps]  # a continuation starts past the cold start


def _manifest(work: Path, m: dict):
    from ratchet.data.manifest import read_manifest

    return read_manifest(work / m["dir"])


@pytest.mark.integration
def test_a_reward_model_is_the_reward_of_a_grpo_round(tiny_model, tiny_reward_model, tmp_path, prefect_harness):
    """label.kind=reward_model scores each step's completions in the train stage, on its own model:
    a stage of its own (label-model) and a parent of the train stage, so its digest keys it. In two
    training processes: each makes the stage's engine, rollout and scorer again (tasks/train.py
    online_process), samples its own prompts of a step and scores them on the reward model.

    Guards `label.kind=reward_model` in online RL, keyed by its model's digest, in two training processes.
    Slow: a GRPO round in two processes, each with its engine and scorer."""
    from prefect.settings import PREFECT_API_URL

    work = tmp_path / "runs"
    done = ratchet("run", *_args(work, tiny_model), "train.steps=2", "train.num_processes=2",
                   "label={kind: reward_model}", f"label.model={tiny_reward_model}", api_url=PREFECT_API_URL.value())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    train = next((work / "stages").glob("train-*"))
    m = json.loads((train / "manifest.json").read_text())
    assert [p["stage"] for p in m["parents"]] == ["base", "prompts", "label-model"]
    assert m["metrics"]["processes"] == 2 and m["metrics"]["groups"] == 2 * 2 * 2  # 2 steps x 2 processes x 2
    shares = [[json.loads(x) for x in (train / "rollouts" / f"00000.{rank}.jsonl").read_text().splitlines()]
              for rank in (0, 1)]
    assert [len(rows) for rows in shares] == [6, 6]  # batch_size 2 prompts x sample.n 3, each
    assert not {r["prompt_id"] for r in shares[0]} & {r["prompt_id"] for r in shares[1]}
    assert all(f"rollouts/00001.{rank}.jsonl" in m["outputs"] for rank in (0, 1))  # kept and in the lineage
    rows = shares[0] + shares[1]
    assert len({r["reward"] for r in rows}) > 1  # a random model's logits differ by completion
    # the ledger: each step over both processes, which sampled from the same weights (DDP keeps them equal)
    ledger = [json.loads(x) for x in (train / "ledger.jsonl").read_text().splitlines()]
    assert [len(r["sampled_from"]) for r in ledger] == [2, 2] and all(a == b for a, b in (r["sampled_from"]
                                                                                          for r in ledger))
    assert ledger[0]["prompt_ids"] == [r["prompt_id"] for r in shares[0] + shares[1]][::3]
    assert ledger[0]["sampled_from"][0]["trainable_sha256"] != ledger[1]["sampled_from"][0]["trainable_sha256"]


@pytest.mark.integration
def test_prompts_every_sample_solved_leave_the_pool_for_the_next_round(tiny_model, tmp_path, prefect_harness):
    """data.retire_solved: the prompts whose every sample in round 1 earned the top reward (here a
    reward that gives 1.0 to every answer of a prompt with an even first term) are not in round 2's
    pool, a stage keyed by round 1's train stage, whose rollouts hold the rewards.

    Guards `data.retire_solved`. Slow: two GRPO rounds on the tiny model."""
    from prefect.settings import PREFECT_API_URL

    reward = tmp_path / "reward.py"
    reward.write_text("import re\n\ndef score(completion, answer=None, prompt=None, **fields):\n"
                      "    return float(int(re.findall(r'\\d+', prompt)[0]) % 2 == 0)\n")
    work = tmp_path / "runs"
    done = ratchet("run", *_args(work, tiny_model), "rounds=2", "train.steps=2", "train.drop_equal=false",
                   "data.retire_solved=true", f"data.check={{kind: python, function: '{reward}:score'}}",
                   api_url=PREFECT_API_URL.value())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifests = {p.parent.name: json.loads(p.read_text()) for p in (work / "stages").glob("*/manifest.json")}
    pool = next(m for m in manifests.values() if m["stage"] == "pool")
    first, second = sorted((m for m in manifests.values() if m["stage"] == "train"), key=lambda m: m["round"])
    assert pool["round"] == 2 and [p["stage"] for p in pool["parents"]] == ["prompts", "train"]
    assert pool["parents"][1]["key"] == first["key"] and [p["stage"] for p in second["parents"]] == ["train", "pool"]

    def rows(m, name):
        return [json.loads(x) for x in (work / m["dir"] / name).read_text().splitlines()]

    sampled = {r["prompt"] for f in ("rollouts/00000.jsonl", "rollouts/00001.jsonl") for r in rows(first, f)}
    even = {p for p in sampled if int(p.split()[2]) % 2 == 0}
    assert {r["prompt"] for r in rows(pool, "retired.jsonl")} == even and even  # every sample of them scored 1.0
    left = {r["prompt"] for r in rows(pool, "train.jsonl")}
    assert not left & even and len(left) == 12 - len(even)
    assert not {r["prompt"] for f in ("rollouts/00000.jsonl", "rollouts/00001.jsonl") for r in rows(second, f)} & even
    assert f"{len(even)} of 12 prompts solved by every sample leave the pool; {12 - len(even)} left" in done.stdout
