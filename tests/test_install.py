"""What is installed is what is tested: the wheel built from this tree, installed (not editable)
into a fresh environment, holds every module and shipped config of the tree, and each imports
there. The dependencies come from the test environment's site-packages, added as a plain path,
so its editable install of this tree is not seen."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[1]
FOLDERS = ("data", "models", "tasks", "flows")

IMPORT_ALL = """
import importlib, json, sys
from pathlib import Path
import ratchet.flows
top = Path(ratchet.flows.__file__).parents[1]
names = sorted(".".join(("ratchet", *p.relative_to(top).with_suffix("").parts)).removesuffix(".__init__")
               for p in top.rglob("*.py"))
for name in names:
    importlib.import_module(name)
print(json.dumps({"top": str(top), "modules": names,
                  "configs": sorted(p.name for p in (top / "flows" / "configs").glob("*.yaml"))}))
"""


def _tree_modules() -> list[str]:
    return sorted(".".join(("ratchet", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
                  for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_the_built_wheel_installs_every_module_and_each_imports(tmp_path):
    """Guards what is installed: the wheel built from a copy of this tree installs into a fresh
    environment and holds every module and shipped config, each of which imports there. Slow: a
    wheel build, a venv and an import of every module."""
    # without the tests' PYTHONPATH: on it, this tree's ratchet.egg-info would pass for an install
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # from a copy of what a clone holds: a build/ folder left in the tree would pass its stale modules on
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(src)], env=clean, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("ratchet-*.whl")

    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], env=clean, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-3000:]
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")

    r = subprocess.run([str(python), "-c", IMPORT_ALL], cwd=tmp_path, env=clean, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["top"]).parent == site  # the installed copy, not this tree
    assert got["modules"] == _tree_modules()
    assert got["configs"] == sorted(p.name for p in (ROOT / "flows" / "configs").glob("*.yaml"))
    cli = subprocess.run([str(env / "bin" / "ratchet"), "--help"], cwd=tmp_path, env=clean, capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0 and "run" in cli.stdout, cli.stderr[-2000:]
