"""The package list, derived: every folder under the repository's four top-level folders is a
subpackage of `ratchet` (`./data/checks` is `ratchet.data.checks`; `./flows/configs`, which
holds the shipped YAML, too), so a new folder is installed without anyone listing it. The rest
of the metadata is pyproject.toml's."""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
FOLDERS = ("data", "models", "tasks", "flows")

setup(
    packages=sorted(".".join(("ratchet", *d.relative_to(ROOT).parts)) for folder in FOLDERS
                    for d in [ROOT / folder, *(ROOT / folder).rglob("*")]
                    if d.is_dir() and d.name != "__pycache__"),
    package_dir={f"ratchet.{folder}": folder for folder in FOLDERS},
)
