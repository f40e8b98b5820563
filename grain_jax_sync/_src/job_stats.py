"""The cross-host view, ``JaxBatchIterator.stats(all_hosts=True)``, and the straggler warning.

Gathered through the agreement's own messages (`messages.Chunk.times`,
`messages.Decision.table`), with no store call of its own while the stream
runs; the final times are posted once each stream ends (`key_value.post_times`).
How, what it costs, and the straggler rule: docs/performance.md, "Seeing the job".
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from grain_jax_sync._src import messages
from grain_jax_sync._src import stats as stats_lib
from grain_jax_sync._src.exchange import key_value

logger = logging.getLogger(__name__)

STRAGGLER_RATIO = 2.0
STRAGGLER_SHARE = 0.5
STRAGGLER_WINDOWS = 3
# Process 0 puts the changed rows into a decision at most this often, times
# max(1, (processes / TABLE_PROCESSES) ** 2): every follower reads every
# decision, so a table of P rows costs P * P rows through the store; so
# scaled, that stays below TABLE_PROCESSES ** 2 rows a second.
TABLE_EVERY_S = 1.0
TABLE_PROCESSES = 64
COUNTS = stats_lib.FIELDS[:5]  # A host's row in a decision: its index, these, then its times.


def encode_times(snapshot: dict[str, Any]) -> tuple[float, ...]:
  """A `stats()` snapshot's times, rounded to 0.1 ms, in `stats.TIMES` order."""
  return tuple(round(float(snapshot[k]), 4) for k in stats_lib.TIMES)


def host_row(process: int, counts: Sequence[int], times: Sequence[float]) -> dict[str, Any]:
  """One host's mapping: ``process_index``, the `stats()` keys, ``padding_fraction``."""
  figures = (process, *map(int, counts), *map(float, times))
  return stats_lib.with_padding_fraction(
    dict(zip(("process_index", *stats_lib.FIELDS), figures, strict=True))
  )


class JobTable:
  """Every host's newest counters, as this process knows them; thread-safe.

  Lives as long as the iterator. `probe` returns this host's `stats()`
  snapshot without the iterator's locks (the agreement thread calls it); a
  bound method weakly: no cycle keeps its owner, and the source, alive.
  `namespace`: the iterator's key prefix, where each process posts its times
  at the end of a stream (None: nothing is exchanged).
  """

  def __init__(self, probe: Callable[[], dict[str, Any]], namespace: str | None = None):
    self._probe = weakref.WeakMethod(probe) if inspect.ismethod(probe) else lambda: probe
    self._base = namespace
    self._streams = 0  # Streams attached here.
    self._running = False
    # Per peer, the streams it had when it last posted its times at an end.
    self._ends: dict[int, int] = {}
    self._lock = threading.Lock()
    self._n = 1
    self._me = jax.process_index()  # Until a stream attaches (one process: for good).
    self._counts: list[list[int]] = [[0] * len(COUNTS)]
    # Counts every host shares (full batches, drops), added to each row read: O(1) a step.
    self._shared = [0] * len(COUNTS)
    self._times: list[tuple[float, ...]] = [(0.0,) * len(stats_lib.TIMES)]
    self._changed: set[int] = set()
    self._sent_at: float | None = None  # When the last table went out (the core's clock).
    self._posted: tuple[float, ...] | None = None  # Own times in the last chunk.
    self.stragglers = Stragglers(time.monotonic())

  def _own(self) -> dict[str, Any]:
    return self._probe()()  # type: ignore[misc]  # The owner outlives its threads, which call.

  def attach(self, process: int, process_count: int) -> None:
    """Sizes the table for a stream's processes (keeps what it knows)."""
    with self._lock:
      self._me = process
      self._streams += 1
      self._running = True
      self._sent_at = None  # The first table one interval in (or the final one).
      if process_count != self._n:
        self._n = process_count
        self._counts = [[0] * len(COUNTS) for _ in range(process_count)]
        self._shared = [0] * len(COUNTS)
        self._times = [(0.0,) * len(stats_lib.TIMES) for _ in range(process_count)]

  def ended(self, *, post: bool = True) -> None:
    """This host's stream ended (its stages closed): posts its times, for the peers' `view`."""
    with self._lock:
      running, self._running = self._running, False
      post = post and running and self._n > 1
    if post and self._base is not None:
      text = json.dumps([self._streams, *encode_times(self._own())])
      key_value.post_times(self._base, text)

  def _read_ends(self) -> None:
    """Once this host's stream ended: the times each peer posted at its end, if not all in yet."""
    with self._lock:
      due = not self._running and self._n > 1
      due = due and any(
        self._ends.get(p, -1) < self._streams for p in range(self._n) if p != self._me
      )
    if not due or self._base is None:
      return
    posted = []
    for p, text in key_value.read_times(self._base):
      try:
        streams, *times = json.loads(text)
      except (TypeError, ValueError):
        continue
      posted.append((p, int(streams), tuple(float(t) for t in times)))
    with self._lock:
      for p, streams, times in posted:
        if p != self._me and 0 <= p < self._n and len(times) == len(stats_lib.TIMES):
          # Every figure only grows over the iterator's life: the larger is the newer.
          self._times[p] = tuple(map(max, self._times[p], times))
          self._ends[p] = streams

  # -- a process other than 0 --------------------------------------------------

  def times_to_post(self) -> tuple[float, ...] | None:
    """This host's times for its next chunk, or None if unchanged since its last."""
    times = encode_times(self._own())
    if times == self._posted:
      return None
    self._posted = times
    return times

  def merge(self, rows: Sequence[Sequence[Any]]) -> None:
    """Takes the rows of a decision (`messages.Decision.table`)."""
    k = len(COUNTS)
    with self._lock:
      for row in rows:
        p = int(row[0])
        if 0 <= p < self._n:
          self._counts[p] = [int(c) - s for c, s in zip(row[1 : 1 + k], self._shared, strict=True)]
          self._times[p] = tuple(float(t) for t in row[1 + k :])

  # -- process 0 ---------------------------------------------------------------

  def add_times(self, news: Sequence[tuple[int, Sequence[float]]]) -> None:
    """Records peers' times from their chunks: (process, times) pairs, one lock for all."""
    with self._lock:
      for process, times in news:
        if 0 <= process < self._n:
          self._times[process] = tuple(times)
          self._changed.add(process)
          self.stragglers.seen(process)

  def decided(self, steps: Sequence[messages.Step]) -> None:
    """Counts decided steps for every host (`Step.real_rows`, process order)."""
    if not steps:
      return
    with self._lock:
      for step, same in itertools.groupby(steps):
        self._count(step, sum(1 for _ in same))
      self._changed.update(range(self._n))

  def _count(self, step: messages.Step, run: int) -> None:
    if step.action == messages.Action.DROP:
      self._shared[4] += run
      return
    if step.real_rows.count(step.rows) == len(step.real_rows) == self._n:
      self._shared[0] += run  # Full everywhere: no padding, no dummy.
      self._shared[1] += step.rows * run
      return
    for c, real in zip(self._counts, step.real_rows, strict=False):
      c[0] += run
      c[1] += real * run
      c[2] += (step.rows - real) * run
      c[3] += run if real == 0 else 0

  def _row_counts(self, p: int) -> list[int]:
    return [c + s for c, s in zip(self._counts[p], self._shared, strict=True)]

  def rows_to_send(self, *, final: bool, now: float) -> tuple[tuple[Any, ...], ...] | None:
    """The changed rows for the next decision, when due at `now` (always when `final`)."""
    every = TABLE_EVERY_S * max(1.0, (self._n / TABLE_PROCESSES) ** 2)
    with self._lock:
      if self._sent_at is None:
        self._sent_at = now
      if self._n < 2 or not self._changed or (not final and now - self._sent_at < every):
        return None
      self._sent_at = now
      self._times[self._me] = encode_times(self._own())
      rows = tuple(
        (p, *self._row_counts(p), *self._times[p]) for p in sorted(self._changed | {self._me})
      )
      self._changed.clear()
      return rows

  def check_stragglers(self, now: float) -> None:
    """Process 0, at `now`: closes a window once every peer posted fresh times (`Stragglers`)."""
    with self._lock:
      sources = [t[stats_lib.TIMES.index("source_s")] for t in self._times]
    sources[self._me] = float(self._own()["source_s"])
    self.stragglers.check(self._me, sources, now)

  # -- stats(all_hosts=True) ---------------------------------------------------

  def view(self) -> dict[str, Any]:
    """``{"hosts": [one mapping per process], "slowest": `slowest` of them}``."""
    self._read_ends()
    own = stats_lib.with_padding_fraction({"process_index": self._me, **self._own()})
    with self._lock:
      if self._n == 1:  # One process, or no stream over the store (collective fallback).
        hosts = [own]
      else:
        hosts = [
          own if p == self._me else host_row(p, self._row_counts(p), self._times[p])
          for p in range(self._n)
        ]
    return {"hosts": hosts, "slowest": slowest(hosts)}


