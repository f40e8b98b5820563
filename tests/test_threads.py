"""Calls from other threads and from signal handlers: next, get_state, set_state, close.

Two consumer threads, a checkpoint or monitoring thread beside the consumer,
`close()` from another thread, from inside `close()` or `next()`, and from a
signal handler at chosen and at random moments.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import wait_for_no_threads

import grain_jax_sync as gjs


def _take_all_from_two_threads(it):
  """Two threads share one iterator from its first `next()`; their batches' first rows."""
  got = [[], []]
  errors = []
  start = threading.Barrier(2)

  def worker(k):
    start.wait()
    try:
      for b in it:
        got[k].append(int(np.asarray(b["x"])[0]))
    except Exception as e:  # noqa: BLE001 - returned to the test.
      errors.append(repr(e))

  threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  return got, errors


@pytest.mark.parametrize("prefetch", [0, 2])
def test_two_threads_on_one_iterator_get_an_error_at_once_and_lose_no_batch(prefetch):
  # `next()` belongs to one thread at a time: a call while another is in
  # progress raises at once (no queue), and takes nothing from the stream.
  data = (({"x": np.full(8, b, np.int32)}) for b in range(2000))
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch)
  got, errors = _take_all_from_two_threads(it)
  rest = [int(np.asarray(b["x"])[0]) for b in it]  # What a thread that gave up left.
  it.close()
  assert all("next() was called while next() is in progress" in e for e in errors), errors
  assert sorted(got[0] + got[1] + rest) == list(range(2000))
  assert got[0] == sorted(got[0]) and got[1] == sorted(got[1])


def test_close_from_another_thread_during_a_generator_read_closes_the_generator():
  finalized, slow_read = threading.Event(), threading.Event()

  def source():
    try:
      for b in range(100):
        if b == 3:
          slow_read.set()
          time.sleep(2.0)
        yield {"x": np.full(8, b, np.int32)}
    finally:
      finalized.set()

  it = gjs.iter_jax_batches(source(), batch_size=8)
  got, ended = [], []

  def consume():
    try:
      for b in it:
        got.append(int(np.asarray(b["x"])[0]))
    except Exception as e:  # noqa: BLE001 - returned to the test.
      ended.append(repr(e))
    else:
      ended.append("StopIteration")

  t = threading.Thread(target=consume)
  t.start()
  assert slow_read.wait(30)
  deadline = time.monotonic() + 1.5
  while len(got) < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
  # The consumer is inside the slow read of batch 3 (or waits for it).
  it.close()  # Raised "generator already executing" and left the generator open.
  t.join(10)
  assert ended == ["StopIteration"] and got == [0, 1, 2]
  assert finalized.is_set()
  it.close()  # Idempotent.


@contextlib.contextmanager
def _switching_often():
  """A short switch interval, so that threads interleave often (races show)."""
  interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)
  try:
    yield
  finally:
    sys.setswitchinterval(interval)


def _drain_beside(it, probe):
  """Drains `it` while another thread calls `probe()` again and again; the batch count."""
  done = threading.Event()

  def watch():
    while not done.is_set():
      probe()

  with _switching_often():
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
      return sum(1 for _ in it)
    finally:
      done.set()
      watcher.join(30)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_get_state_from_another_thread_pairs_the_count_with_its_own_source_state(prefetch):
  # A checkpoint or monitoring thread: the batch count and the source state
  # come from the same batch (it read the count of one batch and the state of
  # a later one). A short switch interval makes the threads interleave often.
  data = [{"x": np.full(8, i, np.int32)} for i in range(2000)]
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch)
  torn, seen = [], []

  def probe():
    state = it.get_state()
    seen.append(state["batches"])
    if state["source"]["index"] != state["batches"]:
      torn.append((state["batches"], state["source"]))

  assert _drain_beside(it, probe) == 2000
  assert torn == [] and len(seen) > 10 and seen == sorted(seen)
  it.close()


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("how", ["set_state", "reset"])
def test_set_state_or_reset_from_another_thread_between_calls_restarts_exactly(prefetch, how):
  # Called while the consumer iterates: it raises at once while a next() is
  # in progress (the caller retries), and once it lands between two calls
  # the rows go on from the restored batch with a count that matches the source.
  data = [{"x": np.full(8, i, np.int32)} for i in range(400)]
  with _switching_often():
    for _ in range(10):
      it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch)
      got: list[int] = []
      t = None
      done = None  # Batches received when the restore was seen done.
      while True:  # Both threads retry a call that met the other's.
        b = _until_between_calls(functools.partial(next, it))
        got.append(int(np.asarray(b["x"])[0]))
        if len(got) == 100:
          saved = it.get_state()
        if len(got) == 120:
          restore = functools.partial(it.set_state, saved) if how == "set_state" else it.reset
          t = threading.Thread(target=_until_between_calls, args=(restore,))
          t.start()
        if done is not None and len(got) > done and len(got) >= 130:
          break  # A batch received after the restore returned.
        if t is not None and done is None and not t.is_alive():
          done = len(got)
      assert t is not None
      t.join(30)
      first = 100 if how == "set_state" else 0
      # 0, 1, ... up to where the restore landed, then `first`, `first` + 1, ...
      cut = next(i for i in range(1, len(got)) if got[i] != got[i - 1] + 1)
      assert cut >= 120 and got[:cut] == list(range(cut)), got
      assert got[cut:] == list(range(first, first + len(got) - cut)), got[cut - 3 :]
      state = it.get_state()
      assert state["batches"] == first + len(got) - cut
      assert state["source"] == {"index": state["batches"]}
      it.close()


