"""The `ratchet` command.

    ratchet run flows/configs/default.yaml [key=value ...]   run the pipeline
    ratchet config flows/configs/default.yaml [key=value ...]  print the resolved config
    ratchet config --explain label.mode                      one config field: type, default, allowed values
    ratchet serve flows/configs/default.yaml --cron "0 3 * * *"  schedule continuation from the champion
    ratchet runs flows/configs/default.yaml                  list the runs in the workdir, how to resume them
    ratchet report flows/configs/default.yaml [--run RUN]    a run's rounds as PNG figures and an HTML page
    ratchet export flows/configs/default.yaml champion DIR   the champion as a plain Hugging Face model dir
    ratchet gc flows/configs/default.yaml                    remove unfinished stage dirs
    ratchet model                                            convert/find the default model
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from ratchet.data.errors import RatchetError

EPILOG = """examples:
  ratchet run flows/configs/default.yaml                  the default CPU run (3 rounds)
  ratchet run flows/configs/default.yaml rounds=1 sample.n=4
  ratchet config flows/configs/default.yaml train.adapter=full
  ratchet config --explain train.adapter              what a config field takes, and its default
  ratchet lineage flows/configs/default.yaml 4         the chain behind model version 4, verified

Re-running the same command (or `ratchet resume CONFIG`) reuses every finished stage
(found by content key, its files re-verified) and continues from the first
unfinished one, in the same MLflow parent and round runs.

