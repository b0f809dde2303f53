"""`ratchet report`: a pipeline run's rounds as pictures, PNG files and one self-contained HTML page.

    ratchet report flows/configs/default.yaml            the run the config names (else the newest of its name)
    ratchet report flows/configs/default.yaml --run RUN  a run by name (see `ratchet runs`)

The figures come from what the run recorded: each round's MLflow child run (its stage
metrics and its decision) and the label stage's rows in the artifact store (the reward
distribution). They are written to `<workdir>/reports/<run>/`, logged to the run's MLflow
parent run under `report/`, and every pipeline run ends by writing its own (flows/stages.py).

Figures, each only where the run has its data:
- held-out accuracy by round, promoted rounds filled, the champion marked;
- the label's reward distribution per round;
- accepted rows or preference pairs per round;
- the label's agreement with the verifier (AUC, pair accuracy) where references exist;
- each kind's own figures (the tree search: solved fraction and generated tokens per prompt);
- wall time per stage, and sampling / evaluation throughput;
- a prompt search's tree (improve: prompt or both): each prompt, its score and the feedback it was
  written from, the chosen one marked, and the revisions refused with why;
- an online round's steps (train.kind: grpo): reward mean, groups kept, KL, entropy, the
  sampler-trainer log-probability gap and generated tokens per second, as a figure and a table.
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ratchet.data.errors import ArtifactError, RatchetError
from ratchet.data.events import Shows
from ratchet.data.store import ArtifactStore
from ratchet.flows.runs import RunSummary, list_runs
from ratchet.flows.tracking import Tracker
from ratchet.data.procs.entry import entry
from ratchet.models.trainer import read_steps
from ratchet.tasks import registry

PALETTE = ("#CCB974", "#8172B3", "#4C72B0", "#DD8452", "#937860", "#C44E52", "#DA8BC3", "#55A868", "#8C8C8C", "#64B5CD")


def round_stages() -> dict[str, str]:
    """The stages a round's MLflow run holds the wall time of (tasks/registry.py), in the order a round
    runs them, each with its colour."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(registry.names(on="round"))}


@dataclass
class Round:
    round: int
    version: str | None
    accuracy: float | None
    promoted: bool
    metrics: dict[str, float]
    stage_dirs: dict[str, str]
    rewards: list[float] = field(default_factory=list)
    sets: dict[str, float] = field(default_factory=dict)  # held-out accuracy on every set (evaluate.sets), by name
    gate_set: str = ""
    eval_dtype: str = ""  # the dtype its held-out answers were generated in (ratchet.eval_dtype)
    files: dict[str, Path] = field(default_factory=dict)  # what it sampled, labeled and answered: name -> file
    answers: list[dict] = field(default_factory=list)  # its answers on the gate's held-out set, as eval.jsonl has them
    cold_start: bool = False  # the round that fine-tuned the base model on the user's demonstrations (cold_start)
    steps: list[dict] = field(default_factory=list)  # an online train stage's figures by step (models/trainer.py)
    search: dict = field(default_factory=dict)  # its prompt search: nodes, refused revisions, the chosen text, figures
    level: int | None = None  # the level its curriculum trained it at (curriculum:)
    band: float | None = None  # how many of its prompts the curriculum drew from the band

    @property
    def name(self) -> str:
        """How the report names the round: its number, and what it was where it was no round of
        samples (the cold start)."""
        return f"{self.round} (cold start)" if self.cold_start else str(self.round)

    @property
    def other_sets(self) -> dict[str, float]:
        return {n: a for n, a in self.sets.items() if n != self.gate_set}

    def wall_s(self) -> dict[str, float]:
        """Wall time by kind of stage (every held-out set's evaluation counts as evaluate)."""
        out: dict[str, float] = dict.fromkeys(round_stages(), 0.0)
        for k, v in self.metrics.items():
            stage, _, rest = k.partition(".")
            if stage in out and rest.split(".")[-1] == "wall_s":
                out[stage] += v
        return {s: v for s, v in out.items() if v}


@dataclass
class Report:
    run: RunSummary
    model: str
    champion: str | None
    rounds: list[Round]
    figures: dict[str, Path] = field(default_factory=dict)  # title -> PNG
    html: Path | None = None
    verified: dict | None = None  # the run's newest `ratchet verify` (flows/verify.py), as it wrote it


