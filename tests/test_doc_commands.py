"""The commands the README and every page under docs/ show in their fenced blocks still work: a new
page is covered by being there. Each command parses (its subcommand and options exist); each
config it names resolves with each override it shows (`ratchet config`), a shape written with
placeholders (`ratchet run CONFIG --from champion`) against the default config; `--help`,
`config --explain` and `config --reference` run; and `ratchet check` runs where its config ships
with the repository and its model is the embedded default. All in this process: no model runs.

Then every form that reads a run, with every form and fallback the run commands' --help promise,
runs against one recorded run (below)."""

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from ratchet.flows.cli import build_parser, main

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DEFAULT = "flows/configs/default.yaml"
# a placeholder the pages write in a command's shape, and what stands in for it here
PLACEHOLDERS = {"CONFIG": DEFAULT, "RUN": "default-0000000000", "W": "/tmp/ratchet-docs-w", "VERSION": "1",
                "DIR": "/tmp/ratchet-docs-out", "FIELD": "sample.n", "DIGEST": "0" * 16, "START": "champion",
                "POOL": "ratchet"}


def commands() -> list[tuple[str, int, list[str]]]:
    """(page, line, argv after `ratchet`) for every `ratchet ...` line of a fenced block."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for block in re.finditer(r"^```[\w-]*\n(.*?)^```", text, re.M | re.S):
            first = text[:block.start(1)].count("\n") + 1
            for i, line in enumerate(block.group(1).replace("\\\n", " \n").splitlines()):
                s = re.sub(r"^\$ ", "", line.strip())
                if not re.match(r"(\.venv/bin/)?ratchet( |$)", s) or s.startswith("ratchet COMMAND"):
                    continue
                words = shlex.split(s.split(" > ")[0], comments=True)
                out.append((page.relative_to(ROOT).as_posix(), first + i, words[1:]))
    return out


def _filled(argv: list[str]) -> list[str]:
    """A command's shape with its placeholders filled and its optional parts (`[...]`) left out."""
    out, depth = [], 0
    for w in argv:
        depth += w.count("[")
        if depth == 0 and w != "...":
            out.append(PLACEHOLDERS.get(w, w))
        depth -= w.count("]")
    return out


def shown_files(page: str) -> dict[str, str]:
    """The files a page shows whole, a fenced block that starts with `# NAME.ext`: what its
    commands may name (mytask.yaml, rewards.py)."""
    text = (ROOT / page).read_text()
    return {m.group(1): m.group(2) for m in re.finditer(
        r"^```[\w-]*\n# ([\w./-]+\.(?:py|yaml|yml|jsonl|json))\n(.*?)^```", text, re.M | re.S)}


CASES = commands()


def test_the_pages_show_commands():
    assert len(CASES) > 40 and {p for p, _, _ in CASES} >= {"README.md", "docs/reference/cli.md",
                                                             "docs/getting-started.md"}


@pytest.mark.parametrize("page,line,argv", CASES, ids=[f"{p}:{n}" for p, n, _ in CASES])
def test_a_shown_command_parses_and_its_config_resolves(page, line, argv, capsys, tmp_path, monkeypatch):
    args = _filled(argv)
    files = shown_files(page)
    if any(name in w for name in files for w in args):  # it names a file the page shows: run where it is
        for name, body in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(body)
        args = [str(ROOT / w) if w.endswith((".yaml", ".yml")) and (ROOT / w).is_file() else w for w in args]
        monkeypatch.chdir(tmp_path)
    else:
        monkeypatch.chdir(ROOT)
    if "--help" in args:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0 and "usage: ratchet" in capsys.readouterr().out
        return
    parsed, extra = build_parser().parse_known_args(args)
    assert all("=" in w and not w.startswith("-") for w in extra), f"{page}:{line}: unknown arguments {extra}"
    if parsed.command == "model":
        return
    if parsed.command == "config":  # --explain, --reference or a config: what it prints is the test
        assert main(args) == 0, f"{page}:{line}: {capsys.readouterr().err}"
        return
    words = [w for w in getattr(parsed, "overrides", []) if "=" in w] + extra
    config = getattr(parsed, "config", None) or next((w for w in getattr(parsed, "overrides", [])
                                                       if w.endswith((".yaml", ".yml"))), None)
    if config is None or not Path(config).is_file():  # a config of the reader's own the page does not show
        config = str(ROOT / DEFAULT)  # its overrides must still be ones the default config takes
    overrides = [w for w in words if not w.startswith("model.path=/models/")]  # a GPU machine's model
    code = main(["config", config, *overrides])
    assert code == 0, f"{page}:{line}: `ratchet config {config} {' '.join(overrides)}`: {capsys.readouterr().err}"