Artifacts, the MLflow store (sqlite:///WORKDIR/mlflow.db) and Prefect's state live
under the config's workdir:
  mlflow ui --backend-store-uri sqlite:///runs/mlflow.db
"""


def _summary(results, champion: str | None) -> str:
    """Round table: accuracy, version, the registry's promotion decision, the current champion,
    and each stage's wall time (the time the stage took when it was computed)."""
    last = results[-1]  # accuracy is on the gate's held-out set; any other set gets a column
    others = [n for n in last.accuracies if n != last.gate_set] if len(last.accuracies) > 1 else []
    heads = "".join(f" {n[:12]:>12}" for n in others)
    lines = [f"{'round':>5} {'accuracy':>9}{heads} {'version':>7} {'promoted':>8}  stage wall times (s)"]
    for r in results:
        walls = ", ".join(f"{s} {t:.0f}" for s, t in r.stage_wall_s.items())
        tail = ("  (cold start)" if r.policy.info.get("objective") == "cold-start" else "") + \
            ("  <- champion" if r.version == champion else "")
        sets = "".join(f" {r.accuracies[n]:>12.3f}" if n in r.accuracies else f" {'':>12}" for n in others)
        lines.append(f"{r.round:>5} {r.accuracy:>9.3f}{sets} {r.version:>7} {'*' if r.promoted else '':>8}  "
                     f"{walls}{tail}")
    return "\n".join(lines)


def cmd_run(args) -> int:
    from ratchet.flows.config import load_config

    return _execute(load_config(args.config, args.overrides), args.start_from, verbose=args.verbose)


def cmd_resume(args) -> int:
    """Continue a pipeline run with the config it was started with, each file it reads (a reward
    function, an environment, a data file) taken as it is now: a file fixed after a failure is
    what the resumed run uses, and the stages that read it run again."""
    from ratchet.flows.runs import choose_run, load_record, resumed_config

    config, (run,), overrides = _words(args, "resume", ["RUN"], required=0)
    if config is None and overrides:
        raise RatchetError(f"ratchet resume continues a run with its own recorded config; {overrides[0]} would change "
                           "it. Name the CONFIG with the overrides the run was started with, or start a new run: "
                           "ratchet run CONFIG key=value")
    chosen = choose_run(config, overrides, args.workdir, args.run or run, own=True)
    record = load_record(chosen.workdir, chosen.run)
    print(f"resuming {chosen.line()}")
    return _execute(resumed_config(record, chosen.workdir), record.ctx.start_version, verbose=args.verbose,
                    run_name=record.ctx.run_name)


def _execute(cfg, start_from: str | None = None, verbose: bool = False, run_name: str | None = None) -> int:
    """Run the pipeline under the console: stage lines on the terminal, everything else in logs
    (see flows/console.py). Errors found before the run starts are raised to `main`; a run
    that fails prints one block (what failed, why, its log, how to resume) and exits 1."""
    from ratchet.flows.inputs import checked_run
    from ratchet.flows.launch import imports_meanwhile, library_env

    library_env()
    if start_from is None and (done := _reused_whole(cfg, run_name, verbose)) is not None:
        return done
    # before anything is written: bad data leaves no workdir behind; the run's own imports are made
    # while the model's checks wait on the fork server
    with checked_run(cfg, imports_meanwhile(Path(cfg.workdir).resolve())) as split:
        return _execute_checked(cfg, split, start_from, verbose, run_name)


SAID = ("done", "reused", "note", "round", "report")  # the events whose lines a finished run keeps


def _reused_whole(cfg, run_name: str | None, verbose: bool) -> int | None:
    """A run whose every stage the plan finds finished and whose files still match their manifests
    (stat-cached: data/digest.py) is a read, as `make` with nothing to do: it prints what the run
    printed when it finished (every stage reused) and its round table, and starts nothing
    (Prefect, MLflow, the fork server, an engine) and records nothing. None: anything to run, or
    nothing kept to print (a run finished before runs kept it, or not on a SQLite MLflow store,
    whose champion this reads without MLflow), and the run goes the usual way."""
    from ratchet.data import events
    from ratchet.data.errors import RatchetError
    from ratchet.data.manifest import read_manifest
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.console import RunConsole
    from ratchet.flows.inputs import check_data, dtype_line, with_sets
    from ratchet.flows.plan import plan
    from ratchet.flows.runs import load_record, recorded_name
    from ratchet.flows.tracking import redact, sqlite_champion

    workdir = Path(cfg.workdir).resolve()
    run = run_name or recorded_name(cfg, workdir)
    try:
        rec = load_record(workdir, run)
    except RatchetError:
        return None
    from ratchet.flows.tracking import store_uri

    said, uri = rec.said, store_uri(cfg.tracking, workdir)
    if rec.state != "finished" or not said or rec.ctx.start_version or not uri.startswith("sqlite:///"):
        return None
    split, sets = check_data(cfg)
    made = plan(cfg, run=run, pool_start=rec.ctx.pool_start, sources=with_sets(split, sets).digests)
    if not made.steps or any(s.state != "reused" for s in made.steps):
        return None
    store = ArtifactStore(workdir, create=False)
    for s in made.steps:  # each file checked against its manifest, as a reuse always is
        store.verify(read_manifest(workdir / s.dir))
    champion = sqlite_champion(uri, said["model"])
    with RunConsole.for_streams(sys.stdout, sys.stderr, plain=True) as console:
        console.header([f"ratchet run {run}: {cfg.rounds} round(s) from the base model",
                        f"  {made.summary()}", f"  workdir  {workdir}",
                        f"  MLflow   {redact(uri)} (parent run {rec.ctx.parent_run_id})",
                        f"  dtype    {dtype_line(cfg).removeprefix('dtype: ')}",
                        "  nothing to run: every stage is reused, its files checked; nothing is recorded"])
        for e in said["events"]:
            kind = "reused" if e["kind"] == "done" else e["kind"]
            console.on_event(events.Event(kind, e["stage"], e["round"], summary=e["summary"], data=e["data"]))
        console.text("\n" + said["table"])
        if champion:
            line = said["champion"] if champion == said.get("champion_version") else \
                f"champion: {said['model']} version {champion}"
            console.text(line)
    return 0


def _sigterm_interrupts() -> None:
    """SIGTERM (systemd, `docker stop`, Kubernetes, a Prefect cancel) stops a run as Ctrl-C does: the
    console says interrupted, the record says interrupted, nothing is left running, exit 143, and
    the same command resumes."""
    import signal
    import threading

    from ratchet.data.errors import Terminated

    def stop(signum, frame):
        raise Terminated()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def _execute_checked(cfg, split, start_from: str | None, verbose: bool, run_name: str | None = None) -> int:
    import time
    import traceback

    from ratchet.data import events, failpoints
    from ratchet.flows.console import RunConsole, redirect_output
    from ratchet.flows.launch import launcher, prepare_env

    workdir = Path(cfg.workdir).resolve()
    prepare_env(workdir)
    failpoints.orchestrator()
    _sigterm_interrupts()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    if verbose:
        os.environ["RATCHET_VERBOSE"] = "1"
        run_log, out, err = None, sys.stdout, sys.stderr
    else:
        run_log = workdir / "logs" / f"{stamp}-{os.getpid()}.log"
        out, err = redirect_output(run_log)
    from ratchet.flows.inputs import dtype_line
    from ratchet.flows.tracking import redact

    ctx = None
    with RunConsole.for_streams(out, err, plain=verbose) as console, launcher(cfg, stamp) as launch:
        try:
            ctx, tracker = launch.start(start_from, split, say=console.line, run_name=run_name)
            if run_log is not None:
                named = run_log.with_name(f"{ctx.run_name}.{stamp}.log")
                run_log.rename(named)
                run_log = named
            origin = f"continuing from {tracker.model_name} version {ctx.start_version}" if ctx.start_version \
                else "from the base model"
            planned = _plan_line(cfg, ctx, tracker)
            console.header([
                f"ratchet run {ctx.run_name}: {cfg.rounds} round(s) {origin}",
                f"  {planned}",
                f"  workdir  {ctx.workdir}",
                f"  MLflow   {redact(tracker.uri)} (parent run {ctx.parent_run_id})",
                f"  dtype    {dtype_line(cfg).removeprefix('dtype: ')}",
                f"  log      {run_log} (each stage's own: stage.log in its directory)" if run_log else
                "  verbose: every library's output follows",
            ])
            said: list = []
            unsubscribe = events.subscribe(lambda ev: said.append(ev) if ev.kind in SAID else None)
            try:
                _, results, _ = launch.execute(ctx)
            finally:
                unsubscribe()
        except BaseException as e:
            traceback.print_exc()  # into the run's log (the terminal with --verbose)
            resume = f"ratchet resume --run {ctx.run_name} --workdir {ctx.workdir}" if ctx else "re-run the same command"
            console.failure(e, run_log, resume)
            if isinstance(e, KeyboardInterrupt):
                return 143 if type(e).__name__ == "Terminated" else 130  # 128 + the signal, as a shell reports it
            return 2 if type(e).__name__ == "ConfigError" else 1
        champ = tracker.champion()
        table, line = _summary(results, champ), ""
        console.text("\n" + table)
        if champ:
            acc = tracker.accuracy(champ, results[-1].eval_set)
            dtype = tracker.version(champ).tags.get("ratchet.eval_dtype")
            on = f"held-out accuracy {acc:.3f}" + (f" in {dtype}" if dtype else "") if acc is not None \
                else "not evaluated on this eval set"
            console.text(line := f"champion: {tracker.model_name} version {champ} ({on})")
    from ratchet.flows.runs import record_said

    record_said(Path(ctx.workdir), ctx.run_name, {
        "events": [{"kind": e.kind, "stage": e.stage, "round": e.round, "summary": e.summary, "data": e.data}
                   for e in said],
        "table": table, "champion": line, "champion_version": champ, "model": tracker.model_name})
    return 0


def _plan_line(cfg, ctx, tracker) -> str:
    """The plan's one line (flows/plan.py) for the run about to start: what it will reuse and run."""
    from ratchet.data.store import ArtifactStore
    from ratchet.flows.lineage import version_manifest
    from ratchet.flows.plan import plan

    start = version_manifest(ArtifactStore(Path(ctx.workdir)), tracker, ctx.start_version) if ctx.start_version \
        else None
    return plan(cfg, run=ctx.run_name, start=start, pool_start=ctx.pool_start, sources=ctx.sources).summary()


def cmd_config(args) -> int:
    import yaml

    from ratchet.flows.config import load_config

    if args.reference or args.explain is not None:
        from ratchet.flows import reference

        if args.reference:
            print(reference.markdown(), end="")
            return 0
        try:
            print(reference.explain(args.explain))
        except KeyError as e:
            close = e.args[0]
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            print(f"ratchet: error: no config field {args.explain!r}{hint} (every field: ratchet config "
                  f"--reference, or {reference.DOC})", file=sys.stderr)
            return 2
        return 0
    if args.config is None:
        print("ratchet: error: ratchet config needs a CONFIG to resolve (or --explain FIELD, or --reference)",
              file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_check(args) -> int:
    """Check a config's task without running it: the config, every row of its data and of each
    held-out set, the answer check (a user's function is loaded in its own process), and every
    prompt against the token budgets. Only the tokenizer is loaded; nothing is written but a pass of
    the model's checks, kept in the user's cache by what they read (flows/inputs.py model_check_key):
    the same inputs again are not checked again (`--full` checks them)."""
    from ratchet.flows.config import load_config
    from ratchet.flows.inputs import (attention_line, check_data, check_served, checked_model, devices_line,
                                      dtype_line, first_message, model_check_key, model_line, passed_before,
                                      record_pass, with_sets)

    cfg = load_config(args.config, args.overrides)
    split, sets = check_data(cfg)
    local = cfg.sampler.backend_kind.local
    # --full: every check made again, no pass kept before looked up (a new one is not kept either)
    key = model_check_key(cfg, split, sets) if local and not getattr(args, "full", False) else None
    said = kept = passed_before(key)
    if kept is None and local:
        said = checked_model(cfg, split, sets)
        record_pass(key, said)
    elif not local:
        check_served(cfg, split, sets)
    split = with_sets(split, sets)
    check = cfg.data.check
    print(f"data: {cfg.data.kind}, {len(split.train)} train prompts "
          f"({sum(p.answer is not None for p in split.train)} with an answer), {len(split.eval)} held out; "
          f"check: {check.kind}" + (f" ({check.function})" if hasattr(check, "function") else "")
          + (f", {how}" if (how := getattr(check, "called_as", lambda: None)()) else ""))
    if (own := cfg.label.scores_with(check)) is not check:
        how = getattr(own, "called_as", lambda: None)()
        print(f"label: {cfg.label.kind}, scored by label.check: {own.kind}"
              + (f" ({own.function})" if hasattr(own, "function") else "") + (f", {how}" if how else "")
              + f"; held-out accuracy by data.check ({check.kind})")
    print((said or {}).get("model_line") or model_line(cfg, first_message(cfg, split)))
    if (search := cfg.prompt.search) is not None:
        draw = cfg.data.prompts_per_round or sum(p.answer is not None or not check.needs_answer for p in split.train)
        print(f"{search.describe(draw)}; improve: {cfg.improve}")
    for s, stage in cfg.eval_stages():
        held = sets[s.name].eval if s.name in sets else split.eval
        src = s.source(cfg.data)
        gate = " · the gate's set" if s.name == cfg.evaluate.gate_set else ""
        print(f"held-out set {s.name!r} ({stage}): {len(held)} prompts from {src.kind}, check {src.check.kind}{gate}")
    if levels := cfg.data.level_list():
        counts = {n: sum(p.level == n for p in split.train) for n in levels}
        from ratchet.tasks.curriculum import describe

        print(describe(cfg.curriculum, counts) if cfg.curriculum is not None else
              f"levels: {levels}, every one evaluated each round; no curriculum: a round's train prompts come from "
              "every level's")
    if cfg.cold_start is not None:
        from ratchet.data.demonstrations import read

        demos, _, _ = read(cfg.cold_start.demonstrations)  # checked above: every row, answer, tool call and episode
        print(f"cold start: {len(demos)} demonstrations from {cfg.cold_start.demonstrations} "
              f"({sum(len(d.turns) > 1 for d in demos)} of several turns), each answer accepted by data.check; "
              f"the base model fine-tuned on them is round 1's, then {cfg.rounds} round(s)")
    if cfg.sampler.backend_kind.local:  # a served policy runs no engine here
        print(devices_line(cfg))
        print(dtype_line(cfg))
        if hint := attention_line(cfg):
            print(hint)
    if kept is not None:
        print("model checks: passed before with the same inputs (the config's fields they read, every prompt, the "
              "model's and your files unchanged, the same code and libraries), not made again; --full makes them again")
    print(f"ok: {args.config} is ready to run")
    return 0


def _is_override(word: str) -> bool:
    import re

    return re.fullmatch(r"[A-Za-z_][\w.]*=.*", word, re.S) is not None


def _words(args, command: str, names: list[str], required: int) -> tuple[str | None, list, list[str]]:
    """A run command's words, `[CONFIG] [ARG ...] [key=value ...]`: the config (a YAML file, or
    None), this command's own arguments by position (`names`; None where left out) and the
    overrides."""
    words = list(args.overrides)
    config = words.pop(0) if words and not _is_override(words[0]) and (
        words[0].endswith((".yaml", ".yml")) or Path(words[0]).is_file()) else None
    rest = [w for w in words if not _is_override(w)]
    overrides = [w for w in words if _is_override(w)]
    usage = " ".join(names)
    if len(rest) > len(names):
        raise RatchetError(f"ratchet {command} takes [CONFIG] {usage or 'no argument'} then key=value overrides; "
                           f"{rest[len(names)]!r} is none of these (a config is a .yaml file)")
    if len(rest) < required:
        raise RatchetError(f"ratchet {command} needs {' '.join(names[:required])}: ratchet {command} [CONFIG] {usage} "
                           "[key=value ...] [--workdir W] [--run RUN]")
    return config, rest + [None] * (len(names) - len(rest)), overrides


def _chosen(args, command: str, names: list[str], required: int = 0, need: bool = True, own: bool = False):
    """The run a command reads, chosen as every run command chooses it, and the line that says so
    (on standard error under --json, where standard output is the document)."""
    from ratchet.flows.runs import choose_run

    config, targets, overrides = _words(args, command, names, required)
    chosen = choose_run(config, overrides, args.workdir, args.run, need=need, own=own)
    print(f"reading {chosen.line()}", file=sys.stderr if getattr(args, "json", False) else sys.stdout)
    return chosen, targets


def cmd_lineage(args) -> int:
    """Print the chain behind a model version or round run; exit 1 if any link fails its check."""
    import json

    from ratchet.flows import api
    from ratchet.flows.lineage import as_json, render_code, render_text

    _, (target,), _ = _words(args, "lineage", ["VERSION"], required=0)
    chosen, _ = _chosen(args, "lineage", ["VERSION"], need=target is None and args.code is None)
    if args.code is not None:  # a code version, opened
        opened = api.code_version(chosen, args.code)
        print(json.dumps(opened, indent=2) if args.json else render_code(opened))
        return 0
    found = api.lineage(chosen, target, run=args.run)
    if found.made_by:
        print(found.made_by, file=sys.stderr if args.json else sys.stdout)
    print(json.dumps(as_json(found.links), indent=2) if args.json else render_text(found.links))
    return 0 if found.verified else 1


def cmd_runs(args) -> int:
    """The pipeline runs recorded in a workdir: state, rounds, versions, champion, how to resume."""
    import json
    import time

    from ratchet.flows import api

    chosen, _ = _chosen(args, "runs", [], need=False)
    found = api.runs(chosen, run=args.run)
    champ = found.champion
    if args.json:
        print(json.dumps({"workdir": str(found.workdir), "model": found.model, "champion": champ,
                          "runs": [r.model_dump() for r in found.runs]}, indent=2))
        return 0
    print(f"workdir {found.workdir} · MLflow {found.tracking} · model {found.model} · champion "
          f"{'version ' + champ if champ else 'none yet'}")
    print(f"{'run':<34} {'state':<11} {'rounds':>6}  {'started':<16}  versions (held-out accuracy; * promoted)")
    for r in found.runs:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started)) if r.started else "?"
        versions = ", ".join(f"v{e.version}{'*' if e.promoted else ''} "
                             f"{'?' if e.accuracy is None else f'{e.accuracy:.1%}'}"
                             f"{' (champion)' if e.version == champ else ''}" for e in r.entries)
        print(f"{r.run:<34} {r.state:<11} {f'{r.rounds_done}/{r.rounds}':>6}  {when:<16}  {versions or '-'}")
        if r.resume:
            print(f"{'':<34} resume: {r.resume}")
        if r.problem:
            print(f"{'':<34} {r.problem}")
    return 0


