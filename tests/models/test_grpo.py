"""train.kind=grpo at the trainer: advantages as the trainer computes them, every loss type, the
engine's weights after a sync, the log-probability gap, a reward that rises, and a killed stage that
resumes to the same bytes. The rollout here is Ratchet's single rollout on a real engine; the reward
is a function of the sampled ids (a real check needs a model that can add)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratchet.models.train_kinds.grpo import GRPOTrainConfig, advantages
from tests.procs import killed_at

LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]


def test_advantages_of_one_group_by_hand():
    r = [1.0, 0.0, 0.0, 1.0]  # mean 0.5; unbiased std sqrt(1/3) = 0.57735
    z = 0.5 / (0.57735027 + 1e-4)
    assert advantages(r, 4, "group") == pytest.approx([z, -z, -z, z], abs=1e-6)  # GRPO
    assert advantages(r, 4, "none") == pytest.approx([0.5, -0.5, -0.5, 0.5])  # Dr. GRPO: no std
    # RLOO: the reward less the mean of the other three: 1 - 1/3, 0 - 2/3
    assert advantages(r, 4, "none", leave_one_out=True) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert advantages([1.0, 1.0, 0.0, 0.0], 2, "group") == pytest.approx([0, 0, 0, 0])  # equal rewards teach nothing


def test_a_group_of_one_and_rloo_with_scaling_are_refused():
    assert "a group of one has no advantage" in GRPOTrainConfig().problems(1)[0]
    assert "set train.scale_rewards: none" in GRPOTrainConfig(leave_one_out=True).problems(4)[0]
    assert GRPOTrainConfig(leave_one_out=True, scale_rewards="none").problems(4) == []


# on the tiny model ------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory, request) -> Path:
    """A tiny random Llama vLLM's CPU attention takes (head size 64; the shared tiny model's 16 it
    does not), its logits spread enough (init range 0.3) for a few steps to move them."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = os.environ.get("RATCHET_TEST_TOKENIZER") or request.getfixturevalue("default_model")
    tok = AutoTokenizer.from_pretrained(source)
    out = tmp_path_factory.mktemp("wide-tiny")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.3,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def target_tokens(model_dir: Path, k: int = 500) -> set[int]:
    """The behaviour the tests reward: the model's k likeliest first tokens for one prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    return set(model(ids).logits[0, -1].topk(k).indices.tolist())


def online(model_dir: Path, backend: str, group: int = 4, max_tokens: int = 8, rewards: list[float] | None = None):
    """Online pieces as the train stage builds them (tasks/train.py), with a reward of the ids: the
    share of a completion's tokens among `target_tokens`, or `rewards` in order where given."""
    from ratchet.data.records import Prompt
    from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler
    from ratchet.models.train_kinds.grpo import Online
    from ratchet.tasks.label_kinds import labeled_row
    from ratchet.tasks.rollouts.single import SingleRollout

    target = target_tokens(model_dir)
    params = SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, logprobs=True)

    def roll(engine, batch, seed):
        t = time.time()
        rows, _ = SingleRollout().roll(engine, [Prompt.model_validate(p) for p in batch], params, seed)
        gen_s = time.time() - t
        given = iter(rewards or [])
        return [labeled_row(r, reward=next(given) if rewards else
                            sum(t in target for t in r.segments[0].token_ids) / len(r.segments[0].token_ids))
                for r in rows], {"gen_s": gen_s}

    cfg = SamplerConfig(backend=backend, dtype="float32", kv_cache_gb=1)
    return Online(open_engine=lambda p: open_sampler(p, cfg, seed=0), roll=roll, group=group, max_completion=max_tokens)


PROMPTS = [{"id": f"p{i}", "prompt": f"What is {i} + 2?", "answer": str(i + 2), "task": "addition"} for i in range(8)]


def run(model_dir: Path, out: Path, backend: str = "hf", **cfg) -> dict:
    from ratchet.models.train_kinds.grpo import train_grpo

    settings = dict(steps=6, batch_size=2, learning_rate=1e-2, adapter="full", lr_scheduler="constant",
                    checkpoint_steps=2, logging_steps=1, precision="fp32") | cfg  # float32, as the engine samples
    return train_grpo(model_dir, PROMPTS, GRPOTrainConfig(**settings), out, 0, online(model_dir, backend))


