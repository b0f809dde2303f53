"""Which method pays on this task and this machine: RFT, DPO, GRPO and prompt search at the same
wall-time budget.

    python bench/method_bench.py flows/configs/default.yaml --budget-min 15 --seeds 0 1 2 --out bench-out/methods
    python bench/method_bench.py --merge bench-out/methods       # the table, from every cell run so far

A cell is one method on one seed, run alone (one cell at a time: they would share the cores).
It runs rounds one more at a time (`ratchet run CONFIG rounds=R seed=S`, every earlier round's
stages reused from the cell's workdir) until its rounds have taken the budget, and records each
round's held-out accuracy (the gate's set, greedy) with the wall time spent so far: every
`ratchet run` of the cell timed whole (start-up, engine loads, every stage), less the base model's
evaluation, which all methods share. A round that stops (RFT's filter finds too few right
samples, DPO too few pairs) ends the cell, and the table says so.

    rft   the config's own rounds with filter.kind=rft, train.kind=rft
    dpo   filter.kind=pairs, train.kind=dpo: right against wrong samples of a prompt
    dpo+rpo     the same, with an NLL term on the chosen answer (RPO: loss_type [sigmoid, sft], weights [1, 1])
    grpo  train.kind=grpo (sample.top_k=0, temperature 1, the grpo.yaml settings): online RL in each round
    prompt      improve=prompt: each round a prompt search (PromptAgent, the policy its own optimiser;
                a config with its own prompt.search, such as a beliefs search over roles, keeps it)
    prompt+rft  improve=both: each round the search, then RFT sampled under the prompt it found

A weights-only method on a config with a search of its own runs without it (improve=weights,
prompt.search=null).

Each cell writes CELL.json (method, seed, rounds, commit, machine, date); --merge reads them all
and prints, per method, the held-out accuracy of the last round finished within the budget (the
mean over seeds, and each seed's), the rounds that fit, and the curve of accuracy against wall
time. Not part of the test suite: a cell takes the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).parents[1]
# the prompt cells' search: the settings of flows/configs/prompt_search.yaml, the policy its own optimiser
SEARCH = "{kind: prompt_agent, iterations: 2, width: 2, depth: 2, batch: 8, score_prompts: 16, reward_prompts: 16}"
METHODS = {
    "rft": ["filter={kind: rft}", "train={kind: rft}"],
    "dpo": ["filter={kind: pairs}", "train={kind: dpo}"],
    # RPO: DPO's loss plus an NLL term on the chosen answer, weight 1 (TRL 1.16 sums loss types)
    "dpo+rpo": ["filter={kind: pairs}", "train={kind: dpo, loss_type: [sigmoid, sft], loss_weights: [1.0, 1.0]}"],
    "grpo": ["train={kind: grpo, steps: 20, batch_size: 4, loss_type: dapo, learning_rate: 1.0e-4, "
             "checkpoint_steps: 5}", "sample.top_k=0", "sample.top_p=1.0", "sample.temperature=1.0"],
    "prompt": ["improve=prompt", f"prompt={{search: {SEARCH}}}"],
    "prompt+rft": ["improve=both", f"prompt={{search: {SEARCH}}}", "filter={kind: rft}", "train={kind: rft}"],
}
# what a method keeps of the config's own `train:` (an override of `train` replaces the section):
# the settings every kind has and the task decides (how long an episode is, the adapter, the
# precision); a method of the config's own kind keeps the whole section
SHARED_TRAIN = ("adapter", "lora", "max_length", "precision", "gradient_checkpointing", "attention")


def overrides(config: str, method: str) -> list[str]:
    """The method's overrides: its `train` section given what the config's has in common with it, the
    config's own `filter` where it is the method's kind (its thresholds are the task's), and the
    config's own prompt search where it has one."""
    import yaml

    cfg = yaml.safe_load(Path(config).read_text()) or {}
    own, own_filter = cfg.get("train") or {}, cfg.get("filter") or {}
    searches = bool((cfg.get("prompt") or {}).get("search"))
    out = []
    for o in METHODS[method]:
        if o.startswith("train="):
            mine = yaml.safe_load(o[len("train="):])
            kept = own if own.get("kind", "rft") == mine["kind"] else {k: own[k] for k in SHARED_TRAIN if k in own}
            o = "train=" + json.dumps({**kept, **mine})
        elif o.startswith("filter="):
            mine = yaml.safe_load(o[len("filter="):])
            o = "filter=" + json.dumps({**(own_filter if own_filter.get("kind", "rft") == mine["kind"] else {}), **mine})
        elif o.startswith("prompt=") and searches:
            continue  # the config's own search
        out.append(o)
    if searches and not any(o.startswith("improve=") for o in out):
        out += ["improve=weights", "prompt.search=null"]  # a weights-only method: no search
    return out


def machine() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    kind = ("AVX-512 with AMX" if "amx_bf16" in flags else "AVX-512 without AMX" if "avx512f" in flags
            else "AVX2" if "avx2" in flags else platform.processor() or "unknown")
    return f"{os.cpu_count()} cores, {kind}"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def rounds_of(work: Path) -> dict[int, dict]:
    """Each round's held-out accuracy (the gate's set), every other set's (a level's, `evaluate.level_2`,
    by its name), the wall of its stages and of its evaluations, from the store."""
    out: dict[int, dict] = {}
    for f in (work / "stages").glob("*/manifest.json"):
        m = json.loads(f.read_text())
        r = out.setdefault(m["round"], {"stage_s": 0.0, "evaluations_s": 0.0, "sets": {}})
        wall = m.get("wall_s") or 0.0
        r["stage_s"] += wall
        if m["stage"] == "evaluate":
            r["accuracy"] = m["metrics"]["accuracy"]
            r["evaluate_s"] = wall
        if m["stage"] == "evaluate" or m["stage"].startswith("evaluate."):
            r["evaluations_s"] += wall
            if m["stage"] != "evaluate":
                r["sets"][m["stage"].removeprefix("evaluate.")] = m["metrics"]["accuracy"]
        if m["stage"] == "curriculum":  # the level the round trained at
            r["level"] = m["metrics"].get("level")
    return out


def cell(config: str, method: str, seed: int, budget_s: float, out: Path, extra: list[str], name: str | None = None,
         less_eval: bool = False) -> dict:
    """One cell: `method`'s overrides and `extra` on `config`, a round more at a time until the budget is
    spent. `name` names the cell (default: the method); `less_eval` leaves every held-out evaluation out
    of the clock (where the cells evaluate different sets, a curriculum's levels reached against every
    level), where by default only the base model's is left out."""
    name = name or method
    work = out / f"{name}-s{seed}"
    record = {"method": name, "seed": seed, "config": config, "budget_s": budget_s,
              "overrides": overrides(config, method) + extra, "clock": "less evaluation" if less_eval else "whole",
              "commit": commit(), "machine": machine(), "date": date.today().isoformat(), "rounds": [],
              "stopped": None}
    spent, r = 0.0, 0
    while spent < budget_s:
        r += 1
        t = time.time()
        done = subprocess.run([sys.executable, "-m", "ratchet.flows.cli", "run", config, f"rounds={r}",
                               f"seed={seed}", f"workdir={work}", *overrides(config, method), *extra], cwd=ROOT,
                              capture_output=True, text=True)
        took = time.time() - t
        rounds = rounds_of(work)
        if r == 1:  # the base model's evaluation: every method's
            took -= rounds.get(0, {}).get("evaluations_s" if less_eval else "evaluate_s", 0.0)
        if less_eval:
            took -= rounds.get(r, {}).get("evaluations_s", 0.0)
        spent += took
        if done.returncode != 0:
            tail = [x for x in done.stdout.splitlines() + done.stderr.splitlines() if x.strip()][-3:]
            record["stopped"] = f"round {r} stopped after {took:.0f} s: " + " / ".join(tail)
            break
        if "accuracy" not in rounds.get(r, {}):  # the run ended before the round (a curriculum's top level)
            record["stopped"] = f"the run ended before round {r}"
            break
        record["rounds"].append({"round": r, "accuracy": rounds[r]["accuracy"], "sets": rounds[r]["sets"],
                                 **({"level": rounds[r]["level"]} if "level" in rounds[r] else {}),
                                 "wall_s": round(took, 1), "spent_s": round(spent, 1)})
        print(f"{name} seed {seed}: round {r} {rounds[r]['accuracy']:.1%} at {spent / 60:.1f} min", flush=True)
    base = rounds_of(work).get(0, {})
    record["base_accuracy"], record["base_sets"] = base.get("accuracy"), base.get("sets", {})
    (out / f"{name}-s{seed}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def pct(a: float | None, digits: int = 1) -> str:
    return "n/a" if a is None else f"{a:.{digits}%}"


def merge(out: Path) -> str:
    cells = [json.loads(f.read_text()) for f in sorted(out.glob("*-s*.json"))]
    if not cells:
        return f"no cells in {out}"
    base = next((c["base_accuracy"] for c in cells if c["base_accuracy"] is not None), None)
    lines = [f"cells in {out}: {', '.join(sorted({c['commit'] for c in cells}))}; {cells[0]['machine']}; "
             f"budget {cells[0]['budget_s'] / 60:.0f} min a cell; base model {pct(base)}", "",
             f"{'method':<10} {'seeds':>5} {'at budget':>10}  {'each seed':<24} {'rounds':>6}  "
             "curve (accuracy at minutes)"]
    for method in METHODS:
        mine = [c for c in cells if c["method"] == method]
        if not mine:
            lines.append(f"{method:<10} {'not measured':>17}")
            continue
        final = []
        for c in mine:
            fit = [x for x in c["rounds"] if x["spent_s"] <= c["budget_s"]]
            final.append(fit[-1]["accuracy"] if fit else c["base_accuracy"])
        each = " ".join(pct(a, 0) for a in final)  # None: the cell stopped before the base was evaluated
        curve = "; ".join(", ".join(f"{x['accuracy']:.0%}@{x['spent_s'] / 60:.1f}" for x in c["rounds"])
                          + (" (stopped)" if c["stopped"] else "") for c in mine)
        fits = "/".join(str(sum(x["spent_s"] <= c["budget_s"] for x in c["rounds"])) for c in mine)
        known = [a for a in final if a is not None]
        mean = pct(sum(known) / len(known)) if known else "n/a"
        lines.append(f"{method:<10} {len(mine):>5} {mean:>10}  {each:<24} {fits:>6}  {curve}")
    stops = [f"{c['method']} seed {c['seed']}: {c['stopped']}" for c in cells if c["stopped"]]
    return "\n".join(lines + ([""] + stops if stops else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--budget-min", type=float, default=15.0, help="wall-time budget of a cell, in minutes")
    ap.add_argument("--out", type=Path, default=Path("bench-out/methods"))
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every cell (key=value)")
    ap.add_argument("--merge", type=Path, help="print the table of the cells in this directory, run nothing")
    a = ap.parse_args()
    if a.merge:
        print(merge(a.merge))
        return
    if not a.config:
        ap.error("give a config to run, or --merge DIR")
    a.out.mkdir(parents=True, exist_ok=True)
    for seed in a.seeds:
        for method in a.methods:
            cell(a.config, method, seed, a.budget_min * 60, a.out, a.set)
    print(merge(a.out))


if __name__ == "__main__":
    main()
