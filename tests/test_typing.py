"""The package is typed: `python -m mypy -p grain_jax_sync` passes with pyproject's config."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_finds_no_issue_in_the_package():
  pytest.importorskip("mypy")
  proc = subprocess.run(
    [sys.executable, "-m", "mypy", "-p", "grain_jax_sync"],
    cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-5000:]
  assert "Success: no issues found" in out and "note:" not in out, out[-5000:]


def test_the_package_ships_its_py_typed_marker():
  assert os.path.isfile(os.path.join(ROOT, "grain_jax_sync", "py.typed"))