def history(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# each loss type with an advantage rule: GRPO's, Dr. GRPO's (no std) and RLOO's among them
RULES = {"grpo": ("group", False), "dr_grpo": ("none", False), "dapo": ("none", True), "bnpo": ("batch", False)}


@pytest.mark.integration
@pytest.mark.parametrize("loss", LOSS_TYPES)
def test_each_loss_type_takes_a_step_on_the_advantages_of_the_rule(wide_tiny, tmp_path, loss):
    """One LoRA step of each loss type TRL 1.16 accepts; the advantages the trainer logged are the
    rule's (models/train_kinds/grpo.py `advantages`, checked by hand above)."""
    import math

    from ratchet.models.train_kinds.grpo import grpo_trainer

    rewards = [1.0, 0.0, 0.0, 1.0, 0.25, 0.5, 0.75, 1.0]  # two groups of four
    scale, loo = RULES.get(loss, ("group", False))
    cfg = GRPOTrainConfig(steps=1, batch_size=2, loss_type=loss, scale_rewards=scale, leave_one_out=loo,
                          logging_steps=1)
    trainer, *_ = grpo_trainer(wide_tiny, PROMPTS, cfg, tmp_path, 0, online(wide_tiny, "hf", rewards=rewards))
    trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(trainer.state.log_history[0]["loss"])
    assert list(trainer._logs["advantages"]) == pytest.approx(advantages(rewards, 4, scale, loo), abs=1e-5)


def in_child(fn: str, *args) -> object:
    """tests.models.test_grpo.FN(*ARGS) in a fresh interpreter, its JSON result back. An in-process
    vLLM engine sets OMP_NUM_THREADS and binds its threads to cores in the process that opens it,
    which a test worker would carry into the tests after it (torchrun's processes among them)."""
    script = (f"import sys, json; sys.path.insert(0, {os.getcwd()!r}); from tests.models import test_grpo as t; "
              f"print('RESULT ' + json.dumps(t.{fn}(*json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", script, json.dumps([str(a) for a in args])], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])


def vllm_rise(model: str, out: str) -> dict:
    """The two vLLM checks in one child: the engine after a sync, then ten steps."""
    synced = synced_engine(model)
    m = run(Path(model), Path(out), backend="vllm", steps=10, learning_rate=2e-2)
    return {"synced": synced, "metrics": m, "history": history(Path(out))}


@pytest.mark.integration
def test_on_vllm_the_engine_holds_the_policy_the_reward_rises_and_the_gap_stays_small(wide_tiny, tmp_path):
    """After a sync from memory the engine holds the policy's weights (`synced_engine`). Then ten
    steps on vLLM, weights synced before each generation after the first: the reward of the target
    rises at least 2x from steps 1-3 to steps 8-10 (measured at lr 2e-2: 0.09, 0.09, 0.20, 0.66, then
    1.0 from step 5, where every group is equal and dropped), and in float32 the engine's
    log-probabilities stay within 1e-4 of the trainer's (measured: max 7e-6 to 3e-5 a step). A sync
    that missed a layer would let the gap grow with each step.

    Guards online RL on vLLM: the engine samples from the policy being trained, and it learns. Slow: ten GRPO
    steps, each syncing weights into the engine."""
    got = in_child("vllm_rise", wide_tiny, tmp_path)
    m, h = got["metrics"], got["history"]
    assert got["synced"] is True
    first, last = sum(x["reward"] for x in h[:3]) / 3, sum(x["reward"] for x in h[-3:]) / 3
    assert last >= 2 * first, [x["reward"] for x in h]
    assert m["syncs"] == 9 and m["logp_gap_max"] < 1e-4, m
    assert max(x["sampling/sampling_logp_difference/max"] for x in h) < 1e-4


