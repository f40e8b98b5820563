"""Helpers shared by the prefetch, exchange and lifetime tests, and the exchange round trip.

`exchange_roundtrip` runs in simulated hosts: module level, so that
`grain_jax_sync.testing.run_processes` can import it in every process. The
short scenarios of a single test live beside that test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

THREAD_PREFIX = "grain_jax_sync"
BEATS = "grain_jax_sync/beat/"  # Per-process liveness keys, not per iterator.


def library_threads() -> list[str]:
  """Names of the live threads this library started."""
  return sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX))


def slow(batches: list[Any], delay_s: float) -> Iterator[Any]:
  for b in batches:
    if delay_s:
      time.sleep(delay_s)
    yield b


def exchange_roundtrip(chunks: int) -> dict[str, Any]:
  """Chunks up to process 0 and decisions back down through KeyValueExchange."""
  import jax

  from grain_jax_sync._src.exchange import key_value

  client = key_value.distributed_client()
  p, n = jax.process_index(), jax.process_count()
  ns = "grain_jax_sync/test_roundtrip"
  ex = key_value.KeyValueExchange(client, ns, process_index=p, process_count=n)
  got: list[tuple[int, str]] = []
  deadline = time.monotonic() + 30
  if p == 0:
    while len(got) < (n - 1) * chunks and time.monotonic() < deadline:
      new = ex.read_chunks()
      if not new:
        missing = [q for q in range(1, n) if sum(1 for g in got if g[0] == q) < chunks]
        new = ex.wait_chunk(missing[0])
      got.extend(new)
    for c in range(chunks):
      ex.post_decision(c, f"d{c}")
  else:
    for c in range(chunks):
      ex.post_chunk(f"{p}:{c}")
    for c in range(chunks):
      text = None
      while text is None and time.monotonic() < deadline:
        text = ex.wait_decision(c)
      got.append((0, text))
  client.wait_at_barrier("test_roundtrip/read", 30_000)
  if p == 0:
    ex.delete_decisions(chunks)
  else:
    ex.delete_chunks(chunks)
  client.wait_at_barrier("test_roundtrip/released", 30_000)
  left_after_release = [k for k, _ in client.key_value_dir_get(ns + "/")]
  client.wait_at_barrier("test_roundtrip/looked", 30_000)
  ex.end()
  client.wait_at_barrier("test_roundtrip/finished", 30_000)
  left_after_end = [k for k, _ in client.key_value_dir_get(ns + "/")]
  return {
    "got": got,
    "left_after_release": left_after_release,
    "left_after_end": left_after_end,
  }
