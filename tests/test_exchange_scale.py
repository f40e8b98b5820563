"""The exchange scale simulation (`benchmarks/exchange_scale.py`), quick mode.

Runs in a child interpreter (it starts its own coordination service) and
checks what the protocol promises per decided window: O(processes) store
calls, one chunk write and one decision read per process.
"""

import json
import os
import subprocess
import sys

from grain_jax_sync._src.exchange import key_value

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_exchange_scale_quick_store_work_is_linear():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run(
    [sys.executable, "-m", "benchmarks.exchange_scale", "--quick", "--json"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
  assert [r["processes"] for r in results] == [16, 64]
  for r in results:
    n = r["processes"]
    # Per window: n - 1 chunk writes, n - 1 decision reads, one directory read
    # and one decision write (no group of 16 decisions is complete within 6
    # windows), and each follower's delete of a group of chunks in the window
    # that decides its last chunk (windows 1-5 are counted; window w decides
    # chunk w).
    deletes = sum(1 for w in range(1, 6) if (w + 1) % key_value.CHUNK_GROUP == 0)
    assert r["store_ops_per_window"] == 2 * (n - 1) + 2 + (n - 1) * deletes / 5
    assert r["window_ms"] > 0
  small, big = results
  assert big["store_bytes_per_window"] / small["store_bytes_per_window"] < 4 * 1.5
