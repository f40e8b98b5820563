"""The iterator's lifetime: turns, the one close path, finalizers, and random schedules.

`lifetime.Lifetime` is the state machine and `session.Streams` ends each
stream; these tests drive them through the public API (and, for a signal
handler's view, its turn), in one process and, where an ending must reach a
peer, in two real processes.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import grain
import numpy as np
import pytest
import scenarios
import scenarios_faults
from helpers import check_cases, run_cases, wait_for_no_threads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import grain_jax_sync as gjs

TIMEOUT = 180


def rows(n: int) -> list[dict[str, np.ndarray]]:
  return [{"x": np.full(8, i, np.int32)} for i in range(n)]


def first(batch) -> int:
  return int(np.asarray(batch["x"])[0])


# -- lifetime ------------------------------------------------------------------------


def test_close_and_context_manager_leave_no_thread():
  before = set(threading.enumerate())
  with gjs.iter_jax_batches(
    scenarios.make_batches(0, [8] * 10), batch_size=8, prefetch_batches=2
  ) as it:
    next(it)
  assert set(threading.enumerate()) - before == set()
  with pytest.raises(RuntimeError, match="closed"):
    next(it)


@pytest.mark.parametrize("call", ["next", "reset", "set_state", "local_set_state"])
def test_every_call_that_moves_a_closed_iterator_raises_closed(call):
  ds = grain.MapDataset.range(32).map(lambda i: {"x": np.int32(i)}).batch(8)
  it = gjs.iter_jax_batches(ds.to_iter_dataset(), batch_size=8)
  next(it)
  state, local = it.get_state(), it.local_iterator.get_state()
  it.close()
  moves = {
    "next": lambda: next(it),
    "reset": it.reset,
    "set_state": lambda: it.set_state(state),
    "local_set_state": lambda: it.local_iterator.set_state(local),
  }
  with pytest.raises(RuntimeError, match="the iterator is closed"):
    moves[call]()
  assert it.get_state() == state  # Still the state after the last batch received.


@pytest.mark.parametrize("how", ["close", "drop"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_iterator_let_go_frees_its_source_without_the_cycle_collector(how, prefetch):
  # A source (a tf.data iterator with its buffers, a Grain iterator with its
  # workers' semaphores and shared memory) goes with the last reference to
  # the iterator, not at some later collection of cycles.
  source = (row for row in rows(40))  # A generator: weakly referenceable.
  it = gjs.iter_jax_batches(source, batch_size=8, prefetch_batches=prefetch)
  assert [first(next(it)) for _ in range(3)] == [0, 1, 2]
  alive = weakref.ref(source)
  gc.disable()
  try:
    if how == "close":
      it.close()
    del it, source
    assert wait_for_no_threads(15.0) == []  # A build thread may still be finishing its batch.
    assert alive() is None
  finally:
    gc.enable()


# -- defects found by running the library as users do -----------------------------


class _NextOnly:  # MaxText-style: `__next__` and state, no `__iter__`.
  def __init__(self):
    self.i = 0

  def __next__(self):
    if self.i == 5:
      raise StopIteration
    self.i += 1
    return {"x": np.full(8, self.i - 1, np.int32)}


class _NextOnlyWithState(_NextOnly):
  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]


class _IterNone(_NextOnlyWithState):
  __iter__ = None  # Python's marker for "not iterable"; `next()` takes it.


class _IterNoneNoState(_NextOnly):
  __iter__ = None


@pytest.mark.parametrize("kind", [_NextOnlyWithState, _IterNone])
def test_a_source_with_only_next_is_read_and_reset_restores_its_start(kind):
  with gjs.iter_jax_batches(kind(), batch_size=8) as it:
    got = [first(b) for b in it]
    state = it.get_state()
    it.reset()  # Was an empty stream: the same object reopened where it stood.
    again = [first(b) for b in it]
  assert got == again == [0, 1, 2, 3, 4]
  assert state["source"] == {"i": 5} and state["batches"] == 5


@pytest.mark.parametrize("kind", [_NextOnly, _IterNoneNoState])
def test_a_source_with_only_next_and_no_state_refuses_reset(kind):
  with gjs.iter_jax_batches(kind(), batch_size=8) as it:
    assert [first(b) for b in it] == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match=r"`reset\(\)` cannot restart an iterator of type"):
      it.reset()


def test_a_device_put_state_before_the_first_batch_restores_single_process():
  import grain

  ds = grain.MapDataset.range(40).batch(8).map(lambda x: {"x": x})
  synced = gjs.device_put(ds, batch_size=8, paddings=0, mask_key="mask")
  it = iter(synced)
  state = it.get_state()
  assert state["batches"] == 0 and isinstance(state["settings"], dict)
  want = [np.asarray(next(it)["x"]).tolist() for _ in range(2)]
  it.close()
  it = iter(synced)
  it.set_state(state)
  assert [np.asarray(next(it)["x"]).tolist() for _ in range(2)] == want
  it.close()


def state_before_the_first_batch_of_device_put() -> dict[str, Any]:
  """A step-0 checkpoint of `device_put` restores on every host."""
  import jax

  p = jax.process_index()
  ds = grain.MapDataset.range(100 * p, 100 * p + 48).batch(8).map(lambda x: {"x": x})
  synced = gjs.device_put(ds, batch_size=8, paddings=0, mask_key="mask")
  it = iter(synced)
  state = it.get_state()
  rows = lambda b: np.asarray(scenarios.gather(b["x"])).reshape(-1)[::8].tolist()  # noqa: E731
  first = [rows(next(it)) for _ in range(2)]
  it.close()
  it2 = iter(synced)
  it2.set_state(state)
  again = [rows(next(it2)) for _ in range(2)]
  it2.close()
  return {"first": first, "again": again, "state": state}


def check_a_device_put_state_before_the_first_batch_restores_two_processes(outs):
  for o in outs:
    assert o["state"]["batches"] == 0
    assert o["first"] == o["again"] == [[0, 100], [8, 108]]


def test_no_traceback_at_interpreter_exit_from_grain_closing_an_open_iterator():
  code = (
    "import grain, numpy as np, grain_jax_sync as gjs\n"
    "ds = grain.MapDataset.range(64).batch(8).map(lambda x: {'x': x})\n"
    "it = iter(gjs.device_put(ds, batch_size=8))\n"
    "next(it); next(it)\n"
    "print('ok')\n"  # Left open: Grain's `__del__` closes it at exit.
  )
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=False
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "ok"
  assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def host_batches(n: int, p: int) -> list[dict[str, np.ndarray]]:
  """Host `p`'s `n` batches of 8 rows: batch i holds 100 * p + i."""
  return [{"x": np.full((8,), 100 * p + i, np.int32)} for i in range(n)]


