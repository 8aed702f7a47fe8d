"""The code stays lint-clean (ruff) and the core strictly typed (mypy --strict)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*cmd):
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_ruff_is_clean():
    r = run("ruff", "check", "src", "tests", "benchmarks", "examples")
    assert r.returncode == 0, r.stdout + r.stderr


def test_core_is_strictly_typed():
    r = run("mypy")  # files and strictness come from pyproject.toml
    assert r.returncode == 0, r.stdout + r.stderr
