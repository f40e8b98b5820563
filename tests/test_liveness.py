"""The liveness beat and the dead/slow verdict, over the in-memory store.

The multi-process endings (a killed host named within 15 s) are in
test_endings.py; these pin the rules they rest on: a process that built its
exchange has beat, a beat that stops is dead after `DEAD_AFTER_S`, and a
peer's close note is read only when its beat shows a new close.
"""

from __future__ import annotations

import collections
import threading
import time

from grain_jax_sync._src import liveness, periods
from grain_jax_sync._src.exchange import key_value
from grain_jax_sync._src.memory_store import MemoryStore


class _OnlyCallerWrites(MemoryStore):
  """Holds every write from a thread other than `caller` until `release`."""

  def __init__(self, caller: threading.Thread) -> None:
    super().__init__()
    self._caller = caller
    self.release = threading.Event()

  def key_value_set(self, key, value, allow_overwrite=False):
    if threading.current_thread() is not self._caller:
      self.release.wait()
    super().key_value_set(key, value, allow_overwrite)


def test_the_first_beat_is_written_before_the_beat_starts_its_thread():
  # A process killed right after building its iterator, before the beat
  # thread's first write, must still have beat, or peers wait for it as a
  # slow start. With every write from other threads held, the key is there.
  store = _OnlyCallerWrites(threading.current_thread())
  beat = liveness.Beat(store, 3)
  try:
    assert store.key_value_try_get(key_value.beat_key(3)) == "0/0"  # Beat 0, no close.
  finally:
    store.release.set()
    beat.stop()
  assert store.key_value_dir_get(key_value.beat_key(3)) == []  # Deleted on stop.


def _beat_threads() -> set[threading.Thread]:
  return {t for t in threading.enumerate() if t.name.startswith("gjs-beat-")}


def test_the_beat_goes_on_until_stopped():
  store = MemoryStore()
  before = _beat_threads()
  beat = liveness.Beat(store, 0)
  try:
    deadline = time.monotonic() + 10 * periods.LIVENESS_PERIOD_S
    while store.key_value_try_get(key_value.beat_key(0)) in ("0/0", "1/0"):
      assert time.monotonic() < deadline, "the beat did not advance"
      time.sleep(0.05)
    count, closes = store.key_value_try_get(key_value.beat_key(0)).split("/")
    assert int(count) >= 2 and closes == "0"
    assert _beat_threads() - before  # Its own thread beats.
  finally:
    beat.stop()
  assert not _beat_threads() - before  # Stopped: its thread has ended.
  assert store.key_value_dir_get(key_value.beat_key(0)) == []  # And its key is gone.


