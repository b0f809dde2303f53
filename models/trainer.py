"""What every train kind shares: optimisation settings, the policy's loading, checkpoints
and resume, the merged output, the train log, and running a kind's trainer in one process or
several. Each kind (models/train_kinds/: rft, dpo) is a config model that says what rows it
consumes and how it trains on them (`fit`); nothing here names one.

The output is always a full model directory: a LoRA adapter is merged into the
weights it was trained on, so the next round samples from plain weights (vLLM
with an active adapter ran ~4x slower on CPU) and its reference is well-defined.

With `num_processes` above 1, `train` runs the same trainer in that many processes under
torchrun (DDP: gloo on CPU, NCCL on GPUs), `batch_size` rows each per step, so the global
batch is batch_size x grad_accum x num_processes. Checkpoints hold every process's state;
a resumed run continues from them in the same number of processes. The main process alone
merges the adapter and writes the model, the train log and the metrics. An online kind (grpo)
samples in every process, each on its own engine and its own share of the step's prompts.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from abc import abstractmethod
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ratchet.data.procs.entry import entry

# transformers' schedules that run with no arguments of their own and no evaluation loop (the others need
# lr_scheduler_kwargs, or an eval metric, which a round's training has not); tests/models builds each
Scheduler = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                    "inverse_sqrt"]


class LoraSettings(BaseModel):
    """The LoRA adapter trained each round and merged into the round's model."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(default=16, ge=1, description="LoRA rank")
    alpha: int = Field(default=32, ge=1, description="LoRA scaling numerator (scale = alpha / r)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="LoRA dropout")
    target_modules: str | list[str] = Field(default="all-linear", description="modules to adapt")


class OptimSettings(BaseModel):
    """What every trainer shares: optimisation, precision, checkpoints."""

    model_config = ConfigDict(extra="forbid")
    adapter: Literal["lora", "full"] = Field(default="lora", description="LoRA via PEFT, or full fine-tuning")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="the LoRA adapter (adapter: lora)")
    epochs: float = Field(default=2.0, gt=0, description="passes over the round's training set")
    learning_rate: float = Field(default=2e-4, gt=0, description="peak learning rate (2e-4 suits LoRA; ~1e-5 full)")
    lr_scheduler: Scheduler = Field(default="linear", description="learning-rate schedule (transformers' "
                                    "SchedulerType)")
    warmup_ratio: float = Field(default=0.0, ge=0, lt=1, description="share of the round's steps over which the "
                                "learning rate rises from 0 to its peak")
    batch_size: int = Field(default=8, ge=1, description="rows per device step")
    grad_accum: int = Field(default=1, ge=1, description="gradient accumulation steps")
    max_length: int = Field(default=256, ge=16, description="tokens per row (prompt + completion); longer rows are cut")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        default="auto", json_schema_extra={"resolves": "precision"}, description=(
            "auto = the same rule as sampler.dtype: bf16 autocast where the hardware runs bf16 faster than fp32 (a "
            "GPU of compute capability 8.0 or higher, a CPU with AMX, or one whose measured probe says so), fp16 "
            "on an older GPU, else fp32; fp16 needs a GPU; keyed by what it resolves to"))
    gradient_checkpointing: bool = Field(default=False, description="trade compute for memory (big models)")
    attention: Literal["auto", "eager", "sdpa"] = Field(
        default="auto",
        description="attention kernel; auto = eager on CPU (its short-sequence backward measured ~25% faster "
        "per step than sdpa here), sdpa on GPU",
    )
    checkpoint_steps: int = Field(default=20, ge=1, description="save a resumable trainer checkpoint every N steps")
    logging_steps: int = Field(default=2, ge=1, description="log the loss every N steps (the train log, MLflow, "
                               "the console)")
    num_processes: int = Field(default=1, ge=1, description="training processes (torchrun, DDP; one per GPU, or "
                               "CPU cores split between them): the global batch is batch_size x grad_accum x "
                               "num_processes")


    consumes: ClassVar[str]  # the rows it trains on, as a filter kind builds them (tasks/filter_kinds/ ROWS)
    online: ClassVar[bool] = False  # samples its own rows from the round's prompts (no sample, label or filter stage)
    kind: str

    @abstractmethod
    def fit(self, model_dir: Path, rows: list[dict], out: Path, seed: int) -> dict[str, float]:
        """Train on `rows` from the model in `model_dir`; write out/model; return the metrics
        (empty in a training process other than the main one). Resumes from out/checkpoints."""

    @abstractmethod
    def rows_of(self, train_set: Path) -> list[dict]:
        """The filter stage's train_set.jsonl as the rows `fit` takes."""

    def info(self, start_model: str) -> dict[str, str]:
        """What the train stage's manifest records of the kind (`start_model`: the directory of the
        weights this round started from)."""
        return {}

    def summary(self, m: dict[str, float]) -> list[str]:
        """A finished training's result in a few words, for the console."""
        first, last = f"{m.get('first_loss', 0):.3f}", f"{m.get('last_loss', 0):.3f}"
        # one logged loss (a run of fewer than two logging_steps) reads as what it is, not "x -> x"
        out = [f"{m.get('steps', 0):,.0f} steps", f"loss {first}" if first == last else f"loss {first} -> {last}"]
        return out + ([f"{m.get('steps', 0) / m['train_s']:.2f} steps/s"] if m.get("train_s") else [])


