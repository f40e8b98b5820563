"""Scenarios for tests/test_lifetime.py (run in simulated hosts).

Module-level functions only, so that `grain_jax_sync.testing.run_processes`
can import them in every process. Each returns plain values that pickle.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np


def host_batches(n: int, p: int) -> list[dict[str, np.ndarray]]:
  """Host `p`'s `n` batches of 8 rows: batch i holds 100 * p + i."""
  return [{"x": np.full((8,), 100 * p + i, np.int32)} for i in range(n)]


def dropped_in_a_cycle_collected_in_a_library_thread(prefetch: int) -> dict[str, Any]:
  """Process 1 drops its iterator inside a reference cycle after 3 batches.

  Its source then runs a garbage collection in the library's own thread (the
  agreement, read or build thread), where the iterator's finalizer runs.
  Process 0 must raise "process 1 closed its iterator at batch 3" promptly.
  """
  import jax

  kw = {"batch_size": 8, "prefetch_batches": prefetch, "sync_timeout_s": 60.0}
  if jax.process_index() == 1:
    return _drop_in_a_cycle(kw)
  return _iterate_until_the_peer_ends(kw)


def _drop_in_a_cycle(kw: dict[str, Any]) -> dict[str, Any]:
  """Process 1: 3 batches, then the iterator dropped in a cycle its source collects."""
  import grain_jax_sync as gjs

  class Source:
    def __init__(self):
      self.i = 0
      self.dropped = False

    def __iter__(self):
      return self

    def __next__(self):
      if self.i >= 3:
        time.sleep(0.2)  # Slow: little is read (and posted) ahead of the consumer.
      if self.dropped:
        gc.collect()  # In whatever library thread reads the source now.
      self.i += 1
      if self.i > 200:
        raise StopIteration
      return {"x": np.full((8,), 100 + self.i - 1, np.int32)}

  source = Source()
  it = gjs.iter_jax_batches(source, **kw)
  got = [_local_first(next(it)) for _ in range(3)]
  cycle: list[Any] = [it]
  cycle.append(cycle)
  del it, cycle
  source.dropped = True
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and not _closed_everywhere():
    time.sleep(0.05)
  return {"got": got, "threads": _threads_left(10.0)}


def _iterate_until_the_peer_ends(kw: dict[str, Any]) -> dict[str, Any]:
  """Process 0: iterates until the stream ends; what it got, the error and how long it took."""
  import grain_jax_sync as gjs

  it = gjs.iter_jax_batches(host_batches(200, 0), **kw)
  got = []
  t0 = time.monotonic()
  try:
    for b in it:
      got.append(_local_first(b))
    error = None
  except Exception as e:  # noqa: BLE001 - the ending under test.
    error = f"{type(e).__name__}: {e}"
  seconds = time.monotonic() - t0
  it.close()
  return {"got": got, "error": error, "seconds": seconds, "threads": _threads_left(10.0)}


def _local_first(batch: Any) -> int:
  """This host's first row (no collective: the peer may have stopped iterating)."""
  return int(np.asarray(batch["x"].addressable_shards[0].data).reshape(-1)[0])


def _closed_everywhere() -> bool:
  return not any(t.startswith("grain_jax_sync-") for t in _thread_names())


def _thread_names() -> list[str]:
  import threading

  return [t.name for t in threading.enumerate()]


def _threads_left(wait_s: float) -> list[str]:
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline:
    left = [t for t in _thread_names() if t.startswith("grain_jax_sync-")]
    if not left:
      return []
    time.sleep(0.05)
  return left


def _checkpoint(it: Any) -> tuple[Any, Any]:
  """`get_state()` and `stats()` from a checkpoint thread."""
  import threading

  box: dict[str, Any] = {}
  t = threading.Thread(target=lambda: box.update(s=it.get_state(), c=it.stats()))
  t.start()
  t.join(30)
  return box["s"], box["c"]


