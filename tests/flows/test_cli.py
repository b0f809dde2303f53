import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def ratchet(*args):
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True, text=True)


def test_help_lists_commands_and_examples():
    r = ratchet("--help")
    assert r.returncode == 0
    for word in ("run", "config", "model", "ratchet run flows/configs/default.yaml"):
        assert word in r.stdout


def test_config_prints_resolved_yaml():
    r = ratchet("config", "flows/configs/default.yaml", "rounds=4")
    assert r.returncode == 0 and "rounds: 4" in r.stdout and "backend: vllm" in r.stdout


def test_bad_config_exits_2_with_every_problem_and_no_traceback():
    r = ratchet("run", "flows/configs/default.yaml", "rounds=0", "train.lr=1")
    assert r.returncode == 2
    assert "2 problem(s)" in r.stderr and "rounds=0" in r.stderr and "train.lr" in r.stderr
    assert "Traceback" not in r.stderr