CHECKS = [(p, n, a) for p, n, a in CASES if a and a[0] == "check" and len(a) > 1 and (ROOT / a[1]).is_file()
          and not any(w.startswith("model.path=") for w in a)]


@pytest.mark.parametrize("page,line,argv", CHECKS, ids=[f"{p}:{n}" for p, n, _ in CHECKS])
def test_a_shown_check_passes(page, line, argv, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 0, f"{page}:{line}: {capsys.readouterr().err}"
    assert "is ready to run" in capsys.readouterr().out


def test_the_config_table_lists_every_shipped_config():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    table = page[page.index("| config | what it runs | guide |"):]
    table = table[:table.index("\n\n")]
    listed = set(re.findall(r"`([\w.-]+\.yaml)`", table))
    shipped = {p.name for p in (ROOT / "flows" / "configs").glob("*.yaml")}
    assert listed == shipped, f"the config table in docs/getting-started.md lacks {sorted(shipped - listed)}" \
        f" and lists {sorted(listed - shipped)}, which do not ship"



# Every form above that reads a run, and every form and fallback a run command's --help promises, run
# against one recorded run (tests/flows/recorded.py: `ratchet run` on the tiny model, a round that
# searches for a prompt and trains under it, so it has both kinds of version). The words a page writes
# as its own run (a shipped config, a run's name, `--workdir runs`) stand for that run: the test works
# where its workdir is ./runs. All in this process. A `verify` form that names no stage or version verifies the
# filter stage of its chain (every stage of a chain runs the same way; the recorded run's whole chain
# took 40 s). What `run` and `resume` do once they have chosen
# their run and config is the same for every form: it runs whole once for each (the recorded run is
# `ratchet run CONFIG --from champion`; the first `resume` below), and every other form of the two
# stops there, saying which run it would start or continue, from which version. They run with
# `--verbose`, which changes only where their output goes (without it the command moves this
# process's stdout and stderr to the run's log for good).
READERS = ("resume", "lineage", "runs", "report", "export", "verify", "evaluate", "plan", "gc")
RUN_NAME = re.compile(r"[a-z][\w-]*-[0-9a-f]{10}")


def _form(argv: list[str]) -> tuple[str, ...]:
    """A command as a form: the page's own config and run stand for CONFIG and RUN."""
    return tuple("CONFIG" if w.endswith((".yaml", ".yml")) else "RUN" if RUN_NAME.fullmatch(w) else w for w in argv)


_forms: dict[tuple[str, ...], list[str]] = {}
for _p, _n, _a in CASES:
    if _a and (_a[0] in READERS or _a[0] in ("run", "check") and "CONFIG" in _a):
        _forms.setdefault(_form(_a), []).append(f"{_p}:{_n}")
ON_A_RUN = list(_forms)
# (argv, exit code, what its output must say): the help texts' forms and fallbacks the pages do not
# show. CONFIG is the run's config, RUN its name, NAME its registered model, PROMPT its prompt name.
PROMISED = [
    # the workdir: --workdir W, else the config's, else ./runs; with no CONFIG, the newest run there,
    # its recorded config read
    (["runs"], 0, "RUN"), (["lineage"], 0, "version 2: made by run RUN"), (["plan"], 0, "reading run RUN"),
    (["report", "--no-log"], 0, "page: "), (["export", "2", "DIR"], 0, "version 2 -> "),
    (["runs", "--run", "RUN", "--workdir", "W", "--json"], 0, '"run": "RUN"'),
    (["lineage", "2", "--workdir", "W"], 0, "version 2: made by run RUN"),
    (["report", "--workdir", "W", "--run", "RUN", "--no-log"], 0, "RUN: 2 round(s)"),
    (["export", "1", "DIR", "--workdir", "W"], 0, "version 1 -> "),
    (["plan", "--workdir", "W", "--json"], 0, '"run": "RUN"'),
    (["plan", "CONFIG", "--run", "RUN"], 0, "reused"),
    (["gc", "--workdir", "W", "--dry-run"], 0, "would remove 0 item(s)"),
    # the run: --run, else the run CONFIG names, else the newest under the config's name (not for
    # resume, which refuses, nor for plan, which plans the run CONFIG names before it has run)
    (["lineage", "CONFIG", "sample.n=3"], 0, "made by run RUN"),
    (["resume", "CONFIG", "sample.n=3"], 2, "no run of CONFIG is recorded"),
    (["plan", "CONFIG", "sample.n=3"], 0, "not run yet"),
    # the older forms older logs print
    (["resume", "RUN", "--workdir", "W", "--verbose"], 0, "resuming run RUN"),
    (["report", "CONFIG", "RUN", "--no-log"], 0, "RUN: 2 round(s)"),
    # what a VERSION may be
    (["lineage", "CONFIG", "models:/NAME/1"], 0, "version 1: made by run RUN, round 0"),
    (["lineage", "CONFIG", "models:/another/1"], 1, "names another registered model than this run's; give "
                                                    "models:/NAME/N"),
    (["lineage", "CONFIG", "champion", "--run", "RUN"], 0, "made by run RUN"),
    (["lineage", "CONFIG", "prompts:/PROMPT/1"], 0, "(the config's prompt.template)"),
    (["lineage", "CONFIG", "ROUND_RUN_ID"], 0, "template"), (["lineage", "CONFIG", "STAGE_DIR"], 0, "template"),
    (["lineage", "CONFIG", "--code", "DIGEST", "--json"], 0, '"definitions"'),
    (["export", "CONFIG", "models:/NAME/1", "DIR"], 0, "version 1 -> "),
    (["export", "CONFIG", "models:/another/1", "DIR"], 1, "give models:/NAME/N"),
    (["verify", "CONFIG", "--version", "models:/another/1"], 1, "give models:/NAME/N"),
    (["export", "CONFIG", "champion", "DIR", "--run", "RUN"], 0, " -> "),
    # verify: a stage, or a version's chain, run again in a scratch store and compared
    (["verify", "CONFIG", "--stage", "filter", "--stage", "template:1"], 0,
     "2 identical, 0 differs, 0 not re-runnable: verdicts in W/verify/RUN/"),
    (["verify", "--version", "1", "--run", "RUN", "--workdir", "W"], 0, "2 identical, 0 differs"),
    (["verify", "CONFIG", "--stage", "nothing"], 1, "--stage nothing names no stage of this chain"),
    (["report", "CONFIG", "--no-log"], 0, "page: "),  # with the verdicts verify wrote (below)
    # evaluate: a version on the run's sets, read where its round evaluated it; a set the config lacks
    (["evaluate", "2", "--set", "heldout", "--workdir", "W", "--run", "RUN"], 0, "(read: evaluated before)"),
    (["evaluate", "CONFIG", "champion", "--set", "nope"], 1, "--set nope: not a held-out set of this config"),
    # gc: every run of the workdir at once
    (["gc", "CONFIG", "--run", "RUN"], 1, "leave out --run"),
    (["gc", "CONFIG", "--all", "--models", "--dry-run"], 0, "would remove"),
    # run --from: champion (the base model if none yet: how the recorded run was made), a version, base
    (["run", "CONFIG", "--from", "base", "--verbose"], 0, "run RUN"),
    (["run", "CONFIG", "--from", "1", "improve=prompt"], 0, "-from-v1 from version 1"),
]
_whole: set[str] = set()  # the commands whose execution has run whole here
_ran: set[tuple[str, ...]] = set()  # the variants of the pages' forms run so far


@pytest.fixture
def on_the_run(recorded_run, monkeypatch, tmp_path, capsys):
    """Fill a form's words for the recorded run; in its home folder, against the tests' Prefect
    server. `run` and `resume` run whole once each; later, they stop where the run would start."""
    import signal

    from prefect.settings import PREFECT_API_URL

    from ratchet.flows import cli
    from ratchet.flows.config import load_config
    from ratchet.flows.tracking import Tracker

    rec = recorded_run
    monkeypatch.chdir(rec.home)
    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
    monkeypatch.setenv("RATCHET_VERBOSE", "")  # `--verbose` sets it; put back after
    cfg = load_config(rec.config)
    tracker = Tracker(cfg.tracking, rec.work, cfg.name)
    v2 = tracker.version("2")
    words = {"prompts:/NAME/N": v2.tags["ratchet.prompt"], "CONFIG": str(rec.config), "RUN": rec.run,
             "W": str(rec.work), "VERSION": "2", "NAME": tracker.model_name, "ROUND_RUN_ID": v2.run_id,
             "PROMPT": v2.tags["ratchet.prompt"].split("/")[1], "STAGE_DIR": v2.tags["ratchet.stage_dir"],
             "DIGEST": next((rec.work / "code").glob("*.json")).stem, "key=value": "rounds=1", "STAGE": "filter",
             "SET": "heldout"}
    outs = iter(range(1000))
    placeholder = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, words)) + r")(?![\w-])")

    def fill(argv: list[str] | str) -> list[str] | str:
        if isinstance(argv, str):  # a text the output must hold
            return placeholder.sub(lambda m: words[m.group(1)], argv)
        return [str(tmp_path / f"out-{next(outs)}") if w == "DIR" else fill(w) for w in _form(argv)]

    execute = cli._execute

    def started(cfg, start_from=None, verbose=False, run_name=None):
        """The run `_execute` would start or continue, and from which version: said, not run."""
        from ratchet.flows.runs import recorded_name, start_version

        version = start_version(Tracker(cfg.tracking, Path(cfg.workdir), cfg.name), start_from)
        name = run_name or recorded_name(cfg, Path(cfg.workdir).resolve()) + (f"-from-v{version}" if version else "")
        print(f"would run {name}" + (f" from version {version}" if version else ""))
        return 0

    def run(argv: list[str]) -> tuple[int, str]:
        if argv[0] == "verify" and not {"--stage", "--version"} & set(argv):  # one cheap stage of the newest chain
            argv = [*argv, "--stage", "filter"]  # (the whole chain of a run is measured in docs/results.md)
        if argv[0] in ("run", "resume"):
            whole = argv[0] not in _whole and argv[0] != "run"  # the recorded run is `run`'s
            monkeypatch.setattr(cli, "_execute", execute if whole else started)
            _whole.add(argv[0])
            argv = argv if "--verbose" in argv else [*argv, "--verbose"]
        code = main(argv)
        seen = capsys.readouterr()
        return code, seen.out + seen.err

    term = signal.getsignal(signal.SIGTERM)
    yield fill, run
    signal.signal(signal.SIGTERM, term)  # `run` and `resume` set their own


