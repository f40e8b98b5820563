"""`JaxBatchIterator.stats()` scenarios that run inside simulated hosts (and in one process).

Each case iterates `scenarios.make_batches` with given per-process sizes and
returns the stats, so the test compares them with the counts the rules give.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import scenarios

# The same cases in every topology: (per-process sizes, iter_jax_batches options).
PADDED = {"batch_size": 8, "paddings": 0, "mask_key": "mask"}
CASES: dict[str, tuple[list[list[int]], dict[str, Any]]] = {
  # Process 0: 3 batches, the last short; process 1: 2, the last short, then dummies.
  "padded": ([[8, 8, 5], [8, 3]], PADDED),
  "padded_no_prefetch": ([[8, 8, 5], [8, 3]], {**PADDED, "prefetch_batches": 0}),
  "padded_window_1": ([[8, 8, 5], [8, 3]], {**PADDED, "synchronize_lookahead": 1}),
  # drop_last: the short position is dropped on every host, then every host stops.
  "dropped": ([[8, 8, 5], [8, 8, 8, 8]], {"batch_size": 8, "drop_last": True}),
  "even": ([[8, 8], [8, 8]], {"batch_size": 8}),
}
SLOW_READ_S = 0.02  # Per batch of the slow source.


class SlowSource:
  """Sleeps `delay_s` before each batch (time that `source_s` must count)."""

  def __init__(self, batches: list[Any], delay_s: float = SLOW_READ_S):
    self._batches = batches
    self._delay_s = delay_s

  def __iter__(self):
    for b in self._batches:
      time.sleep(self._delay_s)
      yield b


def _case(p: int, sizes: list[list[int]], kwargs: dict[str, Any]) -> dict[str, Any]:
  import grain_jax_sync as gjs

  mine = sizes[p] if p < len(sizes) else []
  with gjs.iter_jax_batches(scenarios.make_batches(p, mine), **kwargs) as it:
    n = sum(1 for _ in it)
    return {"yielded": n, "stats": it.stats()}


def _mid_stream(p: int) -> dict[str, Any]:
  """Stats after 1 of 6 batches, with the pipeline prefetching ahead."""
  import grain_jax_sync as gjs

  data = scenarios.make_batches(p, [8, 8, 8, 8, 8, 6])
  with gjs.iter_jax_batches(data, **PADDED, prefetch_batches=4) as it:
    next(it)
    time.sleep(0.5)  # Let the stages run ahead.
    first = it.stats()
    rest = sum(1 for _ in it)
    return {"first": first, "rest": rest, "end": it.stats()}


def _slow(p: int) -> dict[str, Any]:
  """A slow source read in the consumer's thread: every stage's time nests in wait_s."""
  import grain_jax_sync as gjs

  data = SlowSource(scenarios.make_batches(p, [8, 8, 8, 8]))
  with gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=0) as it:
    t0 = time.monotonic()
    n = sum(1 for _ in it)
    return {"yielded": n, "stats": it.stats(), "loop_s": time.monotonic() - t0}


def _resumed(p: int) -> dict[str, Any]:
  """stats() after set_state: counts of this iterator's batches only, then more."""
  import grain_jax_sync as gjs

  data = scenarios.make_batches(p, [8, 8, 8, 5])
  with gjs.iter_jax_batches(data, **PADDED) as it:
    next(it)
    state = it.get_state()
  with gjs.iter_jax_batches(data, **PADDED) as it:
    it.set_state(state)
    before = it.stats()
    next(it)
    it.set_state(state)  # Restart: the prefetched batches are not counted.
    n = 1 + sum(1 for _ in it)
    return {"before": before, "yielded": n, "stats": it.stats()}


def run_all() -> dict[str, Any]:
  """Every case on this process, in the same order on every process."""
  import jax

  p = jax.process_index()
  out: dict[str, Any] = {k: _case(p, sizes, kwargs) for k, (sizes, kwargs) in CASES.items()}
  out["mid_stream"] = _mid_stream(p)
  out["slow"] = _slow(p)
  out["resumed"] = _resumed(p)
  return out


# stats(all_hosts=True): process p reads STRAGGLER_BATCHES + p full batches and
# a short one of 5 rows; the slowed host sleeps before each of its batches.
STRAGGLER_BATCHES = 24
STRAGGLER_READ_S = 0.03


class _Captured(logging.Handler):
  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    self.messages.append(record.getMessage())


def straggler(slow: int) -> dict[str, Any]:
  """Iterates with host `slow` slowed; every host's cross-host table and warnings."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  data: Any = scenarios.make_batches(p, [8] * (STRAGGLER_BATCHES + p) + [5])
  if p == slow:
    data = SlowSource(data, STRAGGLER_READ_S)
  captured = _Captured()
  log = logging.getLogger("grain_jax_sync._src.job_stats")
  log.addHandler(captured)
  try:
    with gjs.iter_jax_batches(data, **PADDED, synchronize_lookahead=2) as it:
      n = sum(1 for _ in it)
      return {
        "yielded": n,
        "own": it.stats(),
        "job": it.stats(all_hosts=True),
        "warnings": captured.messages,
      }
  finally:
    log.removeHandler(captured)
