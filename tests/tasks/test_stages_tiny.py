"""Each stage on the tiny random model (HF backend, in process): the exact files it leaves."""

import json

import pytest

from ratchet.data.prompts import AdditionSource
from ratchet.data.records import SFTRow, write_jsonl
from ratchet.data.store import ArtifactStore
from ratchet.models.sampler import SamplerConfig
from ratchet.models.train_kinds import RFTTrainConfig
from ratchet.tasks import evaluate, filter as filt, label, prepare, sample, train
from ratchet.tasks.evaluate import EvaluateConfig
from ratchet.tasks.filter_kinds.rft import RFTFilter
from ratchet.tasks.label import VerifierLabel
from ratchet.tasks.sample import SampleConfig
from ratchet.tasks.runner.stage import body_code

pytestmark = pytest.mark.integration
HF = SamplerConfig(backend="hf", dtype="float32")


def files(store, m):
    d = store.dir_of(m)
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


def hand_made_train_set(store, rows, parents):
    """A finished filter stage holding `rows` as its train set, written by hand: a stand-in for the
    filter where a random model's labels would accept or pair nothing reliably."""
    key = "f" * 64
    write_jsonl(store.prepare("filter", key) / "train_set.jsonl", rows)
    return store.finish(stage="filter", round=1, key=key, code_version="test", config={}, parents=parents,
                        outputs={"train_set.jsonl": len(rows)})


def test_stages_write_exactly_their_files(tiny_model, tmp_path):
    store = ArtifactStore(tmp_path)
    src = AdditionSource(a_max=4, b_max=3, eval_size=4)
    pm, _ = prepare.prompts(store, src, seed=0, sources={})
    assert files(store, pm) == ["eval.jsonl", "manifest.json", "train.jsonl"]
    assert pm.metrics == {"train_prompts": 8.0, "eval_prompts": 4.0, "train_with_answer": 8.0}

    base, _ = prepare.base_model(store, "tiny", tiny_model)
    assert [f for f in files(store, base) if f != "manifest.json"] == sorted(
        f"model/{p.name}" for p in tiny_model.iterdir() if p.is_file())

    s, reused = sample.sample(store, base, pm, SampleConfig(n=3, max_tokens=5, shard_size=3), HF, seed=1, round=1,
                              isolate=False)
    assert not reused and files(store, s) == ["manifest.json", "samples.jsonl"]  # shards folded in and removed
    assert s.outputs["samples.jsonl"].rows == 24 and s.metrics["shards"] == 3
    assert [p.stage for p in s.parents] == ["base", "prompts"]

    lab, _ = label.label(store, s, VerifierLabel(), src, round=1)
    assert files(store, lab) == ["labels.jsonl", "manifest.json"] and lab.outputs["labels.jsonl"].rows == 24

    # a random 2-layer model answers nothing right: a hand-made accepted set stands in for the filter
    fm = hand_made_train_set(store, [SFTRow(prompt_id=f"p{i}", prompt=f"What is {i} + 1?", completion=f"{i + 1}",
                                            reward=1.0) for i in range(8)], [lab])
    tm, _ = train.train(store, base, fm, RFTTrainConfig(epochs=1, batch_size=4, checkpoint_steps=1), seed=1,
                        round=1, isolate=False)
    got = files(store, tm)
    assert "model/model.safetensors" in got and "adapter/adapter_model.safetensors" in got
    assert "train_log.jsonl" in got and not any(f.startswith("checkpoints/") for f in got)
    # beside the outputs, not among them: the MLflow model a registered version loads (it records
    # times and absolute paths, so it is no function of the inputs and is not digested)
    mlflow_model = {f for f in got if f.startswith("mlflow-model/")}
    assert "mlflow-model/MLmodel" in mlflow_model and "mlflow-model/peft/adapter_model.safetensors" in mlflow_model
    assert set(got) - {"manifest.json"} - mlflow_model == set(tm.outputs)

    ev, _ = evaluate.evaluate(store, tm, pm, EvaluateConfig(max_tokens=5), HF, src, seed=0, round=1,
                              isolate=False)
    assert files(store, ev) == ["eval.jsonl", "manifest.json"] and ev.metrics["eval_prompts"] == 4.0
    from ratchet.data.checkers import check
    from ratchet.data.records import LabeledCompletion, read_jsonl

    answered = read_jsonl(store.path(ev, "eval.jsonl"), LabeledCompletion)
    right = [check(src.check, r.text, r.answer).correct for r in answered]
    assert ev.metrics["accuracy"] == sum(right) / len(right)  # the number is the answers it scored