def _until_between_calls(call):
  """Calls `call` until it lands between two `next()` calls of the consumer."""
  while True:
    try:
      return call()
    except RuntimeError as e:
      assert "is in progress in another thread" in str(e), e
      time.sleep(0)


def test_stats_from_another_thread_are_one_batchs_counts():
  data = [{"x": np.full(8, i, np.int32)} for i in range(3000)]
  it = gjs.iter_jax_batches(data, batch_size=8)
  torn = []

  def probe():
    stats = it.stats()
    if stats["real_rows"] != 8 * stats["batches"]:
      torn.append(stats)

  assert _drain_beside(it, probe) == 3000
  assert torn == []
  it.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_from_inside_close_returns_at_once(prefetch):
  # A SIGTERM handler that calls close() while the main thread is already in
  # close() (here: the generator's own cleanup, which close() runs) waited
  # 30 s for the close it interrupted, a preemption's whole grace period.
  box = {}

  def source():
    try:
      yield from ({"x": np.full(8, i, np.int32)} for i in range(100))
    finally:
      start = time.monotonic()
      box["it"].close()
      box["inner_s"] = time.monotonic() - start

  it = box["it"] = gjs.iter_jax_batches(source(), batch_size=8, prefetch_batches=prefetch)
  next(it)
  start = time.monotonic()
  it.close()
  assert time.monotonic() - start < 5.0 and box["inner_s"] < 5.0, box


