"""`ratchet report`: figures from a run's MLflow rounds and label rows, one self-contained page."""

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


ANSWERS = [["9", "", "<script>alert(1)</script>", "7", "6"], ["2", "3", "4", "5", "6"], ["2", "3", "4", "5", "6"],
           ["2", "3", "4", "5", "6"]]  # each round's held-out answers to "What is i + 2?"


def _online_train(tmp_path: Path, k: int) -> str:
    """A GRPO train stage's directory as the trainer leaves it: steps.jsonl (an attempt killed in step
    3's row, which a resumed attempt then wrote whole, and step 4 read from its stored rollouts) and the
    train log, which holds KL, entropy and the log-probability gap at the steps it logged."""
    d = tmp_path / "stages" / f"train-{k:016x}"
    d.mkdir(parents=True)
    rows = [{"step": 1, "reward": 0.25, "groups_kept": 0.5, "gen_tokens": 900, "gen_tokens_per_s": 150.0,
             "step_s": 9.0, "sync_s": 0.1, "reused": 0.0},
            {"step": 2, "reward": 0.5, "groups_kept": 0.75, "gen_tokens": 800, "gen_tokens_per_s": 160.0,
             "step_s": 8.0, "sync_s": 0.1, "reused": 0.0}]
    resumed = [{"step": 3, "reward": 0.625, "groups_kept": 1.0, "gen_tokens": 700, "gen_tokens_per_s": 140.0,
                "step_s": 7.5, "sync_s": 0.1, "reused": 0.0},
               {"step": 4, "reward": 0.75, "groups_kept": 1.0, "gen_tokens": 0, "gen_tokens_per_s": None,
                "step_s": 2.0, "sync_s": 0.0, "reused": 1.0}]
    d.joinpath("steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew'
                                         + "\n" + "".join(json.dumps(r) + "\n" for r in resumed))
    log = [{"step": 2, "loss": 0.1, "kl": 0.002, "entropy": 1.25, "sampling/sampling_logp_difference/mean": 3e-6},
           {"step": 3, "loss": 0.0, "kl": None, "entropy": None},  # a step whose groups were all dropped
           {"step": 4, "loss": 0.1, "kl": 0.004, "entropy": 1.5, "sampling/sampling_logp_difference/mean": 4e-6}]
    d.joinpath("train_log.jsonl").write_text("".join(json.dumps(h) + "\n" for h in log) + '{"step": 5, "lo')
    return f"stages/train-{k:016x}"


