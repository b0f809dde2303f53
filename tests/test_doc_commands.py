"""The commands the README and every page under docs/ show in their fenced blocks still work: a new
page is covered by being there. Each command parses (its subcommand and options exist); each
config it names resolves with each override it shows (`ratchet config`), a shape written with
placeholders (`ratchet run CONFIG --from champion`) against the default config; `--help`,
`config --explain` and `config --reference` run; and `ratchet check` runs where its config ships
with the repository and its model is the embedded default. All in this process: no model runs."""

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