def gather(workdir: Path, tracker: Tracker, run: str | None = None) -> Report:
    """What the report shows, read from MLflow and the artifact store."""
    runs = list_runs(workdir, tracker)
    if not runs:
        raise RatchetError(f"no pipeline runs recorded in {workdir}/runs; run the pipeline first or set workdir=...")
    if run is None:
        chosen = runs[-1]
    else:
        chosen = next((r for r in runs if r.run == run), None)
        if chosen is None:
            raise RatchetError(f"no pipeline run {run!r} in {workdir}/runs; known runs: {[r.run for r in runs]}")
    from ratchet.flows.runs import load_record

    rec = load_record(workdir, chosen.run)
    children = tracker.client.search_runs(
        [tracker.experiment_id], f"tags.mlflow.parentRunId = '{rec.ctx.parent_run_id}'")
    rounds = []
    store = ArtifactStore(workdir)
    try:  # the curriculum's band by round, on the run's parent (none without a curriculum)
        bands = {m.step: m.value for m in tracker.client.get_metric_history(rec.ctx.parent_run_id, "curriculum.band")}
    except Exception:  # noqa: BLE001 - a store without the metric answers in its own ways
        bands = {}
    for c in children:
        if not str(c.data.tags.get("ratchet.round", "")).isdigit():  # not a round run, or a tag edited out of shape
            continue
        tags = c.data.tags
        dirs = {k.removeprefix("ratchet.stage."): v for k, v in tags.items() if k.startswith("ratchet.stage.")}
        r = Round(round=int(tags["ratchet.round"]), version=tags.get("ratchet.model_version"),
                  accuracy=c.data.metrics.get("round.accuracy", c.data.metrics.get("evaluate.accuracy")),
                  promoted=bool(c.data.metrics.get("round.promoted")), metrics=dict(c.data.metrics), stage_dirs=dirs,
                  sets={k.removeprefix("round.accuracy."): v for k, v in c.data.metrics.items()
                        if k.startswith("round.accuracy.")}, gate_set=tags.get("ratchet.gate_set", ""),
                  eval_dtype=tags.get("ratchet.eval_dtype", ""), cold_start=tags.get("ratchet.cold_start") == "true")
        gate_stage = f"evaluate.{r.gate_set}" if f"evaluate.{r.gate_set}" in dirs else "evaluate"
        for name, stage, file in (("samples", "sample", "samples.jsonl"), ("labels", "label", "labels.jsonl"),
                                  ("answers", gate_stage, "eval.jsonl")):
            try:  # a tag is a record outside the store: only a stage directory of this store is read
                path = store.recorded_dir(dirs[stage], f"run {c.info.run_id}'s ratchet.stage.{stage} tag") / file \
                    if stage in dirs else None
            except ArtifactError:
                path = None
            if path is not None and path.exists():
                r.files[name] = path
        for row in _rows(r.files.get("labels")):
            if (x := row.get("reward")) is not None:
                r.rewards.append(float(x))
        r.answers = list(_rows(r.files.get("answers")))
        if "train" in dirs:
            try:
                where = f"run {c.info.run_id}'s ratchet.stage.train tag"
                r.steps = read_steps(store.recorded_dir(dirs["train"], where))
            except (ArtifactError, OSError, ValueError):  # a tag edited out of shape, a log cut short: no steps
                r.steps = []
        if "search" in dirs:
            r.search = _search_of(store, dirs["search"], f"run {c.info.run_id}'s ratchet.stage.search tag")
        if str(tags.get("ratchet.level", "")).isdigit():
            r.level = int(tags["ratchet.level"])
            r.band = bands.get(r.round)
        rounds.append(r)
    rounds.sort(key=lambda r: r.round)
    return Report(run=chosen, model=tracker.model_name, champion=tracker.champion(), rounds=rounds,
                  verified=_newest_verify(workdir, chosen.run))


def _newest_verify(workdir: Path, run: str) -> dict | None:
    """The verdicts the run's newest `ratchet verify` wrote (WORKDIR/verify/RUN/STAMP.json)."""
    import json

    for path in sorted((workdir / "verify" / run).glob("*.json"), reverse=True):
        try:
            return {**json.loads(path.read_text()), "path": str(path)}
        except (OSError, ValueError):
            continue
    return None


def _verified(report: Report) -> str:
    """What `ratchet verify` found when it ran the run's stages again."""
    v = report.verified
    if not v or not v.get("stages"):
        return ""
    rows = "".join(f"<tr><td>{html.escape(s['stage'])}</td><td>{s['round']}</td><td>{html.escape(s['verdict'])}</td>"
                   f"<td style=\"text-align:left\">{html.escape(s.get('why') or '')}</td></tr>" for s in v["stages"])
    return (f"<h2>Verified</h2><p>The stages <code>ratchet verify</code> ran again at "
            f"{html.escape(v.get('stamp', '?'))} from their recorded inputs, each compared with its record digest by digest "
            f"(<code>{html.escape(v['path'])}</code>).</p><table><thead><tr><th>stage</th><th>round</th>"
            f"<th>verdict</th><th>why</th></tr></thead><tbody>{rows}</tbody></table>")


def _search_of(store: ArtifactStore, rel: str, where: str) -> dict:
    """A round's prompt search as its stage wrote it (empty where it cannot be read)."""
    from ratchet.data.manifest import read_manifest

    try:
        d = store.recorded_dir(rel, where)
        m = read_manifest(d)
        if (d / "versions.jsonl").is_file():  # a beliefs search (tasks/searches/beliefs.py)
            return {"versions": list(_rows(d / "versions.jsonl")), "metrics": dict(m.metrics) if m else {}}
        told = json.loads((d / "refused.json").read_text())
        return {"nodes": list(_rows(d / "nodes.jsonl")), "refused": told["refused"], "unexpanded": told["unexpanded"],
                "text": json.loads((d / "prompt.json").read_text())["text"]["template"],
                "metrics": dict(m.metrics) if m else {}}
    except (ArtifactError, OSError, ValueError, KeyError):
        return {}


def _rows(path: Path | None):
    """The JSON rows of a stage's file (none where the round has no such file)."""
    if path is not None:
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


SHOWN = 4  # held-out prompts the report follows from round to round