def created_in_another_order() -> dict[str, Any]:
  """Host 0 makes `a` (batch_size 8) then `b` (4); host 1 makes `b` then `a`."""
  import jax

  p = jax.process_index()
  data = host_batches(4, p)
  make_a = lambda: gjs.iter_jax_batches(data, batch_size=8)  # noqa: E731
  make_b = lambda: gjs.iter_jax_batches([{"x": d["x"][:4]} for d in data], batch_size=4)  # noqa: E731
  if p == 0:
    a, b = make_a(), make_b()
  else:
    b, a = make_b(), make_a()
  mine = a if p == 0 else b  # Each host's first iterator: paired by creation order.
  try:
    next(mine)
    error = None
  except ValueError as e:
    error = str(e)
  a.close()
  b.close()
  return {"error": error}


def check_iterators_created_in_another_order_name_creation_order_on_every_host(outs):
  for o in outs:
    assert o["error"] is not None
    assert "created their iterators in a different order" in o["error"], o["error"]
    assert "`name=`" in o["error"]
  assert outs[0]["error"] == outs[1]["error"]


def dropped_in_a_cycle_collected_in_a_library_thread(prefetch: int) -> dict[str, Any]:
  """Process 1 drops its iterator inside a reference cycle after 3 batches.

  Its source then runs a garbage collection in the library's own thread (the
  agreement, read or build thread), where the iterator's finalizer runs.
  Process 0 must raise "process 1 closed its iterator at batch 3" promptly.
  """
  import jax

  kw = {"batch_size": 8, "prefetch_batches": prefetch, "sync_timeout_s": 60.0}
  if jax.process_index() == 1:
    return _drop_after_3_in_a_cycle(kw)
  return _iterate_until_the_peer_ends(kw)