def test_empty_accepted_set_stops_before_training(tiny_model, tmp_path):
    store = ArtifactStore(tmp_path)
    src = AdditionSource(a_max=4, b_max=3, eval_size=4)
    pm, _ = prepare.prompts(store, src, seed=0, sources={})
    base, _ = prepare.base_model(store, "tiny", tiny_model)
    s, _ = sample.sample(store, base, pm, SampleConfig(n=2, max_tokens=4), HF, seed=1, round=1, isolate=False)
    lab, _ = label.label(store, s, VerifierLabel(), src, round=1)
    from ratchet.data.errors import EmptyStageError

    with pytest.raises(EmptyStageError, match="filter.min_rows"):
        filt.filter_rows(store, lab, RFTFilter(min_rows=1), seed=0, round=1)


def test_self_reward_chain_judge_pairs_dpo(tiny_model, tmp_path):
    """sample -> judge (the policy scores itself, P(yes) mode) -> pairs -> DPO, on the tiny model."""
    from ratchet.data.records import LabeledCompletion, PairRow, read_jsonl
    from ratchet.data.store import stage_key
    from ratchet.models.train_kinds import DPOTrainConfig
    from ratchet.tasks.filter_kinds.pairs import PairFilter
    from ratchet.tasks.label_kinds.judge import JudgeLabel

    store = ArtifactStore(tmp_path / "a")
    src = AdditionSource(a_max=4, b_max=3, eval_size=4)
    pm, _ = prepare.prompts(store, src, seed=0, sources={})
    base, _ = prepare.base_model(store, "tiny", tiny_model)
    s, _ = sample.sample(store, base, pm, SampleConfig(n=4, max_tokens=6), HF, seed=1, round=1, isolate=False)
    # a random model spreads its next token over the whole vocabulary: read all of it (HF can)
    judge = JudgeLabel(mode="p_yes", shard_size=8, top_logprobs=50_000)
    lab, _ = label.label(store, s, judge, src, round=1, policy=base, sampler=HF, seed=1,
                         isolate=False)
    assert files(store, lab) == ["labels.jsonl", "manifest.json"]  # judge shards folded in and removed
    assert [p.stage for p in lab.parents] == ["sample", "base"]
    rows = read_jsonl(store.path(lab, "labels.jsonl"), LabeledCompletion)
    assert len(rows) == 32 and all(r.correct is not None and r.votes == [r.reward] for r in rows)
    for r in rows[:3]:  # each reward is P(yes) / (P(yes) + P(no)) of the judge prompt, from the model's logits
        assert r.reward == pytest.approx(_p_yes_by_hand(tiny_model, r.prompt, r.text), abs=1e-4)
    assert lab.metrics["judge_scored_frac"] == 1.0 and lab.metrics["unscored"] == 0

    # resume: a second store holding a finished first shard judges only the rest
    other = ArtifactStore(tmp_path / "b")
    pm2, _ = prepare.prompts(other, src, seed=0, sources={})
    base2, _ = prepare.base_model(other, "tiny", tiny_model)
    s2, _ = sample.sample(other, base2, pm2, SampleConfig(n=4, max_tokens=6), HF, seed=1, round=1, isolate=False)
    job = label.LabelJob(label=judge, data=src, sampler=HF, seed=1)
    d = other.prepare("label", stage_key("label", body_code(label.label_body, config=job), job.model_dump(mode="json"),
                                         [s2, base2]), keep_partial=True)
    (d / "shards").mkdir()
    write_jsonl(d / "shards" / "00000.jsonl", [r.model_copy(update={"reward": 0.123}) for r in rows[:8]])
    lab2, _ = label.label(other, s2, judge, src, round=1, policy=base2, sampler=HF, seed=1,
                          isolate=False)
    rows2 = read_jsonl(other.path(lab2, "labels.jsonl"), LabeledCompletion)
    assert [r.reward for r in rows2[:8]] == [0.123] * 8 and lab2.metrics["judge_shards_reused"] == 1
    assert [r.reward for r in rows2[8:]] == pytest.approx([r.reward for r in rows[8:]], abs=1e-6)

    pairs, _ = filt.filter_rows(store, lab, PairFilter(margin=0.0, min_pairs=1), seed=1, round=1)
    prs = read_jsonl(store.path(pairs, "train_set.jsonl"), PairRow)
    assert prs and all(p.chosen_reward > p.rejected_reward for p in prs) and pairs.info == {"rows": "pairs"}

    dpo = DPOTrainConfig(epochs=1, batch_size=4, logging_steps=1, learning_rate=1e-2)
    tm, _ = train.train(store, base, pairs, dpo, seed=1, round=1, isolate=False)
    assert "model/model.safetensors" in files(store, tm) and tm.metrics["rows"] == len(prs)
    assert tm.info["objective"] == "dpo" and tm.info["reference"] == base.dir  # round k's reference: its start

    # the reference is refreshed each round: round 2 starts from round 1's weights, and at its first step
    # the policy and its reference score the pairs alike (a log-ratio of 0), where round 1's weights had
    # moved from round 1's reference, the base model
    tm2, _ = train.train(store, tm, pairs, dpo, seed=1, round=2, isolate=False)
    assert tm2.info["reference"] == tm.dir
    log1, log2 = ([json.loads(x) for x in store.path(m, "train_log.jsonl").read_text().splitlines()] for m in (tm, tm2))
    assert len(log1) > 1 and abs(log1[-1]["rewards/chosen"]) + abs(log1[-1]["rewards/rejected"]) > 0.05
    assert abs(log2[0]["logps/chosen"] - log1[0]["logps/chosen"]) > 0.1  # round 2 started elsewhere
    for log in (log1, log2):
        assert log[0]["rewards/chosen"] == pytest.approx(0, abs=1e-5)
        assert log[0]["rewards/rejected"] == pytest.approx(0, abs=1e-5)


