"""Online RL and the dtype: GRPO on the default task (flows/configs/grpo.yaml, one round) with the
engine and the trainer each in bf16 or fp32, over seeds, side by side in one run.

    python bench/online_dtype_bench.py [--cells bf16/bf16 fp32/fp32 fp32/bf16] [--seeds 0 1 2] [--steps 20]
                                       [--eval-size 50] [--json FILE]
    python bench/online_dtype_bench.py --cells bf16/bf16@34 fp32/fp32   # at equal wall time: bf16 ran 1.7x the steps

A cell is ENGINE/TRAINER, or ENGINE/TRAINER@STEPS for a cell of its own number of steps (--steps else).

A cell is ENGINE/TRAINER: `sampler.dtype` (what the run's engine samples the groups in, and what
the run evaluates in) and `train.precision` (what the trainer scores and steps in). For each
cell and seed, in a fresh process of its own, one at a time:

- the run's own held-out accuracy before and after the round (in the engine's dtype, as a user
  sees it);
- the same two models evaluated again by the evaluate stage's own unit (greedy, the task's check,
  the run's held-out prompts) in float32 and in bfloat16, so that a gain is told apart from the
  dtype the figure was taken in;
- the sampler-trainer log-probability gap per token (TRL's sampling_logp_difference: the mean over
  steps of each step's mean, and the largest of any step) and the importance ratios' range;
- the train stage's wall time, the part of it spent generating, and its generation tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
DTYPES = {"bf16": ("bfloat16", "bf16"), "fp32": ("float32", "fp32")}


def evaluate(model: Path, dtype: str, prompts: list, check, max_tokens: int) -> float:
    """Held-out accuracy of `model` on `prompts`, greedy, with the evaluate stage's unit."""
    from ratchet.models.sampler import SamplerConfig
    from ratchet.tasks.evaluate import EvaluateWork
    from ratchet.tasks.rollouts.single import SingleRollout

    work = EvaluateWork(items=prompts, size=len(prompts), max_tokens=max_tokens, check=check, rollout=SingleRollout(),
                        model=model, sampler=SamplerConfig(backend="vllm", dtype=dtype, max_model_len=512), seed=0)
    sampler = work.open()
    try:
        rows, _ = work.run(sampler, prompts, 0)
    finally:
        sampler.close()
    return sum(r.reward or 0.0 for r in rows) / len(rows)


def cell(engine: str, trainer: str, seed: int, steps: int, eval_size: int) -> dict:
    from ratchet.data.records import LabeledCompletion, Prompt
    from ratchet.flows import api
    from ratchet.models.default_model import default_model_dir
    from ratchet.models.trainer import read_steps

    work = Path(tempfile.mkdtemp(prefix="online-dtype-"))
    cfg = api.load(ROOT / "flows" / "configs" / "grpo.yaml",
                   [f"workdir={work}", "rounds=1", f"seed={seed}", f"train.steps={steps}", f"data.eval_size={eval_size}",
                    f"sampler.dtype={DTYPES[engine][0]}", f"train.precision={DTYPES[trainer][1]}"])
    t = time.time()
    res = api.run(cfg)
    wall = time.time() - t
    acc = {r.round: r.accuracy for r in res.rounds}
    [train] = list((work / "stages").glob("train-*"))
    steps_rows = read_steps(train)
    log = [json.loads(x) for x in (train / "train_log.jsonl").read_text().splitlines()]
    gaps = [h["sampling/sampling_logp_difference/max"] for h in log if "sampling/sampling_logp_difference/max" in h]
    ratios = [(h["sampling/importance_sampling_ratio/min"], h["sampling/importance_sampling_ratio/max"])
              for h in log if "sampling/importance_sampling_ratio/min" in h]
    gen = [(r["gen_tokens"], r["gen_tokens"] / r["gen_tokens_per_s"]) for r in steps_rows if r.get("gen_tokens_per_s")]
    # the round's held-out prompts as the run evaluated them, to evaluate both models again
    [ev] = sorted((work / "stages").glob("evaluate-*/eval.jsonl"))[:1]
    rows = [LabeledCompletion.model_validate_json(x) for x in ev.read_text().splitlines()]
    prompts = [Prompt(id=r.prompt_id, prompt=r.prompt, answer=r.answer) for r in rows]
    after = res.model_dir(res.rounds[-1].version)
    fixed = {f"{name}_{d}": evaluate(m, DTYPES[d][0], prompts, cfg.data.check, cfg.evaluate.max_tokens)
             for name, m in (("base", default_model_dir()), ("after", after)) for d in ("fp32", "bf16")}
    shutil.rmtree(work)  # a cell's run is 1.2 GB of models and checkpoints: nine cells would fill a small disk
    return {"engine": engine, "trainer": trainer, "steps": steps, "seed": seed, "run_before": acc.get(0), "run_after": acc.get(1),
            **fixed, "gap_mean": statistics.mean(r["logp_gap"] for r in steps_rows if "logp_gap" in r),
            "gap_max": max(gaps), "ratio_min": min(r[0] for r in ratios), "ratio_max": max(r[1] for r in ratios),
            "train_s": sum(r["step_s"] for r in steps_rows), "gen_tok_s": sum(g[0] for g in gen) / sum(g[1] for g in gen),
            "gen_s": sum(g[1] for g in gen), "run_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", default=["bf16/bf16", "fp32/fp32", "fp32/bf16"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20, help="a cell's steps, where it names none (E/T@STEPS)")
    ap.add_argument("--eval-size", type=int, default=50, help="held-out prompts (data.eval_size)")
    ap.add_argument("--json")
    ap.add_argument("--cell")  # ENGINE/TRAINER/SEED, in a child
    a = ap.parse_args()
    if a.cell:
        engine, trainer, seed = a.cell.split("/")
        print("RESULT " + json.dumps(cell(engine, trainer, int(seed), a.steps, a.eval_size)), flush=True)
        return
    results = []
    for seed in a.seeds:  # every cell of a seed before the next seed: a cut-short bench still compares
        for c in a.cells:
            dtypes, _, steps = c.partition("@")
            cmd = [sys.executable, __file__, "--cell", f"{dtypes}/{seed}", "--steps", steps or str(a.steps),
                   "--eval-size", str(a.eval_size)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"cell {c} seed {seed} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(line[7:]))
            print(json.dumps(results[-1]), flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(results, indent=1))
    print("\n| engine/trainer | seeds | run: before -> after | fp32 eval: before -> after | bf16 eval: before -> after "
          "| gap mean / max | ratio range | train s | gen tok/s |")
    print("|---|---:|---|---|---|---|---|---:|---:|")
    for c in a.cells:
        dtypes, _, steps = c.partition("@")
        rs = [r for r in results if f"{r['engine']}/{r['trainer']}" == dtypes and r["steps"] == int(steps or a.steps)]
        if not rs:
            continue

        def m(k):
            return statistics.mean(r[k] for r in rs)

        def pair(b, f):
            return f"{m(b):.0%} -> {m(f):.0%} ({', '.join(f'{r[f] - r[b]:+.0%}' for r in rs)})"

        print(f"| {c} | {len(rs)} | {pair('run_before', 'run_after')} | {pair('base_fp32', 'after_fp32')} | "
              f"{pair('base_bf16', 'after_bf16')} | {m('gap_mean'):.2g} / {max(r['gap_max'] for r in rs):.2g} | "
              f"{min(r['ratio_min'] for r in rs):.2f}-{max(r['ratio_max'] for r in rs):.2f} | {m('train_s'):.0f} | "
              f"{m('gen_tok_s'):.0f} |")


if __name__ == "__main__":
    main()