def _drop_after_3_in_a_cycle(kw: dict[str, Any]) -> dict[str, Any]:
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
  return {"got": got, "threads": wait_for_no_threads(30.0)}


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
  return {"got": got, "error": error, "seconds": seconds, "threads": wait_for_no_threads(10.0)}


def _local_first(batch: Any) -> int:
  """This host's first row (no collective: the peer may have stopped iterating)."""
  return int(np.asarray(batch["x"].addressable_shards[0].data).reshape(-1)[0])


def check_an_iterator_finalized_in_a_library_thread_posts_its_ending(outs):
  # The finalizer ran in the read or agreement thread: it could not join its
  # own thread, or deadlocked joining the build thread that waited on it, and
  # the peer waited `sync_timeout_s` (60 s here) for an ending never posted.
  p0, p1 = outs
  assert p1["got"] == [100, 101, 102]
  assert p0["error"] == "RuntimeError: process 1 closed its iterator at batch 3", p0["error"]
  # The positions decided before the close (process 1's read-ahead) come first.
  assert p0["got"] == list(range(len(p0["got"]))) and 3 <= len(p0["got"]) < 20, p0["got"]
  assert p0["seconds"] < 30, p0["seconds"]
  assert p0["threads"] == p1["threads"] == []


def _allocating_batches(reader: str) -> Any:
  """Process 1's batches 100 + i; each read makes garbage, so the collector runs on its own.

  `reader`: "library" reads them in the library's agreement thread (a
  generator); "own_thread" in the source's own thread, which the agreement
  thread waits on through a queue (as a Grain or tf.data pipeline's threads).
  """

  def batches():
    for i in range(200):
      time.sleep(0.02)
      garbage = [[j] for j in range(20_000)]  # Container objects: the collector counts them.
      del garbage
      yield {"x": np.full((8,), 100 + i, np.int32)}

  if reader == "library":
    return batches()
  ready: queue.Queue[Any] = queue.Queue(maxsize=1)

  def fill():
    for b in batches():
      ready.put(b)
    ready.put(None)

  threading.Thread(target=fill, daemon=True, name="source-reader").start()
  return iter(ready.get, None)


def left_in_a_cycle_while_the_collector_runs_on_its_own(reader: str) -> dict[str, Any]:
  """Process 1 breaks out of its loop after 3 batches, its iterator left in a cycle."""
  import jax

  kw = {"batch_size": 8, "sync_timeout_s": 60.0}  # Defaults otherwise: prefetch 2.
  if jax.process_index() == 0:
    return _iterate_until_the_peer_ends(kw)
  got = []
  it = gjs.iter_jax_batches(_allocating_batches(reader), **kw)
  for batch in it:
    got.append(_local_first(batch))
    if len(got) == 3:
      break
  cycle: list[Any] = [it]
  cycle.append(cycle)
  del it, cycle, batch
  return {"got": got, "threads": wait_for_no_threads(70.0)}


def check_an_iterator_left_in_a_cycle_is_reported_closed_wherever_the_collector_runs(outs):
  # No gc.collect(): the source's garbage makes the collector run where it
  # allocates. In the source's own thread, the close ran there and joined the
  # agreement thread that waited on that very thread: after 30 s it gave up
  # without posting, and the peer waited `sync_timeout_s` (60 s).
  p0, p1 = outs
  assert p1["got"] == [100, 101, 102]
  assert p0["error"] == "RuntimeError: process 1 closed its iterator at batch 3", p0["error"]
  assert p0["seconds"] < 10, p0["seconds"]
  assert p0["threads"] == p1["threads"] == []


def test_close_in_a_finalizer_inside_the_build_thread_hands_the_close_over():
  # A garbage collection inside the build thread (a Python-heavy source) runs
  # the finalizer of an iterator in a cycle: its close must not join the
  # thread it runs in.
  dropped = threading.Event()

  def source():
    for i in range(10_000):
      if dropped.is_set():
        gc.collect()
      yield {"x": np.full(8, i, np.int32)}

  it = gjs.iter_jax_batches(source(), batch_size=8, prefetch_batches=2)
  assert [first(next(it)) for _ in range(3)] == [0, 1, 2]
  cycle = [it]
  cycle.append(cycle)
  alive = weakref.ref(it)
  del it, cycle
  dropped.set()
  _collect(alive)
  assert wait_for_no_threads(15.0) == []


