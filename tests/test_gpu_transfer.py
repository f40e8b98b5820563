"""`benchmarks/gpu_transfer.py` on CPU: the GPU benchmark's code path, smoke-tested.

Runs in a child interpreter (its `--platform` chooses JAX's platform before
JAX starts). On CPU the "raw" figure is a NumPy copy and there is no
`pinned_host` transfer to a device memory, so only sanity is checked: every
figure is measured, finite and positive, and the script says which raw copy
it timed.
"""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **env_vars):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  env.update(env_vars)
  return subprocess.run(
    [sys.executable, "-m", "benchmarks.gpu_transfer", *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
    check=True,
  )


def test_gpu_transfer_cpu_mode_measures_every_figure(tmp_path):
  out_path = tmp_path / "out.jsonl"
  args = ["--platform", "cpu", "--sizes-mb", "1", "2", "--n", "4", "--trials", "2"]
  out = _run([*args, "--json", str(out_path)])
  results = [json.loads(line) for line in out_path.read_text().splitlines()]
  assert [r["mb"] for r in results] == [1.0, 2.0]
  for r in results:
    assert r["bytes"] == (int(r["mb"] * 1e6) // 256) * 256
    assert r["raw_kind"] == "numpy copy (stand-in)"
    for key in ("raw", "put_numpy", "build", "build_inline", "step_ms", "overlap", "serial"):
      assert math.isfinite(r[key]) and r[key] > 0, (key, r)
    assert r["put_pinned"] is None or r["put_pinned"] > 0
    assert 1.0 <= r["serial"] <= 2.0 + 1e-9  # (step + transfer) / max(step, transfer).
  lines = out.stdout.splitlines()
  assert lines[0].startswith("gpu_transfer: ") and "(cpu)" in lines[0]
  assert len(lines) == 3 and all("GB/s" in line for line in lines[1:])


def test_gpu_transfer_without_a_cuda_device_skips_with_exit_0():
  out = _run(["--sizes-mb", "1"], JAX_PLATFORMS="cpu")  # A host without CUDA, even on a GPU host.
  assert out.stdout.startswith("gpu_transfer: skipped, no CUDA device")
  assert len(out.stdout.splitlines()) == 1
