"""The package is typed: `python -m mypy -p grain_jax_sync` passes with pyproject's config.

That the installed wheel's `py.typed` makes mypy read its annotations is
`tests/test_clean_venv.py::test_mypy_finds_the_installed_package_typed`.
"""

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
