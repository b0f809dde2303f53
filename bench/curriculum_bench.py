"""The curriculum on the default model: from the default task toward 8-digit + 8-digit addition.

    python bench/curriculum_bench.py                         # levels 1-8, RFT, until the run ends
    python bench/curriculum_bench.py --rounds 6 --levels 1 2 3 --workdir /tmp/climb
    python bench/curriculum_bench.py --table-only --workdir /tmp/climb   # the table of a run made before
    python bench/curriculum_bench.py --task chain_sum --levels 1 2 3 4 --eval-size 25 --rounds 10 --workdir /tmp/chain
    python bench/curriculum_bench.py --task chain_sum --levels 1 2 3 4 --eval-size 25 --demos 100 --workdir /tmp/demo
    python bench/curriculum_bench.py --worked --demos 240 --demo-levels 1 2 3 --eval-size 25 --workdir /tmp/worked
    python bench/curriculum_bench.py --worked --demos 320 --demo-levels 1 2 3 4 5 6 7 8 --start 8 --review 0.7 \
        --temperature 0.3 --advance-at 0.9 --eval-size 25 --workdir /tmp/allworked
    python bench/curriculum_bench.py --worked --demos 320 --demo-levels 1 2 3 4 5 6 7 8 --start 8 --review 0.7 \
        --temperature 0.3 --advance-at 0.9 --eval-size 25 --check-working --workdir /tmp/allworked
    python bench/curriculum_bench.py --worked --demos 960 --demo-levels 1 2 3 4 5 6 7 8 --demo-epochs 3 --start 8 \
        --review 0.7 --temperature 0.3 --advance-at 0.9 --eval-size 25 --rounds 1 --workdir /tmp/worked960

It runs `ratchet run` on flows/configs/default.yaml with the addition task's levels (digit
counts) and a curriculum, every round keyed and resumable (run the same command again after a
stop: it continues), then prints each level's held-out accuracy per round, the level each round
trained at, its band, and the wall time. The prompt and answer form are the task's own ("What is
a + b?", the last number of the answer is read). Not a test: it takes hours on 2 cores.

`--worked` (addition): the model is taught, by a cold start on `--demos` demonstrations of the
`--demo-levels` (`worked` below writes them), to write its working before the answer: a digit at
a time from the right, each line the digit sum, the carry added, the answer so far and the digits left;
the last line states the sum, which is the number the check reads. The prompt stays "What
is a + b?"; the levels above the demonstrations' are learnt from the model's own samples alone.
With `--check-working`, the label scores with examples/addition/worked.py's `working` (label.check): a sample
counts only when its working is right on every line; held-out accuracy still reads the last number.

At equal wall time (`--arms`), each arm a cell of bench/method_bench.py, run alone, a round more at
a time until its rounds have taken the budget:

    python bench/curriculum_bench.py --arms curriculum-rft uniform-rft curriculum-dpo curriculum-grpo \
        --levels 1 2 3 4 --eval-size 25 --budget-min 15 --out /tmp/arms
    python bench/curriculum_bench.py --merge /tmp/arms      # the table of the arms run so far

    curriculum-rft    the curriculum, RFT
    uniform-rft       no curriculum: curriculum.prompts prompts a round drawn from every level's train
                      prompts (data.prompts_per_round), RFT
    curriculum-dpo    the curriculum, DPO with RPO's NLL term (method_bench's dpo+rpo)
    curriculum-grpo   the curriculum, GRPO (method_bench's grpo: its round's prompts are the curriculum's)

The clock leaves out every held-out evaluation: the uniform arm evaluates every level each round,
the curriculum only the levels reached and the next. The table gives each level's held-out
accuracy at the last round finished within the budget, and the curve.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "examples" / "addition")]
import method_bench  # noqa: E402  (its cells run the arms; its overrides are each method's)
from worked import compact, first_miss, worked  # noqa: E402  (the working's forms; where an answer first goes wrong)
CONFIGS = ROOT / "flows" / "configs"
# reasoning-gym's chain_sum (sums and differences of whole numbers), a level per number of terms and digits
CHAIN_SUM = {1: (2, 1), 2: (3, 1), 3: (2, 2), 4: (3, 2), 5: (4, 2), 6: (3, 3)}
# each task: its config, and the train problems a level holds by default (chain_sum's first level has
# 200 distinct problems in all)
TASKS = {"addition": ("default.yaml", 500), "chain_sum": ("reasoning_gym.yaml", 150)}


def config(a) -> Path:
    return CONFIGS / TASKS[a.task][0]


def data(a) -> str:
    """The task's `data` section with its levels, as an override."""
    size = f"eval_size: {a.eval_size}, train_size: {a.train_size or TASKS[a.task][1]}"
    if a.task == "addition":  # working names many numbers: the check still reads the last
        check = f", check: {{kind: number, max_numbers: {WORKED_NUMBERS}}}" if a.worked else ""
        return f"kind: addition, levels: {list(a.levels)}, {size}{check}"
    levels = ", ".join(f"{n}: {{min_terms: {t}, max_terms: {t}, min_digits: {d}, max_digits: {d}}}"
                       for n, (t, d) in CHAIN_SUM.items() if n in a.levels)
    return (f"kind: reasoning_gym, dataset: chain_sum, config: {{}}, levels: {{{levels}}}, {size}, "
            "instruction: Give only the final answer., check: {read: auto}")