def cmd_report(args) -> int:
    """Draw a run's rounds: PNGs and one self-contained HTML page, also logged to its MLflow run."""
    from ratchet.flows.api import _reading, _tracker
    from ratchet.flows.report import build

    chosen, _ = _chosen(args, "report", []) if args.run else _positional_run(args, "report")
    report = build(chosen.workdir, _reading(chosen), chosen.run, log=not args.no_log, log_with=lambda: _tracker(chosen))
    print(f"{report.run.run}: {len(report.rounds)} round(s), {len(report.figures)} figure(s)")
    for title, path in report.figures.items():
        print(f"  {path}  {title}")
    print(f"page: {report.html}" + ("" if args.no_log else "  (also on the MLflow parent run under report/)"))
    return 0


def _positional_run(args, command: str):
    """`ratchet report CONFIG RUN` and `ratchet resume RUN --workdir W`, as older logs and docs
    print them: a bare RUN is --run."""
    _, (run,), _ = _words(args, command, ["RUN"], required=0)
    if run is not None:
        args.run = run
        args.overrides = [w for w in args.overrides if w != run]
    return _chosen(args, command, [])[0], (run,)


def cmd_export(args) -> int:
    """Write a registered version as a plain Hugging Face model directory with a lineage card."""
    from ratchet.flows import api

    chosen, (target, out_dir) = _chosen(args, "export", ["VERSION", "DIR"], required=2, need=False)
    done = api.export(chosen, target, out_dir, run=args.run)
    out = done.path
    print(done.made_by)
    print(f"{done.model} version {done.version} -> {out} (transformers: AutoModelForCausalLM.from_pretrained("
          f"{str(out)!r}); vLLM: LLM(model={str(out)!r}))")
    return 0