def _drain(it: Any, got: list[Any], expected: int, p: int) -> str:
  """Reads until the stream ends; how it ended."""
  try:
    while True:
      got.append((_local_first(next(it)) - 100 * p, expected))
      expected += 1
  except RuntimeError as e:
    return str(e)
  except StopIteration:
    return "stop"


class _HostSchedule:
  """One host's run of a random schedule: what it got and saved, and how it ended."""

  def __init__(self, it: Any, p: int):
    self.it = it
    self.p = p
    self.got: list[Any] = []
    self.saved: list[Any] = []
    self.ending: str | None = None
    self.expected = 0

  def step(self, op: str, closer: int | None) -> bool:
    """Runs `op`; True when it ended the stream here (closed, stopped or raised)."""
    if op == "close" and closer == self.p:
      t = threading.Thread(target=self.it.close)
      t.start()
      t.join(60)
      self.ending = "closed here"
      return True
    if op == "next":
      self.next()
      return self.ending is not None
    if op == "state":
      state, counts = _checkpoint(self.it)
      self.saved.append((state, self.expected, counts["batches"]))
    elif op == "restore" and self.saved:
      self.it.set_state(self.saved[-1][0])
      self.expected = self.saved[-1][1]
    elif op == "reset":
      self.it.reset()
      self.expected = 0
    return False

  def next(self) -> None:
    """`next()`: records the batch, or the ending."""
    try:
      self.got.append((_local_first(next(self.it)) - 100 * self.p, self.expected))
      self.expected += 1
    except StopIteration:
      self.ending = "stop"
    except RuntimeError as e:
      self.ending = str(e)


def _one_schedule(seed: int, prefetch: int, p: int) -> dict[str, Any]:
  """Runs the schedule of `seed` on this host; what it got, counted, saved and how it ended."""
  import random

  import grain_jax_sync as gjs

  rng = random.Random(seed)
  ops = [rng.choice(["next"] * 4 + ["state", "restore", "reset"]) for _ in range(12)]
  closer = rng.choice([None, 0, 1])
  ops.insert(rng.randrange(len(ops)), "close")
  kw = {"batch_size": 8, "prefetch_batches": prefetch, "sync_timeout_s": 60.0}
  it = gjs.iter_jax_batches(host_batches(20, p), name=f"schedule-{seed}", **kw)
  host = _HostSchedule(it, p)
  for op in ops:
    if host.step(op, closer):
      break
  if host.ending is None and closer is not None and closer != p:
    host.ending = _drain(it, host.got, host.expected, p)  # The peer closed: the next call names it.
  counted = it.stats()["batches"]
  it.close()
  return {
    "keys": _keys_left(f"schedule-{seed}"),
    "seed": seed,
    "got": host.got,
    "counted": counted,
    "saved": [(st["batches"], st["source"], e, c) for st, e, c in host.saved],
    "ending": host.ending,
    "closer": closer,
    "threads": _threads_left(10.0),
  }


def _keys_left(tag: str) -> list[str]:
  """The store keys left once every host closed this schedule's iterator (beats aside)."""
  from jax._src import distributed
  from scenarios_faults import iterator_keys

  client = distributed.global_state.client
  client.wait_at_barrier(f"{tag}/closed", 60_000)
  keys = iterator_keys(client)
  client.wait_at_barrier(f"{tag}/looked", 60_000)  # Nobody starts the next one before.
  return keys


def random_schedules(seeds: list[int], prefetch: int) -> list[dict[str, Any]]:
  """The same random schedule on every host, per seed; one host may close from a thread.

  Ops: `next()`, `get_state()`/`stats()` from a checkpoint thread, `set_state()`
  of a saved state, `reset()`, and `close()` from another thread on one host
  (the other host must then end with "process h closed its iterator").
  """
  import jax

  return [_one_schedule(seed, prefetch, jax.process_index()) for seed in seeds]