def curriculum_of(a) -> str:
    review = f", review: {a.review}" if getattr(a, "review", 0) else ""
    start = f", start: {a.start}" if getattr(a, "start", None) else ""
    return f"prompts: {a.prompts}, advance_at: {a.advance_at}, patience: {a.patience}{review}{start}"


def overrides(a, demos: bool = True) -> list[str]:
    name = f"climb-{a.train}" if a.task == "addition" else f"climb-{a.task}-{a.train}"
    name += ("-worked" if getattr(a, "form", "worked") == "worked" else f"-{a.form}") if a.worked else ""
    name += "-checked" if getattr(a, "check_working", False) else ""
    cold = f"cold_start={{demonstrations: {demonstrations_file(a)}"
    if a.worked:
        cold_train = [f"epochs: {getattr(a, 'demo_epochs', 3)}", f"max_length: {WORKED_LENGTH}",
                      *([f"adapter: {a.demo_adapter}"] if getattr(a, "demo_adapter", None) else []),
                      *([f"learning_rate: {a.demo_lr}"] if getattr(a, "demo_lr", None) else [])]
        cold += f", train: {{{', '.join(cold_train)}}}}}"
    else:
        cold += "}"
    return [f"workdir={a.workdir}", f"rounds={a.rounds}", f"name={name}", f"data={{{data(a)}}}",
            f"curriculum={{{curriculum_of(a)}}}", *method_overrides(a, TRAIN_METHOD[a.train]),
            *(worked_overrides() if a.worked else []),
            *([f"label.check={{kind: python, function: '{ROOT / 'examples' / 'addition' / 'worked.py'}:working'}}"]
              if getattr(a, "check_working", False) else []),
            *([f"sample.temperature={a.temperature}"] if getattr(a, "temperature", None) is not None else []),
            *([f"train.learning_rate={a.lr}"] if getattr(a, "lr", None) is not None else []),
            *([cold] if demos and getattr(a, "demos", 0) else [])]


# --worked: room for the working of an 8-digit sum (369 tokens at most) in samples, evaluation and training; the
# right samples kept at random, not the shortest (a bare answer is shorter, and right on short sums)
WORKED_TOKENS, WORKED_LENGTH, WORKED_NUMBERS = 384, 448, 96


def worked_overrides() -> list[str]:
    return [f"sample.max_tokens={WORKED_TOKENS}", f"evaluate.max_tokens={WORKED_TOKENS}",
            f"train.max_length={WORKED_LENGTH}", "filter.prefer=random"]