def _variants(argv: tuple[str, ...]) -> list[list[str]]:
    """A form without its optional parts (`[...]`) and with all of them."""
    bare, full, depth = [], [], 0
    for w in argv:
        depth += w.count("[")
        if w.strip("[]") != "...":
            full.append(w.strip("[]"))
            if depth == 0:
                bare.append(w)
        depth -= w.count("]")
    return [bare] if bare == full else [bare, full]


@pytest.mark.integration
@pytest.mark.parametrize("form", ON_A_RUN, ids=[" ".join(_forms[f][:2]) for f in ON_A_RUN])
def test_a_shown_command_runs_against_a_recorded_run(form, on_the_run, recorded_run):
    fill, run = on_the_run
    for variant in _variants(form):
        if tuple(variant) in _ran:  # another page's form, without its optional parts, is this one
            continue
        _ran.add(tuple(variant))
        args = fill(variant)
        code, said = run(args)
        assert code == 0, f"{_forms[form]}: `ratchet {' '.join(args)}` exited {code}:\n{said[-3000:]}"
        if args[0] in ("run", "resume"):  # the run it started, continued or would have
            assert re.search(rf"\b(would run|ratchet run) {recorded_run.run}\b", said), said[-3000:]
        elif args[0] in READERS and args[0] not in ("runs", "gc") and "--code" not in args:
            # a line says which run it read (a version names its run; a plan of a config with overrides,
            # the run those name)
            assert re.search(rf"^(reading run {recorded_run.run}\b|.* made by run {recorded_run.run}\b|reading run "
                             r".* not run yet\))", said, re.M), f"{_forms[form]}: {said[:500]}"


