"""Growing past the labels (docs/guides/grow.md), measured: the default model taught addition up to
--labeled-to digits by worked demonstrations (the cold start), then rounds with no labels past
them: each round one level harder (curriculum.advance_by=rounds, or labels), a vote across
--models models (label.kind=vote), the length filter, a share of the levels below in every round,
and each round's label precision per level against references no stage reads.

    python bench/grow_bench.py --workdir /tmp/grow                       # 1-8 taught, grown to 16
    python bench/grow_bench.py --workdir /tmp/grow --table-only          # the table of that run
    python bench/grow_bench.py --workdir /tmp/grow --labels reference    # the same with every level labeled
    python bench/grow_bench.py --workdir /tmp/grow --form shifted --copies 190 --copy-to 20 --labels self
                               # the shifted form, with demonstrations of copying numbers of 2-20 digits
    python bench/grow_bench.py --workdir /tmp/grow --form worked --demos 920 --labels self --levels-to 10 --rounds 1 \
                               --fresh 0 --max-tokens 640 --context 1024
                               # the worked form (every step local, 55 tokens a digit), taught to 8, read at 9 and 10
    python bench/grow_bench.py --workdir /tmp/grow --form worked --demos 920 --labels vote --models 3 --share 1.0 \
                               --n 1 --temperature 0 --prompts 128 --fresh 0 --gate guard --max-tokens 900 \
                               --context 1024 train.gradient_checkpointing=true
                               # the climb of docs/results.md: greedy votes of three models, the 8-digit guard
                               # as the gate; then its version on 200 fresh 16-digit sums:
    python bench/grow_bench.py ...the same... --evaluate VERSION --fresh 200 --target 16
    python bench/grow_bench.py --misses /tmp/grow/stages/evaluate.level_9-*/eval.jsonl
                               # where each answer first goes wrong: the copy, a step, the read-back
    python bench/grow_bench.py --task chain_sum --workdir /tmp/grow-cs --labeled-to 2 --levels-to 5 --labels vote \
                               --n 8 --prompts 96 --rounds 4 --max-tokens 32 --fresh 0 --by prompt
                               # a second task: reasoning-gym's chain_sum, two terms of 1..N digits, answers only
    python bench/grow_bench.py --task chain_sum --form worked --workdir /tmp/grow-csw --labeled-to 3 --levels-to 6 \
                               --demos 450 --demo-epochs 4 --train-size 150 --n 4 --temperature 0.3 --prompts 64 \
                               --share 0.7 --max-tokens 320 --fresh 0 --by prompt --rounds 3
                               # the same worked a digit at a time (40-47 tokens a digit), its differences too

`--task chain_sum` grows reasoning-gym's chain_sum (sums and differences) by its difficulty knob:
level N is --terms terms of N digits each; the demonstrations are the labeled levels' reference
answers (the final answer alone, as flows/configs/reasoning_gym.yaml asks), or with --form worked
their working a digit at a time (examples/addition/worked.py `worked_expression`, two terms),
scored by the dataset's own scorer. A difference can be much shorter than its level's sums, so
the length filter there holds each answer to its prompt's other samples (`--by prompt`).

It is `ratchet run` with overrides (printed first): killed, the same command resumes it, and a
finished one reuses every stage. The table gives, per round, the level it trained at, each level's
held-out accuracy (25 prompts a level by default; the target set, --target digits, 200 fresh
prompts, with its 95% Wilson interval), and each level's label precision (the share of the round's
own labels the hidden references call right, with how many labels). `--labels` compares at equal
settings: vote (the models' own labels), self (a vote among one model's samples,
label.kind=consistency), reference (every level labeled: the verifier; the ceiling).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "addition"))
# the working's forms
from worked import compact, copy, first_miss_tagged, indexed, shifted, worked, worked_expression  # noqa: E402

FORMS = {"compact": compact, "indexed": indexed, "shifted": shifted, "worked": worked}


def tokens_per_digit(form, digits: list[int]) -> dict[int, float]:
    """The form's answer tokens (the default model's tokenizer) per digit, at each digit count."""
    import random

    from transformers import AutoTokenizer

    from ratchet.models.default_model import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    rng = random.Random(0)
    out = {}
    for n in digits:
        lo, hi = 10 ** (n - 1), 10 ** n - 1
        pairs = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(20)]
        out[n] = sum(len(tok(form(a, b))["input_ids"]) for a, b in pairs) / len(pairs) / n
    return out


CONFIGS = {"addition": "default.yaml", "chain_sum": "reasoning_gym.yaml"}


def config(a) -> Path:
    return ROOT / "flows" / "configs" / CONFIGS[a.task]


def demonstrations(a) -> Path:
    """--demos answers spread evenly over the labeled levels, each level's train prompts drawn
    (seeded): addition's worked in --form, chain_sum's the reference answer alone."""
    import random

    from ratchet.data.prompts import load_split
    from ratchet.flows.config import load_config

    cfg = load_config(config(a), overrides(a, with_demos=False))
    train = load_split(cfg.data, cfg.seed).train
    levels = list(range(1, a.labeled_to + 1))
    rows = []
    for i, n in enumerate(levels):
        pool = [p for p in train if p.level == n]
        random.Random(n).shuffle(pool)
        for p in pool[: a.demos // len(levels) + (i < a.demos % len(levels))]:
            if a.task == "chain_sum":  # a problem of one's own is scored by its reasoning-gym entry
                entry = cfg.data.check.entry(p.id)
                said = worked_expression(entry["metadata"]["expression"]) if a.form == "worked" else p.answer
                rows.append({"prompt": p.prompt, "completion": said, "answer": p.answer, "entry": entry})
                continue
            x, y = (int(v) for v in p.id.removeprefix("add-").split("-"))
            rows.append({"prompt": p.prompt, "completion": FORMS[a.form](x, y), "answer": p.answer})
    if a.copies:  # the copy alone, of numbers from 2 to --copy-to digits: no sum, so no level's label
        if a.form not in ("indexed", "shifted"):
            raise SystemExit(f"--copies needs --form indexed or shifted (whose working begins with a copy), not {a.form}")
        rng = random.Random("copies")
        for i in range(a.copies):
            n = 2 + i % (a.copy_to - 1)
            x = rng.randint(10 ** (n - 1), 10 ** n - 1)
            prompt, completion = copy(x, FORMS[a.form])
            rows.append({"id": f"copy-{i}", "prompt": prompt, "completion": completion, "answer": str(x)})
    path = Path(a.workdir) / "demonstrations.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def target_set(a) -> Path:
    """--fresh prompts of --target digits + --target digits, none a train or held-out pair of the run
    (drawn with a seed of their own, checked against the run's split)."""
    import random

    from ratchet.data.prompts import load_split
    from ratchet.flows.config import load_config

    cfg = load_config(config(a), overrides(a, with_demos=False))
    split = load_split(cfg.data, cfg.seed)
    taken = {p.id for p in (*split.train, *split.eval)}
    rng, rows, seen = random.Random(f"grow-target-{a.target}"), [], set()
    lo, hi = 10 ** (a.target - 1), 10 ** a.target - 1
    while len(rows) < a.fresh:
        x, y = rng.randint(lo, hi), rng.randint(lo, hi)
        if f"add-{x}-{y}" in taken or (x, y) in seen:
            continue
        seen.add((x, y))
        rows.append({"id": f"fresh-{x}-{y}", "prompt": f"What is {x} + {y}?", "answer": str(x + y)})
    path = Path(a.workdir) / f"target-{a.target}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def label_of(a) -> str:
    if a.labels == "vote":
        return f"label={{kind: vote, models: {a.models}, share: {a.share}, of: {a.of}}}"
    if a.labels == "self":
        return f"label={{kind: consistency, min_agreement: {a.share}}}"
    return "label={kind: verifier}"


def data_of(a, levels: list[int], labeled: list[int] | None) -> str:
    """The task's `data` section, as an override: addition by digits, or chain_sum's --terms terms of
    1..N digits each (`labeled` None: a held-out set's, which names no labeled levels)."""
    size = (f"labeled_levels: {labeled}, " if labeled is not None else "") + \
        f"eval_size: {a.eval_size}, train_size: {a.train_size}"
    if a.task == "addition":
        return f"{{kind: addition, levels: {levels}, {size}, check: {{kind: number, max_numbers: 200}}}}"
    knob = ", ".join(f"{n}: {{min_terms: {a.terms}, max_terms: {a.terms}, min_digits: {n}, max_digits: {n}}}"
                     for n in levels)
    return (f"{{kind: reasoning_gym, dataset: chain_sum, config: {{}}, levels: {{{knob}}}, {size}, "
            f"instruction: {CHAIN_SUM_SAYS[a.form]}, check: {{read: last_number}}}}")


# chain_sum's instruction, by --form: the answer alone, or worked a digit at a time (worked_expression)
CHAIN_SUM_SAYS = {"answer": "Give only the final answer.", "worked": "Work it out a digit at a time."}


def overrides(a, with_demos: bool = True) -> list[str]:
    levels = list(range(1, a.levels_to + 1))
    labeled = levels if a.labels == "reference" else list(range(1, a.labeled_to + 1))
    form = a.form if a.task == "addition" else "chain_sum" + ("-worked" if a.form == "worked" else "")
    out = [f"workdir={a.workdir}", f"rounds={a.rounds}", f"name=grow-{a.labels}-{form}",
           f"data={data_of(a, levels, labeled)}", label_of(a),
           f"filter={{kind: length, by: {a.by}, margin: {a.margin}, max_per_prompt: {a.per_prompt}, prefer: random, "
           "min_rows: 8}",
           f"curriculum={{prompts: {a.prompts}, advance_by: {a.advance_by}, advance_at: {a.advance_at}, "
           f"review: {a.review}, start: {a.labeled_to + 1}, patience: {a.patience}}}",
           f"sample.n={a.n}", f"sample.temperature={a.temperature}", f"sample.max_tokens={a.max_tokens}",
           f"evaluate.max_tokens={a.max_tokens}", f"train.max_length={a.max_tokens + 64}", f"train.epochs={a.epochs}",
           "agreement.min=null"]
    if getattr(a, "context", None):
        out.append(f"sampler.max_model_len={a.context}")
    out += getattr(a, "overrides", None) or []  # the run's own, after the bench's
    if a.fresh and a.task == "addition":  # the gate's set: the target (every level is evaluated on its own set
        # besides; the task's own split would be their prompts again)
        out.append(target_sets(a))
    elif a.gate == "guard":
        out.append(guard_set(a))
    if with_demos:
        out.append(f"cold_start={{demonstrations: {Path(a.workdir) / 'demonstrations.jsonl'}, train: {{epochs: "
                   f"{a.demo_epochs}, max_length: {a.max_tokens + 64}}}}}")
    return out


def guard_set(a) -> str:
    """evaluate.sets with the guard alone: the top labeled level's prompts (--eval-size of them), the
    figure a climb must keep, as the gate, in place of the task's own split of every level. That
    split costs most at the levels far above the one a round trains at, where the model is not yet
    right: at level 9 of the worked form, 63% of its tokens were levels 11-16's (every level is
    evaluated on its own set anyway, up to one above the round's)."""
    return f"evaluate.sets=[{{name: guard, data: {data_of(a, [a.labeled_to], None)}}}]"


def target_sets(a, beside: bool = False) -> str:
    """evaluate.sets with the target set: the only one (the gate), or beside the run's own gate (the
    held-out split or the guard, --gate), which stays the gate (`--evaluate`: a finished run's
    version measured on it afterwards)."""
    target = (f"{{name: target, data: {{kind: file, path: {Path(a.workdir) / f'target-{a.target}.jsonl'}, "
              "check: {kind: number, max_numbers: 200}}}")
    if not beside:
        return f"evaluate.sets=[{target}]"
    gate = "{name: heldout}" if a.gate == "heldout" else guard_set(a).removeprefix("evaluate.sets=[")[:-1]
    return f"evaluate.sets=[{gate}, {target}]"


def work_seconds(workdir: Path, rounds) -> dict[int, float]:
    """The seconds each round's stages worked (each manifest's wall_s; a stage reused from another run
    counts what it cost to make): the round's own stages and every stage they descend from,
    voters' included, and the voters' trainings on the last round's labels, which nothing
    after them reads."""
    made = {f"stages/{d.name}": json.loads((d / "manifest.json").read_text())
            for d in (workdir / "stages").iterdir() if (d / "manifest.json").exists()}
    seen, todo = set(), [d for r in rounds for d in r.stage_dirs.values()]
    while todo:
        d = todo.pop()
        if d in made and d not in seen:
            seen.add(d)
            todo += [p["dir"] for p in made[d].get("parents", [])]
    seen |= {d for d, m in made.items() if m["stage"] == "train" and m.get("parents")
             and all(p["dir"] in seen for p in m["parents"])}
    out: dict[int, float] = {}
    for d in seen:
        out[made[d]["round"]] = out.get(made[d]["round"], 0.0) + (made[d].get("wall_s") or 0.0)
    return out


def report(a):
    """The report's figures of this arm's newest run in its workdir (arms may share one)."""
    from ratchet.flows.config import load_config
    from ratchet.flows.report import gather
    from ratchet.flows.runs import list_runs
    from ratchet.flows.tracking import Tracker

    cfg = load_config(config(a), overrides(a))
    tracker = Tracker(cfg.tracking, Path(a.workdir), cfg.name)
    mine = [r.run for r in list_runs(Path(a.workdir), tracker) if r.run.startswith(f"{cfg.name}-")]
    return gather(Path(a.workdir), tracker, mine[-1] if mine else None)


def reached(sets: dict[str, float], at: float) -> int:
    """The digits a model has reached: the highest level N at which it, and every level below N, is
    right on at least `at` of its held-out prompts (0: not even level 1)."""
    n = 0
    while sets.get(f"level_{n + 1}", -1.0) >= at:
        n += 1
    return n


def plot(rounds, path: Path, labeled_to: int, at: float) -> list[tuple[int, int, float | None]]:
    """Per round since the cold start: the digits reached (`reached`) and the label precision at the
    level the round trained at, drawn beside Lee et al.'s schedule, one digit a round past the
    labeled lengths (their addition kept to it from 10 to 100 digits). A round not yet evaluated is
    left out. Returns the points drawn: (round since the cold start, digits reached, precision or None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    cold = next((r.round for r in rounds if r.cold_start), 0)
    points = [(r.round - cold, reached(r.sets, at), r.metrics.get(f"label.precision.level_{r.level}"))
              for r in rounds if r.round >= cold and any(n.startswith("level_") for n in r.sets)]  # evaluated
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    xs = [k for k, _, _ in points]
    left.plot(xs, [n for _, n, _ in points], "o-", color="#4C72B0", label="this run")
    left.plot(xs, [labeled_to + k for k in xs], "--", color="#8C8C8C", label="one digit a round (Lee et al.)")
    left.set(xlabel="round since the cold start", ylabel=f"digits reached (held-out >= {at:.0%})")
    left.legend(loc="upper left", fontsize=8)
    marked = [(k, p) for k, _, p in points if p is not None]
    right.plot([k for k, _ in marked], [100 * p for _, p in marked], "o-", color="#C44E52")
    right.set(xlabel="round since the cold start", ylabel="label precision at its level (%)", ylim=(0, 105),
              xlim=left.get_xlim())
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return points


def table(a, rep) -> str:
    """Per round: the level it trained at, its work seconds, the target set and each level's held-out
    accuracy; then each round's label precision by level. `rep`: `report(a)`."""
    from ratchet.flows.api import wilson

    levels = sorted({int(n.removeprefix("level_")) for r in rep.rounds for n in r.sets if n.startswith("level_")})
    lines = [f"{'round':>5} {'level':>5} {'work s':>7} {'target':>16} "
             + " ".join(f"{'L' + str(n):>5}" for n in levels)]
    clock, work = 0.0, work_seconds(Path(a.workdir), rep.rounds)  # the rounds' stage seconds since the cold
    # start, summed: where arms compare at equal wall time
    for r in rep.rounds:
        t = r.sets.get("target")
        ci = wilson(t, a.fresh) if t is not None else None
        target = f"{100 * t:5.1f} ({100 * ci[0]:.0f}-{100 * ci[1]:.0f})" if t is not None else ""
        if r.round > 0 and not r.cold_start:
            clock += work.get(r.round, 0.0)
        level = r.level if r.level is not None else "-"
        lines.append(f"{r.round:>5} {level:>5} {clock:>7.0f} {target:>16} " + " ".join(
            f"{100 * r.sets[f'level_{n}']:5.0f}" if f"level_{n}" in r.sets else f"{'':>5}" for n in levels))
    lines += ["", "label precision by level (the round's own labels the hidden references call right, of how many):"]
    for r in rep.rounds:
        p = {int(k.rsplit("_", 1)[1]): v for k, v in r.metrics.items() if k.startswith("label.precision.level_")}
        if p:
            lines.append(f"round {r.round}: " + ", ".join(
                f"L{n} {100 * v:.0f}% of {int(r.metrics.get(f'label.self_labeled.level_{n}', 0))}"
                for n, v in sorted(p.items())))
    return "\n".join(lines)


def misses(files: list[Path]) -> str:
    """Where each answer of an indexed or shifted form first goes wrong, counted per level: each file a
    stage's answers (an evaluate stage's eval.jsonl, a sample stage's samples.jsonl); the sums are
    read from the prompts, so the hidden references are not needed."""
    import collections
    import re

    by: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for f in files:
        for line in f.read_text().splitlines():
            row = json.loads(line)
            m = re.search(r"(\d+) \+ (\d+)\?", row["prompt"])
            if m:
                x, y = int(m[1]), int(m[2])
                by[len(str(max(x, y)))][first_miss_tagged(x, y, row["text"])] += 1
    return "\n".join(f"L{n} ({sum(c.values())}): " + ", ".join(f"{k} {v}" for k, v in c.most_common())
                     for n, c in sorted(by.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ratchet-grow"))
    ap.add_argument("--task", choices=list(CONFIGS), default="addition",
                    help="addition (levels: digits), or reasoning-gym's chain_sum (levels: digits of --terms terms)")
    ap.add_argument("--terms", type=int, default=2, help="chain_sum: the terms of every level's problems")
    ap.add_argument("--form", choices=[*FORMS, "answer"],
                    help="the answer's form: addition's working (default compact), or chain_sum's answer alone "
                    "(answer, its default) or worked a digit at a time (worked: worked_expression)")
    ap.add_argument("--labeled-to", type=int, default=8, help="levels 1..N keep their labels (and the demonstrations)")
    ap.add_argument("--levels-to", type=int, default=16, help="the task's levels: 1..N digits")
    ap.add_argument("--labels", choices=["vote", "self", "reference"], default="vote")
    ap.add_argument("--models", type=int, default=3, help="label.models of the vote")
    ap.add_argument("--share", type=float, default=0.6, help="label.share (self: consistency's min_agreement)")
    ap.add_argument("--of", choices=["seeds", "versions"], default="seeds")
    ap.add_argument("--demos", type=int, default=800)
    ap.add_argument("--copies", type=int, default=0,
                    help="demonstrations of the copy alone (indexed, shifted), numbers of 2 to --copy-to digits")
    ap.add_argument("--copy-to", type=int, default=20)
    ap.add_argument("--demo-epochs", type=float, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64, help="curriculum.prompts")
    ap.add_argument("--review", type=float, default=0.3, help="curriculum.review")
    ap.add_argument("--advance-by", choices=["rounds", "labels"], default="rounds")
    ap.add_argument("--advance-at", type=float, default=0.5)
    ap.add_argument("--patience", type=int, default=3, help="curriculum.patience")
    ap.add_argument("--n", type=int, default=4, help="sample.n")
    ap.add_argument("--temperature", type=float, default=0.3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--context", type=int, help="sampler.max_model_len (default: the config's, 512), for a form "
                    "whose answers outgrow it (worked: 55 tokens a digit)")
    ap.add_argument("--margin", type=float, default=0.25, help="the length filter's margin")
    ap.add_argument("--by", choices=["level", "level_median", "prompt"], default="level",
                    help="what the length filter holds an answer to (filter.by): the line through the lower levels' "
                    "lengths, its own level's median, or its prompt's")
    ap.add_argument("--per-prompt", type=int, default=1, help="filter.max_per_prompt")
    ap.add_argument("--epochs", type=float, default=2, help="train.epochs of a round")
    ap.add_argument("--eval-size", type=int, default=25)
    ap.add_argument("--train-size", type=int, default=300)
    ap.add_argument("--gate", choices=["heldout", "guard"], default="heldout",
                    help="with --fresh 0, the gate's set: the task's own split of every level, or the guard, "
                    "--labeled-to digits alone (guard_set)")
    ap.add_argument("--target", type=int, default=16, help="the target set's digits")
    ap.add_argument("--fresh", type=int, default=200, help="the target set's prompts (0: none)")
    ap.add_argument("--tokens", action="store_true", help="print the form's tokens per digit and stop")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="more overrides of the run's config, after "
                    "the bench's (train.gradient_checkpointing=true: a round's training in a fraction of the memory "
                    "where its answers are long)")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--evaluate", metavar="VERSION", help="measure a version of the run (made with --fresh 0; "
                    "give the same arguments) on --fresh prompts of --target digits, its gate unchanged "
                    "(`ratchet evaluate`), and stop")
    ap.add_argument("--plot", type=Path, help="also draw the digits reached and the label precision per round "
                    "(a PNG at this path), beside Lee et al.'s one digit a round")
    ap.add_argument("--reach", type=float, default=0.5, help="--plot: the held-out share a level counts as reached at")
    ap.add_argument("--misses", type=Path, nargs="+", help="print where each answer of these stage files "
                    "(eval.jsonl, samples.jsonl; indexed or shifted form) first goes wrong, by level, and stop")
    a = ap.parse_args(argv)
    a.form = a.form or ("compact" if a.task == "addition" else "answer")
    forms = list(FORMS) if a.task == "addition" else list(CHAIN_SUM_SAYS)
    if a.form not in forms:
        ap.error(f"--form {a.form} is not a form of {a.task}: give one of {', '.join(forms)}")
    if a.task == "chain_sum" and a.form == "worked" and a.terms != 2:
        ap.error(f"--form worked works two terms (a + b, a - b), not --terms {a.terms}")
    if a.task == "chain_sum" and (a.fresh or a.tokens or a.misses or a.copies):
        ap.error("--task chain_sum: give --fresh 0; --tokens, --misses and --copies are addition's")
    if a.misses:
        print(misses(a.misses))
        return 0
    if a.tokens:
        for n, t in tokens_per_digit(FORMS[a.form], [1, 2, 4, 8, 16, 32]).items():
            print(f"{n:>2} digits: {t:.1f} tokens a digit ({t * n:.0f} an answer)")
        return 0
    if a.evaluate:  # a version of the run (made with --fresh 0) on the target set, beside its own gate
        if a.task != "addition" or not a.fresh:
            ap.error("--evaluate measures a version on the target set: addition, with --fresh N")
        print(f"target set {target_set(a)}", flush=True)
        cmd = [sys.executable, "-m", "ratchet.flows.cli", "evaluate", str(config(a)), a.evaluate, "--set", "target",
               *overrides(argparse.Namespace(**{**vars(a), "fresh": 0})), target_sets(a, beside=True)]
        print(" ".join(cmd), flush=True)
        return subprocess.run(cmd).returncode
    code = 0  # the run's exit code (a table of a run that stopped early is still printed)
    if not a.table_only:
        t0 = time.time()
        print(f"{demonstrations(a)}; target set {target_set(a) if a.fresh else 'none'}", flush=True)
        cmd = [sys.executable, "-m", "ratchet.flows.cli", "run", str(config(a)), *overrides(a)]
        print(" ".join(cmd), flush=True)
        done = subprocess.run(cmd)
        print(f"ratchet run exited {done.returncode} after {time.time() - t0:.0f} s", flush=True)
        code = done.returncode
    rep = report(a)  # read once: the table and the plot draw on the same run
    print(table(a, rep))
    if a.plot:
        points = plot(rep.rounds, a.plot, a.labeled_to, a.reach)
        print(f"{a.plot}: " + ", ".join(f"round {k}: {n} digits" + (f", precision {100 * p:.0f}%" if p is not None
                                                                   else "") for k, n, p in points))
    return code


if __name__ == "__main__":
    sys.exit(main())