def followed(report: Report) -> list[tuple[str, str]]:
    """(id, prompt) of the first SHOWN prompts of the gate's held-out set, as the earliest round that
    answered it lists them: the same prompts every round. An episode's prompt is what the model was
    first shown: the environment's first observation."""
    first = next((r.answers for r in report.rounds if r.answers), [])
    return list(dict.fromkeys((a["prompt_id"], (a.get("outcome") or {}).get("start") or a["prompt"])
                              for a in first))[:SHOWN]


MARKER = re.compile(r"<\|[^|<>\s]{1,40}\|>")  # a chat template's special tokens (<|im_start|>, <|eot_id|>, ...)
ROLE_LINE = re.compile(r"^\s*(?:system|user|assistant|model|human)\s*$", re.M | re.I)  # what follows a marker


def transcript(a: dict, n: int = 400) -> str:
    """An answer as HTML: its text, or an episode's turns one after another, each environment turn
    as its observation alone (the chat template's markers between the turns dropped) and marked as
    the environment's. At most `n` characters of text in all; every text escaped."""
    segments = a.get("segments") or []
    if not any(s.get("role") == "env" for s in segments):
        return html.escape(_clip(a["text"], n))
    out, left = [], n
    for s in segments:
        if left <= 0:
            out.append("…")
            break
        text = (s.get("text") or "").strip()
        if s.get("role") == "env":
            text = ROLE_LINE.sub("", MARKER.sub("", text)).strip()
            out.append(f"<span class=\"env\">{html.escape(_clip(text, left))}</span>")
        else:
            out.append(html.escape(_clip(text, left)))
        left -= len(text)
    return "\n".join(out)


def verdict(a: dict) -> str:
    """An answer's verdict in words: an episode's return and how it ended; the check's (right, or
    wrong and what it read); else its reward."""
    if (o := a.get("outcome")) is not None:
        if o.get("ret") is None:
            return "the environment failed: " + (o.get("failure") or "").strip().splitlines()[-1][:120]
        attempt = o.get("attempt")  # a reflection's row: the second attempt it was given to
        turns = sum(s.get("role") == "model" for s in (attempt or a.get("segments") or ()))
        won = {True: "success", False: "no success"}.get(a.get("correct"), "episode")
        return (f"{won}{' after a reflection' if attempt else ''}: return {o['ret']:.3g} in {turns} "
                f"turn{'s' if turns != 1 else ''} ({o['ended'].replace('_', ' ')})")
    if a.get("correct") is True:
        return "right"
    if a.get("correct") is False:
        read = a.get("extracted")
        return "wrong: " + (f"read {read!r}" if read is not None else "no answer read")
    return "unscored" if a.get("reward") is None else f"reward {a['reward']:.2f}"


def _pyplot():
    """pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes(title: str, ylabel: str, rounds: list[int], cold: set[int] = frozenset()):
    fig, ax = _pyplot().subplots(figsize=(6.4, 3.8), dpi=110)
    ax.set_title(title)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_xticks(rounds, [f"{k}\ncold start" if k in cold else str(k) for k in rounds])
    ax.grid(axis="y", alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def declared() -> list[tuple[str, Shows]]:
    """(section, what it shows) of every registered label, filter and rollout kind."""
    from ratchet.flows.config import kinds_of
    from ratchet.tasks.sample import ROLLOUTS

    return [(sec, k.shows) for sec in ("label", "filter") for k in kinds_of(sec).values()] + \
        [("sample", k.shows) for k in ROLLOUTS.values()]


def training_rows(m: dict[str, float], shown: list[tuple[str, Shows]]) -> tuple[float, str] | None:
    """A round's training-row count and what the rows are, as its filter kind declares them."""
    for sec, s in shown:
        if s.rows and f"{sec}.{s.rows[0]}" in m:
            return m[f"{sec}.{s.rows[0]}"], s.rows[1]
    return None