@pytest.mark.integration
@pytest.mark.parametrize("argv,code,says", PROMISED, ids=[" ".join(a) for a, _, _ in PROMISED])
def test_a_promised_form_or_fallback_runs_against_a_recorded_run(argv, code, says, on_the_run):
    fill, run = on_the_run
    args = fill(argv)
    got, said = run(args)
    assert got == code, f"`ratchet {' '.join(args)}` exited {got}:\n{said[-3000:]}"
    assert fill(says) in said, f"`ratchet {' '.join(args)}` does not say {fill(says)!r}:\n{said[-3000:]}"
    if args[0] == "report" and (verified := sorted((Path("runs") / "verify").glob("*/*.json"))):
        first = json.loads(verified[-1].read_text())["stages"][0]  # the newest verify's
        page = Path(re.search(r"page: (\S+)", said).group(1)).read_text()
        assert "<h2>Verified</h2>" in page and f"<td>{first['stage']}</td><td>{first['round']}</td><td>" \
            f"{first['verdict']}</td>" in page


def test_every_option_of_a_run_command_is_run_against_the_recorded_run():
    """A new option or a new run command comes with a form above, on a page or in PROMISED."""
    import argparse

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    ran = [list(f) for f in ON_A_RUN] + [a for a, _, _ in PROMISED]
    for command in (*READERS, "run"):
        options = {o for action in sub.choices[command]._actions for o in action.option_strings} - {"-h", "--help"}
        used = {w.strip("[]") for a in ran if a[0] == command for w in a}
        assert options <= used, f"ratchet {command}: {sorted(options - used)} run against no recorded run"