def cmd_verify(args) -> int:
    """Run the stages behind a version again in a scratch store; compare every output's digest."""
    from ratchet.flows import api

    chosen, _ = _chosen(args, "verify", [], need=args.version is None)
    done = api.verify(chosen, args.version, args.stage or [], run=args.run)
    print(done.made_by)
    counts = done.counts
    print(", ".join(f"{n} {k}" for k, n in counts.items()) + f": verdicts in {done.path}{done.logged}")
    if counts["differs"]:
        print(f"the re-run's files are kept in {done.path.with_name(done.path.stem + '-scratch')} to compare")
    return 1 if counts["differs"] else 0


def cmd_evaluate(args) -> int:
    """A registered version's held-out accuracy on the config's sets, each a keyed evaluate stage."""
    from ratchet.flows import api

    chosen, (target,) = _chosen(args, "evaluate", ["VERSION"], required=1, need=False)
    done = api.evaluate(chosen, target, args.set or [], run=args.run, say=print)  # says who made it first
    for s in done.sets:
        lo, hi = s.interval
        how = "read: evaluated before" if s.reused else f"evaluated now in {s.wall_s:.0f} s"
        print(f"  {s.name:<14} {s.accuracy:7.1%} of {s.prompts:<5} (95% interval {lo:.1%}-{hi:.1%})  {s.stage_dir} "
              f"({how})")
    return 0


