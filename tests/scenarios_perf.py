"""Scenarios for the prefetch, exchange and dtype-policy tests (run in simulated hosts).

Module-level functions only, so that `grain_jax_sync.testing.run_processes`
can import them in every process. Each returns plain values that pickle.
"""

from __future__ import annotations

import gc
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import scenarios

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


def consume_with_state(
  sizes: list[list[int]], kwargs: dict[str, Any], *, k: int, delay_s: list[float] | None = None
) -> dict[str, Any]:
  """Consumes `k` batches; returns them (gathered) and the state after them."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  data = scenarios.make_batches(p, sizes[p])
  it = gjs.iter_jax_batches(data, **kwargs)
  got = []
  for _ in range(k):
    got.append(scenarios.gather(next(it)))
  if delay_s is not None:
    time.sleep(delay_s[p])  # Let the prefetch thread run ahead.
  state = it.get_state()
  it.close()
  return {"batches": got, "state": state, "threads": library_threads()}


def consume_all(
  sizes: list[list[int]], kwargs: dict[str, Any], *, delay_s: list[float]
) -> dict[str, Any]:
  """Drains an iterator over a source that sleeps `delay_s[process]` per batch."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  data = scenarios.make_batches(p, sizes[p])
  it = gjs.iter_jax_batches(slow(data, delay_s[p]), **kwargs)
  out = scenarios.consume(it)
  it.close()
  out["threads"] = library_threads()
  return out


def _endless(process: int, delay_s: float) -> Iterator[Any]:
  """Batches of 8 rows, one every `delay_s`, without end."""
  b = 0
  while True:
    time.sleep(delay_s)
    yield {"x": scenarios.rows_for(process, b, 8).astype(np.int32)}
    b += 1


def stop_half_way(mode: str, kwargs: dict[str, Any]) -> dict[str, Any]:
  """Takes 2 batches of an endless source, then closes or drops the iterator.

  Endless, so that the stage threads are still up (blocked on full buffers)
  when it stops: the agreement and build stages together hold up to a few
  hundred batches read ahead, and a finite source could be read to its end.
  """
  import jax

  import grain_jax_sync as gjs
  from grain_jax_sync._src import exchange

  p = jax.process_index()
  it = gjs.iter_jax_batches(_endless(p, 0.001), **kwargs)
  next(it)
  next(it)
  time.sleep(0.2)  # The threads are up and blocked on a full queue.
  during = library_threads()
  # A peer's close ends this host's stream (and its agreement thread): every
  # process looks before any closes.
  exchange.distributed_client().wait_at_barrier(f"half_way/{mode}/looked", 30_000)
  if mode == "close":
    it.close()
  else:
    del it
    gc.collect()
  return {"during": during, "after": library_threads()}


def _failing_source(process: int, fail_process: int, at: int) -> Iterator[Any]:
  for b, batch in enumerate(scenarios.make_batches(process, [8] * 6)):
    if process == fail_process and b == at:
      raise KeyError(f"bad record {b}")
    yield batch


def source_error(kwargs: dict[str, Any], *, fail_process: int = 0, at: int = 3) -> dict[str, Any]:
  """The source of `fail_process` raises KeyError at batch `at`."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  it = gjs.iter_jax_batches(_failing_source(p, fail_process, at), **kwargs)
  got = 0
  out: dict[str, Any] = {}
  try:
    for _ in it:
      got += 1
  except Exception as e:  # noqa: BLE001 - returned to the test.
    out["type"] = type(e).__qualname__
    out["message"] = str(e)
    out["frames"] = [f.name for f in traceback.extract_tb(e.__traceback__)]
  it.close()
  out["got"] = got
  out["threads"] = library_threads()
  return out


def exchange_roundtrip(chunks: int) -> dict[str, Any]:
  """Chunks up to process 0 and decisions back down through KeyValueExchange."""
  import jax

  from grain_jax_sync._src import exchange

  client = exchange.distributed_client()
  p, n = jax.process_index(), jax.process_count()
  ns = "grain_jax_sync/test_roundtrip"
  ex = exchange.KeyValueExchange(client, ns, process_index=p, process_count=n)
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


def keys_after_iteration(sizes: list[list[int]], kwargs: dict[str, Any]) -> dict[str, Any]:
  """Drains an iterator, then lists what is left in the key-value store."""
  import jax

  import grain_jax_sync as gjs
  from grain_jax_sync._src import exchange

  p = jax.process_index()
  it = gjs.iter_jax_batches(scenarios.make_batches(p, sizes[p]), **kwargs)
  n, error = 0, None
  try:
    for _ in it:
      n += 1
  except ValueError as e:
    error = type(e).__name__
  it.close()
  client = exchange.distributed_client()
  client.wait_at_barrier("keys_after_iteration", 30_000)
  left = [k for k, _ in client.key_value_dir_get("grain_jax_sync/") if not k.startswith(BEATS)]
  return {"batches": n, "error": error, "left": left}


def peer_never_comes(timeout_s: float) -> dict[str, Any]:
  """Process 0 iterates; process 1 never builds its iterator."""
  import jax

  import grain_jax_sync as gjs

  if jax.process_index() != 0:
    return {"type": None, "threads": library_threads()}
  it = gjs.iter_jax_batches(
    scenarios.make_batches(0, [8] * 4), batch_size=8, sync_timeout_s=timeout_s
  )
  out: dict[str, Any] = {"type": None}
  try:
    next(it)
  except Exception as e:  # noqa: BLE001 - returned to the test.
    out = {"type": type(e).__qualname__, "message": str(e), "missing": getattr(e, "missing", None)}
  it.close()
  out["threads"] = library_threads()
  return out


def dtype_values(kwargs: dict[str, Any]) -> dict[str, Any]:
  """Float32/float64/int64/uint8 columns through the dtype policy and after."""
  import jax
  import ml_dtypes

  import grain_jax_sync as gjs

  p = jax.process_index()
  rng = np.random.default_rng(p)
  data = [
    {
      "f32": rng.normal(size=(n, 3)).astype(np.float32) * 1000,
      "f64": rng.normal(size=(n,)) * 1e6,
      "i64": rng.integers(-(2**30), 2**30, size=(n,)),
      "u8": rng.integers(0, 256, size=(n, 2), dtype=np.uint8),
    }
    for n in (8, 8, 4)
  ]
  dtypes = {"f32": ml_dtypes.bfloat16, "f64": np.float32, "i64": np.int32, "u8": np.float32}
  policy = [scenarios.gather(b) for b in gjs.iter_jax_batches(data, dtypes=dtypes, **kwargs)]
  after = [
    scenarios.gather({k: v.astype(dtypes[k]) for k, v in b.items()})
    for b in gjs.iter_jax_batches(data, **kwargs)
  ]
  return {"policy": policy, "after": after}
