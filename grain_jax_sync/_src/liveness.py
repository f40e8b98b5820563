"""Liveness: tell a dead peer from a slow one, through the key-value store.

One beat thread per process (not per iterator) overwrites
``grain_jax_sync/beat/{p}`` every liveness period (`key_value.beat_text`). A
process that waits for a peer reads its beat once a wait slice brought nothing
(once per period): unchanged for `periods.DEAD_AFTER_S` means dead (within
docs/guarantees.md's promise). A peer that never beat has not built an
iterator yet: late, not dead.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from grain_jax_sync._src import periods
from grain_jax_sync._src.exchange import key_value

logger = logging.getLogger(__name__)


class Beat:
  """The process's liveness beat: a daemon thread overwriting one key.

  One per (client, process): `Beat.ensure` starts it on first use; `stop()`,
  at interpreter exit, deletes the key (named ``gjs-beat-{p}``, not
  ``grain_jax_sync-*``: per-iterator thread checks do not count it). Its
  thread also runs what `wake` hands it: a signal handler hands work by a put.
  """

  _lock = threading.Lock()
  _running: dict[tuple[int, int], Beat] = {}

  def __init__(self, client: Any, process: int):
    self._client = client
    self._process = process
    # Work to run in the beat's thread (`wake`), or None: stop.
    self._wakes: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
    # The first beat before any iterator exists: one killed right after would otherwise never
    # have beat, and peers would wait for it as a slow start.
    self._beat(0)
    self._thread = threading.Thread(target=self._run, name=f"gjs-beat-{process}", daemon=True)
    self._thread.start()

  @classmethod
  def ensure(cls, client: Any, process: int) -> Beat:
    with cls._lock:
      beat = cls._running.get((id(client), process))
      if beat is None:
        beat = cls._running[(id(client), process)] = cls(client, process)
        if len(cls._running) == 1:
          atexit.register(cls.stop_all)
      return beat

  @classmethod
  def running(cls, client: Any, process: int) -> Beat | None:
    """The beat `ensure` started, or None (a dict read: no lock)."""
    return cls._running.get((id(client), process))

  def _beat(self, n: int) -> None:
    try:
      self._client.key_value_set(key_value.beat_key(self._process), key_value.beat_text(n), True)
    except Exception as e:  # noqa: BLE001 - the store is gone: nothing to tell.
      logger.debug("grain_jax_sync: beat failed: %s", e)

  def wake(self, work: Callable[[], None]) -> None:
    """Has `work` run in the beat's thread now: one reentrant put (a signal handler may call it)."""
    self._wakes.put(work)

  def _run(self) -> None:
    n, due = 0, time.monotonic() + periods.LIVENESS_PERIOD_S
    while True:
      try:
        work = self._wakes.get(timeout=max(0.0, due - time.monotonic()))
      except queue.Empty:  # The next beat is due: a wake does not put it off.
        n += 1
        self._beat(n)
        due = time.monotonic() + periods.LIVENESS_PERIOD_S
        continue
      if work is None:
        return
      try:
        work()
      except Exception as e:  # noqa: BLE001 - the beat goes on.
        logger.warning("grain_jax_sync: %s", e)

  def stop(self) -> None:
    self._wakes.put(None)
    self._thread.join(timeout=2 * periods.LIVENESS_PERIOD_S)
    with contextlib.suppress(Exception):  # Best effort at exit.
      self._client.key_value_delete(key_value.beat_key(self._process))

  @classmethod
  def stop_all(cls) -> None:
    with cls._lock:
      beats = list(cls._running.values())
      cls._running.clear()
    for beat in beats:
      beat.stop()


class Liveness:
  """Tells a dead peer (beat unchanged for `dead_after_s`) from a slow one.

  Reads a peer's beat (`exchange.beat_of`) at most once per liveness period
  of `clock`, only while waiting for it.
  """

  def __init__(
    self,
    exchange: Any,
    dead_after_s: float = periods.DEAD_AFTER_S,
    clock: Callable[[], float] = time.monotonic,
  ):
    self._ex = exchange
    self.dead_after_s = dead_after_s
    self._clock = clock
    # Per process: its beat, since when it is unchanged, when it was read.
    self._seen: dict[int, tuple[str | None, float, float]] = {}
    # Per process: what its note was read on (`closed`), and the note.
    self._closed: dict[int, tuple[float, str | None]] = {}

  def _beat(self, process: int) -> tuple[str | None, float, float]:
    """`process`'s beat, since when it is unchanged, and when it was read (once per liveness period)."""
    now = self._clock()
    last = self._seen.get(process)
    if last is None or now - last[2] >= periods.LIVENESS_PERIOD_S:
      beat = self._ex.beat_of(process)
      held = self._clock() - now
      since = last[1] if last is not None and last[0] == beat else now
      if held >= periods.LIVENESS_PERIOD_S:
        # The store held the read up (process 0, which holds it, was frozen): the beat it
        # returns may be from before the hold, and the hold is not the peer's silence.
        since += held
      last = self._seen[process] = (beat, since, now)
    return last

  def dead(self, process: int) -> bool:
    """Whether `process`'s beat is unchanged for `dead_after_s` (one that never beat is late)."""
    beat, since, _ = self._beat(process)
    return beat is not None and self._clock() - since >= self.dead_after_s

  def waiting(self, process: int) -> list[str]:
    """The streams `process` waits at the start of, as of its last beat read here."""
    beat = self._beat(process)[0]
    return [] if beat is None else beat.split()[1:]

  def closed(self, process: int) -> str | None:
    """What `process` wrote when it closed the iterator, or None: read once its beat shows a close
    not read yet, and at each read of its beat while it has none (gone at its exit)."""
    beat, _, read_at = self._beat(process)
    # `key_value.beat_text`: ``{n}/{closes}`` first.
    mark = read_at if beat is None else int(beat.split()[0].partition("/")[2] or 0)
    seen, note = self._closed.get(process, (0, None))
    if mark != seen:
      note = self._ex.closed_note(process)
      self._closed[process] = (mark, note)
    return note