def test_mcts_chain_trees_pairs_dpo_and_shard_resume(tiny_model, tmp_path):
    """prompts -> MCTS label (sharded, resumable) -> step pairs / best trajectories -> DPO."""
    import json

    from ratchet.data.records import LabeledCompletion, PairRow, read_jsonl
    from ratchet.data.store import stage_key
    from ratchet.models.train_kinds import DPOTrainConfig
    from ratchet.tasks.filter_kinds.step_pairs import StepPairFilter
    from ratchet.tasks.label_kinds.mcts import MctsLabel

    src = AdditionSource(a_max=4, b_max=3, eval_size=4)
    cfg = MctsLabel(simulations=2, k=3, max_depth=2, step_max_tokens=3, rollout_tokens=4, shard_size=4,
                    value="judge", judge={"mode": "p_yes", "top_logprobs": 50_000})

    def run(root, seed_shard=None):
        store = ArtifactStore(root)
        pm, _ = prepare.prompts(store, src, seed=0, sources={})
        base, _ = prepare.base_model(store, "tiny", tiny_model)
        if seed_shard is not None:  # a killed earlier attempt left its first shard
            job = label.LabelJob(label=cfg, data=src, sampler=HF, seed=1)
            d = store.prepare("label", stage_key("label", body_code(label.label_body, config=job),
                                                 job.model_dump(mode="json"), [pm, base]), keep_partial=True)
            (d / "shards").mkdir()
            (d / "shards" / "00000.jsonl").write_text(seed_shard)
        lab, _ = label.label(store, pm, cfg, src, round=1, policy=base, sampler=HF,
                             seed=1, isolate=False)
        return store, pm, base, lab

    store, pm, base, lab = run(tmp_path / "a")
    assert files(store, lab) == ["labels.jsonl", "manifest.json", "trees.jsonl"]
    assert [p.stage for p in lab.parents] == ["prompts", "base"]
    trees = [json.loads(x) for x in store.path(lab, "trees.jsonl").read_text().splitlines()]
    assert len(trees) == 8 and all(t["nodes"][0]["n"] >= cfg.simulations for t in trees)
    rows = read_jsonl(store.path(lab, "labels.jsonl"), LabeledCompletion)
    assert all(r.correct is not None for r in rows)
    for r in rows[:2]:  # a trajectory's value is the judge's P(yes) for its text
        assert r.reward == pytest.approx(_p_yes_by_hand(tiny_model, r.prompt, r.text), abs=1e-4)
    for pid in {r.prompt_id for r in rows}:  # best first within each prompt
        rewards = [r.reward for r in rows if r.prompt_id == pid]
        assert rewards == sorted(rewards, reverse=True)
    m = lab.metrics
    assert m["mcts_prompts"] == 8 and m["mcts_gen_tokens"] > 0 and m["mcts_shards_reused"] == 0
    solved = [any(n["correct"] for n in tr["nodes"]) for tr in trees]
    assert m["mcts_solved_frac"] == sum(solved) / len(solved) and m["labeled"] == len(rows)

    # resume: an unfinished stage holding shard 0 searches only shard 1, and shard 0 stays as it was
    first_shard = store.path(lab, "trees.jsonl").read_text().splitlines()[:4]
    marked = "".join(json.dumps({**json.loads(x), "prompt": json.loads(x)["prompt"] + " (kept)"}, sort_keys=True)
                     + "\n" for x in first_shard)
    other, *_, lab2 = run(tmp_path / "b", seed_shard=marked)
    trees2 = other.path(lab2, "trees.jsonl").read_text().splitlines()
    assert lab2.metrics["mcts_shards_reused"] == 1
    assert all(json.loads(x)["prompt"].endswith("(kept)") for x in trees2[:4])
    assert trees2[4:] == store.path(lab, "trees.jsonl").read_text().splitlines()[4:]  # seeded per shard

    pairs, _ = filt.filter_rows(store, lab, StepPairFilter(margin=0.0, min_pairs=1), seed=1, round=1)
    prs = read_jsonl(store.path(pairs, "train_set.jsonl"), PairRow)
    assert prs and all(p.chosen_reward > p.rejected_reward and p.chosen != p.rejected for p in prs)
    assert pairs.metrics["pairs"] == len(prs)
    best, _ = filt.filter_rows(store, lab, RFTFilter(min_reward=0.0, max_per_prompt=1, prefer="best", min_rows=1),
                               seed=1, round=1)
    sft = read_jsonl(store.path(best, "train_set.jsonl"), SFTRow)
    tops = {r.prompt_id: r for r in rows if r.index == 0}
    assert len(sft) == 8 and all(s.completion == tops[s.prompt_id].text for s in sft)

    tm, _ = train.train(store, base, pairs, DPOTrainConfig(epochs=1, batch_size=4), seed=1, round=1, isolate=False)
    assert tm.metrics["rows"] == len(prs) and tm.info["objective"] == "dpo"