def cmd_plan(args) -> int:
    """What a run would do, before it starts: each stage reused, stale (and why), to run, or waiting."""
    import json

    from ratchet.flows import api
    from ratchet.flows.runs import choose_run, recorded_name

    config, _, overrides = _words(args, "plan", [], required=0)
    chosen = choose_run(config, overrides, args.workdir, args.run, need=config is None)
    run = chosen.run or recorded_name(chosen.cfg, chosen.workdir)
    if chosen.run is not None:
        line = chosen.line()
    else:
        known = (chosen.workdir / "runs" / f"{run}.json").is_file()
        line = f"run {run} (the run {config} names{'' if known else '; not run yet'}) · workdir {chosen.workdir}"
    print(f"reading {line}", file=sys.stderr if args.json else sys.stdout)
    made = api.plan(chosen)
    print(json.dumps(made.as_json(), indent=2) if args.json else made.render())
    return 0


def cmd_serve(args) -> int:
    """Deploy the pipeline on a cron schedule; each run continues from the MLflow champion."""
    from ratchet.flows.config import load_config
    from ratchet.flows.launch import prepare_env
    from ratchet.flows.schedule import absolute_paths, deploy

    prepare_env(None)
    cfg = absolute_paths(load_config(args.config, args.overrides))
    return deploy(cfg, cron=args.cron, name=args.name, pool=args.pool, start_from=args.start_from,
                  timezone=args.timezone)