def misses(answers: list[dict]) -> str:
    """Each level's answers (the gate's held-out set, every level) by where they first went wrong."""
    from collections import Counter, defaultdict

    by: dict[int, Counter] = defaultdict(Counter)
    for r in answers:
        x, y = (int(v) for v in r["prompt_id"].removeprefix("add-").split("-"))
        by[len(str(max(x, y)))][first_miss(x, y, r.get("text") or "", bool(r.get("correct")))] += 1
    return "\n".join(f"L{n}: " + ", ".join(f"{k} {c}" for k, c in by[n].most_common()) for n in sorted(by))


def demonstrations_file(a) -> Path:
    return Path(a.workdir) / "demonstrations.jsonl"


def write_demonstrations(a) -> str:
    """--demos N: N of the first level's train problems (seeded), each with its reference answer as the
    completion, written for the cold start; with --worked, N spread evenly over --demo-levels, each
    worked (`worked`). Returns what they hold."""
    import random

    from ratchet.data.prompts import load_split
    from ratchet.flows.config import load_config

    cfg = load_config(config(a), overrides(a, demos=False))
    train = load_split(cfg.data, cfg.seed).train
    if a.worked:
        levels = a.demo_levels or [min(a.levels)]
        rows = worked_rows(a.demos, train, levels, FORMS[getattr(a, "form", "worked")])
        return f"{len(rows)} worked demonstrations of levels {levels} in {write_rows(a, rows)}"
    first = [p for p in train if p.level == min(a.levels)]
    random.Random(0).shuffle(first)
    rows = [{"prompt": p.prompt, "completion": p.answer, "answer": p.answer} for p in first[: a.demos]]
    if a.task != "addition":  # a reasoning-gym problem of one's own is scored by its dataset entry
        for r, p in zip(rows, first):
            r["entry"] = cfg.data.check.entry(p.id)
    negative = sum(r["answer"].startswith("-") for r in rows)
    return (f"{len(rows)} demonstrations of level {min(a.levels)} in {write_rows(a, rows)} ({negative} with a "
            "negative answer)")


