"""The documentation: the config reference is what the config models generate, `ratchet config
--explain` prints a field's entry, and the site builds in strict mode (a broken link, anchor or
missing page fails it)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.flows import reference

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_config_reference_is_what_the_models_generate():
    committed = (ROOT / reference.DOC).read_text()
    assert committed == reference.markdown(), (
        f"{reference.DOC} differs from what the config models generate; regenerate it with "
        f"`ratchet config --reference > {reference.DOC}` and commit it")


def test_the_committed_lineage_schema_is_what_the_link_model_generates():
    from ratchet.flows.lineage import Link, schema_markdown

    doc = ROOT / "docs" / "reference" / "lineage-json.md"
    assert doc.read_text() == schema_markdown(), (
        f"{doc} differs from flows/lineage.py's Link; regenerate it with `python -c \"from ratchet.flows.lineage "
        f"import schema_markdown; print(schema_markdown(), end='')\" > {doc.relative_to(ROOT)}`")
    assert all(f.description for f in Link.model_fields.values())


def test_every_config_field_is_in_the_reference_with_a_description():
    """Every field of every section and kind, the kinds' own variants included, has an entry
    that says what it does."""
    from ratchet.flows.config import PipelineConfig, kinds_of

    entries = reference.entries()
    paths = {e.path for e in entries}
    missing = [e.path for e in entries if not e.description]
    assert not missing, f"config fields without a description: {missing}"
    for section in ("data", "label", "filter", "train"):
        for kind, model in kinds_of(section).items():
            for name in model.model_fields:
                assert f"{section}.{name}" in paths, (section, kind, name)
            own = {e.path for e in entries if e.kind == kind and e.path.startswith(section + ".")}
            assert own <= {f"{section}.{n}" for n in model.model_fields} | {p for p in own if p.count(".") > 1}
    for name, f in PipelineConfig.model_fields.items():
        assert name in paths or any(p.startswith(name + ".") for p in paths), name


def test_a_kind_s_field_says_which_kind_and_its_allowed_values():
    judge = [e for e in reference.entries() if e.path == "label.mode"]
    assert [e.kind for e in judge] == ["judge"]
    assert judge[0].allowed == "text, p_yes, rating" and judge[0].default == "text"
    seed = next(e for e in reference.entries() if e.path == "seed")
    assert (seed.type, seed.default, seed.allowed) == ("int", "0", ">= 0, <= 4000000")
    sets = next(e for e in reference.entries() if e.path == "evaluate.sets[].check")
    assert sets.see == "data.check" and "math" in sets.allowed


def _ratchet(*args):
    return subprocess.run([sys.executable, "-m", "ratchet.flows.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_config_explain_prints_one_field_and_names_close_ones_for_a_typo():
    r = _ratchet("config", "--explain", "train.beta")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("train.beta   (with train.kind: dpo)\n  type     float\n  default  0.1\n  allowed  > 0")
    r = _ratchet("config", "--explain", "evaluate.sets[0].name")
    assert r.returncode == 0 and "lower-case letters" in r.stdout
    r = _ratchet("config", "--explain", "sample.temprature")
    assert r.returncode == 2 and "sample.temperature" in r.stderr and r.stdout == ""
    r = _ratchet("config", "--explain", "")
    assert r.returncode == 0 and r.stdout.startswith("the top level: A whole self-improvement run.\n  name, workdir, seed")


def test_explain_qualifies_a_nested_field_by_the_kind_that_holds_it_and_lists_a_sections_kinds():
    """label.judge under label.kind=mcts: qualified by label's kind, with the default that place makes
    (rating), and without the fields that place refuses; a section of kinds lists them, not itself."""
    from ratchet.flows.reference import explain

    mode = explain("label.judge.mode")
    assert mode.startswith("label.judge.mode   (with label.kind: mcts)\n  type     str\n  default  rating\n")
    for refused in ("label.judge.endpoint", "label.judge.model"):
        with pytest.raises(KeyError):
            explain(refused)
    check = explain("data.check")
    assert "ratchet config --explain data.check\n" not in check + "\n"  # never points at itself
    assert "    code: The response's program against the row's tests, in a sandbox." in check
    assert check.count("    number: ") == 1 and "its kinds: as above" in check


def test_the_site_builds_in_strict_mode(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'; make test installs it)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_overrides_after_an_option_are_overrides_and_anything_else_is_refused(tmp_path):
    """`ratchet serve CONFIG --cron "..." key=value`, as the README writes it: argparse alone
    would refuse the override after the option."""
    r = _ratchet("gc", "flows/configs/default.yaml", "--dry-run", f"workdir={tmp_path / 'w'}")
    assert r.returncode == 1 and f"no artifact store at {tmp_path / 'w'}" in r.stderr
    r = _ratchet("gc", "flows/configs/default.yaml", "--dry-run", "--bogus")
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr


def test_a_field_a_kind_refuses_is_listed_only_under_the_kinds_that_take_it():
    """GRPO runs train.steps steps and refuses epochs and grad_accum: the reference lists those
    under rft and dpo, never under every kind or grpo; `--explain` qualifies them the same way."""
    from ratchet.flows.reference import explain

    train = [e for e in reference.entries() if e.path in ("train.epochs", "train.grad_accum")]
    assert sorted((e.path, e.kind) for e in train) == [("train.epochs", "dpo"), ("train.epochs", "rft"),
                                                       ("train.grad_accum", "dpo"), ("train.grad_accum", "rft")]
    assert "grpo" not in explain("train.epochs") and "rft" in explain("train.epochs")
