"""Scenarios for tests/test_session.py (run in simulated hosts).

Module-level functions only, so that `grain_jax_sync.testing.run_processes`
can import them in every process. Each returns plain values that pickle.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np


def library_threads() -> list[str]:
  return sorted(t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync-"))


def _no_threads(deadline_s: float = 10.0) -> list[str]:
  end = time.monotonic() + deadline_s
  while library_threads() and time.monotonic() < end:
    time.sleep(0.01)
  return library_threads()


def stage_threads(prefetch: int) -> dict[str, Any]:
  """The threads of one start on this host: before, while it runs, its close order, after."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  # A long stream: the agreement thread, held back by the bounded read-ahead,
  # still runs when the threads are looked at.
  data = ({"x": np.full(8, 100 * p + i, np.int32)} for i in range(100_000))
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch, sync_timeout_s=60.0)
  out: dict[str, Any] = {"before": library_threads()}
  rows = [int(np.asarray(next(it)["x"].addressable_shards[0].data)[0])]
  out["running"] = library_threads()
  rows += [int(np.asarray(next(it)["x"].addressable_shards[0].data)[0]) for _ in range(4)]
  it.close()  # Mid-stream, on every host at the same batch.
  out["rows"] = rows
  out["after"] = _no_threads()
  return out