def _recorded_run(tmp_path: Path, mcts: bool, cold_start: bool = False, online: bool = False):
    """A run as the pipeline records it: a parent run, a child per round with its stage metrics,
    its version and decision, the label stage's rows in the store, the run's record (`cold_start`:
    round 1 the cold start, as the pipeline tags it)."""
    from ratchet.flows.config import load_config
    from ratchet.flows.runs import RunContext, RunRecord, write_record
    from ratchet.flows.tracking import Tracker

    cfg = load_config(ROOT / "flows" / "configs" / "default.yaml", [f"workdir={tmp_path}"])
    t = Tracker(cfg.tracking, tmp_path, cfg.name)
    t.client.create_registered_model(t.model_name)
    parent = t.start_parent("demo-1", {}, {"ratchet.run": "demo-1"})
    accuracy = [0.42, 0.8, 0.78, 0.96]
    for k, acc in enumerate(accuracy):
        child = t.child(parent, k, {"ratchet.cold_start": "true"} if cold_start and k == 1 else {})
        t.client.create_model_version(t.model_name, source=str(tmp_path), run_id=child)
        metrics = {"evaluate.accuracy": acc, "evaluate.wall_s": 25.0, "evaluate.tokens_per_s": 200.0 - k}
        ev = tmp_path / "stages" / f"evaluate-{k:016x}"
        ev.mkdir(parents=True)
        answers = [{"prompt_id": f"e{i}", "prompt": f"What is {i} + 2?", "index": 0, "n_tokens": 3,
                    "text": ANSWERS[k][i], "reward": float(ANSWERS[k][i] == str(i + 2)),
                    "correct": ANSWERS[k][i] == str(i + 2), "extracted": ANSWERS[k][i][:1].strip() or None}
                   for i in range(5)]
        ev.joinpath("eval.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
        t.client.set_tag(child, "ratchet.stage.evaluate", f"stages/evaluate-{k:016x}")
        if k:
            label = tmp_path / "stages" / f"label-{k:016x}"  # a stage directory's shape: <stage>-<key>
            label.mkdir(parents=True)
            rewards = [1.0] * (300 * k) + [0.0] * (1200 - 300 * k)
            label.joinpath("labels.jsonl").write_text("".join(json.dumps({"reward": r}) + "\n" for r in rewards))
            t.client.set_tag(child, "ratchet.stage.label", f"stages/label-{k:016x}")
            metrics.update({"sample.wall_s": 100.0, "sample.tokens_per_s": 400.0, "label.wall_s": 1.0,
                            "filter.accepted": 150.0 + 50 * k, "train.wall_s": 130.0, "train.tokens_per_s": 190.0,
                            "label.reward_mean": sum(rewards) / len(rewards), "label.verifier_auc": 0.5 + k / 10})
            if mcts:
                metrics.update({"label.mcts_tokens_per_prompt": 400.0 + k, "label.mcts_solved_frac": 0.3 * k})
            if online:
                t.client.set_tag(child, "ratchet.stage.train", _online_train(tmp_path, k))
        t.log_metrics(child, metrics)
        t.log_once(child, "ratchet.model_version", str(k + 1), {"accuracy": acc, "promoted": float(k != 2)},
                   prefix="round.")
    t.client.set_registered_model_alias(t.model_name, "champion", "4")
    ctx = RunContext(run_name="demo-1", workdir=str(tmp_path), parent_run_id=parent, code_version="c",
                     config_hash="h")
    (tmp_path / "runs").mkdir()
    write_record(tmp_path, RunRecord(ctx=ctx, config={"rounds": 3}, state="finished"))
    return t, parent


def test_a_report_draws_every_figure_it_has_data_for_into_one_page(tmp_path):
    from ratchet.flows.report import build, markdown

    t, parent = _recorded_run(tmp_path, mcts=False, cold_start=True)
    report = build(tmp_path, t)
    out = tmp_path / "reports" / "demo-1"
    assert [p.name for p in report.figures.values()] == [
        "accuracy.png", "rewards.png", "training_data.png", "agreement.png", "wall_time.png", "throughput.png"]
    for p in report.figures.values():
        assert p.parent == out and p.read_bytes().startswith(PNG) and p.stat().st_size > 5000
    page = report.html.read_text()
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert [base64.b64decode(x) for x in embedded] == [p.read_bytes() for p in report.figures.values()]
    assert "src=\"http" not in page and "<script" not in page  # self-contained: opens alone, offline
    assert "<td>3</td><td>v4 (champion)</td><td>96.0%</td><td>yes</td><td>300</td>" in page
    assert "<td>2</td><td>v3</td><td>78.0%</td><td>no</td>" in page
    assert "<td>1 (cold start)</td><td>v2</td><td>80.0%</td>" in page and "<th>round 1 (cold start)<br>" in page
    assert {a.path for a in t.client.list_artifacts(parent, "report")} == \
        {f"report/{p.name}" for p in [*report.figures.values(), report.html]}
    md = markdown(report)
    assert "| 3 | 4 | 96.0% | yes | 300 | 256 |" in md and str(report.html) in md
    assert "| 1 (cold start) | 2 | 80.0% | yes |" in md and "| 2 | 3 | 78.0% | no |" in md


def test_a_report_drawn_from_the_same_data_is_read_not_drawn_again(tmp_path, monkeypatch):
    """`ratchet report` on a finished run: the figures and page kept beside their digest are the
    report; nothing is drawn or logged again until the data under it changes. Read through the
    SQLite reader (no MLflow), it is the same report."""
    from ratchet.flows import report as rep
    from ratchet.flows.tracking_read import reader

    t, parent = _recorded_run(tmp_path, mcts=False, cold_start=True)
    first = rep.build(tmp_path, t)
    drawn = {p: p.stat().st_mtime_ns for p in [*first.figures.values(), first.html]}
    logged = len(t.client.list_artifacts(parent, "report"))

    def refuse(*a, **k):
        raise AssertionError("drawn again")

    monkeypatch.setattr(rep, "draw", refuse)
    read = reader(t.uri, t.model_name)
    assert rep.gather(tmp_path, read) == rep.gather(tmp_path, t)  # what it reads is MLflow's answer
    again = rep.build(tmp_path, read, log_with=lambda: (_ for _ in ()).throw(AssertionError("logged again")))
    assert again.figures == first.figures and again.html == first.html
    assert {p: p.stat().st_mtime_ns for p in drawn} == drawn and len(t.client.list_artifacts(parent, "report")) == logged
    monkeypatch.undo()
    t.client.log_metric(next(c.info.run_id for c in t.client.search_runs(
        [t.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")), "round.accuracy", 0.5)  # the data moves
    redrawn = rep.build(tmp_path, read, log=False)
    assert redrawn.html.stat().st_mtime_ns != drawn[first.html]


def test_online_rounds_show_their_steps_as_a_figure_and_a_table(tmp_path):
    """Item 6 of online RL: per step, reward mean, groups kept, KL, entropy, the log-probability gap,
    generated tok/s and the step's seconds; the row of a step a killed attempt cut short is the
    resumed attempt's, and a step read from stored rollouts says so."""
    from ratchet.flows.report import build

    t, _ = _recorded_run(tmp_path, mcts=False, online=True)
    report = build(tmp_path, t, log=False)
    assert report.figures["Online RL by step"].name == "online_steps.png"
    assert report.figures["Online RL by step"].read_bytes().startswith(PNG)
    assert [x["step"] for x in report.rounds[1].steps] == [1, 2, 3, 4] and report.rounds[0].steps == []
    page = report.html.read_text()
    assert "<h2>Online RL by step</h2>" in page
    assert ("<td>1</td><td>2</td><td>0.500</td><td>75%</td><td>0.002</td><td>1.25</td><td>3e-06</td>"
            "<td>160</td><td>8.0</td>") in page
    assert "<td>3</td><td>3</td><td>0.625</td><td>100%</td><td></td><td></td><td></td><td>140</td>" in page
    assert "<td>3</td><td>4</td><td>0.750</td><td>100%</td><td>0.004</td><td>1.5</td><td>4e-06</td>" \
           "<td>stored</td><td>2.0</td>" in page
    assert "another policy" not in page  # a gap of 3e-6: engine and trainer agreed
    # a round whose engine and trainer disagreed (a bf16 trainer, 0.042 nats a token): the report says so
    [one] = [c.info.run_id for c in t.client.search_runs([t.experiment_id], "tags.`ratchet.round` = '1'")]
    for key, value in (("train.logp_gap_mean", 0.042), ("train.logp_gap_peak", 0.94), ("train.bf16", 1.0)):
        t.client.log_metric(one, key, value)
    page = build(tmp_path, t, log=False).html.read_text()
    assert ("<p class=\"other\">Round 1: warning: the engine sampled from another policy than the trainer scored, "
            "log-prob gap 0.042 a token, up to 0.94 in a step (the trainer in bf16: float32 for both closes it, "
            "sampler.dtype and train.precision).</p>") in page


def test_tree_search_runs_get_their_figure_and_the_cli_names_the_files(tmp_path):
    _recorded_run(tmp_path, mcts=True)
    r = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "report", "flows/configs/default.yaml", "demo-1",
                        f"workdir={tmp_path}", "--no-log"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "demo-1: 4 round(s), 7 figure(s)" in r.stdout and "mcts.png  Tree search per round" in r.stdout
    assert r.stdout.startswith(f"reading run demo-1 (named by --run) · workdir {tmp_path}")  # `report CONFIG RUN`
    assert (tmp_path / "reports" / "demo-1" / "mcts.png").read_bytes().startswith(PNG)
    bad = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "report", "--workdir", str(tmp_path),
                          "--run", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "no pipeline run 'nope'" in bad.stderr and "demo-1" in bad.stderr


def test_the_report_follows_a_few_held_out_prompts_through_every_round(tmp_path):
    """The same held-out prompts, each round's answer beside the last with its verdict, the model's
    text escaped; each round's column links its files, and the markdown names them."""
    from ratchet.flows.report import build, markdown

    t, _ = _recorded_run(tmp_path, mcts=False)
    report = build(tmp_path, t, log=False)
    page = report.html.read_text()
    table = page[page.index('<table class="answers">'):]
    rows = re.findall(r"<tr><td class=\"prompt\">(.*?)</td>(.*?)</tr>", table)
    assert [p for p, _ in rows] == ["What is 0 + 2?", "What is 1 + 2?", "What is 2 + 2?", "What is 3 + 2?"]
    cells = [re.findall(r"<pre>(.*?)</pre><span class=\"\w+\">(.*?)</span>", r) for _, r in rows]
    assert cells[0] == [("9", "wrong: read &#x27;9&#x27;"), ("2", "right"), ("2", "right"), ("2", "right")]
    assert cells[1][0] == ("", "wrong: no answer read")
    assert cells[2][0] == ("&lt;script&gt;alert(1)&lt;/script&gt;", "wrong: read &#x27;&lt;&#x27;")
    assert "<script" not in page
    evals = sorted((tmp_path / "stages").glob("evaluate-*"))
    assert f'<a href="{(evals[0] / "eval.jsonl").as_uri()}">answers</a>' in table
    assert f'<a href="{(tmp_path / "stages" / f"label-{1:016x}" / "labels.jsonl").as_uri()}">labels</a>' in table
    md = markdown(report)
    assert f"- round 0: answers `{evals[0] / 'eval.jsonl'}`" in md
    assert f"- round 1: labels `{tmp_path / 'stages' / f'label-{1:016x}' / 'labels.jsonl'}`, answers" in md