def slowest(hosts: Sequence[dict[str, Any]]) -> int | None:
  """The host with the most ``source_s`` at 0.1 ms (`encode_times`), or None if another has as much."""
  ranked = sorted(hosts, key=lambda h: (-round(h["source_s"], 4), h["process_index"]))
  if len(ranked) > 1 and round(ranked[0]["source_s"], 4) == round(ranked[1]["source_s"], 4):
    return None
  return ranked[0]["process_index"]


class Stragglers:
  """The straggler rule (docs/performance.md, "Straggler warning"), at process 0; warns once."""

  def __init__(self, start: float):
    self._start = start  # When the iterator started, on the clock `check` is given.
    self._fresh: set[int] = set()
    self._last_own: float | None = None
    self._streak = (-1, 0)  # (process, windows in a row)
    self.warned: int | None = None

  def seen(self, process: int) -> None:
    self._fresh.add(process)

  def check(self, me: int, sources: list[float], now: float) -> None:
    """Judges the host with the most source time at `now`, if its figure is fresh."""
    if sources[me] != self._last_own:
      self._last_own = sources[me]
      self._fresh.add(me)
    fresh, self._fresh = self._fresh, set()
    if self.warned is not None or len(sources) < 2:
      return
    slow = max(range(len(sources)), key=sources.__getitem__)
    if slow not in fresh:
      return
    mine = sources[slow]
    others = statistics.median(s for p, s in enumerate(sources) if p != slow)
    wall = now - self._start
    if not (mine >= STRAGGLER_RATIO * others and mine >= STRAGGLER_SHARE * wall > 0):
      self._streak = (-1, 0)
      return
    streak = self._streak[1] + 1 if self._streak[0] == slow else 1
    self._streak = (slow, streak)
    if streak < STRAGGLER_WINDOWS:
      return
    self.warned = slow
    logger.warning(
      "grain_jax_sync: process %d's source is the straggler: %.3fs of source time,"
      " %.0f%% of the %.3fs since the iterator started and %.1fx the median of the"
      " other processes (%.3fs), in %d windows in a row; every host waits for it"
      " (process 0's view)",
      slow,
      mine,
      100 * mine / wall,
      wall,
      mine / others if others > 0 else float("inf"),
      others,
      streak,
    )