def worked_rows(count: int, train: list, levels: list[int], form=worked) -> list[dict]:
    """`count` train problems spread evenly over `levels` (each level's seeded), each answered by `form`
    (`worked`, or `compact`)."""
    import random

    rows = []
    for i, n in enumerate(levels):
        pool = [p for p in train if p.level == n]
        random.Random(n).shuffle(pool)
        for p in pool[: count // len(levels) + (i < count % len(levels))]:
            x, y = (int(v) for v in p.id.removeprefix("add-").split("-"))
            rows.append({"prompt": p.prompt, "completion": form(x, y), "answer": p.answer})
    return rows


def write_rows(a, rows: list[dict]) -> Path:
    """The demonstrations file, written."""
    import json

    path = demonstrations_file(a)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FORMS = {"worked": worked, "compact": compact}  # --form: the working the demonstrations write


# --train and an arm's method: the overrides of bench/method_bench.py's cell of that name
TRAIN_METHOD = {"rft": "rft", "dpo": "dpo+rpo", "grpo": "grpo"}
ARMS = {"curriculum-rft": ("rft", True), "uniform-rft": ("rft", False), "curriculum-dpo": ("dpo+rpo", True),
        "curriculum-grpo": ("grpo", True)}


def method_overrides(a, method: str) -> list[str]:
    return method_bench.overrides(str(config(a)), method)


def arm_overrides(a, curriculum: bool) -> list[str]:
    """The levels, and the curriculum or (without one) the same number of prompts a round drawn from every
    level's train prompts."""
    if curriculum:
        return [f"data={{{data(a)}}}", f"curriculum={{{curriculum_of(a)}}}"]
    return [f"data={{{data(a)}, prompts_per_round: {a.prompts}}}"]


def arms(a) -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    for arm in a.arms:
        method, curriculum = ARMS[arm]
        method_bench.cell(str(config(a)), method, a.seed, a.budget_min * 60, a.out, arm_overrides(a, curriculum),
                          name=arm, less_eval=True)


def merge(out: Path) -> str:
    """Each arm's held-out accuracy by level at the last round within the budget, and its curve."""
    import json

    cells = {c["method"]: c for c in (json.loads(f.read_text()) for f in sorted(out.glob("*-s*.json")))}
    if not cells:
        return f"no arms in {out}"
    for c in cells.values():  # each round's sets, as the arm's store has them
        store = method_bench.rounds_of(out / f"{c['method']}-s{c['seed']}")
        c["base_sets"] = store.get(0, {}).get("sets", c["base_sets"])
        for x in c["rounds"]:
            x["sets"] = store.get(x["round"], {}).get("sets", x["sets"])
    first = next(iter(cells.values()))
    every = [sets for c in cells.values() for sets in [c["base_sets"], *(x["sets"] for x in c["rounds"])]]
    levels = sorted({int(k.removeprefix("level_")) for sets in every for k in sets if k.startswith("level_")})
    lines = [f"arms in {out}: {', '.join(sorted({c['commit'] for c in cells.values()}))}; {first['machine']}; "
             f"budget {first['budget_s'] / 60:.0f} min an arm, the clock less evaluation", "",
             f"{'arm':<16} {'rounds':>6} {'level':>5} " + " ".join(f"{'L' + str(n):>5}" for n in levels)]
    base = {k: v for c in cells.values() for k, v in c["base_sets"].items()}  # the same model, whichever arm
    lines.append(f"{'base model':<16} {'':>6} {'':>5} " + " ".join(
        f"{base[f'level_{n}']:5.0%}" if f"level_{n}" in base else f"{'-':>5}" for n in levels))
    for arm in [x for x in ARMS if x in cells]:
        c = cells[arm]
        fit = [x for x in c["rounds"] if x["spent_s"] <= c["budget_s"]]
        last = fit[-1] if fit else {"sets": c["base_sets"]}
        # a curriculum's round evaluates the levels reached and the next; a level it did not is shown as -
        row = " ".join(f"{last['sets'][f'level_{n}']:5.0%}" if f"level_{n}" in last["sets"] else f"{'-':>5}"
                       for n in levels)
        level = last.get("level")
        lines.append(f"{arm:<16} {len(fit):>6} {'-' if level is None else int(level):>5} {row}")
    lines.append("")
    for arm in [x for x in ARMS if x in cells]:
        c = cells[arm]
        curve = ", ".join(f"r{x['round']}@{x['spent_s'] / 60:.1f}min L{int(x['level']) if 'level' in x else '-'} "
                          + "/".join(f"{x['sets'][f'level_{n}']:.0%}" for n in levels if f"level_{n}" in x["sets"])
                          for x in c["rounds"])
        lines.append(f"{arm}: {curve}" + (f" ({c['stopped']})" if c["stopped"] else ""))
    return "\n".join(lines)


def table(a) -> str:
    from ratchet.flows.config import load_config
    from ratchet.flows.report import gather
    from ratchet.flows.tracking import Tracker

    cfg = load_config(config(a), overrides(a))
    rep = gather(a.workdir, Tracker(cfg.tracking, a.workdir, cfg.name))
    levels = sorted({int(n.removeprefix("level_")) for r in rep.rounds for n in r.sets if n.startswith("level_")})
    head = f"{'round':>5} {'level':>5} {'band':>5} " + " ".join(f"{'L' + str(n):>6}" for n in levels)
    rows = [head]
    for r in rep.rounds:
        cells = " ".join(f"{100 * r.sets[f'level_{n}']:5.1f}%" if f"level_{n}" in r.sets else f"{'':>6}"
                         for n in levels)
        rows.append(f"{r.round:>5} {r.level if r.level is not None else '-':>5} "
                    f"{r.band if r.band is not None else '-':>5} {cells}")
    if a.worked and getattr(a, "form", "worked") == "worked" and rep.rounds and rep.rounds[-1].answers:
        rows += ["", f"round {rep.rounds[-1].round}'s held-out answers, by where each first went wrong:",
                 misses(rep.rounds[-1].answers)]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ratchet-climb"))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--levels", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--eval-size", type=int, default=50)
    ap.add_argument("--task", choices=list(TASKS), default="addition",
                    help="addition (levels: digit counts) or reasoning-gym's chain_sum (levels 1-6: terms x digits, "
                    f"{CHAIN_SUM})")
    ap.add_argument("--train-size", type=int, help="train problems a level holds (addition 500, chain_sum 150)")
    ap.add_argument("--prompts", type=int, default=64, help="curriculum.prompts")
    ap.add_argument("--advance-at", type=float, default=0.9, help="curriculum.advance_at")
    ap.add_argument("--patience", type=int, default=4, help="curriculum.patience")
    ap.add_argument("--review", type=float, default=0.0, help="curriculum.review: the share of a round's prompts "
                    "drawn from the levels below the current one")
    ap.add_argument("--temperature", type=float, help="sample.temperature (default: the config's, 0.8)")
    ap.add_argument("--lr", type=float, help="train.learning_rate of the rounds (default: the method's, 2e-4 for "
                    "RFT); the cold start keeps its own")
    ap.add_argument("--start", type=int, help="curriculum.start: the level the first curriculum round trains at "
                    "(default: the first); every level below it counts as reached")
    ap.add_argument("--train", choices=["rft", "dpo", "grpo"], default="rft")
    ap.add_argument("--demos", type=int, default=0, help="begin with a cold start on this many of the first "
                    "level's train problems, each answered with its reference answer")
    ap.add_argument("--worked", action="store_true", help="addition: answers with working, taught by a cold "
                    "start on --demos worked demonstrations of --demo-levels")
    ap.add_argument("--check-working", action="store_true", help="with --worked, label with a check of the "
                    "working itself (examples/addition/worked.py's `working`: right only when every line is), so RFT keeps only "
                    "right workings; held-out accuracy still reads the last number")
    ap.add_argument("--form", choices=list(FORMS), default="worked", help="with --worked, the working's form: "
                    "worked (what is left copied into every line) or compact (a short step a digit)")
    ap.add_argument("--demo-levels", type=int, nargs="+", help="with --worked, the levels the demonstrations are "
                    "drawn from (default: the first)")
    ap.add_argument("--demo-epochs", type=float, default=3, help="with --worked, the cold start's epochs")
    ap.add_argument("--demo-adapter", choices=["lora", "full"], help="with --worked, the cold start's adapter "
                    "(default: LoRA)")
    ap.add_argument("--demo-lr", type=float, help="with --worked, the cold start's learning rate (default: "
                    "2e-4; ~1e-5 suits --demo-adapter full)")
    ap.add_argument("--table-only", action="store_true", help="print the table of the run in --workdir")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), help="run these arms at equal wall time (--budget-min)")
    ap.add_argument("--budget-min", type=float, default=15.0, help="an arm's wall-time budget, less evaluation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/ratchet-arms"), help="the arms' cells")
    ap.add_argument("--merge", type=Path, help="print the table of the arms in this directory, run nothing")
    a = ap.parse_args(argv)
    if a.worked and (a.task != "addition" or not a.demos):
        ap.error("--worked is for --task addition, with --demos N (the cold start that teaches the working)")
    if a.check_working and not a.worked:
        ap.error("--check-working checks the working that --worked teaches; add --worked")
    if a.merge:
        print(merge(a.merge))
        return 0
    if a.arms:
        arms(a)
        print(merge(a.out))
        return 0
    t0 = time.time()
    if a.demos and not a.table_only:
        print(write_demonstrations(a), flush=True)
    if not a.table_only:
        cmd = [sys.executable, "-m", "ratchet.flows.cli", "run", str(config(a)),
               *overrides(a)]
        print(" ".join(cmd), flush=True)
        done = subprocess.run(cmd)
        print(f"ratchet run exited {done.returncode} after {time.time() - t0:.0f} s", flush=True)
    print(table(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