_SIGNAL_CLOSE = """
import random, signal, sys, threading
import grain
import numpy as np
import grain_jax_sync as gjs
sys.setswitchinterval(1e-6)
main = threading.main_thread().ident
data = [{"x": np.full(8, i, np.int32)} for i in range(2000)]
ends = []
for trial in range(int(sys.argv[1])):
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=int(sys.argv[2]))
  signal.signal(signal.SIGUSR1, lambda *_: it.close())
  delay = random.uniform(0.001, 0.05)
  threading.Timer(delay, lambda: signal.pthread_kill(main, signal.SIGUSR1)).start()
  n = 0
  try:
    for b in it:
      assert int(np.asarray(b["x"])[0]) == n
      n += 1
    ends.append("stop")
  except RuntimeError as e:
    assert "the iterator is closed" in str(e), e
    ends.append("closed")
  assert not [t for t in threading.enumerate() if t.name.startswith("grain_jax_sync")]
print(len(ends), sorted(set(ends)))
"""


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_from_a_signal_handler_at_random_moments_never_hangs(prefetch):
  # Each trial closes from a SIGUSR1 handler at a random point of the loop:
  # inside `next()` (that call ends with StopIteration) or between calls (the
  # next call raises "closed"); the rows before it are right, no thread stays.
  out = subprocess.run(
    [sys.executable, "-c", _SIGNAL_CLOSE, "40", str(prefetch)],
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split()[0] == "40", out.stdout


@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_from_inside_the_consumers_own_next_returns_at_once(prefetch):
  # As a signal handler (SIGTERM: shut down cleanly) that runs while the
  # main thread is inside next(): close() waited 30 s for the lock that this
  # very thread held, or raised "generator already executing".
  finalized = threading.Event()
  box = {}

  def source():
    try:
      for b in range(20):
        if b == 3:
          start = time.monotonic()
          box["it"].close()
          box["close_s"] = time.monotonic() - start
        yield {"x": np.full(8, b, np.int32)}
    finally:
      finalized.set()

  it = box["it"] = gjs.iter_jax_batches(source(), batch_size=8, prefetch_batches=prefetch)
  got = []
  try:
    for b in it:  # The call in which close() ran ends the loop (StopIteration).
      got.append(int(np.asarray(b["x"])[0]))
  except RuntimeError as e:
    # With prefetch the source runs in the build thread: its close() may
    # land between two calls, and the next call finds the iterator closed.
    assert prefetch and str(e) == "the iterator is closed", e
  if prefetch:  # The close runs beside the source's thread, which returns from it.
    assert finalized.wait(10) and wait_for_no_threads() == []
  assert box["close_s"] < 1.0
  # No batch after close(), not even the one in flight. With prefetch the
  # source runs in the build thread, ahead of the consumer: the batches it
  # read before close() and the consumer had not received are dropped.
  if prefetch == 0:
    assert got == [0, 1, 2]
  else:
    assert got == list(range(len(got))) and len(got) <= 3, got
  with pytest.raises(RuntimeError, match="the iterator is closed"):
    next(it)
  assert finalized.is_set()
  assert [t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync")] == []


_PACKAGE = gjs.__file__.rsplit("/", 1)[0]


def _call_closing_at(it, call, at, *, repeat):
  """`call(it)`, calling `it.close()` before line `at` of the library that it runs (and,
  with `repeat`, before every later line), as a signal handler would: in this thread,
  between two lines. Returns what the call returned or raised, and the lines it ran."""
  lines = [0]

  def on_line(frame, event, arg):
    if event == "line":
      lines[0] += 1
      if lines[0] == at or (repeat and lines[0] > at):
        it.close()  # Tracing is off while a tracer runs, as a handler's code runs.
    return on_line

  old = sys.gettrace()
  sys.settrace(lambda frame, *_: on_line if frame.f_code.co_filename.startswith(_PACKAGE) else None)
  try:
    return call(it), lines[0]
  except (StopIteration, RuntimeError) as e:
    return e, lines[0]
  finally:
    sys.settrace(old)


_CALLS = {
  # What each returns when the close lands after its turn's last look.
  "next": (next, lambda got: int(np.asarray(got["x"])[0]) == 2),
  "set_state": (lambda it: it.set_state(_state_at_1()), lambda got: got is None),
  "reset": (lambda it: it.reset(), lambda got: got is None),
}


def _closed_at(prefetch, call, at, repeat):
  """What went wrong when a handler's close landed before line `at` of `call` (after two
  batches); None if that call ran fewer lines."""
  it = gjs.iter_jax_batches(_BATCHES, batch_size=8, prefetch_batches=prefetch)
  assert [int(np.asarray(next(it)["x"])[0]) for _ in range(2)] == [0, 1]
  start = time.monotonic()
  fn, returned = _CALLS[call]
  got, lines = _call_closing_at(it, fn, at, repeat=repeat)
  took = time.monotonic() - start
  if lines < at:
    it.close()
    return None
  if isinstance(got, RuntimeError):  # It landed before the turn began.
    assert str(got) == "the iterator is closed", got
  elif not isinstance(got, StopIteration):  # Inside `next()`, it ends the iteration.
    assert returned(got), got  # Or it landed after the turn's last look.
  wrong = [f"{call} took {took:.1f} s"] if took > 5.0 else []
  left = [t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync")]
  if left:
    wrong.append(f"threads left: {left}")
  got, _ = _call_closing_at(it, next, 0, repeat=False)
  if not isinstance(got, RuntimeError) or str(got) != "the iterator is closed":
    wrong.append(f"next() after close() gave {got!r}")
  return wrong


_BATCHES = [{"x": np.full(8, i, np.int32)} for i in range(50)]


@functools.cache
def _state_at_1():
  it = gjs.iter_jax_batches(_BATCHES, batch_size=8)
  next(it)
  state = it.get_state()
  it.close()
  return state


@pytest.mark.parametrize("repeat", [False, True], ids=["once", "at-every-later-line"])
@pytest.mark.parametrize("call", sorted(_CALLS))
@pytest.mark.parametrize("prefetch", [0, 2])
def test_close_from_a_signal_handler_before_any_line_of_a_call_is_carried_out(
  prefetch, call, repeat
):
  # A handler that landed after the call's last look at the close request
  # (at the end of its start or of its end) only asked, as it was
  # still inside the call, and nobody closed: the stages ran on (CI saw a
  # build thread left). A second handler during the close that the turn
  # carried out waited 30 s for itself, or took a lock its thread held.
  _state_at_1()  # Made before the calls are traced.
  wrong, at = {}, 1
  while (w := _closed_at(prefetch, call, at, repeat)) is not None:
    if w:
      wrong[at] = w
    at += 1
  assert at > 30, at  # The whole call: with prefetch, `next()` takes a built batch.
  assert wrong == {}, wrong
