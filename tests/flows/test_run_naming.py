"""One way to name a run: every command that reads a run finds it the same way (flows.runs.choose_run)
and says which one it read. No model, no server: run records written by hand."""

import json
import os
import time
from types import SimpleNamespace

import pytest

from ratchet.data.errors import RatchetError
from ratchet.flows.api import made_by
from ratchet.flows.cli import build_parser, main
from ratchet.flows.config import load_config
from ratchet.flows.runs import choose_run, run_name_for

CONFIG = "flows/configs/default.yaml"
COMMANDS = ["resume", "report", "runs", "lineage", "export", "gc"]


def _record(workdir, name, cfg, age=0.0):
    (workdir / "runs").mkdir(parents=True, exist_ok=True)
    ctx = {"run_name": name, "workdir": str(workdir), "parent_run_id": "p", "code_version": "c", "config_hash": "h"}
    path = workdir / "runs" / f"{name}.json"
    path.write_text(json.dumps({"ctx": ctx, "config": cfg.model_dump(mode="json"), "state": "failed"}))
    os.utime(path, (time.time() - age, time.time() - age))  # older records changed longer ago


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return tmp_path


def test_every_run_command_takes_the_same_arguments_in_the_same_order():
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for c in COMMANDS:
        usage = subs[c].format_usage()
        assert usage.startswith(f"usage: ratchet {c} [CONFIG] "), usage
        assert "[key=value ...] [--workdir W] [--run RUN]" in usage, usage
        args = parser.parse_args([c, "--workdir", "w", "--run", "r"])
        assert (args.workdir, args.run) == ("w", "r")


def test_the_config_names_its_own_run_and_run_names_any(workdir):
    cfg = load_config(CONFIG, [f"workdir={workdir}"])
    own = run_name_for(cfg)
    _record(workdir, own, cfg, age=60)
    _record(workdir, "default-other", cfg)  # newer, but not the one the config names
    got = choose_run(CONFIG, [f"workdir={workdir}"])
    assert (got.run, got.how) == (own, f"the run {CONFIG} names") and got.workdir == workdir.resolve()
    assert choose_run(CONFIG, [], workdir=str(workdir)).run == own  # --workdir is the workdir override
    assert choose_run(CONFIG, [f"workdir={workdir}"], run="default-other").run == "default-other"
    assert "run default-other (named by --run) · workdir" in choose_run(None, [], str(workdir), "default-other").line()


def test_without_its_own_run_the_newest_of_its_name_and_resume_refuses(workdir):
    cfg = load_config(CONFIG, [f"workdir={workdir}"])
    _record(workdir, "default-aaaa", cfg, age=60)
    _record(workdir, "default-bbbb", cfg)
    _record(workdir, "other-cccc", cfg.model_copy(update={"name": "other"}), age=-60)  # newest, another name
    got = choose_run(CONFIG, [f"workdir={workdir}", "rounds=7"])
    assert got.run == "default-bbbb" and "which has not run here" in got.how, got.how
    with pytest.raises(RatchetError, match="no run of flows/configs/default.yaml is recorded") as e:
        choose_run(CONFIG, [f"workdir={workdir}", "rounds=7"], own=True)  # resume: never another run than named
    assert "ratchet run flows/configs/default.yaml" in str(e.value)


def test_without_a_config_the_run_and_its_recorded_config(workdir):
    cfg = load_config(CONFIG, [f"workdir={workdir}", "name=mine", "rounds=5"])
    _record(workdir, "mine-1234", cfg)
    got = choose_run(None, [], str(workdir))
    assert got.run == "mine-1234" and got.cfg.name == "mine" and got.cfg.rounds == 5
    assert got.how == f"the newest in {workdir.resolve() / 'runs'}"
    assert choose_run(None, ["rounds=2"], str(workdir)).cfg.rounds == 2
    whole = choose_run(None, [], str(workdir), need=False)  # runs, gc: about every run, with its config
    assert whole.run is None and whole.cfg.name == "mine" and whole.line().startswith("every run in ")
    with pytest.raises(RatchetError, match="no pipeline run is recorded"):
        choose_run(None, [], str(workdir / "empty"))


def test_old_resume_form_still_names_the_run(workdir, capsys):
    cfg = load_config(CONFIG, [f"workdir={workdir}"])
    _record(workdir, "default-aaaa", cfg)
    assert main(["resume", "default-nope", "--workdir", str(workdir)]) == 2  # the positional RUN is the run
    assert "no pipeline run 'default-nope'" in capsys.readouterr().err
    assert main(["resume", "--workdir", str(workdir), "rounds=9"]) == 1  # overrides without a config: refused
    assert "resume continues a run with its own recorded config; rounds=9" in capsys.readouterr().err
    assert main(["gc", CONFIG, "--run", "default-aaaa"]) == 1
    assert "leave out --run" in capsys.readouterr().err
    gc_help = " ".join(next(a for a in build_parser()._actions if a.dest == "command").choices["gc"].format_help()
                       .split())
    assert "--run RUN refused by gc, which reads every run of the workdir at once" in gc_help  # as it does
    assert main(["export", CONFIG, "3", "a", "b"]) == 1
    assert "'b' is none of these" in capsys.readouterr().err


def test_a_version_names_the_run_that_made_it():
    tags = {"ratchet.run": "default-aaaa", "ratchet.round": "2"}
    tracker = SimpleNamespace(model_name="m", version=lambda v: SimpleNamespace(tags=tags))
    assert made_by(tracker, "4", None) == "m version 4: made by run default-aaaa, round 2"
    assert made_by(tracker, "4", "default-aaaa").endswith("round 2")
    with pytest.raises(RatchetError, match="was made by run default-aaaa, not default-bbbb"):
        made_by(tracker, "4", "default-bbbb")


def test_a_run_is_found_under_any_spelling_of_its_folder(tmp_path, monkeypatch):
    """Relative, absolute, ./w, a symlink, given in the config or by --workdir: one folder, one run.
    A run recorded when the name still held the workdir as written continues under that name."""
    from ratchet.flows import runs

    config = os.path.abspath(CONFIG)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "w")
    cfg = load_config(config, ["workdir=w"])
    name = run_name_for(cfg)
    _record(tmp_path / "w", name, cfg)
    for spelling in ["w", "./w", str(tmp_path / "w"), "link", str(tmp_path / "link") + "/"]:
        assert run_name_for(load_config(config, [f"workdir={spelling}"])) == name
        assert choose_run(config, [f"workdir={spelling}"]).run == name, spelling
        assert choose_run(config, [], workdir=spelling).run == name, spelling
    old = load_config(config, ["workdir=old"])
    before = runs._name_before(old)
    assert before != run_name_for(old)
    _record(tmp_path / "old", before, old)
    _record(tmp_path / "old", "default-0123456789", load_config(config, ["workdir=old", "rounds=9"]))  # another run
    for spelling in ["old", str(tmp_path / "old")]:
        assert choose_run(config, [f"workdir={spelling}"], own=True).run == before, spelling
        assert runs.recorded_name(load_config(config, [f"workdir={spelling}"]), tmp_path / "old") == before
    assert runs.recorded_name(load_config(config, ["workdir=old", "rounds=2"]), tmp_path / "old") == \
        run_name_for(load_config(config, ["workdir=old", "rounds=2"]))  # another config: its own name