def test_close_from_a_real_signal_handler_while_next_waits():
  # A SIGALRM handler calls close() while the main thread waits in next()
  # for a slow source's batch: that next() ends at once, nothing is left.
  def slow():
    for i in range(100):
      time.sleep(0.3 if i >= 2 else 0)
      yield {"x": np.full(8, i, np.int32)}

  it = gjs.iter_jax_batches(slow(), batch_size=8, prefetch_batches=2)
  assert [first(next(it)) for _ in range(2)] == [0, 1]
  old = signal.signal(signal.SIGALRM, lambda *_: it.close())
  try:
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    t0 = time.monotonic()
    with pytest.raises(StopIteration):
      next(it)
    assert time.monotonic() - t0 < 5
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)
  assert wait_for_no_threads() == []
  with pytest.raises(RuntimeError, match="the iterator is closed"):
    next(it)


def test_close_from_another_thread_ends_a_waiting_next_while_the_source_is_stuck():
  # One process, prefetch: the build thread is inside the source's read when
  # a watchdog closes. The waiting next() ends at once; close() itself waits
  # for the read (it may not close a source that is being read), then returns.
  release, reading = threading.Event(), threading.Event()

  def stuck():
    for i in range(10):
      if i == 2:
        reading.set()
        release.wait(60)
      yield {"x": np.full(8, i, np.int32)}

  it = gjs.iter_jax_batches(stuck(), batch_size=8, prefetch_batches=2)
  assert [first(next(it)) for _ in range(2)] == [0, 1]
  assert reading.wait(30)
  closer = threading.Thread(target=it.close)
  threading.Timer(0.2, closer.start).start()
  try:
    t0 = time.monotonic()
    # StopIteration; "closed" only where a loaded machine let the close take the turn first.
    with pytest.raises((StopIteration, RuntimeError)) as ended:
      next(it)
    waited = time.monotonic() - t0
    assert ended.type is StopIteration or "the iterator is closed" in str(ended.value)
    assert closer.is_alive()  # Still joining the read: the consumer did not wait for it.
    assert waited < 10
  finally:
    release.set()
    closer.join(60)
  assert not closer.is_alive()
  assert wait_for_no_threads() == []
  with pytest.raises(RuntimeError, match="the iterator is closed"):
    next(it)


# -- random schedules -----------------------------------------------------------------


def _collect(alive, deadline_s=10.0):
  """Collects until `alive` is gone: a collection already running in another thread
  (the source's) makes `gc.collect()` return at once."""
  end = time.monotonic() + deadline_s
  while alive() is not None and time.monotonic() < end:
    gc.collect()
    time.sleep(0.01)
  assert alive() is None


def _from_another_thread(it):
  box = {}
  t = threading.Thread(target=lambda: box.update(s=it.get_state(), c=it.stats()))
  t.start()
  t.join(30)
  assert not t.is_alive(), "get_state()/stats() from another thread hung"
  return box["s"], box["c"]


OPS = st.lists(
  st.sampled_from(
    [
      "next",
      "next",
      "next",
      "state",
      "stats",
      "restore",
      "reset",
      "close_thread",
      "close_signal",
      "stop",
    ]
  ),
  min_size=1,
  max_size=14,
)


