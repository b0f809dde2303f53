"""A run's record reads back to the config that ran, for every shipped config and every train kind
it allows, and passes every command that reads a run. No model, no server: records written as
`runs.start` writes them (the resolved config, every field given)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ratchet.data.errors import ConfigError
from ratchet.flows import cli
from ratchet.flows.config import config_from_dict, load_config
from ratchet.flows.runs import RunContext, RunRecord, choose_run, list_runs, resumed_config, write_record

ROOT = Path(__file__).parents[2]
CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "flows" / "configs").glob("*.yaml"))
# each train kind, as a user switches to it: a whole new section (the filter follows it), or
# dotted over the file's own train section; GRPO samples from the whole distribution
KINDS = {
    "as shipped": [],
    "rft": ["train={kind: rft}", "filter={kind: rft}"],
    "dpo": ["train={kind: dpo, beta: 0.2}", "filter={kind: pairs}"],
    "grpo": ["train={kind: grpo, steps: 4}", "sample.top_k=0", "sample.top_p=1.0"],
    "grpo, dotted": ["train.kind=grpo", "sample.top_k=0", "sample.top_p=1.0"],
}


def _runs(workdir: Path) -> dict[str, tuple[Path, dict]]:
    """Every shipped config under every kind it allows, recorded in `workdir` as `start` records
    it: run name -> (config, the resolved config that ran)."""
    out = {}
    for config in CONFIGS:
        for kind, overrides in KINDS.items():
            try:
                cfg = load_config(config, [f"workdir={workdir}", *overrides])
            except ConfigError:
                continue  # a switch this config refuses (a judge cannot be GRPO's reward): never recorded
            name = f"{cfg.name}-{len(out):03d}"
            ctx = RunContext(run_name=name, workdir=str(workdir), parent_run_id="p", code_version="c",
                             config_hash="h")
            write_record(workdir, RunRecord(ctx=ctx, config=cfg.model_dump(mode="json"), state="failed"))
            out[name] = (config, cfg.model_dump(mode="json"))
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    here = Path.cwd()
    os.chdir(ROOT)  # the shipped configs name their files from the repository's root
    try:
        work = tmp_path_factory.mktemp("records") / "runs"
        (work / "runs").mkdir(parents=True)
        (work / "stages").mkdir()
        yield work.resolve(), _runs(work.resolve())
    finally:
        os.chdir(here)


def test_every_kind_a_config_allows_is_recorded(recorded):
    _, runs = recorded
    kinds = {(str(config), ran["train"]["kind"]) for config, ran in runs.values()}
    assert ("flows/configs/grpo.yaml", "grpo") in kinds and ("flows/configs/default.yaml", "grpo") in kinds
    assert {k for _, k in kinds} == {"rft", "dpo", "grpo"}
    assert len(runs) >= 40, sorted(kinds)


def test_each_record_reads_back_to_the_config_that_ran(recorded, monkeypatch):
    """`ratchet resume` of each: the config it would run is the recorded one, field for field."""
    work, runs = recorded
    monkeypatch.chdir(ROOT)
    ran = {}
    monkeypatch.setattr(cli, "_execute", lambda cfg, start, verbose=False, run_name=None:
                        ran.setdefault(run_name, cfg.model_dump(mode="json")) and 0)
    for name, (_, config) in runs.items():
        assert cli.main(["resume", "--run", name, "--workdir", str(work)]) == 0, name
        assert ran[name] == config, name
        again = resumed_config(RunRecord.model_validate_json((work / "runs" / f"{name}.json").read_text()), work)
        assert again.model_dump(mode="json") == config


def test_each_record_passes_every_command_that_reads_a_run(recorded, monkeypatch, capsys, tmp_path):
    from ratchet.tasks import prepare

    work, runs = recorded
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(prepare, "apart", lambda fn, *args: fn(*args))  # the template read here, not in a child
    planned = {}  # a plan loads the model's tokenizer: one run of each kind of train stage
    for name, (_, config) in runs.items():
        planned.setdefault((config["train"]["kind"], config["filter"]["kind"]), name)
    for name in runs:
        for command in ("report", "lineage", "export"):  # how each reads a run: cli._chosen
            words = ["champion", str(tmp_path / "out")] if command == "export" else []
            args = cli.build_parser().parse_args([command, *words, "--workdir", str(work), "--run", name])
            chosen, _ = cli._chosen(args, command, ["VERSION", "DIR"][:len(words)], need=command != "export")
            assert chosen.run == name and chosen.cfg.model_dump(mode="json") == runs[name][1]
        capsys.readouterr()
    for name in planned.values():
        assert cli.main(["plan", "--run", name, "--workdir", str(work), "--json"]) == 0, capsys.readouterr().err
        stages = json.loads(capsys.readouterr().out)
        assert stages["run"] == name and stages["stages"], name
    assert cli.main(["gc", "--workdir", str(work), "--dry-run"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli.main(["runs", "--workdir", str(work), "--json"]) == 0, capsys.readouterr().err
    listed = json.loads(capsys.readouterr().out)["runs"]
    assert {r["run"] for r in listed} == set(runs) and not [r for r in listed if r["problem"]]


def test_a_record_is_still_refused_for_what_the_resume_writes(recorded):
    """What counts as the user's own writing is the overrides given now: a resume's or a tick's."""
    work, runs = recorded
    name = next(n for n, (_, c) in runs.items() if c["train"]["kind"] == "grpo")
    with pytest.raises(ConfigError, match="remove train.epochs"):
        choose_run(None, ["train.epochs=2"], str(work), name)
    _, config = runs[name]
    assert config_from_dict(config, [], "deployment parameters", resolved=True).train.kind == "grpo"
    with pytest.raises(ConfigError, match="remove train.epochs"):
        config_from_dict(config, [])  # the same mapping as a user's own: every field is written