def cmd_gc(args) -> int:
    """Remove what interrupted stages left behind that no recorded run will resume."""
    from ratchet.flows.gc import collect_garbage

    if args.run is not None:
        raise RatchetError("ratchet gc looks at every run of a workdir at once (a stage may be shared by several); "
                           "leave out --run. `ratchet gc CONFIG --dry-run` lists which run keeps what")
    chosen, _ = _chosen(args, "gc", [], need=False)
    items = collect_garbage(chosen.workdir, dry_run=args.dry_run, everything=args.all)
    if args.models:
        from ratchet.flows.gc import drop_models
        from ratchet.flows.tracking import Tracker

        tracker = Tracker(chosen.cfg.tracking, chosen.workdir, chosen.cfg.name)
        items += drop_models(chosen.workdir, tracker, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for x in items:
        print(f"{verb if x.remove else 'kept':>12} {x.path}  ({x.bytes / 2**20:.1f} MiB): {x.why}")
    gone = [x for x in items if x.remove]
    print(f"{verb} {len(gone)} item(s), {sum(x.bytes for x in gone) / 2**20:.1f} MiB; kept {len(items) - len(gone)}")
    if args.models and not args.dry_run:
        from ratchet.flows.gc import UNLOADABLE

        for mv in sorted(tracker.client.search_model_versions(f"name='{tracker.model_name}'"),
                         key=lambda v: int(v.version)):
            if UNLOADABLE in mv.tags:
                print(f"version {mv.version} loads through MLflow after `ratchet restore`: {mv.tags[UNLOADABLE]}")
    return 0


def cmd_restore(args) -> int:
    """Make again the merged weights `gc --models` dropped that registered versions load against."""
    from ratchet.flows.api import version_number
    from ratchet.flows.gc import restore
    from ratchet.flows.tracking import Tracker

    chosen, (target,) = _chosen(args, "restore", ["VERSION"], need=False)
    tracker = Tracker(chosen.cfg.tracking, chosen.workdir, chosen.cfg.name)
    done = restore(chosen.workdir, tracker, [version_number(tracker, target)] if target else None)
    for version, what in done:
        print(f"version {version}: made again {what}, byte for byte")
    said = f"version {target}" if target else "every version whose MLflow model lost its base"
    print(f"{said}: {len(done)} set(s) of weights made again; mlflow.transformers.load_model loads "
          f"{'it' if target else 'them'}")
    return 0


def cmd_model(args) -> int:
    from ratchet.models.default_model import default_model_dir

    print(default_model_dir())
    return 0


RUN_USAGE = "ratchet {command} [CONFIG] {args}[key=value ...] [--workdir W] [--run RUN]"
RUN_NAMING = ("Every command that reads a run (resume, report, runs, lineage, export, verify, gc, plan) names it "
              "the same way: the workdir is --workdir W, else the CONFIG's workdir after its overrides, else ./runs; "
              "the run is --run RUN, else the run CONFIG names (the one `ratchet run CONFIG` continues), else the "
              "newest recorded under the config's name (not for resume, which continues only the run it names, nor for "
              "plan, which plans the run CONFIG names even before it has run), or with no CONFIG the newest in the "
              "workdir, whose recorded config is then read. The first line says which run was read.")


def _run_command(sub, name: str, fn, help: str, description: str, *, args: str = "", tail: str = "",
                 words: str = "none", json: bool = False, run_help: str | None = None) -> argparse.ArgumentParser:
    """A command that reads a run: `ratchet NAME [CONFIG] ARGS [key=value ...] [--workdir W] [--run RUN]
    TAIL`, its description ending in how every such command names its run."""
    s = sub.add_parser(name, help=help, usage=RUN_USAGE.format(command=name, args=args) + tail,
                       description=f"{description} {RUN_NAMING}")
    _run_args(s, f"{name}: {words}", json, run_help)
    s.set_defaults(fn=fn)
    return s


def _run_args(s: argparse.ArgumentParser, words: str, json: bool = False, run_help: str | None = None) -> None:
    """[CONFIG] [ARG ...] [key=value ...] [--workdir W] [--run RUN]: a command that reads a run."""
    s.add_argument("overrides", nargs="*", metavar="WORD", help="the run's YAML config (optional), this command's "
                   f"own arguments ({words}), then dotted overrides as given to `run`")
    s.add_argument("--workdir", default=None, metavar="W", help="the workdir the run is in (default: the config's; "
                   "with no config, ./runs)")
    s.add_argument("--run", default=None, metavar="RUN", help=run_help or "the run's name, as `ratchet runs` lists "
                   "it (default: the run the config names, else the newest)")
    if json:
        s.add_argument("--json", action="store_true", help="machine-readable output (which run was read goes to "
                       "standard error)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ratchet",
        description="Iterative self-improvement of a language model: sample -> label -> filter -> train -> "
        "evaluate, repeated for rounds, orchestrated by Prefect and tracked in MLflow.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, fn, text in [
        ("run", cmd_run, "run (or resume) the self-improvement pipeline"),
        ("config", cmd_config, "print the resolved config after overrides and checks"),
        ("check", cmd_check, "check a task before running it: the config, every row of the data and of each "
         "held-out set, the answer check (a user's function is loaded) and the token budgets; writes nothing to the "
         "workdir"),
    ]:
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("config", help="YAML config, e.g. flows/configs/default.yaml",
                       **({"nargs": "?"} if name == "config" else {}))
        s.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.beta=0.2")
        s.set_defaults(fn=fn)
        if name == "run":
            s.add_argument("--verbose", action="store_true", help="also stream every engine's, trainer's and "
                           "library's output to the terminal (it always goes to the logs)")
            s.add_argument("--from", dest="start_from", default=None, metavar="START",
                           help="start from 'champion' (the MLflow alias; the base model if none yet), a "
                           "registered version number, or 'base' (default)")
        if name == "check":
            s.add_argument("--full", action="store_true", help="make every check again and read every file, even "
                           "where the same inputs passed before")
        if name == "config":
            s.add_argument("--explain", metavar="FIELD", default=None, help="print one field's entry of the "
                           "config reference: type, default, allowed values, what it does (e.g. label.mode)")
            s.add_argument("--reference", action="store_true", help="print the whole config reference as "
                           "Markdown (docs/reference/config.md is this output)")
    s = _run_command(sub, "resume", cmd_resume, "continue a pipeline run (the one CONFIG names, or --run RUN)",
                     "Continue a pipeline run with the config it was started with: finished stages are reused, the "
                     "same MLflow parent and round runs continue.",
                     words="also RUN, as older logs print it (ratchet resume RUN --workdir W)")
    s.add_argument("--verbose", action="store_true", help="also stream every library's output to the terminal")
    s = _run_command(sub, "lineage", cmd_lineage, "print and verify the chain that produced a model version",
                     "Walk a model's manifests back to the base model and prompts, re-verifying every digest. Exits "
                     "1 if any link was changed after it finished. VERSION: a model version number, models:/NAME/N, "
                     "a prompt version prompts:/NAME/N (from the stage that wrote its text), 'champion', a round's "
                     "MLflow run id, or a stage dir (its path, or as a link prints it: stages/NAME-KEY); left out, the "
                     "run's newest version. A version names the run that made it (its ratchet.run tag), which the "
                     "first line says.",
                     args="[VERSION] ", tail=" [--json] [--code DIGEST]", words="VERSION", json=True)
    s.add_argument("--code", metavar="DIGEST", default=None, help="open a stage's code version (the `code` a link "
                   "prints): every definition it covers, with its module and digest, and the libraries' versions")
    _run_command(sub, "runs", cmd_runs, "list the pipeline runs in a workdir, their state and how to resume them",
                 "The pipeline runs recorded in the workdir: finished, failed, interrupted (killed or lost) or "
                 "running; rounds done; each round's registered version and held-out accuracy; the champion; and "
                 "the command that resumes an unfinished run. --run lists one.", tail=" [--json]", json=True)
    s = _run_command(sub, "report", cmd_report, "draw a run's rounds as PNG figures and one HTML page",
                     "Held-out accuracy by round (promoted rounds marked), label rewards, training rows or pairs, "
                     "label-vs-verifier agreement, tree-search figures where used, wall time per stage and "
                     "throughput: PNG files and one self-contained HTML page in WORKDIR/reports/RUN/, logged to the "
                     "run's MLflow parent run under report/. Every run writes its own at the end; this draws one "
                     "again, or an older run's.", tail=" [--no-log]",
                     words="also RUN, as `ratchet report CONFIG RUN` was written before --run")
    s.add_argument("--no-log", action="store_true", help="write the files only, log nothing to MLflow")
    _run_command(sub, "export", cmd_export, "write a registered version as a plain Hugging Face model directory",
                 "Copy a registered version's merged weights and tokenizer, re-verified against their digests, "
                 "into DIR with a model card (README.md) naming its lineage: a directory transformers' "
                 "from_pretrained and vLLM load as is. VERSION: a version number, models:/NAME/N, or 'champion'; "
                 "it names the run that made it. DIR must not exist, or be empty.", args="VERSION DIR ",
                 words="VERSION DIR")
    s = _run_command(sub, "verify", cmd_verify, "run a version's stages again from their recorded inputs and "
                     "compare the bytes",
                     "Each stage of the chain behind a model version (the run's newest, or --version) runs again, "
                     "in a scratch store under WORKDIR/verify/ that reads the recorded parents and writes nothing "
                     "in the run's own store, and every output's sha256 is compared with its manifest. A stage is "
                     "identical, differs (which files; each metric that moved, by how much) or not re-runnable (and "
                     "why: a server's answers, another code version, a key that resolves differently here). The "
                     "verdicts go to WORKDIR/verify/RUN/STAMP.json and the run's MLflow parent run (verify/). "
                     "Exits 1 if any stage differs.", tail=" [--version VERSION] [--stage STAGE ...]")
    s.add_argument("--version", default=None, metavar="VERSION", help="the model version whose chain is verified: "
                   "a number, models:/NAME/N or 'champion' (default: the run's newest)")
    s.add_argument("--stage", action="append", default=None, metavar="STAGE", help="verify only this stage of the "
                   "chain (train, or train:2 for round 2's; repeat for more)")
    s = _run_command(sub, "evaluate", cmd_evaluate, "a registered version's held-out accuracy on the config's "
                     "sets, or on a set added with evaluate.sets=[...]",
                     "Evaluate a model version (a number, models:/NAME/N or 'champion') on every held-out set of "
                     "the config, as a round evaluates its model (greedy, evaluate.dtype, the set's check), each with "
                     "its Wilson 95% interval. Each set is an evaluate stage in the store, keyed by the model, the "
                     "prompts and how they are scored: a set a round already evaluated this model on is read, not "
                     "run again, and a set added by an override (evaluate.sets=[{name: heldout}, {name: NAME, "
                     "data: {kind: file, path: FILE}}]) is evaluated once and kept. Nothing is logged to MLflow.",
                     args="VERSION ", tail=" [--set NAME ...]", words="VERSION")
    s.add_argument("--set", action="append", default=None, metavar="NAME", help="evaluate only this set "
                   "(heldout, level_3, a name evaluate.sets gives; repeat for more)")
    _run_command(sub, "plan", cmd_plan, "say, before a run, which stages it would reuse, re-run or run, and why",
                 "For every stage of every round: reused (a finished stage with its key is in the store), stale "
                 "(this run finished it under another key: the config fields, files, code definitions or parents "
                 "that differ are named), to run, or waits (on a stage before it that will run, or on a gate's "
                 "decision). It loads no model and writes nothing in the workdir or in MLflow. `ratchet run` "
                 "prints its last line before it starts.", tail=" [--json]", json=True)
    s = sub.add_parser("serve", help="deploy on a cron schedule to a Prefect server; each run continues from "
                       "the champion", description="Create a Prefect deployment of the pipeline with a cron "
                       "schedule. Each scheduled run adds `rounds` rounds on top of the MLflow `champion` model "
                       "and records it as the parent in its lineage. Needs a real Prefect server "
                       "(PREFECT_API_URL): an ephemeral one cannot run schedules. Without --pool this process "
                       "serves the deployment (runs what is scheduled) until stopped; with --pool a "
                       "`prefect worker start --pool POOL` runs it.")
    s.add_argument("config", help="YAML config, e.g. flows/configs/default.yaml")
    s.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as given to `run`")
    s.add_argument("--cron", required=True, help='cron schedule, e.g. "0 3 * * *" (03:00 daily)')
    s.add_argument("--timezone", default=None, help="IANA timezone of the cron schedule (default UTC)")
    s.add_argument("--name", default=None, help="deployment name (default: the config's name)")
    s.add_argument("--pool", default=None, help="register with this process work pool for a worker to run, "
                   "instead of serving from this process (the pool is created if missing)")
    s.add_argument("--from", dest="start_from", default="champion", metavar="START",
                   help="what each scheduled run starts from: 'champion' (default), 'base' or a version number")
    s.set_defaults(fn=cmd_serve)
    s = _run_command(sub, "gc", cmd_gc, "remove unfinished stage dirs that no recorded run will resume",
                     "Delete stage directories without a manifest that no recorded pipeline run can resume (every "
                     "run that started them finished, or has no record), and scratch a kill left in finished "
                     "stages. A directory a live process holds is never touched, nor is any finished output. "
                     "--dry-run lists each with the reason. It reads every run of the workdir, so it takes no --run.",
                     tail=" [--dry-run] [--all] [--models]",
                     run_help="refused by gc, which reads every run of the workdir at once (a stage may be shared "
                     "by several); `--dry-run` lists which run keeps what")
    s.add_argument("--dry-run", action="store_true", help="list what would be removed and why, remove nothing")
    s.add_argument("--all", action="store_true", help="also remove unfinished stages a recorded run could still "
                   "resume (never one a live process holds)")
    s.add_argument("--models", action="store_true", help="also drop the merged weights of every registered version "
                   "but the champion, each run's newest and the models those were trained from; each keeps its "
                   "adapter and is made again, byte for byte, when a run or `ratchet export` needs it")
    _run_command(sub, "restore", cmd_restore, "make again the merged weights `gc --models` dropped that a registered "
                 "version needs to load through MLflow",
                 "A LoRA version's MLflow model loads its adapter against the model it was trained from, by path; "
                 "where `ratchet gc --models` (or drop_models) dropped that model's merged weights, the version is "
                 "tagged ratchet.mlflow_base_dropped and MLflow's loader cannot read it. This makes them again from "
                 "their adapter and parent, checked byte for byte against their manifest, with the version's own, "
                 "and removes the tag. VERSION: a version number, models:/NAME/N or 'champion'; left out, every "
                 "tagged version.", args="[VERSION] ", words="VERSION")
    s = sub.add_parser("model", help="convert (once) and print the default model directory")
    s.set_defaults(fn=cmd_model)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides after an option (`serve CONFIG --cron "..." rounds=2`) are overrides too:
    # argparse gives a positional list only the words before the first option
    later = [a for a in extra if "=" in a and not a.startswith("-")]
    if extra and later == extra and isinstance(getattr(args, "overrides", None), list):
        args.overrides += later
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore", "alembic", "urllib3", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.fn(args)
    except RatchetError as e:
        print(f"ratchet: error: {e}", file=sys.stderr)
        return 2 if type(e).__name__ == "ConfigError" else 1
    except BrokenPipeError:  # `ratchet plan | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 141  # as a shell reports a command that a closed pipe ended (128 + SIGPIPE)


def _send_prefect_logs() -> None:
    """Send the run's last log lines to Prefect while its server still serves. The exit handlers
    stop the temporary server first (registered last, run first) and then flush Prefect's log
    handler, which waits its full 5 s for a server that is gone and loses those lines."""
    if "prefect.logging.handlers" in sys.modules:
        from prefect.logging.handlers import APILogWorker

        with contextlib.suppress(Exception):
            APILogWorker.drain_all(timeout=5)


def entry() -> None:
    """The `ratchet` command: main, then the process ends without the interpreter's teardown.
    Every exit handler runs and every stream is flushed first; what is skipped is the freeing of
    each imported module, which with torch, transformers, Prefect and MLflow loaded took 4.5 s
    of a run's end on 2 idle cores and 16 s on 2 busy ones, after its last line. An error that
    escapes main ends the process as Python does (its traceback, then the usual teardown)."""
    import atexit
    import threading

    try:
        code = main()
    except SystemExit as e:  # argparse's own exits (--help, a usage error): its message is printed already
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    _send_prefect_logs()
    for t in threading.enumerate():  # as the interpreter would: a non-daemon thread is waited for
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
