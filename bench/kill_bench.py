"""Kill small runs with SIGKILL at random moments, resume each, and compare with unbroken runs.

    python bench/kill_bench.py --kills 4 --seed 0 --out /tmp/kills

Each workload is a shipped config shrunk onto a tiny random model (2 layers, the default model's
tokenizer: every stage's real code, seconds a stage):

- `search-rft`: a round that searches for a prompt, then samples, labels, filters and trains
  under it (default.yaml, improve: both);
- `cold-start-grpo`: a cold start on demonstrations, then a GRPO round (grpo.yaml);
- `self-reward-dpo`: the policy judges its own samples, then DPO (self_reward_dpo.yaml).

And three on the shipped path, run only when named (`--workloads shipped-grpo ...`): the default
model, `auto`'s dtype (bf16 where this CPU runs it faster), vLLM sampling, each config shrunk in
prompts and steps but not in model (minutes a run; `--stages train` aims every kill mid-training):

- `shipped-grpo`: grpo.yaml, one round of 8 steps, a checkpoint every 2 (`shipped-grpo-fp32`: the
  same in float32, engine and trainer);
- `shipped-rft`: default.yaml, one round, 2 epochs, a checkpoint every 2 steps;
- `shipped-dpo`: self_reward_dpo.yaml, one round, 2 epochs, a checkpoint every 2 steps.

For each: one unbroken run, timed; then K runs of the same command, each in a workdir of its own,
whose whole process group is killed with SIGKILL (a lost machine) at a moment drawn at random
inside a stage of the unbroken run (each kill another stage, chosen at random, so that every kind
is cut mid-way; `--moments anywhere`: in (1 s, its wall)), the stage it was in read from the console, and then the same
command run again to its end. Each killed-and-resumed run must match the unbroken one on the
champion's and the newest version's chain: every stage's key and output digests (so the
champion's weights), its metrics but timings, and each online train stage's ledger. It prints
one line per kill and per workload, and writes DIR/kills.json."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' tiny model (tests/flows/tiny.py)
CONFIGS = ROOT / "flows" / "configs"
# sized so that each stage that does work runs for seconds, long enough to be cut mid-way
TINY = ["rounds=1", "sampler.backend=hf", "sampler.dtype=float32", "data.a_max=12", "data.b_max=8",
        "data.train_size=48", "data.eval_size=24", "sample.max_tokens=32", "evaluate.max_tokens=32"]


def tiny_model(out: Path) -> Path:
    """A 2-layer random Llama with the default model's tokenizer, as the tests make it."""
    if (out / "config.json").exists():
        return out
    from ratchet.models.default_model import default_model_dir
    from tests.flows.tiny import tiny_causal_lm

    return tiny_causal_lm(out, default_model_dir(), seed=0)


# the shipped path shrunk in prompts and steps, not in model or dtype: the default model, `auto`, vLLM
SHIPPED = ["rounds=1", "data.train_size=24", "data.eval_size=16", "sample.max_tokens=40", "evaluate.max_tokens=40"]


def workloads(model: Path, out: Path) -> dict[str, list[str]]:
    """Each workload's `ratchet run` arguments, less its workdir."""
    from ratchet.data.prompts import load_split
    from ratchet.flows.config import load_config

    (out / "reward.py").write_text("import re\n\ndef score(completion, answer=None, prompt=None, **fields):\n"
                                   "    return float(int(re.findall(r'\\d+', prompt)[0]) % 2 == 1)\n")
    grpo = [str(CONFIGS / "grpo.yaml"), f"model.path={model}", *TINY, "sample.n=4", "train.steps=8",
            "train.batch_size=2", "train.checkpoint_steps=2"]
    split = load_split(load_config(grpo[0], grpo[1:]).data, 0, train_answers=True)
    demos = out / "demos.jsonl"
    demos.write_text("".join(json.dumps({"id": p.id, "prompt": p.prompt, "completion": f"It is {p.answer}.",
                                         "answer": p.answer}) + "\n" for p in split.train[:6]))
    search = "prompt.search={kind: prompt_agent, iterations: 2, width: 2, depth: 2, batch: 6, score_prompts: 12, " \
             "reward_prompts: 12, feedback_tokens: 32, revision_tokens: 32}"
    return {
        "search-rft": [str(CONFIGS / "default.yaml"), f"model.path={model}", *TINY, "sample.n=4", "train.epochs=3",
                       "filter.min_rows=1", "label.kind=verifier", "filter.max_per_prompt=2",
                       "prompt.template='Q: {prompt}'", "improve=both", search, "train.checkpoint_steps=2",
                       f"data.check={{kind: python, function: '{out / 'reward.py'}:score'}}"],
        "cold-start-grpo": [*grpo, f"cold_start.demonstrations={demos}", "cold_start.train.epochs=2",
                            "cold_start.train.batch_size=3"],
        "self-reward-dpo": [str(CONFIGS / "self_reward_dpo.yaml"), f"model.path={model}", *TINY, "sample.n=4",
                            "sample.shard_size=3", "label.top_logprobs=60000", "label.shard_size=9",
                            "filter.margin=0", "filter.min_pairs=1", "filter.max_length_ratio=null",
                            "train.epochs=2", "train.batch_size=4", "train.checkpoint_steps=2", "agreement.min=null"],
        "shipped-grpo": [str(CONFIGS / "grpo.yaml"), *SHIPPED, "train.steps=8", "train.checkpoint_steps=2"],
        "shipped-grpo-fp32": [str(CONFIGS / "grpo.yaml"), *SHIPPED, "train.steps=8", "train.checkpoint_steps=2",
                              "sampler.dtype=float32", "train.precision=fp32"],
        "shipped-rft": [str(CONFIGS / "default.yaml"), *SHIPPED, "sample.n=4", "filter.min_rows=4",
                        "train.checkpoint_steps=2", "train.batch_size=4"],
        "shipped-dpo": [str(CONFIGS / "self_reward_dpo.yaml"), *SHIPPED, "sample.n=4", "filter.min_pairs=1",
                        "train.epochs=2", "train.batch_size=4", "train.checkpoint_steps=2", "agreement.min=null"],
    }