def synced_engine(model: str) -> bool:
    """After a sync from memory the engine holds the policy's weights: those it keeps as they are
    (embeddings, norms) equal them, and its sampled tokens' log-probabilities, which every layer
    makes, are the policy's (vLLM's CPU engine fuses q/k/v and gate/up and keeps only a packed copy
    of a linear layer's weight for its kernels)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ratchet.models.sampler import SamplerConfig, SamplingParams, open_sampler
    from ratchet.models.train_kinds.grpo import merged_weights

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    engine = open_sampler(Path(model), SamplerConfig(dtype="float32", kv_cache_gb=1), seed=0)
    with merged_weights(policy) as weights:
        engine.load_state(weights)
    got = engine.llm.apply_model(lambda m: {n: p.detach().clone() for n, p in m.named_parameters()})[0]
    sd = policy.state_dict()
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    compared = 0
    for name, t in got.items():
        if not t.numel():  # a linear layer's weight handed to its packed copy (the log-probabilities below see it)
            continue
        parts = next(([name.replace(f, p) for p in ps] for f, ps in fused.items() if f in name), [name])
        torch.testing.assert_close(t, torch.cat([sd[p] for p in parts]), msg=name)
        compared += 1
    assert compared >= 5  # the embeddings and every norm
    ids = [[1, 2, 3, 4]]
    g = engine.generate_ids(ids, SamplingParams(n=1, temperature=1.0, max_tokens=4, logprobs=True), 0)[0][0]
    with torch.no_grad():
        logits = policy(torch.tensor([ids[0] + list(g.token_ids)])).logits[0, len(ids[0]) - 1: -1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-4), (g.logprobs, want)
    engine.close()
    return True


# the kill test's settings: the shipped path's LoRA, bf16 and linear schedule (a LoRA policy is merged
# for the engine every step, which is where a resume once parted from the unbroken run)
KILLED = dict(micro_batch=4, adapter="lora", precision="bf16", lr_scheduler="linear")


def _train_to(model_dir: str, out: str) -> None:
    """A child process's run, for the kill test."""
    run(Path(model_dir), Path(out), **KILLED)


def test_merging_a_lora_policy_for_the_engine_leaves_its_base_weights_bit_for_bit(wide_tiny):
    """The policy's weights handed to the engine each step are its base plus its adapter's delta,
    made as new tensors: the base the trainer goes on training over is not written. (PEFT's merge
    and unmerge in place moved it by rounding each step, and a run resumed from a checkpoint, its
    base fresh from disk, then took other steps from the same rollouts: issue 87.)"""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ratchet.models.train_kinds.grpo import merged_weights

    model = AutoModelForCausalLM.from_pretrained(wide_tiny, dtype=torch.bfloat16)
    policy = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # a trained adapter: a delta that rounds in bf16
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    for _ in range(3):  # three steps' syncs
        with merged_weights(policy) as weights:
            merged = dict(weights)
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    name = next(k for k in merged if k.endswith("q_proj.weight"))
    base = before[f"base_model.model.{name.replace('q_proj.weight', 'q_proj.base_layer.weight')}"]
    assert not torch.equal(merged[name], base)  # the adapter is in what the engine gets
    with torch.no_grad():  # and it is what PEFT's own merge gives
        policy.merge_adapter()
        inner = name.replace("q_proj.weight", "q_proj.base_layer.weight")
        assert torch.equal(merged[name], policy.state_dict()[f"base_model.model.{inner}"])
        policy.unmerge_adapter()