class _Schedule:
  """One random schedule's model: the next source index, batches received, states saved."""

  def __init__(self, it, n):
    self.it = it
    self.n = n
    self.expected = 0  # The source index of the next batch.
    self.received = 0
    self.saved = []  # (state, the next index after it)
    self.closed = False
    self.stop_at = None  # Batches received when `request_stop()` was called.

  def apply(self, op):
    """Runs `op` on the iterator and checks what it did against the model."""
    if op == "next":
      self.next()
    elif op in ("state", "stats"):
      self.checkpoint()
    elif op == "restore" and self.saved and not self.closed:
      state, at = self.saved[-1]
      self.it.set_state(state)
      self.expected, self.stop_at = at, None  # A new stream, no stop asked in it.
    elif op == "reset" and not self.closed:
      self.it.reset()
      self.expected, self.stop_at = 0, None
    elif op == "stop":
      self.it.request_stop()  # Ends the stream a few batches on (nothing after its end).
      if self.stop_at is None:
        self.stop_at = self.received
    elif op == "close_thread":
      t = threading.Thread(target=self.it.close)
      t.start()
      t.join(60)
      assert not t.is_alive(), "close() from another thread hung"
      self.closed = True
    elif op == "close_signal":
      self.close_from_a_signal_handler()

  def close_from_a_signal_handler(self):
    """`close()` from a SIGALRM handler, timed to land inside a `next()` (or just after it)."""
    fired = threading.Event()

    def handler(*_):
      self.it.close()
      fired.set()

    old = signal.signal(signal.SIGALRM, handler)
    try:
      signal.setitimer(signal.ITIMER_REAL, 0.0005)
      self.next(closing=True)
      deadline = time.monotonic() + 30
      while not fired.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)  # The handler runs in this thread, between bytecodes.
      assert fired.is_set(), "the signal handler's close() did not return"
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, old)
    self.closed = True

  def next(self, *, closing=False):
    """`next()`: the expected batch, the end, or the closed error once closed.

    `closing`: a signal handler's close may land in this call; then it ends
    the iteration, or a batch received before the close is counted.
    """
    try:
      b = next(self.it)
    except StopIteration:
      assert self.expected == self.n or self.closed or closing or self.stop_at is not None
      if self.stop_at is not None and not self.closed and not closing:
        # Stopped by the request, or at the natural end that came first.
        assert self.it.stop_requested_by == (None if self.expected == self.n else 0)
      return
    except RuntimeError as e:
      assert (self.closed or closing) and str(e) == "the iterator is closed"
      return
    assert not self.closed
    assert first(b) == self.expected
    # One process: decided at most the queued and the one in hand ahead of a stop.
    assert self.stop_at is None or self.received - self.stop_at < 2 + 2 + 1
    self.expected += 1
    self.received += 1

  def checkpoint(self):
    """`get_state()`/`stats()` from a checkpoint thread: the source's position, each batch once."""
    state, counts = _from_another_thread(self.it)
    assert state["source"] == {"index": self.expected}
    assert counts["batches"] == self.received
    self.saved.append((state, self.expected))


def _drop_in_a_cycle(n, prefetch):
  """Drops a started iterator in a cycle while a garbage collection runs in the build thread."""

  def source():
    for i in range(n):
      if i % 7 == 3:
        gc.collect()
      yield {"x": np.full(8, i, np.int32)}

  other = gjs.iter_jax_batches(source(), batch_size=8, prefetch_batches=prefetch)
  next(other)
  cycle = [other]
  cycle.append(cycle)
  alive = weakref.ref(other)
  del other, cycle
  _collect(alive)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, prefetch=st.sampled_from([0, 2]), gc_in_thread=st.booleans())
def test_random_schedules_count_every_batch_once_and_resume_exactly(ops, prefetch, gc_in_thread):
  # `next()`, `get_state()`/`stats()` from a checkpoint thread, `set_state()`,
  # `reset()`, and `close()` from another thread or from a signal handler
  # that interrupts `next()`, in a random order: no hang,
  # every received batch is counted once, every state resumes exactly, and
  # no thread is left. Some schedules also drop the iterator in a cycle while
  # a garbage collection runs in the build thread.
  n = 30
  it = gjs.iter_jax_batches(rows(n), batch_size=8, prefetch_batches=prefetch)
  schedule = _Schedule(it, n)
  for op in ops:
    schedule.apply(op)
  assert it.stats()["batches"] == schedule.received
  if gc_in_thread and not schedule.closed:
    _drop_in_a_cycle(n, prefetch)
  it.close()
  assert wait_for_no_threads(15.0) == []
  for state, at in schedule.saved:  # Every state resumes exactly, in a fresh iterator.
    with gjs.iter_jax_batches(rows(n), batch_size=8, prefetch_batches=prefetch) as fresh:
      fresh.set_state(state)
      assert [first(b) for b in fresh] == list(range(at, n))


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
      state, counts = _from_another_thread(self.it)
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
    "keys": scenarios_faults.keys_left(f"schedule-{seed}"),
    "seed": seed,
    "got": host.got,
    "counted": counted,
    "saved": [(st["batches"], st["source"], e, c) for st, e, c in host.saved],
    "ending": host.ending,
    "closer": closer,
    "threads": wait_for_no_threads(10.0),
  }