def test_one_run_whose_record_does_not_read_back_stops_no_listing(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    work = tmp_path / "runs"
    (work / "runs").mkdir(parents=True)
    cfg = load_config("flows/configs/default.yaml", [f"workdir={work}"])
    for name, config in (("default-old", cfg.model_dump(mode="json")),
                         ("default-new", {**cfg.model_dump(mode="json"), "rounds": 0})):  # rounds >= 1
        ctx = RunContext(run_name=name, workdir=str(work), parent_run_id="p", code_version="c", config_hash="h")
        write_record(work, RunRecord(ctx=ctx, config=config, state="failed"))
        os.utime(work / "runs" / f"{name}.json", (1e9 + len(name), 1e9 + len(name)))  # default-new is newest
    chosen = choose_run(None, [], str(work), need=False)
    assert "with run default-old's config" in chosen.how
    from ratchet.flows.tracking import Tracker

    listed = {r.run: r for r in list_runs(work, Tracker(chosen.cfg.tracking, work, chosen.cfg.name))}
    assert listed["default-old"].problem is None and listed["default-old"].resume
    assert "its recorded config does not read back: rounds=0" in listed["default-new"].problem


READING = {"plan": ("torch", "transformers", "vllm", "prefect", "mlflow"),
           "runs": ("torch", "transformers", "vllm", "prefect", "mlflow"),
           "gc": ("torch", "transformers", "vllm", "prefect")}


def test_a_command_that_only_reads_imports_no_model_library(recorded):
    """`ratchet plan` and `ratchet runs` in a fresh interpreter, as a user starts them: no torch,
    transformers or vLLM (each seconds to import), no Prefect; plan and runs no MLflow either (runs
    reads the store with sqlite3: flows/tracking_read.py)."""
    import subprocess
    import sys

    work, runs = recorded
    name = next(iter(runs))
    argv = {"plan": ["--run", name, "--json"], "runs": ["--json"], "gc": ["--dry-run"]}
    for command, banned in READING.items():
        code = ("import sys, io, contextlib\nfrom ratchet.flows import cli\n"
                f"with contextlib.redirect_stdout(io.StringIO()):\n"
                f"    code = cli.main({[command, '--workdir', str(work), *argv[command]]!r})\n"
                "print(code, sorted(m for m in sys.modules if m.split('.')[0] in "
                f"{list(banned)!r} and '.' not in m))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "0 []", (command, out.stdout[-500:])