@pytest.mark.integration
def test_a_killed_stage_resumes_to_the_same_bytes(wide_tiny, tmp_path):
    """Killed after its step-4 checkpoint and the next step's rollouts, the stage resumes from the
    checkpoint, reads the rollouts of the steps it sampled before (so their completions are shuffled
    into micro-batches without the engine having run), and ends with the uninterrupted run's rollouts,
    log and weights, byte for byte.

    Guards the resume promise for online RL (GRPO): a killed stage resumes from its checkpoint and stored
    rollouts to the uninterrupted bytes. Slow: three GRPO trainings (whole, killed, resumed)."""
    full = run(wide_tiny, tmp_path / "full", **KILLED)  # two micro-batches a step
    assert full["resumed"] == 0.0 and full["steps"] == 6

    out = tmp_path / "killed"
    script = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); "
              f"from tests.models.test_grpo import _train_to; _train_to({str(wide_tiny)!r}, {str(out)!r})")
    killed_at(script, out / "rollouts" / "00004.json", seconds=600)  # after checkpoint-4, with step 5's rollouts
    assert not (out / "model").exists(), "the run finished before it could be killed"
    sampled = sorted(p.name for p in (out / "rollouts").iterdir())

    resumed = run(wide_tiny, out, **KILLED)
    assert resumed["resumed"] == 1.0 and resumed["resumed_from_step"] == 4 and resumed["steps"] == 6
    assert resumed["steps_reused"] == len([n for n in sampled if int(n[:5]) >= 4 and n.endswith(".jsonl")]) >= 1
    for f in ["train_log.jsonl", "model/model.safetensors", "adapter/adapter_model.safetensors", "ledger.jsonl",
              *[f"rollouts/{n:05d}.jsonl" for n in range(6)]]:
        assert (out / f).read_bytes() == (tmp_path / "full" / f).read_bytes(), f
    # and what the stage says it made is the whole training's, not the resumed attempt's
    made = ("gen_tokens", "groups", "groups_equal", "groups_dropped", "kept_group_frac", "first_draw_taught_frac",
            "micro_batches", "micro_batches_skipped", "forward_chunks_skipped", "train_loss", "steps")
    assert {k: resumed[k] for k in made} == {k: full[k] for k in made} and full["gen_tokens"] > 0
    # the ledger: a row per optimizer step, each sampled from the weights of the step before it (the
    # trainer's step then, and its trainable parameters' digest: another after every step)
    ledger = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == [1, 2, 3, 4, 5, 6]
    assert [r["sampled_from"][0]["step"] for r in ledger] == [0, 1, 2, 3, 4, 5]
    assert len({r["sampled_from"][0]["trainable_sha256"] for r in ledger}) == 6
    assert all(r["prompt_ids"] and r["seeds"] and list(r["rollouts"]) == [f"rollouts/{r['step'] - 1:05d}.jsonl"]
               for r in ledger)

    # each step's figures (the report's and MLflow's): one row a step, the resumed attempt's last;
    # the steps after the checkpoint read stored rollouts and generated nothing
    from ratchet.models.trainer import read_steps

    steps, whole = read_steps(out), read_steps(tmp_path / "full")
    assert [x["step"] for x in steps] == [x["step"] for x in whole] == [1, 2, 3, 4, 5, 6]
    assert [x["reward"] for x in steps] == [x["reward"] for x in whole]  # the rollouts' own: the same bytes
    assert all(x["reused"] == 0.0 and x["gen_tokens"] > 0 and x["gen_tokens_per_s"] > 0 for x in whole)
    stored = [x["step"] for x in steps if x["reused"]]
    assert len(stored) == resumed["steps_reused"] and all(x["gen_tokens_per_s"] is None for x in steps if x["reused"])
    assert all(0.0 <= x["groups_kept"] <= 1.0 and x["step_s"] > 0 and "logp_gap" in x for x in whole)


def test_a_trajectory_is_read_with_other_writers_tokens_masked():
    """A tool episode as the trainer reads it: the tool's tokens masked, and no sampling
    log-probability for them (NaN: the correction leaves them out)."""
    import math

    from ratchet.data.records import LabeledCompletion, Segment
    from ratchet.models.train_kinds.grpo import episode

    row = LabeledCompletion(prompt_id="p", prompt="q", index=0, text="abc", n_tokens=5, reward=1.0,
                            prompt_ids=(1, 2), segments=(Segment(role="model", text="a", token_ids=(5, 6),
                                                                 logprobs=(-0.5, -0.25)),
                                                         Segment(role="tool", text="b", token_ids=(7,)),
                                                         Segment(role="model", text="c", token_ids=(8, 9),
                                                                 logprobs=(-1.0, -2.0))))
    prompt, ids, mask, lps = episode(row)
    assert (prompt, ids, mask) == ([1, 2], [5, 6, 7, 8, 9], [1, 1, 0, 1, 1])
    assert lps[:2] == [-0.5, -0.25] and math.isnan(lps[2]) and lps[3:] == [-1.0, -2.0]


