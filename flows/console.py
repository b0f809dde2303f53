"""What `ratchet run` shows: a few lines a person wants to read, and everything else in logs.

On a terminal, finished stages print one line each, and the running stage is one live line
below them (a spinner, its units or steps, its rate), redrawn from the stage's progress
file (data/events.py). Without a terminal (CI, cron, a Prefect worker) the same facts are
plain lines, one per event. Either way the output of the engines, the trainer and every
library goes to logs instead: a stage worker's to `<stage dir>/stage.log` (also logged to
the round's MLflow run), the orchestrator's own (Prefect, MLflow, warnings) to
`<workdir>/logs/<run>.<time>.log`. `--verbose` streams all of it to the terminal as well.

    console = RunConsole.for_terminal(out, err)
    with console:               # subscribes to stage events; on a terminal, starts the live line
        ...run the pipeline...
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ratchet.data import events
from ratchet.data.errors import RatchetError, StageFailedError, out_of_space

STAGE_WIDTH = 8


def redirect_output(log_path: Path) -> tuple[TextIO, TextIO]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so subprocesses such as
    Prefect's server and C libraries too) to `log_path`; return files on the original two,
    for the console. For the `ratchet` command's process: nothing restores them."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    out, err = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return open(out, "w", buffering=1, encoding="utf-8", errors="replace"), \
        open(err, "w", buffering=1, encoding="utf-8", errors="replace")


def short_reason(gate: str) -> str:
    """A gate's reason without the eval-set digests it names (the registry keeps them)."""
    import re

    return re.sub(r" on eval set \w+| \(eval set \w+\)", "", gate)


def rate_of(p: dict[str, Any]) -> str:
    """The running stage's rate: work done per second of work, over what this attempt added, by
    the counters its work declares (`rate` in the progress file)."""
    now, base = p.get("counters", {}), p.get("counters_at_start", {})
    if p.get("rate") and p["rate"][0] in now:
        key, secs, unit = p["rate"]
        dt = now.get(secs, 0) - base.get(secs, 0)
        return f"{(now[key] - base.get(key, 0)) / dt:.0f} {unit}" if dt > 0 else ""
    if p.get("unit") == "step":
        done = p.get("done", 0) - p.get("done_at_start", 0)
        dt = max(p.get("at", 0) - p.get("started", 0), 1e-9)
        loss = f" · loss {now['loss']:.3f}" if "loss" in now and "reward" not in now else ""
        online = ""
        if "reward" in now:  # an online trainer's step (models/trainer.py LIVE)
            online = f" · reward {now['reward']:.2f}"
            online += f" · {1 - now['zero_std']:.0%} of groups taught" if "zero_std" in now else ""
            online += "".join(f" · {k.replace('_', ' ')} {now[k]:.3g}"
                              for k in ("kl", "entropy", "logp_gap") if k in now)
            online += f" · generating {now['gen_tok_s']:.0f} tok/s" if "gen_tok_s" in now else ""
        return f"{done / dt:.2f} steps/s{loss}{online}"
    return ""


@dataclass
class _Running:
    stage: str
    round: int
    dir: Path | None
    since: float