@pytest.mark.integration
def test_the_api_reads_the_recorded_run_as_the_commands_do(recorded_run, monkeypatch, tmp_path):
    """flows/api.py's reading functions, one call each as docs/reference/python.md shows them: the
    data the commands print."""
    from ratchet.flows import api

    rec = recorded_run
    monkeypatch.chdir(rec.home)
    made = api.plan(rec.config)
    assert made.run == rec.run and made.steps and {s.state for s in made.steps} == {"reused"}
    listing = api.runs(workdir=rec.work)
    assert [r.run for r in listing.runs] == [rec.run] and listing.champion in [e.version for e in listing.runs[0].entries]
    chain = api.lineage(rec.config, "2")
    assert chain.verified and chain.version == "2" and chain.made_by.endswith(f"made by run {rec.run}, round 1")
    assert chain.links[0].role == "text" and "model" in {x.role for x in chain.links}  # a pair, over its weights
    checked = api.verify(api.find_run(rec.config), "2", ["filter"])
    assert checked.counts == {"identical": 1, "differs": 0, "not re-runnable": 0} and checked.path.is_file()
    done = api.export(rec.config, "champion", tmp_path / "out")
    assert done.version == listing.champion and (done.path / "config.json").is_file()
    scored = api.evaluate(rec.config, "2")  # a pair's, read where its round evaluated it
    [heldout] = scored.sets
    assert heldout.reused and heldout.accuracy == next(e.accuracy for e in listing.runs[0].entries if e.version == "2")


