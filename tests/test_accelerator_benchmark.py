"""`benchmarks/accelerator.py` on CPU: its code path, small, and its skip without an accelerator.

Runs in a child interpreter (`--platform cpu` chooses JAX's platform before
JAX starts). CPU figures say nothing about an accelerator, so only sanity
is checked: every section and variant is measured, finite and positive.
"""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **env_vars):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  env.pop("XLA_FLAGS", None)
  env.update(env_vars)
  return subprocess.run(
    [sys.executable, "-m", "benchmarks.accelerator", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
    check=True,
  )


def _positive(figures):
  return all(math.isfinite(v) and v >= 0 for v in figures.values()) and figures["wall_ms"] > 0


def test_accelerator_cpu_mode_measures_every_section(tmp_path):
  out_path = tmp_path / "out.json"
  args = ["--platform", "cpu", "--quick", "--trials", "1", "--n", "4", "--workers", "0"]
  out = _run([*args, "--json", str(out_path)])
  results = json.loads(out_path.read_text())
  assert results["meta"]["command"].startswith("python -m benchmarks.accelerator --platform cpu")
  (steady,) = results["steady"]
  assert set(steady["variants"]) == {
    "resident", "bare", "iter_jax_batches", "inline", "grain_device_put", "device_put",
  }  # fmt: skip
  (bound,) = results["input_bound"]
  assert bound["workers"] == 0 and bound["rows"] == 32 and bound["skip"] == 8
  assert set(bound["variants"]) == {"bare", "iter_jax_batches", "grain_device_put", "device_put"}
  for row in (steady, bound):
    assert row["step_ms"] > 0
    for figures in row["variants"].values():
      assert _positive(figures), figures
      assert {"cpu_ms", "cpu_ours_ms", "cpu_python_ms", "cpu_native_ms"} <= set(figures)
  (moved,) = results["transfer"]
  assert moved["bytes"] == (int(0.25e6) // 256) * 256
  assert moved["trials"] == 1
  variants = ("put_1", "put_4", "put_16", "build", "build_p8", "build_inline")
  for key in (*variants, "grain_device_put", "device_put", "put_call_ms"):
    assert math.isfinite(moved[key]) and moved[key] > 0, (key, moved)
  lines = out.stdout.splitlines()
  assert lines[0].startswith("accelerator: 1 x cpu (cpu), jax ")
  assert sum("GB/s" in line for line in lines) == 1


def test_accelerator_without_an_accelerator_skips_with_exit_0():
  out = _run(["--quick"], JAX_PLATFORMS="cpu")  # A host without one, even beside one.
  assert out.stdout.startswith("accelerator: skipped, no accelerator found (1 x cpu (cpu))")
  assert len(out.stdout.splitlines()) == 1


def test_accelerator_variants_keeps_the_input_bound_variants_named():
  args = ["--platform", "cpu", "--quick", "--trials", "1", "--n", "4", "--workers", "0"]
  args += ["--sections", "input_bound", "--diagnose", "--variants", "device_put_c3d1", "bare"]
  out = _run(args)
  rows = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
  assert rows == ["bare", "device_put_c3d1"]