class RunConsole:
    """Prints stage events as lines (and, on a terminal, keeps one live line for the running
    stage). Thread-safe: Prefect may run tasks on threads of its own."""

    def __init__(self, out: TextIO, err: TextIO, live: bool):
        self.out, self.err, self.live = out, err, live
        self._lock = threading.Lock()
        self._running: _Running | None = None
        self._failed: events.Event | None = None
        self._accuracy: dict[str, float] = {}  # held-out accuracy by version, as rounds are decided
        self._unsubscribe = None
        self._live = None
        self._rich = None

    @classmethod
    def for_streams(cls, out: TextIO, err: TextIO, plain: bool = False) -> "RunConsole":
        term = not plain and out.isatty() and os.environ.get("TERM", "") not in ("", "dumb")
        return cls(out, err, live=term)

    # lifecycle ------------------------------------------------------------------

    def __enter__(self) -> "RunConsole":
        self._unsubscribe = events.subscribe(self.on_event)
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._rich = Console(file=self.out, highlight=False)
            self._live = Live(get_renderable=self._render, console=self._rich, refresh_per_second=4,
                              transient=True, redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._unsubscribe:
            self._unsubscribe()
        if self._live is not None:
            self._live.stop()
            self._live = None

    # output ---------------------------------------------------------------------

    def line(self, text: str, style: str = "") -> None:
        """A permanent line: above the live line on a terminal, a timestamped line otherwise."""
        if self._rich is not None:
            self._rich.print(text, style=style or None, markup=False, highlight=False)
        else:
            self.out.write(f"{time.strftime('%H:%M:%S')} {text}\n")
            self.out.flush()

    def text(self, text: str) -> None:
        """Lines as they are (the round table), on the console's stream."""
        if self._rich is not None:
            self._rich.print(text, markup=False, highlight=False)
        else:
            self.out.write(text.rstrip("\n") + "\n")
            self.out.flush()

    def header(self, lines: list[str]) -> None:
        for i, x in enumerate(lines):
            self.line(x, "bold" if i == 0 else "")

    # events ---------------------------------------------------------------------

    def on_event(self, e: events.Event) -> None:
        with self._lock:
            name = f"round {e.round:<2} {e.stage:<{STAGE_WIDTH}}"
            if e.kind == "start":
                self._running = _Running(e.stage, e.round, e.dir, time.time())
                if not self.live:
                    self.line(f"{name} started")
            elif e.kind in ("done", "reused"):
                self._running = None
                how = "reused  " if e.kind == "reused" else f"{e.wall_s:5.0f} s "
                mark = "↺" if e.kind == "reused" else "✓"
                self.line(f"{name} {mark} {how} {e.summary}".rstrip(),
                          "dim" if e.kind == "reused" else "")
            elif e.kind == "failed":
                self._running = None
                self._failed = e
                stopped = (e.error or "").startswith(("KeyboardInterrupt", "Terminated"))  # not the stage's fault
                self.line(f"{name} ✗ {'interrupted' if stopped else 'failed'}", "bold red")
            elif e.kind == "note":
                self.line(f"{name} {e.data['text']}")
            elif e.kind == "report":
                self.line(f"report   {e.data['html']}")
            elif e.kind == "round":
                d = e.data
                # against the model the round trained from (not the round before: that one may be set aside)
                start = self._accuracy.get(d.get("parent_version") or "")
                gain = f" ({(d['accuracy'] - start) * 100:+.1f} points)" if start is not None else ""
                self._accuracy[d["version"]] = d["accuracy"]
                verdict = "promoted to champion" if d.get("promoted") else \
                    "not promoted" + (f" ({short_reason(d['gate'])})" if d.get("gate") else "")
                others = "".join(f" · {n} {a:.1%}" for n, a in d.get("sets", {}).items() if n != d.get("gate_set"))
                on = f" ({d['gate_set']})" if others else ""
                at = f" · level {d['level']}" if d.get("level") is not None else ""
                dtype = f" in {d['dtype']}" if d.get("dtype") else ""
                self.line(f"round {e.round:<2} -> version {d['version']}{at} · held-out accuracy{on} "
                          f"{d['accuracy']:.1%}{dtype}{gain}{others} · {verdict}", "bold")

    def _render(self):
        from rich.spinner import Spinner
        from rich.table import Table

        with self._lock:
            r = self._running
        if r is None:
            return Table.grid()
        p = events.read_progress(r.dir)
        grid = Table.grid(padding=(0, 1))
        grid.add_row(Spinner("dots"), f"round {r.round:<2} {r.stage:<{STAGE_WIDTH}}", self._status(r, p))
        return grid

    @staticmethod
    def _status(r: _Running, p: dict[str, Any] | None) -> str:
        elapsed = f"{time.time() - r.since:5.0f} s"
        if not p:
            return f"{elapsed}  starting"
        done, total = p.get("done", 0), max(p.get("total", 0), 1)
        width = 12
        fill = int(width * done / total)
        bar = "━" * fill + "╺" + "─" * (width - fill - 1) if fill < width else "━" * width
        started = p.get("done", 0) == p.get("done_at_start", 0) and not p.get("counters")
        rate = "opening the engine" if started and p.get("unit") == "unit" else rate_of(p)
        return f"{elapsed}  {bar} {done}/{total} {p.get('unit', 'unit')}s  {rate}"

    # the end --------------------------------------------------------------------

    def failure(self, error: BaseException, run_log: Path | None, resume: str) -> None:
        """One block on stderr: what failed, the error, where its log is, how to resume."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        from ratchet.tasks.agreement import LabelDisagreesError

        e = self._failed
        what = f"round {e.round} {e.stage}" if e else "the run"
        if isinstance(error, LabelDisagreesError):
            what = f"round {error.round}'s agreement gate"
            resume = "run the command again with one of the changes above (e.g. agreement.on_below=train)"
        log = (Path(e.dir) / events.STAGE_LOG) if e and e.dir and (Path(e.dir) / events.STAGE_LOG).exists() else run_log
        full = out_of_space(error, Path(e.dir) if e and e.dir else Path.cwd())  # the orchestrator's own writes
        interrupted = isinstance(error, KeyboardInterrupt)
        how = "SIGTERM" if type(error).__name__ == "Terminated" else "Ctrl-C"
        lines = [f"ratchet: {what} interrupted ({how})" if interrupted else f"ratchet: {what} failed",
                 *([] if interrupted else [f"  {type(error).__name__}: {full or error}"])]
        if e and isinstance(error, StageFailedError) and KILLED in str(error) and (
                fix := MEMORY_FIXES.get(e.stage.partition(".")[0])):
            lines.append(f"  if the kernel killed it for memory: {fix}")
        if log is not None:
            lines.append(f"  log: {log}")
            # a clear error says all; a crash or an unexpected exception shows how the log ends
            crashed = isinstance(error, StageFailedError) and not error.clear
            tail = _tail(log, 12) if (crashed or not isinstance(error, RatchetError)) and not interrupted else []
            if tail:
                lines += ["  its last lines:", *("    " + x for x in tail)]
        lines.append(f"  finished stages are kept; to resume: {resume}")
        self.err.write("\n".join(lines) + "\n")
        self.err.flush()


# a stage worker's death by SIGKILL (tasks/runner/stage.py words it so), most often the kernel's out-of-memory
# killer; what lowers the stage's peak memory (a re-run may change these: a training resumes from its checkpoints,
# a sampling keeps its finished units)
KILLED = "worker died with exit code -9"
MEMORY_FIXES = {
    "train": "set train.gradient_checkpointing=true (a training holds every layer's activations for a batch of its "
             "longest rows), or lower train.batch_size and raise train.grad_accum to keep the batch",
    "sample": "lower sampler.kv_cache_gb, sample.max_tokens or executor.engines",
    "evaluate": "lower sampler.kv_cache_gb or evaluate.max_tokens",
}


def _tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = [x.rstrip()[:300] for x in text.replace("\r", "\n").splitlines() if x.strip()]
    return lines[-n:]