def resolve_precision(p: str) -> str:
    import torch

    from ratchet.models import dtype

    p = dtype.resolve_precision(p)
    if p == "fp16" and not torch.cuda.is_available():
        from ratchet.data.errors import ConfigError

        raise ConfigError(["train.precision='fp16' needs a GPU; use 'bf16' or 'auto' on CPU"])
    return p


def last_checkpoint(ckpt_dir: Path) -> Path | None:
    cks = [p for p in ckpt_dir.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
    return max(cks, key=lambda p: int(p.name.split("-")[1])) if cks else None


def trainer_args(cls, cfg: OptimSettings, out: Path, seed: int, **extra):
    """`cls` (a TRL config) from the kind's settings; `extra` adds to them or overrides them."""
    import dataclasses

    import torch

    prec = resolve_precision(cfg.precision)
    kwargs = dict(
        output_dir=str(out / "checkpoints"),
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_ratio,  # transformers 5: a float < 1 is a ratio of total steps
        bf16=prec == "bf16",
        fp16=prec == "fp16",
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=cfg.gradient_checkpointing,
        save_strategy="steps",
        save_steps=cfg.checkpoint_steps,
        save_total_limit=1,
        logging_steps=cfg.logging_steps,
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,  # a progress bar is noise in a log file; the console shows progress.json
    )
    if "max_length" in {f.name for f in dataclasses.fields(cls)}:  # GRPO's lengths are its rollouts'
        kwargs["max_length"] = cfg.max_length
    args = cls(**{**kwargs, **extra})
    return one_device(args), prec


def one_device(args):
    """A training process trains on one GPU. Alone on a machine that shows several, HF's Trainer
    would split each batch over all of them (DataParallel in one process), multiplying the global
    batch by the count without a word; several GPUs are trained on through `num_processes`, one
    process each (DDP), where the global batch is batch_size x grad_accum x num_processes."""
    if args.n_gpu > 1:
        import logging

        logging.getLogger(__name__).warning(
            "training in one process on GPU 0 of the %d this machine shows; train.num_processes=%d trains on all "
            "of them, one process each", args.n_gpu, args.n_gpu)
        args._n_gpu = 1  # what the Trainer reads for its batch and for DataParallel
    return args


def attention_impl(choice: str) -> str:
    import torch

    if choice == "auto":
        return "sdpa" if torch.cuda.is_available() else "eager"
    return choice


def load_policy(model_dir: Path, cfg: OptimSettings, precision: str):
    """The policy to train. A frozen LoRA base is held in the compute dtype (bf16 halves its
    memory and skips autocast's per-step weight casts); trained weights stay fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from ratchet.models import tokenizer

    tok = tokenizer.load(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.bfloat16 if (cfg.adapter == "lora" and precision == "bf16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attention_impl(cfg.attention)
    )
    peft_config = None
    if cfg.adapter == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
            task_type="CAUSAL_LM",
        )
    return model, tok, peft_config


def save_merged(trainer, tok, base_dir: Path, out: Path, adapter: str) -> None:
    """Write the trained policy as a plain fp32 model directory at out/model (and out/adapter for LoRA).

    A LoRA adapter is merged into a fresh fp32 copy of the base, never into a bf16 one:
    bf16 keeps ~3 significant digits, which would round small LoRA deltas away.
    """
    model = trainer.model
    if adapter == "lora":
        import os

        model.save_pretrained(out / "adapter")
        # Make the adapter's files a function of the training alone, so a resumed or moved run
        # writes the same bytes: PEFT records the base model's absolute path (here: relative to
        # this stage directory instead) and writes target_modules from a set (here: sorted).
        rel = os.path.relpath(base_dir, out)
        card = out / "adapter" / "README.md"
        if card.exists():
            card.write_text(card.read_text().replace(str(base_dir), rel))
        conf = out / "adapter" / "adapter_config.json"
        c = json.loads(conf.read_text())
        c["base_model_name_or_path"] = rel
        if isinstance(c.get("target_modules"), list):
            c["target_modules"] = sorted(c["target_modules"])
        conf.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
        model = adapted(base_dir, out / "adapter")
        from ratchet.models.mlflow_model import save_adapter

        save_adapter(model, tok, base_dir, out)  # what the registered version loads from (before the merge)
        model = merged(model)
    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out / "model", ignore_errors=True)
    tmp.replace(out / "model")


def adapted(base_dir: Path, adapter: Path):
    """A LoRA adapter on a fresh fp32 copy of its base, as training merges it (save_merged) and as a
    dropped model is made again (remake): the same two steps give the same weights."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter)


def merged(model):
    """PEFT's merge of a LoRA model (`adapted`) into plain weights, each weight it adds into first
    copied into the process's own memory. A float32 base is loaded as a private map of its
    safetensors file and PEFT's merge adds into it in place, so each page it writes is copied on its
    first write: 1.85-1.88 s for the default model's 210 adapted layers against 0.36-0.47 s with the
    copies made first (the 2-core Xeon, a round-3 train stage's adapter, three times each). The
    same additions on the same values: the same bytes."""
    import torch
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoraLayer):
                weight = layer.get_base_layer().weight
                weight.data = weight.data.clone()
    return model.merge_and_unload()


WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")  # of a model directory


@entry
def remake(base_dir: str, stage_dir: str) -> list[str]:
    """A LoRA train stage's merged weights made again, as training made them, from its adapter and
    the model it trained from (`base_dir`), into stage_dir/model; returns the files written. The
    caller checks them against the stage's manifest (ArtifactStore.restored)."""
    d = Path(stage_dir)
    model = merged(adapted(Path(base_dir), d / "adapter"))
    tmp = d / "model.remake"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    written = []
    for pattern in WEIGHTS:
        for f in sorted(tmp.glob(pattern)):
            f.replace(d / "model" / f.name)
            written.append(f"model/{f.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    return written


# logged values that depend on the attempt, not the training: TRL's running token counter (it restarts
# from zero when training resumes from a checkpoint) and its per-step wall time
CLOCKED = ("num_tokens", "step_time")


def write_log(trainer, out: Path, started: float, n_tokens: int, save_s: float = 0.0) -> dict[str, float]:
    """Loss curve to out/train_log.jsonl; summary metrics returned.

    The log is a function of the training alone, so a resumed run writes the same bytes as
    an uninterrupted one: keys sorted, and what depends on the attempt left out (CLOCKED).
    """
    hist = [{k: v for k, v in h.items() if k not in CLOCKED} for h in trainer.state.log_history if "loss" in h]
    with open(out / "train_log.jsonl", "w") as f:
        for h in hist:
            f.write(json.dumps(h, sort_keys=True) + "\n")
    wall = time.time() - started
    final = [h for h in trainer.state.log_history if "train_loss" in h]
    mean = logged_mean(hist) if hist else float(final[-1]["train_loss"]) if final else float("nan")
    steps_s = float(final[-1].get("train_runtime", wall)) if final else wall
    return {
        # where train_s went: the optimizer's steps (this attempt's), writing the model, and the rest
        # (loading the policy, preparing the data, building the trainer)
        "steps_s": steps_s,
        "save_s": save_s,
        "train_loss": mean,
        # a run shorter than logging_steps logs no step loss: its mean loss stands for both ends
        "first_loss": float(hist[0]["loss"]) if hist else mean,
        "last_loss": float(hist[-1]["loss"]) if hist else mean,
        "steps": float(trainer.state.global_step),
        "train_s": wall,
        "tokens_per_s": n_tokens * trainer.args.num_train_epochs / wall if wall > 0 else 0.0,
    }


def logged_mean(hist: list[dict]) -> float:
    """The mean loss over the steps the log covers, each logged loss weighted by the steps since
    the one before. The trainer's own `train_loss` averages only the steps of the attempt that
    finished (a resumed run's, from its checkpoint on); this one is the same however many
    attempts the training took."""
    total, before = 0.0, 0
    for h in hist:
        step = int(h.get("step", before + 1))
        total += float(h["loss"]) * (step - before)
        before = step
    return total / before if before else float(hist[-1]["loss"])


def chat_dataset(rows: list[dict]):
    """TRL's conversational format: `prompt` becomes the user turn, every other field
    (completion, or chosen and rejected) an assistant turn. Rows of trajectories come as token
    ids already (`token_rows`) and are taken as they are."""
    from datasets import Dataset

    if rows and any(k.endswith("ids") for k in rows[0]):
        return Dataset.from_list(rows)
    return Dataset.from_list([{k: [{"role": "user" if k == "prompt" else "assistant", "content": v}]
                               for k, v in r.items()} for r in rows])


def turn_ids(segments) -> tuple[list[int], list[int]]:
    """A trajectory's token ids after its prompt, and its loss mask: 1 on the model's own tokens,
    0 on every other segment's (a tool's output, an environment's answer)."""
    ids: list[int] = []
    mask: list[int] = []
    for s in segments:
        ids += s.token_ids
        mask += [int(s.role == "model")] * len(s.token_ids)
    return ids, mask


def token_rows(rows: list, fields: list[str]) -> bool:
    """Whether a train set's rows are trajectories (train on their token ids) or text (TRL
    templates and tokenizes them); a set of both is an error naming the first of each."""
    turns = [getattr(r, fields[0]) is not None for r in rows]
    if any(turns) and not all(turns):
        from ratchet.data.errors import ArtifactError

        raise ArtifactError(f"the train set mixes trajectories (row {turns.index(True)}, prompt "
                            f"{rows[turns.index(True)].prompt_id!r}) with single completions (row "
                            f"{turns.index(False)}); a round's samples come from one sample.rollout")
    return any(turns)


# what the console's live line shows of a trainer's logs (flows/console.py rate_of): the loss, and an
# online trainer's reward, share of groups whose rewards differ, KL, entropy and log-probability gap
LIVE = {"loss": "loss", "reward": "reward", "frac_reward_zero_std": "zero_std", "kl": "kl", "entropy": "entropy",
        "sampling/sampling_logp_difference/mean": "logp_gap"}


STEPS = "steps.jsonl"  # an online trainer's figures by step (models/train_kinds/grpo.py step_log)


def read_steps(stage_dir: Path) -> list[dict]:
    """An online train stage's figures by step: steps.jsonl (the last row of each step: a resumed
    stage ran some again) joined with what the train log holds of that step (KL, entropy, the
    sampler's and the trainer's log-probability gap). [] for a stage that has no steps.jsonl."""
    path = Path(stage_dir) / STEPS
    if not path.is_file():
        return []
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows[row["step"]] = row
    log = Path(stage_dir) / "train_log.jsonl"
    for line in log.read_text().splitlines() if log.is_file() else []:
        try:
            h = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(h, dict) and h.get("step") in rows:  # a step that trained on no token logs nulls
            rows[h["step"]].update({name: float(v) for key, name in LIVE.items()
                                    if name in ("kl", "entropy", "logp_gap")
                                    and isinstance(v := h.get(key), (int, float)) and not isinstance(v, bool)})
    return [rows[k] for k in sorted(rows)]


def run_training(trainer, out: Path, live=None) -> int | None:
    """Train, resuming from out/checkpoints when an earlier attempt left one; the step it
    resumed from, or None. `live`: more figures for the console's live line, read as each step
    ends (a function returning {name: value})."""
    from transformers import TrainerCallback

    from ratchet.data import events, failpoints

    class _Progress(TrainerCallback):
        """Steps done of the run's total, and the last logged loss, in out/progress.json."""

        def __init__(self):
            self.progress, self.last = None, {}

        def on_step_end(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            if self.progress is None:  # the first step of this attempt (a resumed run starts late)
                self.progress = events.Progress(out, state.max_steps, "step", state.global_step - 1)
            if live is not None:
                self.last.update(live())
            self.progress.update(state.global_step, self.last)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.last.update({name: float(logs[key]) for key, name in LIVE.items() if key in (logs or {})})

    trainer.add_callback(_Progress())
    if failpoints.armed("train:checkpoint"):
        class _DieAfterSave(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                # every process has written its part of the checkpoint; then the main one kills them
                # all (the others die with torchrun), so the kill lands after a whole checkpoint
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    dist.barrier()
                if state.is_world_process_zero:
                    failpoints.hit("train:checkpoint")

        trainer.add_callback(_DieAfterSave())
    ck = last_checkpoint(out / "checkpoints")
    trainer.train(resume_from_checkpoint=str(ck) if ck else None)
    return int(ck.name.split("-")[1]) if ck else None


def train(model_dir: Path, rows: list[dict], cfg: OptimSettings, out: Path, seed: int,
          online=None) -> dict[str, float]:
    """The kind's trainer, in this process or, with cfg.num_processes > 1, in that many
    processes under torchrun (on this machine, rendezvous on localhost). `online`: what an online
    kind samples and scores with (models/train_kinds/grpo.py: Online); in several processes each
    one makes its own again from the Online's `process` entry and `spec`."""
    if cfg.num_processes == 1:
        return cfg.fit(model_dir, rows, out, seed, **({"online": online} if online is not None else {}))
    if online is not None and online.process is None:
        raise TypeError("training online in several processes needs an Online that each process can make again "
                        "(its `process` entry and `spec`)")
    import os
    import sys

    from ratchet.data import failpoints
    from ratchet.data.errors import StageFailedError

    out.mkdir(parents=True, exist_ok=True)
    spec, result = out / "train-processes.json", out / "train-metrics.json"
    spec.write_text(json.dumps({"kind": cfg.kind, "model": str(model_dir), "rows": rows, "out": str(out), "seed": seed,
                                "cfg": cfg.model_dump(mode="json"), "online": online.spec if online else None}))
    result.unlink(missing_ok=True)
    n = cfg.num_processes
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // n)))  # the cores, split
    env.setdefault(failpoints.GROUP, str(os.getpgrp()))  # torchrun starts its processes in groups of their own
    import signal

    from ratchet.data.procs.lifetime import child_dies_with_parent

    from ratchet.data.procs.spawn import launch

    # torchrun stops its training processes when it gets SIGTERM; each of them also dies with torchrun
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "--no-python"]
    proc = launch(torchrun, online.process if online else train_process, str(spec), env=env,
                  preexec_fn=child_dies_with_parent(signal.SIGTERM))
    if proc.returncode != 0 or not result.exists():
        raise StageFailedError(f"training in {n} processes (torchrun) failed with exit code {proc.returncode}; "
                               f"its checkpoints are kept in {out / 'checkpoints'}, re-run the same command to resume")
    metrics = json.loads(result.read_text())
    spec.unlink()
    result.unlink()
    return metrics


def fit_in_process(spec: dict, online=None) -> None:
    """One training process of several (under torchrun): the kind's trainer on the spec `train`
    wrote, with `online` where the kind trains online; the main process writes the metrics file."""
    from ratchet.data.procs.lifetime import die_with_parent
    from ratchet.models.train_kinds import config_class

    die_with_parent()  # torchrun killed (its worker, its orchestrator), no process trains on into the stage

    cfg = config_class(spec["kind"]).model_validate(spec["cfg"])
    metrics = cfg.fit(Path(spec["model"]), spec["rows"], Path(spec["out"]), spec["seed"],
                      **({"online": online} if online is not None else {}))
    if metrics:
        (Path(spec["out"]) / "train-metrics.json").write_text(json.dumps(metrics))


@entry
def train_process(spec_path: str) -> None:
    """One training process under torchrun: the trainer, then (main process) the metrics file."""
    fit_in_process(json.loads(Path(spec_path).read_text()))