def random_schedules(seeds: list[int], prefetch: int) -> list[dict[str, Any]]:
  """The same random schedule on every host, per seed; one host may close from a thread.

  Ops: `next()`, `get_state()`/`stats()` from a checkpoint thread, `set_state()`
  of a saved state, `reset()`, and `close()` from another thread on one host
  (the other host must then end with "process h closed its iterator").
  """
  import jax

  return [_one_schedule(seed, prefetch, jax.process_index()) for seed in seeds]


def check_random_schedules_on_two_processes_end_the_same_way(outs):
  # The same random schedule on both hosts (next, get_state/stats from a
  # checkpoint thread, set_state, reset), with a close from another thread
  # on one host at a random point: no hang, every batch counted once, every
  # state the source's position, the peer ends naming the closer, and no
  # thread is left.
  for p, per_host in enumerate(outs):
    for o in per_host:
      assert o["threads"] == [], o
      for value, expected in o["got"]:
        assert value == expected, o
      assert o["counted"] == len(o["got"]), o
      for _, source, expected, counted in o["saved"]:
        assert source == {"index": expected}, o
        assert counted <= len(o["got"])
      closer = o["closer"]
      assert o["keys"] == [], o  # Nothing left in the store once every host closed.
      if closer == p:
        assert o["ending"] == "closed here"
      elif closer is not None and o["ending"] != "stop":
        assert o["ending"].startswith(f"process {closer} closed its iterator at batch"), o
  for a, b in zip(outs[0], outs[1], strict=True):
    if a["closer"] is None:  # Neither closed: the same batches on both hosts.
      assert [v for v, _ in a["got"]] == [v for v, _ in b["got"]]


def first_next_in_another_order(prefetch: int) -> dict[str, Any]:
  """Both hosts make `a` then `b`; host 0 first calls next(a), host 1 next(b)."""
  import jax

  p = jax.process_index()
  kw = {"batch_size": 8, "prefetch_batches": prefetch, "sync_timeout_s": 8.0}
  a = gjs.iter_jax_batches(host_batches(4, p), **kw)
  b = gjs.iter_jax_batches(host_batches(4, p), **kw)
  return _first_next_ending(a if p == 0 else b, a, b)


def _first_next_ending(first: Any, a: Any, b: Any) -> dict[str, Any]:
  """The error (or None) of `next(first)` and how long it took; then closes `a` and `b`."""
  t0 = time.monotonic()
  try:
    next(first)
    error = None
  except Exception as e:  # noqa: BLE001 - the ending under test.
    error = f"{type(e).__name__}: {e}"
  seconds = time.monotonic() - t0
  a.close()
  b.close()
  return {"error": error, "seconds": seconds}


def check_first_next_in_another_order_ends_every_host_with_one_error(outs):
  # Each host waited in a stream the other never started: after
  # `sync_timeout_s` process 0 raised PeerTimeoutError (whose hint did not
  # fit) and process 1 another error. Now both name the cause, at half
  # `sync_timeout_s` (8 s here), well before a timeout.
  p0, p1 = outs
  assert p0["error"] == p1["error"], (p0, p1)
  assert p0["error"].startswith("RuntimeError: process 0 waits for the first batch of iterator")
  assert "created or started their iterators in a different order" in p0["error"]
  assert "call next() on them in the same order on every process" in p0["error"]
  assert p0["seconds"] < 7.2 and p1["seconds"] < 7.2, (p0, p1)


def created_in_another_order_same_settings(prefetch: int) -> dict[str, Any]:
  """Host 0 makes `a` then `b`, host 1 `b` then `a`, with the same settings; both call next(a).

  Paired by creation order, each host's `a` is the other's `b`, which it has
  not started: each waits at the start of a stream the other never starts.
  """
  import jax

  p = jax.process_index()
  kw = {"batch_size": 8, "prefetch_batches": prefetch, "sync_timeout_s": 8.0}
  make = lambda: gjs.iter_jax_batches(host_batches(4, p), **kw)  # noqa: E731
  if p == 0:
    a, b = make(), make()
  else:
    b, a = make(), make()
  return _first_next_ending(a, a, b)