@pytest.mark.integration
def test_the_trainer_masks_the_tool_s_tokens_from_the_loss(wide_tiny, tmp_path):
    """Rows of a tool episode reach TRL's loss with their tool tokens masked (its tool_mask, by
    which it multiplies the completion mask)."""
    from ratchet.data.records import Segment
    from ratchet.models.train_kinds.grpo import grpo_trainer

    base = online(wide_tiny, "hf", rewards=[1.0, 0.0, 0.0, 1.0] * 2)
    single = base.roll

    def roll(engine, batch, seed):  # each completion: its model turn, then three tokens a tool wrote
        tool = Segment(role="tool", text="out", token_ids=(11, 12, 13))
        rows, cost = single(engine, batch, seed)
        return [r.model_copy(update={"segments": (*r.segments, tool)}) for r in rows], cost

    base.roll, cfg = roll, GRPOTrainConfig(steps=1, batch_size=2, adapter="full")
    trainer, *_ = grpo_trainer(wide_tiny, PROMPTS, cfg, tmp_path, 0, base)
    trainer.train()
    batch = trainer._buffered_inputs[0]
    n = batch["completion_mask"].sum(-1)  # the model's tokens and the tool's
    for row, count in zip(batch["tool_mask"].tolist(), n.tolist()):
        assert row[:count][-3:] == [0, 0, 0] and all(row[:count - 3])


@pytest.mark.integration
def test_a_micro_batch_that_teaches_nothing_is_not_run_and_changes_nothing(wide_tiny, tmp_path):
    """A micro-batch whose rows all belong to dropped groups (rewards all equal) is not run through
    the model, and their sampled tokens' log-probabilities are not computed: the weights and the train
    log end as they do when they are, byte for byte, and the counts say so."""
    from safetensors.torch import load_file

    from ratchet.models.train_kinds import grpo

    def go(out: Path, skip_masked: bool = True) -> dict:
        cfg = GRPOTrainConfig(steps=2, batch_size=2, micro_batch=2, learning_rate=1e-2, lr_scheduler="constant",
                              adapter="full", checkpoint_steps=10)
        # two groups of four a step: the first teaches, the second's rewards are equal (dropped)
        return grpo.train_grpo(wide_tiny, PROMPTS, cfg, out, 0, online(wide_tiny, "hf", rewards=[1.0, 0.0, 0.0, 1.0]
                                                                        + [1.0] * 4), skip_masked=skip_masked)

    skipped = go(tmp_path / "skip")
    assert skipped["micro_batches"] == 8 and 1 <= skipped["micro_batches_skipped"] < 8  # 4 a step, shuffled
    assert skipped["forward_chunks_skipped"] == 4  # before the shuffle: the dropped group's two chunks a step
    ran = go(tmp_path / "run", skip_masked=False)
    assert ran["micro_batches_skipped"] == ran["forward_chunks_skipped"] == 0
    a, b = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("skip", "run"))
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)
    # the train log too, but for TRL's entropy: a mean over the micro-batches run, which a masked one
    # pulled toward 0 when it was run (its masked mean is 0) and no longer enters
    drop = lambda rows: [{k: v for k, v in r.items() if k != "entropy"} for r in rows]
    assert drop(history(tmp_path / "skip")) == drop(history(tmp_path / "run"))
    assert all(s["entropy"] > r["entropy"] for s, r in zip(history(tmp_path / "skip"), history(tmp_path / "run")))
    assert not all(torch_equal(a[k], load_file(wide_tiny / "model.safetensors")[k]) for k in a)  # it did learn


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y)