SHIPPED_ONLY = ("shipped-grpo", "shipped-grpo-fp32", "shipped-rft", "shipped-dpo")  # minutes a run: only when named


def started(args: list[str], sink) -> subprocess.Popen:
    """`ratchet ARGS` started in a process group of its own, its own temporary Prefect server, its
    console piped, its log to `sink`."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return subprocess.Popen([sys.executable, "-m", "ratchet.flows.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=sink, text=True, start_new_session=True)


def ratchet(*args: str, timeout: float | None = None, log: Path | None = None) -> tuple[int | None, str, float]:
    """`ratchet ARGS` in a process group of its own; killed (the whole group, SIGKILL) after
    `timeout` s. (exit code, or None where killed; its output; its wall)."""
    start = time.time()
    with open(log or os.devnull, "w") as sink:
        p = started(args, sink)
        try:
            out, _ = p.communicate(timeout=timeout)
            return p.returncode, out, time.time() - start
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            return None, out, time.time() - start


def ratchet_cut(args: list[str], stage: str, after: float, log: Path,
                checkpoint: Path | None = None) -> tuple[int | None, str, float]:
    """`ratchet run ARGS` killed (its whole group, SIGKILL) `after` s past the moment its console says
    `stage` ("train (round 1)") started: aimed by the run's own progress, not by the clock of the
    unbroken run, so that a machine busier or idler than it was still cuts the stage mid-way. With
    `checkpoint` (the workdir), `after` s past the moment the stage's first trainer checkpoint is whole
    (its trainer_state.json written, as a resume requires) instead: the resumed attempt trains from it.
    (exit code, or None where killed; its output; the kill's moment from the command's start)."""
    import threading

    name, rnd = re.match(r"(\S+) \(round (\d+)\)", stage).groups()
    start, lines, cut = time.time(), [], []
    with open(log, "w") as sink:
        p = started(["run", *args], sink)

        def kill() -> None:
            cut.append(time.time() - start)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

        timer, done = None, threading.Event()

        def cut_after() -> None:  # `after` s past the stage's start, or past its first whole checkpoint
            while checkpoint is not None and not done.is_set() and not list(
                    checkpoint.glob(f"stages/{name}-*/checkpoints/checkpoint-*/trainer_state.json")):
                time.sleep(0.05)
            if not done.wait(after):
                kill()

        for line in p.stdout:
            lines.append(line)
            if timer is None and re.search(rf"round {rnd}\s+{re.escape(name)}\s+started", line):
                timer = threading.Thread(target=cut_after, daemon=True)
                timer.start()
        p.wait()
        done.set()  # a run that ended before its moment is not cut
    return (None if cut else p.returncode), "".join(lines), (cut[0] if cut else time.time() - start)


def running(console: str) -> str:
    """The stage the console last said started and did not say finished."""
    state: dict[str, str] = {}
    for m in re.finditer(r"round (\d+)\s+(\w[\w-]*)\s+(started|✓|↺ reused|✗)", console):
        state[f"{m.group(2)} (round {m.group(1)})"] = m.group(3)
    live = [s for s, how in state.items() if how == "started"]
    if live:
        return live[-1]
    return f"between stages, after {list(state)[-1]}" if state else "its start, before its first stage"


def windows(console: str, started: float) -> list[tuple[str, float, float]]:
    """(stage, from, to): each stage the console says ran, in seconds from the command's start
    (`started`, a time.time()), where it ran for 2 s or more (a shorter one cannot be aimed at)."""
    day = time.strftime("%Y-%m-%d ", time.localtime(started))
    at = lambda hms: time.mktime(time.strptime(day + hms, "%Y-%m-%d %H:%M:%S")) - started  # noqa: E731
    began, out = {}, []
    for m in re.finditer(r"^(\d\d:\d\d:\d\d) round (\d+)\s+(\w[\w-]*)\s+(started|✓)", console, re.M):
        name = f"{m.group(3)} (round {m.group(2)})"
        if m.group(4) == "started":
            began[name] = at(m.group(1))
        elif name in began and at(m.group(1)) - began[name] >= 2:
            out.append((name, began[name], at(m.group(1))))
    return out


# metrics that say how the attempt that finished a stage went, not what the stage made: that it resumed,
# from which step, how many engine holders it had (the executor is not in a key), how often an online
# stage's engine took new weights (a resumed one loads its checkpoint's once more), and, by their
# `_reused` names, how many shards or answers it read back instead of making them again
ATTEMPT = ("resumed", "resumed_from_step", "holders", "syncs")


def timing(name: str) -> bool:
    """A metric of the attempt: a time, a rate, a reuse count or one of ATTEMPT."""
    return name.endswith(("_s", "_reused")) or "per_s" in name or "wall" in name or name in ATTEMPT


def comparable(lineage: list[dict]) -> list[dict]:
    """A lineage JSON as the comparison reads it: every link's stage, round, key, output digests,
    parents and ledger, and its metrics but the attempt's (`timing`); not when, how fast or in how
    many attempts it ran."""
    keep = ("stage", "round", "key", "dir", "outputs", "parents", "verified", "ledger", "code_version")
    return [{**{k: link.get(k) for k in keep},
             "metrics": {n: v for n, v in (link.get("metrics") or {}).items() if not timing(n)}} for link in lineage]


def chains(args: list[str], work: Path) -> dict[str, list[dict]]:
    """The champion's and the newest version's chains, as `ratchet lineage --json` prints them."""
    out = {}
    for target in ("champion", None):
        code, said, _ = ratchet("lineage", *args, f"workdir={work}", *([target] if target else []), "--json")
        if code != 0:
            raise SystemExit(f"lineage of {work} failed ({code}): {said[-2000:]}")
        out[target or "newest"] = comparable(json.loads(said))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=4, help="killed runs per workload, each resumed to its end")
    ap.add_argument("--seed", type=int, default=0, help="seeds the moments")
    ap.add_argument("--out", type=Path, required=True, help="a new folder for the runs and kills.json")
    ap.add_argument("--moments", choices=["stages", "anywhere"], default="stages", help="stages: each kill at a "
                    "random moment inside a stage of the unbroken run (a different stage each, at random); "
                    "anywhere: at a random moment of the run")
    ap.add_argument("--workloads", nargs="*", default=None, help="a subset: search-rft cold-start-grpo "
                    "self-reward-dpo shipped-grpo shipped-grpo-fp32 shipped-rft shipped-dpo (default: the first three)")
    ap.add_argument("--stages", nargs="*", default=None, help="with --moments stages, aim only at these stages "
                    "(train: every kill mid-training)")
    ap.add_argument("--after-checkpoint", action="store_true", help="with --stages, each kill within 1 s after "
                    "the aimed stage's first trainer checkpoint appears (a resume mid-epoch, from it)")
    ap.add_argument("--recompare", action="store_true", help="run nothing: compare the runs DIR holds again "
                    "(after the comparison changed), and rewrite DIR/kills.json")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    model = tiny_model(a.out / "tiny-model")
    if a.recompare:
        return recompare(a.out, workloads(model, a.out))
    results = []
    for name, args in workloads(model, a.out).items():
        if (a.workloads and name not in a.workloads) or (not a.workloads and name in SHIPPED_ONLY):
            continue
        ref = a.out / name / "unbroken"
        t0 = time.time()
        code, console, wall = ratchet("run", *args, f"workdir={ref}", log=a.out / f"{name}-unbroken.log")
        if code != 0:
            raise SystemExit(f"{name}: the unbroken run failed ({code}); see {a.out / f'{name}-unbroken.log'}")
        stages = [w for w in windows(console, t0) if not a.stages or w[0].split(" (")[0] in a.stages]
        print(f"{name}: unbroken run {wall:.0f} s; stages of 2 s or more: "
              f"{', '.join(f'{n} {end - begin:.0f} s' for n, begin, end in stages)}", flush=True)
        want, kills = chains(args, ref), []
        # the moments: with --moments stages, one drawn inside each of K stages of the unbroken run
        # (chosen at random where there are more), so that every kind of stage is cut mid-way; else
        # anywhere in (1 s, the wall)
        aimed = rng.sample(stages, min(a.kills, len(stages))) if a.moments == "stages" else []
        if a.stages and stages:  # every kill inside one of the named stages, more kills than stages reusing them
            aimed = [stages[k % len(stages)] for k in range(a.kills)]
        for k in range(a.kills):  # each kill in a run of its own, resumed to its end
            killed = a.out / name / f"killed-{k}"
            if k < len(aimed):  # a moment inside the stage, counted from its start in this run
                stage, begin, end = aimed[k]
                after = rng.uniform(0.0, 1.0) if a.after_checkpoint else rng.uniform(0.5, end - begin - 0.5)
                code, console, at = ratchet_cut([*args, f"workdir={killed}"], stage, after,
                                                log=a.out / f"{name}-killed-{k}.log",
                                                checkpoint=killed if a.after_checkpoint else None)
            else:
                at = rng.uniform(1.0, wall)
                code, console, _ = ratchet("run", *args, f"workdir={killed}", timeout=at,
                                           log=a.out / f"{name}-killed-{k}.log")
            if code is not None:
                raise SystemExit(f"{name}: the run finished ({code}) before its kill at {at:.1f} s; see "
                                 f"{a.out / f'{name}-killed-{k}.log'}")
            where = running(console)
            (a.out / f"{name}-killed-{k}.console").write_text(console)
            code, _, took = ratchet("run", *args, f"workdir={killed}", log=a.out / f"{name}-resumed-{k}.log")
            if code != 0:
                raise SystemExit(f"{name}: the resumed run failed ({code}); see {a.out / f'{name}-resumed-{k}.log'}")
            same, differ = compared(want, chains(args, killed))
            aim = f"aimed at {aimed[k][0]}, " if k < len(aimed) else ""
            kills.append({"at_s": round(at, 1), "aimed_at": aimed[k][0] if k < len(aimed) else None, "stage": where,
                          "resumed_s": round(took, 1), "same": same, "differ": differ})
            print(f"  kill {k + 1}: at {at:.1f} s ({aim}in {where}); resumed in {took:.0f} s; "
                  f"{'matches' if all(same.values()) else 'DIFFERS: ' + ', '.join(differ)}", flush=True)
        ledgers = [x["ledger"] for x in want["newest"] if x.get("ledger")]
        results.append({"workload": name, "unbroken_s": round(wall, 1), "kills": kills,
                        "ledger_steps": sum(len(x) for x in ledgers)})
        matched = sum(all(x["same"].values()) for x in kills)
        steps = f", {results[-1]['ledger_steps']} ledger steps compared" if ledgers else ""
        print(f"{name}: {matched} of {len(kills)} killed runs ended where the unbroken run ends{steps}", flush=True)
    (a.out / "kills.json").write_text(json.dumps(results, indent=1))
    kills = [x for r in results for x in r["kills"]]
    matched = sum(all(x["same"].values()) for x in kills)
    print(f"{matched} of {len(kills)} kills in {len(results)} workload(s) ended where an unbroken run ends "
          f"({a.out / 'kills.json'})")
    return 0 if matched == len(kills) else 1


def compared(want: dict, got: dict) -> tuple[dict, list[str]]:
    """Whether each chain matches, and the newest chain's links that do not."""
    return ({t: want[t] == got[t] for t in want},
            [f"{w['stage']} (round {w['round']})" for w, g in zip(want["newest"], got["newest"]) if w != g])


def recompare(out: Path, args_of: dict[str, list[str]]) -> int:
    results = json.loads((out / "kills.json").read_text())
    for r in results:
        args = args_of[r["workload"]]
        want = chains(args, out / r["workload"] / "unbroken")
        for k, x in enumerate(r["kills"]):
            x["same"], x["differ"] = compared(want, chains(args, out / r["workload"] / f"killed-{k}"))
            print(f"{r['workload']} kill {k + 1}: at {x['at_s']} s in {x['stage']}: "
                  f"{'matches' if all(x['same'].values()) else 'DIFFERS: ' + ', '.join(x['differ'])}", flush=True)
    (out / "kills.json").write_text(json.dumps(results, indent=1))
    kills = [x for r in results for x in r["kills"]]
    matched = sum(all(x["same"].values()) for x in kills)
    print(f"{matched} of {len(kills)} kills ended where an unbroken run ends")
    return 0 if matched == len(kills) else 1


if __name__ == "__main__":
    sys.exit(main())