def check_iterators_created_in_another_order_with_the_same_settings_name_both_causes_and_the_fix(
  outs,
):
  # Host 0 makes `a` then `b`, host 1 `b` then `a`, no `name=`; both call
  # next(a) first. The message named only the order of the next() calls,
  # which was the same on both hosts.
  p0, p1 = outs
  assert p0["error"] == p1["error"], (p0, p1)
  assert p0["error"].startswith(
    "RuntimeError: process 0 waits for the first batch of iterator 'grain_jax_sync/0' and"
    " process 1 for that of iterator 'grain_jax_sync/1', and neither has started the"
    " other's: the processes created or started their iterators in a different order"
  ), p0["error"]
  assert "paired across processes by creation order unless given a `name=`" in p0["error"]
  assert "or pass the same `name=` to the iterators that belong together" in p0["error"]
  # At half `sync_timeout_s` (8 s here), well before a timeout.
  assert 3.2 < p0["seconds"] < 7.2 and 3.2 < p1["seconds"] < 7.2, (p0, p1)


# -- real processes: one launch per group of cases, each case with its own checks ---------


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_creation_and_first_next_orders_and_a_step_0_state_across_two_processes():
  # The same-settings case first: it names the job's first two iterators.
  by_case = run_cases(
    2,
    4,
    {
      "created_in_another_order_same_settings": (created_in_another_order_same_settings, (2,), {}),
      "created_in_another_order": (created_in_another_order, (), {}),
      "first_next_in_another_order_prefetch_0": (first_next_in_another_order, (0,), {}),
      "first_next_in_another_order_prefetch_2": (first_next_in_another_order, (2,), {}),
      "device_put_state_before_the_first_batch": (
        state_before_the_first_batch_of_device_put,
        (),
        {},
      ),
    },
    timeout_s=TIMEOUT,
  )
  first_next = check_first_next_in_another_order_ends_every_host_with_one_error
  check_cases(
    by_case,
    {
      "created_in_another_order_same_settings": (
        check_iterators_created_in_another_order_with_the_same_settings_name_both_causes_and_the_fix
      ),
      "created_in_another_order": (
        check_iterators_created_in_another_order_name_creation_order_on_every_host
      ),
      "first_next_in_another_order_prefetch_0": first_next,
      "first_next_in_another_order_prefetch_2": first_next,
      "device_put_state_before_the_first_batch": (
        check_a_device_put_state_before_the_first_batch_restores_two_processes
      ),
    },
  )


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_an_iterator_dropped_in_a_cycle_posts_its_ending_wherever_the_collector_runs():
  finalized = dropped_in_a_cycle_collected_in_a_library_thread
  left = left_in_a_cycle_while_the_collector_runs_on_its_own
  by_case = run_cases(
    2,
    4,
    {
      "finalized_in_a_library_thread_prefetch_1": (finalized, (1,), {}),
      "finalized_in_a_library_thread_prefetch_2": (finalized, (2,), {}),
      "left_in_a_cycle_library_reader": (left, ("library",), {}),
      "left_in_a_cycle_own_thread_reader": (left, ("own_thread",), {}),
    },
    timeout_s=2 * TIMEOUT,
  )
  finalized_check = check_an_iterator_finalized_in_a_library_thread_posts_its_ending
  left_check = check_an_iterator_left_in_a_cycle_is_reported_closed_wherever_the_collector_runs
  check_cases(
    by_case,
    {
      "finalized_in_a_library_thread_prefetch_1": finalized_check,
      "finalized_in_a_library_thread_prefetch_2": finalized_check,
      "left_in_a_cycle_library_reader": left_check,
      "left_in_a_cycle_own_thread_reader": left_check,
    },
  )


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_random_schedules_on_two_processes_end_the_same_way_with_and_without_prefetch():
  seeds = list(range(6))
  by_case = run_cases(
    2,
    4,
    {f"prefetch_{k}": (random_schedules, (seeds, k), {}) for k in (0, 2)},
    timeout_s=2 * TIMEOUT,
  )
  check_cases(
    by_case,
    dict.fromkeys(
      ("prefetch_0", "prefetch_2"), check_random_schedules_on_two_processes_end_the_same_way
    ),
  )