def _p_yes_by_hand(model_dir, prompt: str, response: str) -> float:
    """P(yes) / (P(yes) + P(no)) over the whole vocabulary, from the model's own next-token logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ratchet.models.sampler import chat_token_ids
    from ratchet.tasks.label_kinds.judging import NO_WORDS, YES_WORDS, YES_NO, first_token_ids, judge_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([chat_token_ids(tok, [judge_prompt(YES_NO, prompt, response)])[0]])
    with torch.inference_mode():
        p = torch.softmax(model(input_ids=ids).logits[0, -1].float(), -1)
    yes, no = (sum(p[i].item() for i in first_token_ids(tok, w)) for w in (YES_WORDS, NO_WORDS))
    return yes / (yes + no)


def test_a_base_model_runs_every_stage_in_the_plain_format(tiny_base_model, tmp_path):
    """A model without a chat template: the base stage's copy reads the plain layout, and sampling,
    the policy judging itself, DPO, RFT and evaluation all run on it; the judge's prompt is the layout
    around the judge's text (recomputed here from the bare tokenizer), and each trained model keeps
    the layout for the next round."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ratchet.data.records import LabeledCompletion, PairRow, read_jsonl
    from ratchet.models.prompt_format import plain_template
    from ratchet.models.train_kinds import DPOTrainConfig
    from ratchet.tasks.filter_kinds.pairs import PairFilter
    from ratchet.tasks.label_kinds.judging import NO_WORDS, YES_NO, YES_WORDS, first_token_ids, judge_prompt
    from ratchet.tasks.label_kinds.judge import JudgeLabel

    plain = plain_template("Question: {prompt}\nAnswer:")
    store = ArtifactStore(tmp_path)
    src = AdditionSource(a_max=4, b_max=3, eval_size=4)
    pm, _ = prepare.prompts(store, src, seed=0, sources={})
    base, _ = prepare.base_model(store, "base", tiny_base_model, template=plain)
    s, _ = sample.sample(store, base, pm, SampleConfig(n=2, max_tokens=4), HF, seed=1, round=1, isolate=False)
    judge = JudgeLabel(mode="p_yes", shard_size=8, top_logprobs=50_000)
    lab, _ = label.label(store, s, judge, src, round=1, policy=base, sampler=HF, seed=1, isolate=False)
    rows = read_jsonl(store.path(lab, "labels.jsonl"), LabeledCompletion)
    tok = AutoTokenizer.from_pretrained(tiny_base_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_base_model, dtype=torch.float32).eval()
    for r in rows[:2]:
        text = "Question: " + judge_prompt(YES_NO, r.prompt, r.text) + "\nAnswer:"
        with torch.inference_mode():
            p = torch.softmax(model(input_ids=torch.tensor([tok.encode(text, add_special_tokens=False)])).logits[0, -1], -1)
        yes, no = (sum(p[i].item() for i in first_token_ids(tok, w)) for w in (YES_WORDS, NO_WORDS))
        assert r.reward == pytest.approx(yes / (yes + no), abs=1e-4)

    pairs, _ = filt.filter_rows(store, lab, PairFilter(margin=0.0, min_pairs=1), seed=1, round=1)
    assert read_jsonl(store.path(pairs, "train_set.jsonl"), PairRow)
    dpo, _ = train.train(store, base, pairs, DPOTrainConfig(epochs=1, batch_size=4), seed=1, round=1, isolate=False)
    fm = hand_made_train_set(store, [SFTRow(prompt_id=f"p{i}", prompt=f"What is {i} + 1?", completion=f" {i + 1}",
                                            reward=1.0) for i in range(4)], [lab])
    rft, _ = train.train(store, base, fm, RFTTrainConfig(epochs=1, batch_size=4), seed=1, round=1, isolate=False)
    for m in (dpo, rft):
        assert (prepare.model_dir(store, m) / "chat_template.jinja").read_text() == plain
    ev, _ = evaluate.evaluate(store, rft, pm, EvaluateConfig(max_tokens=4), HF, src, seed=0, round=1, isolate=False)
    assert ev.metrics["eval_prompts"] == 4.0