def test_the_beat_runs_what_it_is_handed_in_its_thread_and_keeps_its_period():
  # What a signal handler hands it (`wake`, one put) runs in the beat's thread;
  # wakes, even one that raises, put off no beat.
  store, ran, handed = MemoryStore(), [], 0
  beat = liveness.Beat(store, 2)
  try:
    beat.wake(lambda: 1 / 0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.5 * periods.LIVENESS_PERIOD_S:
      beat.wake(lambda: ran.append(threading.current_thread().name))
      handed += 1
      time.sleep(periods.LIVENESS_PERIOD_S / 20)
    _until(lambda: len(ran) == handed or None, "a wake did not run")
    count = int(store.key_value_try_get(key_value.beat_key(2)).partition("/")[0])
  finally:
    beat.stop()
  assert set(ran) == {"gjs-beat-2"}
  assert count >= 2, count  # Beats 1 to 3 are due by 3.5 periods.


def _verdicts(store: MemoryStore, dead_after_s: float) -> list[tuple[float, bool]]:
  ex = key_value.KeyValueExchange(store, "t", process_index=0, process_count=2)
  live = liveness.Liveness(ex, dead_after_s=dead_after_s)
  out = []
  start = time.monotonic()
  while time.monotonic() - start < dead_after_s + 2 * periods.LIVENESS_PERIOD_S + 0.5:
    out.append((time.monotonic() - start, live.dead(1)))
    time.sleep(0.1)
  return out


def test_a_peer_whose_beat_stops_is_dead_after_dead_after_s_and_not_before():
  store = MemoryStore()
  store.key_value_set(key_value.beat_key(1), "5", True)  # Beat once, then silent.
  verdicts = _verdicts(store, dead_after_s=1.5)
  assert not [t for t, dead in verdicts if dead and t < 1.5]
  # Named at most one read period after the threshold.
  assert [dead for t, dead in verdicts if t >= 1.5 + periods.LIVENESS_PERIOD_S + 0.2]
  assert all(dead for t, dead in verdicts if t >= 1.5 + periods.LIVENESS_PERIOD_S + 0.2)


def test_a_peer_that_never_beat_is_late_not_dead():
  verdicts = _verdicts(MemoryStore(), dead_after_s=1.5)
  assert verdicts and not any(dead for _, dead in verdicts)


class _CountingReads(MemoryStore):
  """Counts `key_value_try_get` calls by the key's kind ("beat", "closed")."""

  def __init__(self) -> None:
    super().__init__()
    self.reads: collections.Counter[str] = collections.Counter()

  def key_value_try_get(self, key):
    self.reads[key.split("/")[-2]] += 1
    return super().key_value_try_get(key)


def _until(fn, what: str):
  deadline = time.monotonic() + 5 * periods.LIVENESS_PERIOD_S
  while (out := fn()) is None:
    assert time.monotonic() < deadline, what
    time.sleep(0.05)
  return out


def test_a_close_note_is_read_only_when_the_beat_shows_a_new_close():
  store = _CountingReads()
  ex = key_value.KeyValueExchange(store, "it/2", process_index=0, process_count=2)
  live = liveness.Liveness(ex)
  store.key_value_set(key_value.beat_key(1), "7/0", True)
  assert live.closed(1) is None and store.reads == {"beat": 1}  # No close: no note read.
  note = '["it/2", "process 1 closed its iterator at batch 3"]'
  store.key_value_set(key_value.closed_key("it", 1), note)
  store.key_value_set(key_value.beat_key(1), "8/1 other/1", True)  # Its beat shows the close.
  assert _until(lambda: live.closed(1), "the close was not found") == note
  assert store.reads["closed"] == 1
  time.sleep(1.5 * periods.LIVENESS_PERIOD_S)
  assert live.closed(1) == note and store.reads["closed"] == 1  # The beat read again, not the note.


def test_a_close_note_is_read_once_a_beat_period_while_the_peer_has_no_beat():
  # A peer that closed and exited deleted its beat: its note is still found.
  store = _CountingReads()
  ex = key_value.KeyValueExchange(store, "it/1", process_index=0, process_count=2)
  live = liveness.Liveness(ex)
  assert live.closed(1) is None and store.reads == {"beat": 1, "closed": 1}
  assert live.closed(1) is None and store.reads["closed"] == 1  # Not again within a period.
  note = '["it/1", "process 1 closed its iterator at batch 0"]'
  store.key_value_set(key_value.closed_key("it", 1), note)
  assert _until(lambda: live.closed(1), "the close was not found") == note
  assert store.reads["closed"] == 2


class _HeldReads:
  """Beats read through a store that process 0 holds: a read during its freeze returns after it."""

  def __init__(self, clock: list[float]) -> None:
    self.clock = clock
    self.beat = "1/0"
    self.hold_s = 0.0

  def beat_of(self, process: int) -> str:
    self.clock[0] += self.hold_s
    self.hold_s = 0.0
    return self.beat


def test_a_beat_read_that_the_store_held_up_does_not_count_as_silence():
  # Process 0 frozen 12 s (SIGSTOP, a swap storm) freezes the store with it: a follower's read
  # returns when it resumes, with the beat from before. Before, that read made the follower
  # name process 0 lost while it was alive again, and process 0 went on yielding batches
  # that the follower never got, then raised another error.
  clock = [0.0]
  ex = _HeldReads(clock)
  live = liveness.Liveness(ex, dead_after_s=8.0, clock=lambda: clock[0])
  assert not live.dead(0)
  clock[0] = 1.0
  ex.hold_s = 12.0
  assert not live.dead(0)  # Read from 1 s to 13 s: the beat is still "1/0".
  clock[0] = 14.0
  ex.beat = "2/0"  # Process 0 beats again.
  assert not live.dead(0)
  # A beat that then stops is dead after `dead_after_s` of quick reads, not before.
  verdicts = []
  for t in range(15, 25):
    clock[0] = float(t)
    verdicts.append((t, live.dead(0)))
  assert [t for t, dead in verdicts if dead] == [22, 23, 24], verdicts


def test_a_dead_peer_is_still_named_through_a_store_that_holds_every_read_up():
  clock = [0.0]
  ex = _HeldReads(clock)
  live = liveness.Liveness(ex, dead_after_s=8.0, clock=lambda: clock[0])
  named_at = None
  while named_at is None and clock[0] < 60.0:
    clock[0] += 1.0
    ex.hold_s = 1.5  # A loaded coordinator: every read takes 1.5 s; the beat never changes.
    if live.dead(1):
      named_at = clock[0]
  assert named_at is not None and 8.0 <= named_at <= 30.0, named_at
