"""A GRPO step on the default task and model, taken apart, beside the sample stage's generation at
the same sampling settings and the same sequences in flight, in one run:

- where a step's wall time goes: generation, scoring, storing the rollouts, syncing the policy's
  weights into the engine, and the rest (the optimizer: TRL's log-probabilities, loss, backward,
  step, logging); the share that is neither generation nor the optimizer;
- the step's generation tok/s against the sample stage's (SingleRollout on the same engine,
  without log-probabilities), and their ratio;
- peak memory of the process that holds the policy, the engine and (with beta > 0) the reference.

    python bench/grpo_bench.py [--steps 4] [--micro-batch 4 8 32] [--adapter lora] [--beta 0] [--processes 1]

With `--processes 2` each cell trains in two processes (train.num_processes), each sampling its
own batch_size prompts of a step on its own engine: a step is then twice the completions, and
the peak RSS is the largest process's.

Each cell runs in a fresh process, one at a time. Settings are flows/configs/grpo.yaml's
(4 prompts x 8 completions of up to 48 tokens, temperature 1.0, LoRA) unless given.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _job(a):
    from ratchet.flows.config import load_config
    from ratchet.tasks.train import OnlineJob

    cfg = load_config(ROOT / "flows" / "configs" / "grpo.yaml",
                      [f"train.steps={a.steps}", f"train.adapter={a.adapter}", f"train.beta={a.beta}",
                       f"train.checkpoint_steps={a.steps + 1}"])
    return cfg, OnlineJob(train=cfg.train, seed=0, sample=cfg.sample, sampler=cfg.sampler, label=cfg.label,
                          data=cfg.data)


def _prompts(count: int) -> list[dict]:
    return [{"id": f"add-{a}-{b}", "prompt": f"What is {a} + {b}?", "answer": str(a + b), "task": "addition"}
            for a in range(20) for b in range(10)][:count]


def sample_cell(a) -> dict:
    """The sample stage's rollout, the same batches a GRPO step generates (batch_size prompts x n)."""
    from ratchet.data.records import Prompt
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.sampler import open_sampler
    from ratchet.tasks.rollouts.single import SingleRollout

    cfg, job = _job(a)
    engine = open_sampler(default_model_dir(), cfg.sampler, seed=0)
    prompts = [Prompt.model_validate(p) for p in _prompts(cfg.train.batch_size * a.steps)]
    engine.generate(["What is 1 + 1?"], cfg.sample.params().model_copy(update={"n": 1, "max_tokens": 4}), seed=0)
    tokens, gen = 0, 0.0
    for s in range(a.steps):
        batch = prompts[s * cfg.train.batch_size:(s + 1) * cfg.train.batch_size]
        t = time.time()
        rows, cost = SingleRollout().roll(engine, batch, cfg.sample.params(), seed=s)
        gen += time.time() - t
        tokens += int(cost["gen_tokens"])
    return {"tok_s": tokens / gen, "tokens": tokens, "gen_s": gen}


def grpo_cell(a) -> dict:
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.trainer import train
    from ratchet.tasks.train import online_of

    cfg, job = _job(a)
    train_cfg = job.train.model_copy(update={"micro_batch": a.micro_batch, "num_processes": a.processes})
    with tempfile.TemporaryDirectory() as out:
        t = time.time()
        m = train(default_model_dir(), _prompts(150), train_cfg, Path(out), 0, online=online_of(job, 0))
        m["wall_s"] = time.time() - t
    m["peak_rss_gb"] = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                           ) / 2**20  # in several processes, the largest training process
    return m


def _child(cell: str, a, micro_batch: int = 8) -> dict:
    cmd = [sys.executable, __file__, "--cell", cell, "--steps", str(a.steps), "--adapter", a.adapter,
           "--beta", str(a.beta), "--micro-batch", str(micro_batch), "--processes", str(a.processes)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{cell} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[4, 8, 32])
    ap.add_argument("--adapter", choices=["lora", "full"], default="lora")
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--cell", choices=["sample", "grpo"])
    a = ap.parse_args()
    if a.cell == "sample":
        print(json.dumps(sample_cell(a)))
        return
    if a.cell == "grpo":
        a.micro_batch = a.micro_batch[0]
        print(json.dumps(grpo_cell(a)))
        return

    base = _child("sample", a)
    print(f"sample stage's rollout, the same batches: {base['tok_s']:.0f} tok/s ({base['tokens']} tokens)")
    print(f"\nGRPO, {a.steps} steps, adapter {a.adapter}, beta {a.beta}, {a.processes} process(es) (default model, "
          "grpo.yaml's sampling)\n")
    print("| micro_batch | s/step | generation | scoring | storing | weight sync | optimizer | outside both | "
          "gen tok/s | vs sample | peak RSS GB |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for g in a.micro_batch:
        m = _child("grpo", a, g)
        steps, wall = m["steps"], m["steps_s"]
        other = m["score_s"] + m["store_s"] + m["sync_s"]
        print(f"| {g} | {wall / steps:.1f} | {m['gen_s'] / wall:.0%} | {m['score_s'] / wall:.1%} | "
              f"{m['store_s'] / wall:.1%} | {m['sync_s'] / wall:.1%} | {m['optimizer_s'] / wall:.0%} | "
              f"{other / wall:.1%} | {m['gen_tokens_per_s']:.0f} | {m['gen_tokens_per_s'] / base['tok_s']:.2f} | "
              f"{m['peak_rss_gb']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