def test_a_reasoning_gym_task_is_labeled_and_evaluated_by_its_own_scorer(tiny_model, tmp_path):
    """Sample, label and evaluate a reasoning-gym task on the tiny model, the evaluation in a
    worker process: every reward and verdict is the dataset's own score_answer of the answer read
    from the text, recomputed here by hand."""
    from ratchet.data.records import LabeledCompletion, read_jsonl
    from ratchet.data.sources.reasoning_gym import ReasoningGymSource, extract_answer, open_dataset

    store = ArtifactStore(tmp_path)
    src = ReasoningGymSource(dataset="chain_sum", config={"min_terms": 2, "max_terms": 2, "max_digits": 1},
                             eval_size=4, train_size=6)
    pm, _ = prepare.prompts(store, src, seed=0, sources={})
    base, _ = prepare.base_model(store, "tiny", tiny_model)
    s, _ = sample.sample(store, base, pm, SampleConfig(n=2, max_tokens=5, shard_size=3), HF, seed=1, round=1,
                         isolate=False)
    lab, _ = label.label(store, s, VerifierLabel(shard_size=5), src, round=1)
    ev, _ = evaluate.evaluate(store, base, pm, EvaluateConfig(max_tokens=5), HF, src, seed=0, round=0, isolate=True)
    ds = open_dataset("chain_sum", src.config, 0, src.check.size)
    for stage, n in ((lab, 12), (ev, 4)):
        rows = read_jsonl(store.path(stage, "labels.jsonl" if stage is lab else "eval.jsonl"), LabeledCompletion)
        assert len(rows) == n
        for r in rows:
            entry = ds[int(r.prompt_id.removeprefix("rg-"))]
            assert entry["answer"] == r.answer and r.prompt.startswith(entry["question"])
            want = ds.score_answer(answer=extract_answer(r.text, r.answer, "auto"), entry=entry)
            assert r.correct == (want >= 1.0) and (stage is ev or r.reward == want)
    assert ev.metrics["accuracy"] == sum(r.correct for r in rows) / 4