@entry
def draw(report: Report, out: Path) -> dict[str, Path]:
    """Write the report's figures into `out` as PNG files; returns title -> path."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    rs = report.rounds
    ks = [r.round for r in rs]
    cold = {r.round for r in rs if r.cold_start}
    figs: dict[str, Path] = {}
    colors = round_stages()

    scored = [r for r in rs if r.accuracy is not None]
    if scored:
        fig, ax = _axes("Held-out accuracy by round", "accuracy (%)", ks, cold)
        x, y = [r.round for r in scored], [100 * r.accuracy for r in scored]
        ax.plot(x, y, color="#4C72B0", zorder=1)
        for r in scored:
            ax.scatter([r.round], [100 * r.accuracy], s=60, zorder=2, color="#4C72B0" if r.promoted else "white",
                       edgecolors="#4C72B0", linewidths=1.5)
            tail = f"\nv{r.version}" + (" champion" if r.version == report.champion else "") if r.version else ""
            ax.annotate(f"{100 * r.accuracy:.0f}%{tail}", (r.round, 100 * r.accuracy), textcoords="offset points",
                        xytext=(0, 8), ha="center", fontsize=8)
        ax.scatter([], [], s=60, color="#4C72B0", label="promoted to champion")
        ax.scatter([], [], s=60, color="white", edgecolors="#4C72B0", label="not promoted")
        others = sorted({n for r in scored for n in r.other_sets})
        for i, name in enumerate(others):  # the other held-out sets: reported beside the gate's, dashed
            pts = [(r.round, 100 * r.other_sets[name]) for r in scored if name in r.other_sets]
            ax.plot([x for x, _ in pts], [y for _, y in pts], linestyle="--", marker="s", markersize=4,
                    color=("#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3")[i % 5], label=name)
        if others:
            ax.plot([], [], color="#4C72B0", label=f"{scored[-1].gate_set} (the gate's set)")
        ax.set_ylim(0, 110)
        ax.legend(loc="best" if others else "lower right", fontsize=8)
        figs["Held-out accuracy by round"] = _save(fig, out / "accuracy.png")

    levels = sorted({int(n.removeprefix("level_")) for r in scored for n in r.sets
                     if n.startswith("level_") and n.removeprefix("level_").isdigit()})
    if levels:
        figs["Held-out accuracy by level and round"] = _save(_levels_figure(scored, levels), out / "levels.png")
    labeled = sorted({int(k.rsplit("_", 1)[1]) for r in rs for k in r.metrics if k.startswith("label.precision.level_")})
    if labeled:  # of the labels a round made itself (data.labeled_levels), the share the hidden references call right
        title = "Label precision (%) by level: its own labels the hidden references call right"
        figs["Label precision by level and round"] = _save(_levels_figure(
            rs, labeled, lambda r, n: r.metrics.get(f"label.precision.level_{n}"), title), out / "precision.png")

    with_rewards = [r for r in rs if r.rewards]
    if with_rewards and all(x in (0.0, 1.0) for r in with_rewards for x in r.rewards):  # a 0/1 label: counts
        fig, ax = _axes("Label rewards by round", "completions", [r.round for r in with_rewards], cold)
        ks_r = [r.round for r in with_rewards]
        ones = [sum(r.rewards) for r in with_rewards]
        zeros = [len(r.rewards) - o for r, o in zip(with_rewards, ones)]
        ax.bar(ks_r, ones, color=colors["evaluate"], width=0.6, label="reward 1")
        ax.bar(ks_r, zeros, bottom=ones, color="#BBBBBB", width=0.6, label="reward 0")
        for k, o, z in zip(ks_r, ones, zeros):
            ax.annotate(f"{o / (o + z):.0%}", (k, o), textcoords="offset points", xytext=(0, -12), ha="center",
                        fontsize=8, color="white")
        ax.legend(fontsize=8)
        figs["Label rewards by round"] = _save(fig, out / "rewards.png")
    elif with_rewards:
        fig, ax = _axes("Label reward distribution by round", "reward", [r.round for r in with_rewards], cold)
        parts = ax.violinplot([r.rewards for r in with_rewards], positions=[r.round for r in with_rewards],
                              showmeans=True, widths=0.7)
        for b in parts["bodies"]:
            b.set_facecolor(colors["label"])
            b.set_alpha(0.5)
        ax.set_xticks([r.round for r in with_rewards],
                      [f"{r.round}\nmean {sum(r.rewards) / len(r.rewards):.2f}, n={len(r.rewards)}" for r in with_rewards])
        lo, hi = min(min(r.rewards) for r in with_rewards), max(max(r.rewards) for r in with_rewards)
        pad = max((hi - lo) * 0.1, 0.05)
        ax.set_ylim(lo - pad, hi + pad)
        figs["Label reward distribution by round"] = _save(fig, out / "rewards.png")

    shown = declared()
    kept = [(r.round, *rows) for r in rs if (rows := training_rows(r.metrics, shown))]
    if kept:
        what = " / ".join(dict.fromkeys(w for _, _, w in kept))
        fig, ax = _axes(f"Training data per round ({what})", what, [k for k, _, _ in kept], cold)
        ax.bar([k for k, _, _ in kept], [v for _, v, _ in kept], color=colors["filter"], width=0.6)
        for k, v, _ in kept:
            ax.annotate(f"{v:.0f}", (k, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
        ax.set_ylim(0, max(v for _, v, _ in kept) * 1.15 or 1)
        figs["Training data per round"] = _save(fig, out / "training_data.png")

    series = [("label.verifier_auc", "label vs verifier AUC"),
              ("label.verifier_within_prompt_auc", "AUC within a prompt"),
              *((f"{sec}.{k}", name) for sec, s in shown for k, name in s.agreement)]
    present = [(k, name) for k, name in dict.fromkeys(series) if any(k in r.metrics for r in rs)]
    if present:
        fig, ax = _axes("Label agreement with the verifier", "AUC / fraction", ks, cold)
        for k, name in present:
            pts = [(r.round, r.metrics[k]) for r in rs if k in r.metrics]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(0.5, color="grey", linestyle=":", linewidth=1, label="chance (AUC)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=8)
        figs["Label agreement with the verifier"] = _save(fig, out / "agreement.png")

    for sec, s in shown:
        for f in s.figures:
            bars = f"{sec}.{f.bars[0]}"
            pts = [r for r in rs if bars in r.metrics]
            if not pts or f.title in figs:
                continue
            fig, ax = _axes(f.title, f.ylabel, [r.round for r in pts], cold)
            ax.bar([r.round for r in pts], [r.metrics[bars] for r in pts], color=colors[sec], width=0.6,
                   label=f.bars[1])
            if f.line and any(f"{sec}.{f.line[0]}" in r.metrics for r in pts):
                ax2 = ax.twinx()
                ax2.plot([r.round for r in pts], [100 * r.metrics.get(f"{sec}.{f.line[0]}", 0) for r in pts],
                         color="black", marker="o", label=f.line[1])
                ax2.set_ylabel(f.line[2])
                ax2.set_ylim(0, 105)
                ax2.legend(loc="upper right", fontsize=8)
            ax.legend(loc="upper left", fontsize=8)
            figs[f.title] = _save(fig, out / f.file)

    walls = [(r.round, r.wall_s()) for r in rs]
    walls = [(k, w) for k, w in walls if w]
    if walls:
        fig, ax = _axes("Wall time per stage", "seconds", [k for k, _ in walls], cold)
        bottom = [0.0] * len(walls)
        ran = list(dict.fromkeys(s for _, w in walls for s in w))  # in a round's order (Round.wall_s)
        for s in ran:
            h = [w.get(s, 0.0) for _, w in walls]
            if any(h):
                ax.bar([k for k, _ in walls], h, bottom=bottom, color=colors.get(s, PALETTE[-1]), label=s, width=0.6)
                bottom = [b + x for b, x in zip(bottom, h)]
        ax.legend(fontsize=8, ncols=len(ran))
        ax.set_ylim(0, max(bottom) * 1.2 if max(bottom) > 0 else 1)
        figs["Wall time per stage"] = _save(fig, out / "wall_time.png")

    rates = [(f"{s}.tokens_per_s", s) for s in ("sample", "train", "evaluate")]
    rates[1:1] = dict.fromkeys((f"{sec}.{s.throughput}", sec) for sec, s in shown if s.throughput)
    tput = [(k, name) for k, name in rates if any(k in r.metrics for r in rs)]
    if tput:
        fig, ax = _axes("Throughput", "tokens per second", ks, cold)
        for k, name in tput:
            pts = [(r.round, r.metrics[k]) for r in rs if k in r.metrics]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=colors[name])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        figs["Throughput"] = _save(fig, out / "throughput.png")
    online = [r for r in rs if r.steps]
    if online:
        figs["Online RL by step"] = _save(_steps_figure(online), out / "online_steps.png")
    report.figures = figs
    return figs


# an online round's figures by step: (key in the step rows, panel title)
STEP_PANELS = (("reward", "reward mean"), ("groups_kept", "share of groups kept"), ("kl", "KL to the start"),
               ("entropy", "entropy"), ("logp_gap", "log-prob gap, sampler vs trainer"),
               ("gen_tokens_per_s", "generated tokens / s"))


def _levels_figure(rounds: list[Round], levels: list[int], of=lambda r, n: r.sets.get(f"level_{n}"),
                   title: str = "Held-out accuracy (%) by level"):
    """A heat map: each level's held-out accuracy (rows) in each round (columns), or what `of` reads
    of a round at a level, blank where the round has none; under a curriculum, each round's level
    framed, its band below."""
    import numpy as np

    plt = _pyplot()
    grid = np.full((len(levels), len(rounds)), np.nan)
    for j, r in enumerate(rounds):
        for i, n in enumerate(levels):
            if (a := of(r, n)) is not None:
                grid[i, j] = 100 * a
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(rounds) + 2), max(2.4, 0.45 * len(levels) + 1.4)), dpi=110)
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=100, aspect="auto", origin="lower")
    for i in range(len(levels)):
        for j in range(len(rounds)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if grid[i, j] < 60 else "black")
    for j, r in enumerate(rounds):
        if r.level in levels:
            ax.add_patch(plt.Rectangle((j - 0.5, levels.index(r.level) - 0.5), 1, 1, fill=False, edgecolor="#C44E52",
                                       linewidth=2))
    ax.set_xticks(range(len(rounds)), [r.name + (f"\nband {r.band:.0f}" if r.band is not None else "")
                                        for r in rounds], fontsize=8)
    ax.set_yticks(range(len(levels)), [str(n) for n in levels])
    framed = any(r.level is not None for r in rounds)
    ax.set_xlabel("round (framed: the level it trained at)" if framed else "round", fontsize=8)
    ax.set_ylabel("level")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    return fig


def _steps_figure(online: list[Round]):
    fig, axes = _pyplot().subplots(2, 3, figsize=(10.5, 5.6), dpi=110)
    for ax, (key, title) in zip(axes.flat, STEP_PANELS):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        for i, r in enumerate(online):
            pts = [(x["step"], x[key]) for x in r.steps if isinstance(x.get(key), (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                        color=("#C44E52", "#4C72B0", "#55A868", "#8172B3", "#DD8452")[i % 5], label=f"round {r.name}")
        if key in ("reward", "groups_kept", "gen_tokens_per_s"):
            ax.set_ylim(bottom=0)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Online RL by step")
    return fig


def other_sets(report: Report) -> list[str]:
    """The held-out sets beside the gate's, in the order the rounds name them."""
    return list(dict.fromkeys(n for r in report.rounds for n in r.other_sets))


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _table(report: Report) -> str:
    rows, others, shown = [], other_sets(report), declared()
    for r in report.rounds:
        m = r.metrics
        data = (training_rows(m, shown) or (None,))[0]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in (
            r.name, f"v{r.version}" + (" (champion)" if r.version == report.champion else "") if r.version else "",
            held_out_cell(report, r), *(_pct(r.other_sets.get(n)) for n in others), "yes" if r.promoted else "no",
            f"{data:.0f}" if data is not None else "",
            f"{m['label.reward_mean']:.3f}" if "label.reward_mean" in m else "",
            f"{sum(r.wall_s().values()):.0f} s")) + "</tr>")
    gate = held_out_head(report, others)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ("round", "version", f"held-out accuracy{gate}", *others,
                                                         "promoted", "training rows", "mean reward", "wall time"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _dtypes(report: Report) -> list[str]:
    return list(dict.fromkeys(r.eval_dtype for r in report.rounds if r.eval_dtype))


def held_out_head(report: Report, others: list[str]) -> str:
    """What the held-out column's head says beside "held-out accuracy": the gate's set where there
    are others, and the dtype the answers were generated in where every round's was the one
    (where they differ, each round's cell says its own: `held_out_cell`)."""
    dtypes = _dtypes(report)
    said = [report.rounds[-1].gate_set] if others else []
    said += [f"in {dtypes[0]}"] if len(dtypes) == 1 else []
    return f" ({', '.join(said)})" if said else ""


def held_out_cell(report: Report, r: Round) -> str:
    """A round's held-out accuracy, with its dtype where the report's rounds were taken in several."""
    return _pct(r.accuracy) + (f" in {r.eval_dtype}" if len(_dtypes(report)) > 1 and r.eval_dtype else "")


def _num(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else ""


def _steps_table(report: Report) -> str:
    """Each online round's steps: reward mean, share of groups kept, KL, entropy, the log-probability
    gap, generated tokens per second and the step's own seconds (KL, entropy and the gap at the
    steps the trainer logged them)."""
    online = [r for r in report.rounds if r.steps]
    if not online:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ("round", "step", "reward mean", "groups kept", "KL", "entropy",
                                             "log-prob gap", "generated tok/s", "step s"))
    rows = []
    for r in online:
        for x in r.steps:
            cells = (r.name, x["step"], _num(x.get("reward"), ".3f"), _num(x.get("groups_kept"), ".0%"),
                     _num(x.get("kl"), ".3g"), _num(x.get("entropy"), ".3g"), _num(x.get("logp_gap"), ".2g"),
                     _num(x.get("gen_tokens_per_s"), ".0f") if not x.get("reused") else "stored",
                     _num(x.get("step_s"), ".1f"))
            rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    warned = "".join(f"<p class=\"other\">Round {html.escape(r.name)}: {html.escape(said)}.</p>" for r in online
                     if (said := _gap_warning(r)))
    return ("<h2>Online RL by step</h2><p>Each step of an online round's train stage: its reward mean and the share "
            "of its groups kept (a group whose rewards are all equal teaches nothing), KL to the round's start, "
            "entropy and the gap between the sampler's and the trainer's log-probabilities (at the steps the "
            "trainer logged them), the tokens it generated per second (\"stored\": read from an earlier attempt's "
            "rollouts) and its seconds.</p>"
            f"{warned}<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _gap_warning(r: Round) -> str:
    """The train stage's warning where its engine and trainer disagreed (models/train_kinds/grpo.py)."""
    from ratchet.models.train_kinds.grpo import gap_warning

    m = {k.removeprefix("train."): v for k, v in r.metrics.items() if k.startswith("train.")}
    return gap_warning(m)


def _search_tree(report: Report) -> str:
    """Each round's prompt search as a tree: every prompt with its score on the score prompts and the
    feedback its revision was written from, the chosen one marked; then the revisions refused, each
    with why. Every text is escaped: the optimiser wrote it."""
    searched = [r for r in report.rounds if r.search.get("nodes")]
    if not searched:
        return ""
    out = ["<h2>Prompt search</h2><p>Each node is a prompt (<code>{prompt}</code>: where the task's prompt goes), "
           "with its accuracy on the score prompts; under it, the prompts the optimiser wrote from the feedback "
           "shown, which it wrote from that prompt's wrong answers. The chosen prompt is marked; it replaced the "
           "round's starting prompt only where it scored higher on the reward prompts, which the search never "
           "scored.</p>"]
    for r in searched:
        nodes, m = r.search["nodes"], r.search.get("metrics", {})
        chosen = next((n["id"] for n in nodes if n["template"] == r.search.get("text")), None)
        kids: dict = {}
        for n in nodes:
            kids.setdefault(n["parent"], []).append(n)

        def tree(parent) -> str:
            items = []
            for n in kids.get(parent, []):
                mark = " <strong>chosen</strong>" if n["id"] == chosen else ""
                fb = (f"<div class=\"feedback\">from feedback: {html.escape(_clip(n['feedback'], 240))}</div>"
                      if n["feedback"] else "")
                items.append(f"<li>node {n['id']} · {_pct(n['score'])} · {n['visits']} visit(s){mark}{fb}"
                             f"<pre>{html.escape(_clip(n['template'], 400))}</pre>{tree(n['id'])}</li>")
            return f"<ul>{''.join(items)}</ul>" if items else ""

        refused = "".join(f"<li>{html.escape(x['why'])}" + (f": <code>{html.escape(_clip(x['text'], 120))}</code>"
                                                           if x.get("text") else "") + "</li>"
                          for x in r.search.get("refused", []))
        refused += "".join(f"<li>node {x['node']} was not expanded: {html.escape(x['why'])}</li>"
                           for x in r.search.get("unexpanded", []))
        out.append(f"<h3>round {html.escape(r.name)}</h3><p>reward prompts: the chosen prompt "
                   f"{_pct(m.get('chosen_reward'))}, the starting prompt {_pct(m.get('base_reward'))}; "
                   f"{'replaced' if m.get('replaced') else 'kept the starting prompt'}</p><div class=\"tree\">"
                   f"{tree(None)}</div>" + (f"<p>Refused revisions, and nodes not expanded:</p><ul>{refused}</ul>"
                                           if refused else ""))
    return "".join(out)


def _beliefs(report: Report) -> str:
    """Each round's beliefs search, iteration by iteration: the pairs of episodes compared (their
    returns), what the optimiser wrote of each, the beliefs kept (by role) and refused (with why),
    and every role's beliefs after. Every text is escaped: the optimiser wrote it."""
    searched = [r for r in report.rounds if r.search.get("versions")]
    if not searched:
        return ""
    out = ["<h2>Beliefs</h2><p>Each iteration played episodes under the roles' beliefs, compared a better and a "
           "worse episode of one start, and added what the optimiser wrote to the roles it named. The final beliefs "
           "replaced the round's only where they scored higher on reward starts no iteration played.</p>"]
    for r in searched:
        m = r.search.get("metrics", {})
        rows = []
        for v in r.search["versions"]:
            compared = "".join(
                f"<li>start {html.escape(str(c['start']))}: return {c['better']:+.4g} against {c['worse']:+.4g}"
                + (f"; wrote <pre>{html.escape(_clip(c['wrote'], 600))}</pre>" if "wrote" in c else
                   f" ({html.escape(c.get('why', ''))})") + "</li>" for c in v["compared"])
            kept = "".join(f"<li><strong>{html.escape(k['role'])}</strong>: {html.escape(_clip(k['belief'], 300))}</li>"
                           for k in v["kept"])
            refused = "".join(f"<li>{html.escape(x['why'])}: <code>{html.escape(_clip(x['text'], 160))}</code></li>"
                              for x in v["refused"])
            after = "".join(f"<li><strong>{html.escape(role)}</strong><pre>{html.escape(_clip(b, 600))}</pre></li>"
                            for role, b in sorted(v["after"].items()))
            rows.append(f"<h4>iteration {v['iteration']} · mean return {v['mean_return']:+.4g}</h4>"
                        + (f"<p>{html.escape(v['why'])}</p>" if v.get("why") else "")
                        + (f"<ul>{compared}</ul>" if compared else "")
                        + (f"<p>Kept:</p><ul>{kept}</ul>" if kept else "")
                        + (f"<p>Refused:</p><ul>{refused}</ul>" if refused else "")
                        + (f"<p>Beliefs after it:</p><ul>{after}</ul>" if after else "<p>No role holds a belief.</p>"))
        out.append(f"<h3>round {html.escape(r.name)}</h3><p>reward starts: the final beliefs "
                   f"{_pct(m.get('chosen_reward'))} (mean return {m.get('chosen_return', 0):+.4g}), the round's "
                   f"{_pct(m.get('base_reward'))} ({m.get('base_return', 0):+.4g}); "
                   f"{'replaced' if m.get('replaced') else 'kept the round beliefs'}</p>{''.join(rows)}")
    return "".join(out)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _answers(report: Report) -> str:
    """The followed prompts, one row each, every round's answer and verdict side by side; each round's
    column heads link its samples, labels and answers. Every text is escaped: it is the model's."""
    prompts = followed(report)
    if not prompts:
        return ""
    head = "".join(
        f"<th>round {html.escape(r.name)}<br>" + " · ".join(
            f"<a href=\"{html.escape(p.resolve().as_uri())}\">{name}</a>" for name, p in r.files.items()) + "</th>"
        for r in report.rounds)
    rows = []
    for pid, prompt in prompts:
        cells = []
        for r in report.rounds:
            a = next((a for a in r.answers if a["prompt_id"] == pid and a.get("index", 0) == 0), None)
            cells.append("<td></td>" if a is None else
                         f"<td class=\"answer\"><pre>{transcript(a)}</pre>"
                         f"<span class=\"{'right' if a.get('correct') else 'other'}\">{html.escape(verdict(a))}"
                         "</span></td>")
        rows.append(f"<tr><td class=\"prompt\">{html.escape(_clip(prompt, 300))}</td>{''.join(cells)}</tr>")
    gate = report.rounds[-1].gate_set
    return (f"<h2>What the model says</h2><p>The first {len(prompts)} prompts of the held-out set"
            f"{f' {html.escape(gate)}' if gate else ''}, each round's answer and its verdict. A column's links open "
            "that round's files: every sampled completion, its label, every held-out answer.</p>"
            f"<table class=\"answers\"><thead><tr><th>prompt</th>{head}</tr></thead><tbody>{''.join(rows)}"
            "</tbody></table>")


def write_html(report: Report, out: Path) -> Path:
    """One page, figures embedded as data URIs: it opens anywhere, alone."""
    r = report.run
    imgs = "".join(
        f"<figure><img alt=\"{html.escape(title)}\" src=\"data:image/png;base64,"
        f"{base64.b64encode(p.read_bytes()).decode()}\"></figure>"
        for title, p in report.figures.items())
    origin = f"continued from version {r.start_version}" if r.start_version else "from the base model"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Ratchet report: {html.escape(r.run)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 70rem; color: #222; }}
table {{ border-collapse: collapse; margin: 1rem 0; }}
th, td {{ border-bottom: 1px solid #ddd; padding: .3rem .8rem; text-align: right; }}
figure {{ display: inline-block; margin: .5rem; }} img {{ max-width: 100%; }}
table.answers td {{ text-align: left; vertical-align: top; max-width: 22rem; }}
table.answers pre {{ white-space: pre-wrap; margin: 0 0 .2rem; }}
.right {{ color: #2a7a3a; }} .other {{ color: #a33; }}
pre .env {{ color: #666; font-style: italic; }} pre .env::before {{ content: "env: "; }}
.tree ul {{ list-style: none; border-left: 1px solid #ccc; padding-left: 1rem; }}
.tree pre {{ white-space: pre-wrap; margin: .2rem 0; text-align: left; }} .feedback {{ color: #666; }}
</style></head><body>
<h1>{html.escape(r.run)}</h1>
<p>{html.escape(report.model)} · {r.state} · {r.rounds_done} of {r.rounds} round(s) {origin} ·
champion: {('version ' + html.escape(report.champion)) if report.champion else 'none yet'}</p>
{_table(report)}
{imgs}
{_steps_table(report)}
{_search_tree(report)}
{_beliefs(report)}
{_answers(report)}
{_verified(report)}
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    report.html = path
    return path


def build(workdir: Path, tracker: Tracker, run: str | None = None, log: bool = True,
          state: str | None = None, log_with=None) -> Report:
    """Gather, draw and write a run's report under `<workdir>/reports/<run>/`; log it to the run's
    MLflow parent run under `report/` unless `log` is False. `state`: what to call the run's
    state (the flow reports itself as finished just before its record says so). `log_with`: what
    makes the tracker that logs, where `tracker` only reads (flows/tracking_read.py).

    A report whose figures and page were drawn from the same data by the same code (its digest,
    kept in `report.json` beside them) is not drawn or logged again: `ratchet report` on a
    finished run reads and prints."""
    report = gather(workdir, tracker, run)
    if state is not None:
        report.run = report.run.model_copy(update={"state": state})
    out = workdir / "reports" / report.run.run
    digest = _digest(report)
    kept = _kept(out, digest)
    if kept is not None:
        report.figures, report.html, logged = kept
    else:
        from ratchet.data.procs import forkserver

        report.figures = forkserver.call(draw, report, out)  # where matplotlib is imported already
        write_html(report, out)
        logged = False
    if log and not logged:
        from ratchet.flows.runs import load_record

        parent = load_record(workdir, report.run.run).ctx.parent_run_id
        (log_with() if log_with is not None else tracker).client.log_artifacts(parent, str(out),
                                                                                artifact_path="report")
        logged = True
    if kept is None or logged != kept[2]:
        (out / STAMP).write_text(json.dumps({"digest": digest, "logged": logged, "html": report.html.name,
                                             "figures": {t: p.name for t, p in report.figures.items()}}, indent=1))
    return report


STAMP = "report.json"


def _digest(report: Report) -> str:
    """What the report is drawn from, and the code that draws it."""
    import dataclasses
    import hashlib

    data = dataclasses.asdict(report)
    data.pop("figures"), data.pop("html")
    data["run"] = report.run.model_dump(mode="json")
    code = Path(__file__).read_bytes()
    return hashlib.sha256(code + json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _kept(out: Path, digest: str) -> tuple[dict[str, Path], Path, bool] | None:
    """The figures, page and whether they were logged, where `out` holds them drawn from `digest`."""
    try:
        kept = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("digest") != digest:
        return None
    figures = {t: out / name for t, name in kept.get("figures", {}).items()}
    page = out / str(kept.get("html"))
    if not page.is_file() or not all(p.is_file() for p in figures.values()):
        return None
    return figures, page, bool(kept.get("logged"))


def markdown(report: Report) -> str:
    """The round table and where the report's files are: a Prefect artifact's body."""
    others, shown = other_sets(report), declared()
    gate = held_out_head(report, others)
    lines = [f"# {report.run.run}", "", f"{report.model}: {report.run.rounds_done} of {report.run.rounds} round(s); "
             f"champion {'version ' + report.champion if report.champion else 'none yet'}.", "",
             f"| round | version | held-out accuracy{gate} | {''.join(f'{n} | ' for n in others)}promoted | "
             "training rows | wall time (s) |", "|---:|---:|---:|" + "---:|" * len(others) + ":---:|---:|---:|"]
    for r in report.rounds:
        data = (training_rows(r.metrics, shown) or (None,))[0]
        lines.append(f"| {r.name} | {r.version or ''} | {held_out_cell(report, r)} | "
                     f"{''.join(f'{_pct(r.other_sets.get(n))} | ' for n in others)}{'yes' if r.promoted else 'no'} | "
                     f"{'' if data is None else f'{data:.0f}'} | {sum(r.wall_s().values()):.0f} |")
    lines += ["", f"Figures: {', '.join(report.figures)}; the page with all of them: `{report.html}` "
              "(and the MLflow parent run's `report/` artifacts)."]
    if any(r.files for r in report.rounds):
        lines += ["", "Each round's files (JSON lines):", ""]
        lines += [f"- round {r.round}: " + ", ".join(f"{name} `{p}`" for name, p in r.files.items())
                  for r in report.rounds if r.files]
    return "\n".join(lines) + "\n"