@pytest.mark.integration
def test_a_run_with_every_stage_reused_is_a_read(recorded_run):
    """The same `ratchet run` again, in a fresh interpreter as a user starts it: every stage reused and
    its files checked, it prints the run's own lines (each stage reused), its round table and its
    champion, and starts and imports nothing of Prefect, MLflow or a model library; nor do `ratchet
    lineage` and `ratchet report` once the report is drawn (issue 86: read-only commands)."""
    import subprocess
    import sys

    rec = recorded_run
    code = ("import sys\nfrom ratchet.flows import cli\ncode = cli.main(['run', sys.argv[1]])\n"
            "print('EXIT', code, sorted(m for m in sys.modules if m in ('torch', 'transformers', 'vllm', 'prefect', "
            "'mlflow')))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PREFECT_API_URL"}
    out = subprocess.run([sys.executable, "-c", code, str(rec.config)], capture_output=True, text=True, cwd=rec.home,
                         env=env, timeout=300)
    said = out.stdout
    assert "EXIT 0 []" in said, said[-3000:] + out.stderr[-3000:]
    assert f"ratchet run {rec.run}:" in said and "nothing to run: every stage is reused" in said
    assert re.search(r"round 1\s+train\s+↺ reused", said) and "-> version" in said and "champion:" in said
    assert re.search(r"round\s+accuracy\s+version\s+promoted", said)  # the round table
    # and the other commands that read a finished run: its lineage, and its report once drawn
    from ratchet.flows import cli as in_process

    with contextlib.redirect_stdout(io.StringIO()):
        assert in_process.main(["report", str(rec.config)]) == 0  # drawn and logged here, in this process
    for argv in (["lineage", str(rec.config)], ["report", str(rec.config)]):
        out = subprocess.run([sys.executable, "-c", code.replace("['run', sys.argv[1]]", repr(argv)), str(rec.config)],
                             capture_output=True, text=True, cwd=rec.home, env=env, timeout=300)
        assert "EXIT 0 []" in out.stdout, (argv, out.stdout[-3000:] + out.stderr[-3000:])


@pytest.mark.integration
def test_the_store_read_without_mlflow_answers_as_mlflow_does(recorded_run, monkeypatch):
    """`ratchet runs` and `lineage` read the SQLite store with sqlite3 (flows/tracking_read.py):
    every call they make gives MLflow's own answer, on a finished run's store, and a missing
    version is a clear error."""
    from ratchet.data.errors import RatchetError
    from ratchet.data.store import ArtifactStore
    from ratchet.flows import api
    from ratchet.flows.lineage import annotate, resolve, walk
    from ratchet.flows.runs import list_runs
    from ratchet.flows.tracking_read import ReadTracker, reader

    rec = recorded_run
    monkeypatch.chdir(rec.home)
    full = api._tracker(api.find_run(rec.config))
    read = reader(full.uri, full.model_name)
    assert isinstance(read, ReadTracker) and read.champion() == full.champion() is not None
    assert list_runs(rec.work, read) == list_runs(rec.work, full)
    versions = [e.version for r in list_runs(rec.work, full) for e in r.entries]
    assert versions
    for v in versions:
        mine, theirs = read.version(v), full.version(v)
        assert (mine.tags, mine.run_id, mine.source) == (theirs.tags, theirs.run_id, theirs.source)
        assert read.version_of(theirs.tags["ratchet.stage_key"]) == full.version_of(theirs.tags["ratchet.stage_key"])
        run_mine, run_theirs = read.client.get_run(theirs.run_id), full.client.get_run(theirs.run_id)
        assert (run_mine.data.tags, run_mine.data.metrics, run_mine.info.start_time, run_mine.info.experiment_id) == \
            (run_theirs.data.tags, run_theirs.data.metrics, run_theirs.info.start_time, run_theirs.info.experiment_id)
        history = [(m.step, m.value) for m in full.client.get_metric_history(theirs.run_id, "round.accuracy")]
        assert history and [(m.step, m.value) for m in read.client.get_metric_history(theirs.run_id,
                                                                                      "round.accuracy")] == history
        prompt = theirs.tags.get("ratchet.prompt")
        if prompt:
            name, number = prompt.removeprefix("prompts:/").rsplit("/", 1)
            assert read.client.get_prompt_version(name, number).tags == full.client.get_prompt_version(name, number).tags
    store = ArtifactStore(rec.work)
    for target in ("champion", *versions):
        ours, mlflows = walk(store, resolve(target, store, read)), walk(store, resolve(target, store, full))
        annotate(ours, read)
        annotate(mlflows, full)
        assert [(x.key, x.model_version, x.mlflow_run_id, x.verified) for x in ours] == \
            [(x.key, x.model_version, x.mlflow_run_id, x.verified) for x in mlflows]
    with pytest.raises(RatchetError, match="has no version 99"):
        read.version("99")
    absent = reader(f"sqlite:///{rec.work / 'absent.db'}", full.model_name)
    assert absent.champion() is None and not (rec.work / "absent.db").exists()  # read, not created
    assert reader("http://127.0.0.1:5000", full.model_name) is None  # a server: the full tracker