def test_training_writes_the_same_bytes_in_a_forked_worker_and_a_fresh_one(tiny_model, tmp_path, monkeypatch):
    """Guards `executor.warm_workers`: DPO training in a worker forked from the run's fork server
    (data/procs/forkserver.py, every run's default) writes the bytes a fresh interpreter's worker
    writes (`warm_workers=false`), so either reuses the other's stages (the executor is in no key).
    The whole runs the fault and Ray tests compare fork their workers; the Ray round's sampling,
    labels and evaluations run in its nodes' fresh interpreters and match them, its training does
    not. Slow: a fresh worker's imports (torch, transformers, TRL, PEFT)."""
    from ratchet.data.procs import forkserver, spawn
    from ratchet.data.records import PairRow
    from ratchet.flows.inputs import run_preload
    from ratchet.models.train_kinds import DPOTrainConfig

    def trained(root):
        store = ArtifactStore(root)
        base, _ = prepare.base_model(store, "tiny", tiny_model)
        fm = hand_made_train_set(store, [
            PairRow(prompt_id=f"p{i}", prompt=f"What is {i} + 1?", chosen=f"{i + 1}", rejected=f"{i + 2}",
                    chosen_reward=1.0, rejected_reward=0.0, chosen_tokens=1, rejected_tokens=1) for i in range(6)],
            [base])
        t, _ = train.train(store, base, fm, DPOTrainConfig(epochs=1, batch_size=4, checkpoint_steps=1), seed=1,
                           round=1)
        return t.dir, {k: f.sha256 for k, f in t.outputs.items()}

    fresh_starts = []  # the workers started as new interpreters
    started = spawn.run_logged
    monkeypatch.setattr(spawn, "run_logged", lambda *a, **k: fresh_starts.append(a[0]) or started(*a, **k))
    assert forkserver.current() is None
    fresh = trained(tmp_path / "fresh")  # no fork server: the worker is a new interpreter
    assert len(fresh_starts) == 1
    with forkserver.for_run(True, tmp_path / "forkserver.log", run_preload()) as server:
        forked = trained(tmp_path / "forked")
    assert len(fresh_starts) == 1 and server.n == 1  # forked from the server
    assert forked == fresh and {"model/model.safetensors", "adapter/adapter_model.safetensors"} <= fresh[1].keys()
