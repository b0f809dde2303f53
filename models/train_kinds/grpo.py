"""train.kind=grpo: online RL inside a round's train stage, with TRL's GRPOTrainer.

Each step the policy samples `sample.n` completions (a group) for each of `batch_size` prompts
on Ratchet's own engine (models/sampler.py), through the run's rollout kind; the run's reward
scores them; advantages are relative to the group (GRPO; RLOO's leave-one-out with
`leave_one_out`); the policy steps. The rollout and the reward live above this layer (tasks/):
they are handed in as `Online`. What this module owns:

- the engine, in this process, sampling with each token's log-probability. Before each step's
  generation the policy's current weights are loaded into it from memory (a LoRA adapter merged
  for the copy, then unmerged): no model is written to disk between steps.
- each step's rollouts, stored as a unit (rollouts/NNNNN.jsonl, seeded by the stage seed and the
  step) before the step trains on them. A resumed stage continues from the trainer's last
  checkpoint and reads the steps it already sampled instead of sampling them again.
- a ledger (ledger.jsonl, LEDGER): for each optimizer step, the prompts it sampled and those whose
  groups its loss read, the seeds it sampled with, the sha256 of its stored rollouts, and the
  weights they were sampled from (the trainer's step then, and the sha256 of its trainable
  parameters: with LoRA the adapter, over the round's starting model). Kept with each step's
  rollouts as they are stored, so a resumed stage's ledger is the unbroken one's where its
  rollouts are; `ratchet lineage --json` carries it.
- each step's figures in steps.jsonl (STEPS): its reward mean and groups kept (from its rollouts),
  and what it cost on the clock (generated tokens per second, the step's seconds). Clocked, so it
  is not an output of the stage (a resumed stage appends the steps it ran again; the last row of a
  step is its own); the report and MLflow read it beside the train log's KL, entropy and
  log-probability gap.
- TRL's trainer, driven through its `rollout_func`: it computes the advantages, the loss
  (`loss_type`), the KL to the round's starting model (`beta`) and the importance-sampling
  correction from the engine's log-probabilities (its vLLM path, which this engine stands in for).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from ratchet.data.procs.entry import Entry

from ratchet.models.trainer import (STEPS, OptimSettings, load_policy, resolve_precision, run_training,
                                    read_steps, save_merged, trainer_args, turn_ids, write_log)

# every loss_type TRL 1.16's GRPOTrainer accepts
LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]


GAP_WARN = 0.01  # nats a token, mean over steps: float32 engine and trainer agree to ~1e-5, bf16 ones to ~0.05


def gap_warning(m: dict[str, float], engine: str = "", precision: str = "") -> str:
    """Said beside an online stage's figures where the engine sampled from a policy other than the
    one the trainer scored: a mean log-prob gap per token above GAP_WARN (TRL's
    sampling_logp_difference), with what the engine (`engine`, a dtype) and the trainer
    (`precision`; unsaid: as the stage's metrics say) ran in. Empty where it was below, or where no
    step measured it."""
    gap = m.get("logp_gap_mean")
    precision = precision or ("bf16" if m.get("bf16") else "")
    if not isinstance(gap, (int, float)) or isinstance(gap, bool) or gap <= GAP_WARN:
        return ""
    peak = f", up to {m['logp_gap_peak']:.2g} in a step" if isinstance(m.get("logp_gap_peak"), (int, float)) else ""
    ran = [f"the engine in {engine}"] if engine and engine != "float32" else []
    ran += [f"the trainer in {precision}"] if precision and precision != "fp32" else []
    fix = f" ({' and '.join(ran)}: float32 for both closes it, sampler.dtype and train.precision)" if ran else ""
    return (f"warning: the engine sampled from another policy than the trainer scored, log-prob gap {gap:.2g} a "
            f"token{peak}{fix}")


class GRPOTrainConfig(OptimSettings):
    """Online RL: the policy samples groups for the round's prompts, the run's reward scores them,
    and it steps on group-relative advantages (TRL's GRPOTrainer)."""

    consumes: ClassVar[str] = "prompts"  # it samples its own rows from the round's prompts: no filter stage
    # fields every other train kind takes that this one does not: refused where given, left out of its reference
    not_taken: ClassVar[dict[str, str]] = {
        "epochs": "train.epochs does not apply to train.kind=grpo, which runs train.steps steps; remove train.epochs",
        "grad_accum": "train.grad_accum does not apply to train.kind=grpo: a step is its batch_size x sample.n "
                      "completions, taken in micro-batches of train.micro_batch; remove train.grad_accum"}
    online: ClassVar[bool] = True
    kind: Literal["grpo"] = "grpo"
    steps: int = Field(default=20, ge=1, description="optimizer steps; each samples sample.n completions (a group) "
                       "for each of batch_size prompts, scores them and steps")
    batch_size: int = Field(default=4, ge=1, description="prompts per step and process (each brings a group of "
                            "sample.n completions; in num_processes processes, each on its own engine, a step "
                            "takes batch_size x num_processes prompts)")
    learning_rate: float = Field(default=1e-4, gt=0, description="peak learning rate")
    micro_batch: int = Field(default=8, ge=1, description="completions per forward and backward pass: a step's "
                             "batch_size x sample.n completions go through in micro-batches of the largest count "
                             "that divides them and is at most this (measured on the default model, 32 "
                             "completions a step: micro-batches of 8 took 23 s a step and 7 GB, one of 32 took "
                             "33 s and 14 GB)")
    loss_type: LossType = Field(default="dapo", description="TRL's GRPO loss: grpo, dr_grpo, dapo (TRL's default), "
                                "bnpo, cispo, sapo, luspo or vespo")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group", description="divide advantages by the group's reward std (group: GRPO), the batch's "
        "(batch), or not at all (none: Dr. GRPO)")
    leave_one_out: bool = Field(default=False, description="RLOO: each completion's baseline is the mean of the "
                                "other completions of its group (scale_rewards must be none)")
    beta: float = Field(default=0.0, ge=0, description="KL penalty to the round's starting model (0: off, as in TRL)")
    epsilon: float = Field(default=0.2, gt=0, description="clip range of the policy ratio (lower side; and upper "
                           "unless epsilon_high)")
    epsilon_high: float | None = Field(default=None, gt=0, description="upper clip range (DAPO's clip-higher)")
    importance_sampling: Literal["auto", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                                 "off"] = Field(
        default="auto", description="correction for the gap between the engine's and the trainer's "
        "log-probabilities (TRL's vllm_importance_sampling_mode); auto: sequence_mask (TRL's default), "
        "token_truncate for vespo; off: none")
    importance_sampling_cap: float = Field(default=3.0, gt=1, description="the ratio above which a token or "
                                           "sequence is truncated or masked")
    mask_truncated: bool = Field(default=False, description="leave completions that ran out of tokens out of the "
                                 "loss (DAPO)")
    drop_equal: bool = Field(default=True, description="leave a group whose rewards are all equal (it has no "
                             "advantage) out of the loss, so a token-level loss is not diluted by it; counted")
    resample: int = Field(default=0, ge=0, description="DAPO's dynamic sampling: up to this many more draws a step "
                          "replace groups whose rewards are all equal with groups of other prompts of the round")

    def fit(self, model_dir: Path, rows: list[dict], out: Path, seed: int,
            online: Online | None = None) -> dict[str, float]:
        if online is None:
            raise TypeError("train.kind=grpo trains online: it needs the run's rollout and reward (Online)")
        return train_grpo(model_dir, rows, self, out, seed, online)

    def rows_of(self, train_set: Path) -> list[dict]:
        from ratchet.data.records import Prompt, read_jsonl

        return [p.model_dump(mode="json") for p in read_jsonl(train_set, Prompt)]

    def info(self, start_model: str) -> dict[str, str]:
        return {"loss_type": self.loss_type, "advantage": "rloo" if self.leave_one_out else self.scale_rewards}

    def summary(self, m: dict[str, float]) -> list[str]:
        out = [f"{m.get('steps', 0):,.0f} steps", f"reward {m.get('first_reward', 0):.2f} -> "
               f"{m.get('last_reward', 0):.2f}"]
        out += [f"{m['first_draw_taught_frac']:.0%} of groups taught"] if "first_draw_taught_frac" in m else []
        out += [f"{m['groups_replaced']:,.0f} of {m['groups_equal']:,.0f} replaced by resampling"] \
            if m.get("groups_drawn") else []
        out += [f"{m['groups_dropped']:,.0f} dropped"] if m.get("groups_dropped") else []
        out += [f"{m['micro_batches_skipped']:,.0f} of {m['micro_batches']:,.0f} micro-batches skipped"] \
            if m.get("micro_batches_skipped") else []
        return out + ([f"{m.get('steps', 0) / m['train_s']:.2f} steps/s"] if m.get("train_s") else [])

    def problems(self, group: int) -> list[str]:
        """What cannot work with groups of `group` completions, each with its fix."""
        out = []
        if group < 2:
            out.append(f"sample.n={group}: train.kind=grpo compares the completions of a group, and a group of one "
                       "has no advantage; set sample.n to 2 or more (8 is usual)")
        if self.leave_one_out and self.scale_rewards != "none":
            out.append(f"train.leave_one_out=true with train.scale_rewards={self.scale_rewards!r}: RLOO's advantage is "
                       "the reward less the others' mean, unscaled; set train.scale_rewards: none")
        return out + [why for name, why in self.not_taken.items() if name in self.model_fields_set]

    def trl_settings(self) -> dict[str, Any]:
        """This config as GRPOConfig's arguments."""
        mode = self.importance_sampling
        if mode == "auto":
            mode = "token_truncate" if self.loss_type == "vespo" else "sequence_mask"
        return dict(loss_type=self.loss_type, scale_rewards=self.scale_rewards, beta=self.beta, epsilon=self.epsilon,
                    epsilon_high=self.epsilon_high, mask_truncated_completions=self.mask_truncated,
                    importance_sampling_level="sequence" if self.loss_type == "luspo" else "token",
                    vllm_importance_sampling_correction=mode != "off",
                    vllm_importance_sampling_mode=mode if mode != "off" else "sequence_mask",
                    vllm_importance_sampling_clip_max=self.importance_sampling_cap)


@dataclass
class Online:
    """What the train stage hands an online kind from above this layer.

    open_engine(model_dir): an engine (models/sampler.py) on those weights.
    roll(engine, prompts, seed): `group` scored completions of each prompt, in order (prompt by
        prompt, index by index), as LabeledCompletion rows that keep their prompt's ids and their
        segments (the model's with the engine's log-probabilities); `reward` None where the reward
        could not be computed (that completion then teaches nothing); and the seconds it spent
        generating (`gen_s`) and scoring (`score_s`).
    """

    open_engine: Callable[[Path], Any]
    roll: Callable[[Any, list[dict], int], tuple[list, dict[str, float]]]
    group: int
    max_completion: int  # the most tokens one completion (an episode, for a multi-turn rollout) takes
    # how each training process of several (train.num_processes) makes this Online again: an entry
    # (data/procs/entry.py) that takes the path of the training spec, which carries `spec` (JSON)
    # under "online", and calls models/trainer.fit_in_process with the Online it makes from it
    process: Entry | None = None
    spec: dict | None = None


def step_seed(seed: int, step: int, draw: int = 0, rank: int = 0) -> int:
    """The seed of one step's generation (a draw above 0: a draw that replaces groups that teach
    nothing; a rank above 0: another training process's share of the step): the stage seed, the
    step, the draw and the rank, whoever runs it and whenever."""
    key = f"{seed}:{step}:{draw}" + (f":{rank}" if rank else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "big")


def advantages(rewards: list[float], group: int, scale: str = "group", leave_one_out: bool = False) -> list[float]:
    """Group-relative advantages as the trainer computes them (TRL's GRPOTrainer, sum_then_normalize
    with one reward): the reward less its group's mean, divided by the group's std (`group`,
    unbiased, +1e-4) or the batch's (`batch`), or not (`none`); RLOO's leave-one-out is the
    unscaled one times group/(group-1), which is the reward less the mean of the others."""
    import statistics

    out = []
    std_batch = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    for g in range(0, len(rewards), group):
        rs = rewards[g: g + group]
        mean = sum(rs) / len(rs)
        std = statistics.stdev(rs) if scale == "group" else std_batch
        w = group / (group - 1) if leave_one_out else 1.0
        out += [w * (r - mean) / (std + 1e-4) if scale != "none" else w * (r - mean) for r in rs]
    return out


LEDGER = "ledger.jsonl"


def trainable_sha256(model) -> str:
    """The sha256 of a model's trainable parameters (names and bytes, by name): with LoRA its
    adapter, which with the frozen starting model makes the weights; else every parameter."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        if p.requires_grad:
            h.update(name.encode() + b"\0")
            h.update(p.detach().to("cpu").contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_ledger(out: Path) -> int:
    """out/ledger.jsonl from the stored rollouts: a row per optimizer step (1-based), over every
    training process's share of it (rank order), each share's rollouts file with its sha256.
    Returns the number of steps."""
    from ratchet.data.digest import sha256_file

    steps: dict[int, list[tuple[int, Path]]] = {}
    for f in (out / "rollouts").glob("*.jsonl"):
        parts = f.name.split(".")  # NNNNN.jsonl, or NNNNN.R.jsonl in several processes
        steps.setdefault(int(parts[0]), []).append((int(parts[1]) if len(parts) == 3 else 0, f))
    rows = []
    for step in sorted(steps):
        row: dict[str, Any] = {"step": step + 1, "prompt_ids": [], "trained_prompt_ids": [], "seeds": [],
                               "rollouts": {}, "sampled_from": []}
        for _, f in sorted(steps[step]):
            side = f.with_name(f.name.removesuffix(".jsonl") + ".json")
            entry = json.loads(side.read_text()).get("ledger") or {} if side.exists() else {}
            row["prompt_ids"] += entry.get("prompt_ids", [])
            row["trained_prompt_ids"] += entry.get("trained_prompt_ids", [])
            row["seeds"] += entry.get("seeds", [])
            row["rollouts"][f"rollouts/{f.name}"] = sha256_file(f)
            row["sampled_from"].append(entry.get("sampled_from"))
        rows.append(row)
    tmp = out / (LEDGER + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    tmp.replace(out / LEDGER)
    return len(rows)


@contextlib.contextmanager
def merged_weights(model):
    """The policy's weights as (name, tensor) pairs in the base model's checkpoint names: each LoRA
    layer's base weight with its adapter's delta added, as a new tensor, one layer at a time as the
    pairs are read. The base weights are never written: merging the adapter into them in place and
    out again (PEFT's merge_adapter, unmerge_adapter) is not exact in floating point, so every sync
    moved the base a little, and a run resumed from a checkpoint (its base fresh from disk) trained
    from other weights than the unbroken run (tests/models/test_grpo.py). Where a layer is not a
    plain LoRA layer (DoRA, a LoRA bias), PEFT's merge is used as before."""
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        yield list(model.state_dict().items())
        return
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    plain = all(not getattr(m, "lora_variant", {}) and not any(getattr(m, "lora_bias", {}).values())
                for m in layers.values())
    if not plain:
        model.merge_adapter()
        try:
            yield [(k.removeprefix("base_model.model.").replace(".base_layer", ""), v)
                   for k, v in model.state_dict().items() if "lora_" not in k]
        finally:
            model.unmerge_adapter()
        return

    def pairs():
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if "lora_" in k:
                    continue
                owner, _, leaf = k.rpartition(".base_layer.")
                layer = layers.get(owner) if leaf == "weight" else None
                if layer is not None:
                    for adapter in layer.active_adapters:
                        if adapter in layer.lora_A and adapter not in getattr(layer, "merged_adapters", []):
                            v = (v + layer.get_delta_weight(adapter)).to(v.dtype)
                yield k.removeprefix("base_model.model.").replace(".base_layer", ""), v

    yield pairs()


class EngineSync:
    """What TRL's GRPOTrainer calls `vllm_generation`, for Ratchet's engine: before a step's
    generation it loads the policy's weights into the engine, from memory."""

    def __init__(self, trainer, engine):
        self.trainer, self.engine, self.syncs, self.sync_s = trainer, engine, 0, 0.0

    def sync_weights(self) -> None:
        t = time.time()
        with merged_weights(self.trainer.accelerator.unwrap_model(self.trainer.model)) as weights:
            self.engine.load_state(weights)
        self.syncs += 1
        self.sync_s += time.time() - t


def episode(row) -> tuple[list[int], list[int], list[int], list[float]]:
    """A stored completion as the trainer reads it: prompt ids, completion ids, the loss mask (1 on
    the model's tokens, 0 on a tool's or environment's) and each completion token's sampling
    log-probability (NaN where there is none: another writer's token, or none returned)."""
    ids, mask = turn_ids(row.segments)
    lps: list[float] = []
    for s in row.segments:
        lp = s.logprobs if s.role == "model" and s.logprobs and len(s.logprobs) == len(s.token_ids) else None
        lps += list(lp) if lp is not None else [math.nan] * len(s.token_ids)
    return list(row.prompt_ids), ids, mask, lps


class Rollouts:
    """Each step's scored rollouts: read from rollouts/NNNNN.jsonl where a step was sampled before,
    else sampled on the engine and written there (atomically) before the step trains on them, with
    what became of its groups in rollouts/NNNNN.json. In several training processes each samples
    its own share of the step's prompts on its own engine, stored as rollouts/NNNNN.R.jsonl (R its
    rank) and seeded by the rank too, and draws replacements from its own share of the round's
    prompts (every `world`-th, from its rank on), so no two processes draw the same replacement.

    A group whose rewards are all equal has no advantage. With `resample`, up to that many more
    draws replace such groups with groups of other prompts of the round (DAPO's dynamic sampling),
    each draw seeded by the step and the draw; a group that still teaches nothing is left out of
    the loss with `drop_equal` (its tokens masked, so a token-level loss is not diluted by it)."""

    def __init__(self, out: Path, online: Online, prompts: list[dict], seed: int, resample: int = 0,
                 drop_equal: bool = True, rank: int = 0, world: int = 1):
        self.dir, self.online, self.seed = out / "rollouts", online, seed
        self.resample, self.drop_equal = resample, drop_equal
        self.rank, self.world = rank, world
        self.prompts = {p["id"]: p for p in prompts}
        self.pool = sorted(self.prompts)[rank::world]  # what this process draws replacements from
        self.dir.mkdir(parents=True, exist_ok=True)
        self.engine = None
        self.weights: Callable[[], dict] | None = None  # the weights it samples from, for the ledger
        self.reused = 0
        self.cost = {"gen_s": 0.0, "score_s": 0.0, "store_s": 0.0}
        self.gen_tokens = 0
        self.seen = {"gen_tokens": 0.0, "gen_s": 0.0}  # every process's, in the main one (step_log)
        self.groups: dict[str, float] = {"groups": 0.0, "groups_equal": 0.0, "groups_drawn": 0.0,
                                         "groups_replaced": 0.0, "groups_dropped": 0.0}
        # the last step's own tallies (StepLog writes its figures)
        self.last = dict.fromkeys(("reward_sum", "scored", "groups", "groups_dropped", "reused"), 0.0)

    def step(self, step: int, prompt_ids: list[str]) -> tuple[list, list[bool]]:
        """The step's rows, and for each row whether the loss reads it."""
        from ratchet.data.records import LabeledCompletion, read_jsonl, write_jsonl

        name = self._name(step)
        f, counts_file = self.dir / f"{name}.jsonl", self.dir / f"{name}.json"
        reused = f.exists() and counts_file.exists()
        if reused:
            self.reused += 1
            rows, counts = read_jsonl(f, LabeledCompletion), json.loads(counts_file.read_text())
        else:
            rows, counts = self._sample(step, prompt_ids)
            t = time.time()
            write_jsonl(f, rows)
            tmp = counts_file.with_name(counts_file.name + ".tmp")  # whole or absent, as the rows are
            tmp.write_text(json.dumps(counts, sort_keys=True) + "\n")
            tmp.replace(counts_file)
            self.cost["store_s"] += time.time() - t
        for k in self.groups:
            self.groups[k] += counts.get(k, 0)
        g = self.online.group
        groups = [rows[i:i + g] for i in range(0, len(rows), g)]
        read = [not (self.drop_equal and not teaches(grp)) for grp in groups for _ in grp]
        scored = [r.reward for r in rows if r.reward is not None]
        self.last = {"reward_sum": float(sum(scored)), "scored": float(len(scored)), "groups": float(len(groups)),
                     "groups_dropped": float(counts.get("groups_dropped", 0)), "reused": float(reused)}
        return rows, read

    def _name(self, step: int) -> str:
        """A step's stored rollouts and counts, less the suffix: this process's share of the step."""
        return f"{step:05d}" + (f".{self.rank}" if self.world > 1 else "")

    def whole(self, steps: int) -> dict[str, float]:
        """The group tallies and generated tokens of every step this process trained, read from the
        stored counts: the whole training's, whichever attempt sampled each step (a resumed attempt
        trains the steps before its checkpoint from none)."""
        out = dict.fromkeys([*self.groups, "gen_tokens"], 0.0)
        for step in range(steps):
            f = self.dir / f"{self._name(step)}.json"
            counts = json.loads(f.read_text()) if f.exists() else {}
            for k in out:
                out[k] += counts.get(k, 0)
        return out

    def _roll(self, prompt_ids: list[str], seed: int) -> list:
        rows, cost = self.online.roll(self.engine, [self.prompts[i] for i in prompt_ids], seed)
        for k in ("gen_s", "score_s"):
            self.cost[k] += cost.get(k, 0.0)
        self.gen_tokens += sum(len(s.token_ids) for r in rows for s in r.segments if s.role == "model")
        return rows

    def _sample(self, step: int, prompt_ids: list[str]) -> tuple[list, dict[str, float]]:
        import random

        g = self.online.group
        sampled_from = self.weights() if self.weights is not None else None
        tokens_before = self.gen_tokens
        seeds = [step_seed(self.seed, step, rank=self.rank)]
        rows = self._roll(prompt_ids, seeds[0])
        groups = [rows[i:i + g] for i in range(0, len(rows), g)]
        equal = [i for i, grp in enumerate(groups) if not teaches(grp)]
        counts = {"groups": len(groups), "groups_equal": len(equal), "groups_drawn": 0, "groups_replaced": 0}
        tried = set(prompt_ids)
        for draw in range(1, self.resample + 1):
            if not equal:
                break
            pool = [p for p in self.pool if p not in tried]
            random.Random(step_seed(self.seed, step, draw, self.rank)).shuffle(pool)
            fresh = pool[:len(equal)]
            if not fresh:
                break
            tried.update(fresh)
            seeds.append(step_seed(self.seed, step, draw, self.rank))
            new = self._roll(fresh, seeds[-1])
            counts["groups_drawn"] += len(fresh)
            for grp in (new[i:i + g] for i in range(0, len(new), g)):
                if teaches(grp) and equal:
                    groups[equal.pop(0)] = grp
                    counts["groups_replaced"] += 1
        counts["groups_dropped"] = len(equal) if self.drop_equal else 0
        counts["gen_tokens"] = self.gen_tokens - tokens_before  # every draw's, the groups replaced too
        counts["ledger"] = {"prompt_ids": [grp[0].prompt_id for grp in groups],
                            "trained_prompt_ids": [grp[0].prompt_id for grp in groups
                                                   if teaches(grp) or not self.drop_equal],
                            "seeds": seeds, "sampled_from": sampled_from}
        return [r for grp in groups for r in grp], counts


def teaches(group: list) -> bool:
    """Whether a group's rewards differ (a reward that could not be computed counts as none)."""
    return len({r.reward for r in group if r.reward is not None}) > 1


def gathered(mine: dict) -> list[dict]:
    """`mine` from every training process, in rank order ([mine] in one process). Every process
    must call it at the same point."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


MICRO = {"run": "micro_batches_run", "skipped": "micro_batches_skipped", "chunks_skipped": "forward_chunks_skipped"}


def step_log(out: Path, rollouts: Rollouts, sync: Callable[[], float], micro: Callable[[], dict]):
    """A callback that appends each step's figures to out/steps.jsonl as the step ends: its reward
    mean and share of groups kept (from Rollouts.last), the tokens it generated and their rate, its
    engine sync's seconds and its own seconds (None where it has none: a step read from stored
    rollouts generated nothing). In several processes the figures are the step's over all of them
    (tokens summed over the slowest process's seconds), written by the main one; it keeps the
    running totals the console's live line reads (`rollouts.seen`)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.began = (time.time(), rollouts.gen_tokens, rollouts.cost["gen_s"], sync(), dict(micro()))

        def on_step_end(self, args, state, control, **kwargs):
            t, tokens, gen_s, sync_s, mb = self.began
            mine = {**rollouts.last, "gen_tokens": rollouts.gen_tokens - tokens,
                    "gen_s": rollouts.cost["gen_s"] - gen_s, "sync_s": sync() - sync_s, "step_s": time.time() - t,
                    **{name: micro()[k] - mb[k] for k, name in MICRO.items()}}
            parts = gathered(mine)
            if not state.is_world_process_zero:
                return
            total = {k: sum(p[k] for p in parts) for k in ("reward_sum", "scored", "groups", "groups_dropped",
                                                             "gen_tokens")}
            gen_s = max(p["gen_s"] for p in parts)
            rollouts.seen["gen_tokens"] += total["gen_tokens"]
            rollouts.seen["gen_s"] += gen_s
            row = {"step": state.global_step,
                   "reward": total["reward_sum"] / total["scored"] if total["scored"] else None,
                   "groups_kept": 1.0 - total["groups_dropped"] / total["groups"] if total["groups"] else None,
                   "reused": float(all(p["reused"] for p in parts)), "gen_tokens": int(total["gen_tokens"]),
                   "gen_tokens_per_s": total["gen_tokens"] / gen_s if gen_s > 0 else None,
                   "sync_s": max(p["sync_s"] for p in parts), "step_s": max(p["step_s"] for p in parts),
                   **{name: sum(p[name] for p in parts) for name in MICRO.values()}}
            with open(out / STEPS, "a") as f:
                f.write(json.dumps({k: None if isinstance(v, float) and math.isnan(v) else v
                                    for k, v in row.items()}, sort_keys=True) + "\n")

    return StepLog()


def grpo_trainer(model_dir: Path, prompts: list[dict], cfg: GRPOTrainConfig, out: Path, seed: int, online: Online,
                 skip_masked: bool = True):
    """TRL's GRPOTrainer over the round's prompts, sampling on Ratchet's engine: (trainer, tokenizer,
    precision, rollouts). `skip_masked`: rows with no token in the loss (dropped groups) are not run
    through the model (its Trainer's compute_loss and _get_per_token_logps_and_entropies); off only
    to compare with the run that runs them; off in several processes, where every process runs
    every micro-batch (DDP reduces the gradients of each, and broadcasts buffers with each forward)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from ratchet.models.train_kinds.grpo_trainer import RatchetGRPOTrainer

    g = online.group
    total = cfg.batch_size * g
    micro = max(d for d in range(1, min(cfg.micro_batch, total) + 1) if total % d == 0)
    prec = resolve_precision(cfg.precision)
    model, tok, peft_config = load_policy(model_dir, cfg, prec)
    # one optimizer step per generation: a step's batch_size x n completions, in micro-batches
    per_device = cfg.model_copy(update={"batch_size": micro, "grad_accum": total // micro})
    args, prec = trainer_args(GRPOConfig, per_device, out, seed, max_steps=cfg.steps, num_generations=g,
                              steps_per_generation=total // micro, max_completion_length=online.max_completion,
                              num_iterations=1, shuffle_dataset=True, log_completions=False,
                              reward_weights=[g / (g - 1)] if cfg.leave_one_out else None, **cfg.trl_settings())
    skip_masked = skip_masked and args.world_size == 1
    # each process samples batch_size prompts of a step (TRL hands each its own whole groups)
    rollouts = Rollouts(out, online, prompts, seed, cfg.resample, cfg.drop_equal, args.process_index, args.world_size)

    def rollout_func(batch: list[str], trainer) -> dict[str, list]:
        import torch

        step = trainer.state.global_step
        rows, read = rollouts.step(step, batch[::g])  # the prompts come repeated, a group each
        trainer.rows_read = read
        # what the step draws after this (TRL shuffles the completions into micro-batches) is drawn
        # from the seed and the step, whether its rollouts were sampled now (the engine reseeds the
        # process's generator) or read from an earlier attempt's store (it does not)
        torch.manual_seed(step_seed(seed, step, -1))
        eps = [episode(r) for r in rows]
        return {"prompt_ids": [e[0] for e in eps], "completion_ids": [e[1] for e in eps],
                "env_mask": [e[2] if keep else [0] * len(e[2]) for e, keep in zip(eps, read)],
                "logprobs": [e[3] for e in eps], "reward": [r.reward for r in rows]}

    def reward(prompts, completions, reward, **_) -> list[float | None]:
        return reward  # scored in the rollout, and stored with it

    rollouts.engine = engine = online.open_engine(model_dir)
    trainer = RatchetGRPOTrainer(engine_sync=lambda t: EngineSync(t, engine), seed=seed, skip_masked=skip_masked,
                                 step_seed=step_seed, model=model, reward_funcs=[reward], args=args,
                                 processing_class=tok, peft_config=peft_config,
                                 train_dataset=Dataset.from_list([{"prompt": p["id"]} for p in prompts]),
                                 rollout_func=rollout_func)
    trainer.add_callback(step_log(out, rollouts, lambda: trainer.vllm_generation.sync_s, lambda: trainer.micro_batches))
    rollouts.weights = lambda: {"step": trainer.state.global_step,  # what the engine holds as a step samples
                                "trainable_sha256": trainable_sha256(trainer.accelerator.unwrap_model(trainer.model))}
    return trainer, tok, prec, rollouts


def train_grpo(model_dir: Path, prompts: list[dict], cfg: GRPOTrainConfig, out: Path, seed: int,
               online: Online, skip_masked: bool = True) -> dict[str, float]:
    """GRPO on the round's prompts; writes out/model; returns metrics. Resumes from
    out/checkpoints and the stored rollouts when an earlier attempt left them."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is TRL's experimental API; pinned here
    started = time.time()
    trainer, tok, prec, rollouts = grpo_trainer(model_dir, prompts, cfg, out, seed, online, skip_masked)
    seen = rollouts.seen
    resumed = run_training(trainer, out, live=lambda: {"gen_tok_s": seen["gen_tokens"] / seen["gen_s"]}
                           if seen["gen_s"] else {})
    sync = trainer.vllm_generation
    # what every process counted, summed (seconds: the slowest process's, which the step waited for;
    # steps read from the store: the most any process read of its own share); before the engine
    # closes, since a vLLM engine in several processes tears the process group down with it
    parts = gathered({"cost": rollouts.cost, "whole": rollouts.whole(cfg.steps), "gen_tokens": rollouts.gen_tokens,
                      "reused": rollouts.reused, "syncs": sync.syncs, "sync_s": sync.sync_s})
    rollouts.engine.close()  # its memory back before the merge loads another copy of the weights
    if not trainer.is_world_process_zero():
        return {}
    cost = {k: max(p["cost"][k] for p in parts) for k in rollouts.cost}
    # what the stage made counts every step, whichever attempt ran it (the stored counts, each step's
    # row of steps.jsonl); the rates and seconds are this attempt's own
    whole = {k: sum(p["whole"][k] for p in parts) for k in parts[0]["whole"]}
    groups = {k: whole[k] for k in rollouts.groups}
    gen_tokens, sync_s = sum(p["gen_tokens"] for p in parts), max(p["sync_s"] for p in parts)
    steps = read_steps(out)  # once: it reads steps.jsonl and the train log
    mb = {name: sum(r.get(name) or 0 for r in steps) for name in MICRO.values()}
    write_ledger(out)
    saving = time.time()
    save_merged(trainer, tok, model_dir, out, cfg.adapter)
    metrics = write_log(trainer, out, started, gen_tokens, save_s=time.time() - saving)
    hist = [h for h in trainer.state.log_history if "reward" in h]
    metrics.update(bf16=float(prec == "bf16"), resumed=float(resumed is not None),
                   resumed_from_step=float(resumed or 0), processes=float(len(parts)), prompts=float(len(prompts)),
                   **cost, **groups, gen_tokens=float(whole["gen_tokens"]), syncs=float(sum(p["syncs"] for p in parts)),
                   sync_s=sync_s, steps_reused=float(max(p["reused"] for p in parts)),
                   micro_batches_skipped=float(mb["micro_batches_skipped"]),
                   micro_batches=float(mb["micro_batches_run"] + mb["micro_batches_skipped"]),
                   forward_chunks_skipped=float(mb["forward_chunks_skipped"]),
                   tokens_per_s=gen_tokens / metrics["train_s"] if metrics["train_s"] else 0.0,
                   gen_tokens_per_s=gen_tokens / cost["gen_s"] if cost["gen_s"] else 0.0)
    # the optimizer's share: the steps' time less what the step spent outside it (generating, scoring,
    # storing the rollouts, syncing the engine)
    metrics["optimizer_s"] = metrics["steps_s"] - sum(cost.values()) - sync_s
    if hist:
        metrics.update(first_reward=float(hist[0]["reward"]), last_reward=float(hist[-1]["reward"]))
        for key, name in (("frac_reward_zero_std", "zero_std_frac"), ("kl", "kl"), ("entropy", "entropy"),
                          ("sampling/sampling_logp_difference/mean", "logp_gap_mean"),
                          ("sampling/sampling_logp_difference/max", "logp_gap_max")):
            vals = [h[key] for h in hist if key in h]
            if vals:
                metrics[f"{name}"] = float(sum(vals) / len(vals))
                if name == "logp_gap_max":  # the largest any step saw, beside the steps' mean of theirs
                    metrics["logp_gap_peak"] = float(max(vals))
    if groups["groups"]:
        g = groups
        metrics["kept_group_frac"] = 1.0 - g["groups_dropped"] / g["groups"]  # of the groups it trained on
        metrics["first_draw_taught_frac"] = 1.0 - g["groups_equal"] / g["groups"]
    return metrics