def _fake_online(group: int = 2):
    """A roll with no engine: prompt pN's group is rewarded [1, 1] (it teaches nothing) where N is
    even, [1, 0] where it is odd; the calls it got are kept."""
    from ratchet.data.records import Completion, Segment
    from ratchet.models.train_kinds.grpo import Online
    from ratchet.tasks.label_kinds import labeled_row

    calls = []

    def roll(engine, batch, seed):
        calls.append(([p["id"] for p in batch], seed))
        rows = []
        for p in batch:
            odd = int(p["id"][1:]) % 2
            for i in range(group):
                c = Completion(prompt_id=p["id"], prompt=p["prompt"], index=i, text="x", n_tokens=1, prompt_ids=(1,),
                               segments=(Segment(role="model", text="x", token_ids=(5,), logprobs=(-1.0,)),))
                rows.append(labeled_row(c, reward=0.0 if odd and i else 1.0))
        return rows, {"gen_s": 0.0, "score_s": 0.0}

    return Online(open_engine=lambda p: None, roll=roll, group=group, max_completion=4), calls


def test_groups_that_teach_nothing_are_replaced_counted_and_dropped(tmp_path):
    from ratchet.models.train_kinds.grpo import Rollouts, teaches

    prompts = [{"id": f"p{i}", "prompt": f"q{i}"} for i in range(6)]
    online, calls = _fake_online()
    r = Rollouts(tmp_path, online, prompts, seed=0, resample=1)
    rows, read = r.step(0, ["p0", "p1", "p2"])  # p0 and p2 teach nothing; one draw of two other prompts
    assert [c[0] for c in calls][0] == ["p0", "p1", "p2"] and len(calls[1][0]) == 2
    assert not set(calls[1][0]) & {"p0", "p1", "p2"} and calls[1][1] != calls[0][1]  # other prompts, own seed
    replaced = sum(int(p[1:]) % 2 for p in calls[1][0])  # the odd ones among the drawn teach
    groups = [rows[i:i + 2] for i in range(0, 6, 2)]
    assert sum(teaches(g) for g in groups) == 1 + replaced
    assert read == [x for g in groups for x in [teaches(g)] * 2]  # what still teaches nothing is masked
    counts = json.loads((tmp_path / "rollouts" / "00000.json").read_text())
    ledger = counts.pop("ledger")
    assert counts == {"groups": 3, "groups_equal": 2, "groups_drawn": 2, "groups_replaced": replaced,
                      "groups_dropped": 2 - replaced, "gen_tokens": r.gen_tokens}  # both draws' tokens
    # the ledger's entry: the prompts of the groups it kept (a replaced group's prompt in its place), those
    # the loss reads, the seed of each draw, and no weights (a trainer gives them: tests below)
    assert ledger["prompt_ids"] == [g[0].prompt_id for g in groups] and ledger["sampled_from"] is None
    assert ledger["trained_prompt_ids"] == [g[0].prompt_id for g in groups if teaches(g)]
    assert ledger["seeds"] == [calls[0][1], calls[1][1]]
    from ratchet.data.digest import sha256_file
    from ratchet.models.train_kinds.grpo import write_ledger

    assert write_ledger(tmp_path) == 1  # the stage's ledger.jsonl: a row per optimizer step
    (row,) = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert row == {"step": 1, "prompt_ids": ledger["prompt_ids"], "trained_prompt_ids": ledger["trained_prompt_ids"],
                   "seeds": ledger["seeds"], "sampled_from": [None],
                   "rollouts": {"rollouts/00000.jsonl": sha256_file(tmp_path / "rollouts" / "00000.jsonl")}}
    # read back, not sampled again: the same rows and mask, the counts added again
    again = Rollouts(tmp_path, online, prompts, seed=0, resample=1)
    assert again.step(0, ["p0", "p1", "p2"]) == (rows, read) and len(calls) == 2 and again.reused == 1
    assert again.groups["groups_equal"] == 2
    # the whole training's tallies come from the store, whichever attempt sampled a step: a process
    # that sampled nothing (a resume past its checkpoint) counts the step the first attempt made
    fresh = Rollouts(tmp_path, online, prompts, seed=0, resample=1)
    assert fresh.whole(1) == {**{k: float(v) for k, v in counts.items()}} and fresh.gen_tokens == 0
    assert fresh.whole(2) == fresh.whole(1)  # a step not sampled yet adds nothing

    kept = Rollouts(tmp_path / "keep", online, prompts, seed=0, drop_equal=False)
    assert all(kept.step(0, ["p0", "p1"])[1]) and kept.groups["groups_dropped"] == 0 and len(calls) == 3
