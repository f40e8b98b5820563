"""One (re)start of the stream (`session.Stream`): its threads, and their close in reverse.

Driven through the public API: the threads a start runs (none without
prefetch; the build thread, and with the key-value store the reading and
agreement threads), the order in which its close stops them (the user's end first), and
a restart (`reset`, `set_state`) stopping the old start before the new one runs.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np
import pytest

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src import session
from grain_jax_sync._src.agreement import core, driver
from grain_jax_sync._src.exchange import key_value

TIMEOUT = 180


def library_threads() -> list[str]:
  return sorted(t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync-"))


def _no_threads(deadline_s=10.0):
  end = time.monotonic() + deadline_s
  while library_threads() and time.monotonic() < end:
    time.sleep(0.01)
  return library_threads()


def _rows(n):
  return [{"x": np.full(8, i, np.int32)} for i in range(n)]


def _first(batch):
  return int(np.asarray(batch["x"])[0])


def test_one_process_with_prefetch_runs_the_build_thread_only_while_it_runs():
  it = gjs.iter_jax_batches(_rows(5), batch_size=8, prefetch_batches=2)
  assert library_threads() == []  # A stream starts at its first `next()`.
  got = [_first(next(it))]
  assert library_threads() == [session.BUILD_THREAD]  # One process: no agreement thread.
  got += [_first(b) for b in it]
  it.close()
  assert got == [0, 1, 2, 3, 4]
  assert _no_threads() == []


def test_one_process_without_prefetch_runs_every_stage_in_the_callers_thread():
  with gjs.iter_jax_batches(_rows(4), batch_size=8, prefetch_batches=0) as it:
    got = [_first(next(it))]
    assert library_threads() == []
    got += [_first(b) for b in it]
  assert got == [0, 1, 2, 3]


@pytest.mark.parametrize("how", ["reset", "set_state"])
def test_a_restart_stops_the_old_start_before_the_new_one_runs(how):
  it = gjs.iter_jax_batches(_rows(10), batch_size=8, prefetch_batches=2)
  got = [_first(next(it)), _first(next(it))]
  saved = it.get_state()
  got.append(_first(next(it)))
  assert library_threads() == [session.BUILD_THREAD]
  it.reset() if how == "reset" else it.set_state(saved)
  assert _no_threads() == []  # The old start is stopped; the new one starts at `next()`.
  got.append(_first(next(it)))
  assert library_threads() == [session.BUILD_THREAD]  # One build thread, the new start's.
  it.close()
  assert got == [0, 1, 2, 0 if how == "reset" else 2]
  assert _no_threads() == []


def stage_threads(prefetch: int) -> dict[str, Any]:
  """In each process: the threads of one start: before, while it runs, its close order, after."""
  import jax

  p = jax.process_index()
  # A long stream: the agreement thread, held back by the bounded read-ahead,
  # still runs when the threads are looked at.
  data = ({"x": np.full(8, 100 * p + i, np.int32)} for i in range(100_000))
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch, sync_timeout_s=60.0)
  out: dict[str, Any] = {"before": library_threads()}
  rows = [int(np.asarray(next(it)["x"].addressable_shards[0].data)[0])]
  out["running"] = library_threads()
  rows += [int(np.asarray(next(it)["x"].addressable_shards[0].data)[0]) for _ in range(4)]
  # Mid-stream, on every host at the same batch, from another thread; each
  # store call of the stream's exchange meanwhile is recorded with its thread.
  calls: list[tuple[str, str]] = []
  real = key_value.KeyValueExchange._call

  def recorded(self: Any, doing: str, *args: Any, **kwargs: Any) -> Any:
    calls.append((threading.current_thread().name, doing))
    return real(self, doing, *args, **kwargs)

  # And each ending asked of the agreement: by which thread, through which frames from `close()`.
  asks: list[tuple[str, list[str], int | None]] = []
  real_ask, real_streams_ask = driver.Driver.ask, session.Streams.ask

  def record(at: int | None) -> None:
    names = [f.name for f in traceback.extract_stack()[:-2]] + ["ask"]
    asks.append((threading.current_thread().name, names[names.index("close") :], at))

  def asked(self: Any, ask: Any) -> None:
    if isinstance(ask, core.Closing):
      record(ask.at_batch)
    real_ask(self, ask)

  def streams_asked(self: Any, what: str) -> None:
    record(None)
    real_streams_ask(self, what)

  key_value.KeyValueExchange._call = recorded  # type: ignore[method-assign]
  driver.Driver.ask = asked  # type: ignore[method-assign]
  session.Streams.ask = streams_asked  # type: ignore[method-assign]
  try:
    closer = threading.Thread(target=it.close, name="closer")
    closer.start()
    closer.join(TIMEOUT)
  finally:
    key_value.KeyValueExchange._call = real  # type: ignore[method-assign]
    driver.Driver.ask = real_ask  # type: ignore[method-assign]
    session.Streams.ask = real_streams_ask  # type: ignore[method-assign]
  out["close_calls"] = calls
  out["close_asks"] = asks
  out["rows"] = rows
  out["after"] = _no_threads()
  return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [0, 2])
def test_two_processes_threads_of_one_start_and_their_close_in_reverse(prefetch):
  outs = testing.values(
    testing.run_processes(
      stage_threads,
      num_processes=2,
      devices_per_process=4,
      args=(prefetch,),
      timeout_s=TIMEOUT,
    )
  )
  for p, out in enumerate(outs):
    assert out["before"] == [] and out["after"] == []
    assert out["rows"] == [100 * p + i for i in range(5)]
    if prefetch:
      # Three library threads per iterator, besides the process-wide beat:
      # reading, agreeing, building (docs/internals.md, Threads).
      threads = [session.READ_THREAD, session.AGREE_THREAD, session.BUILD_THREAD]
      assert out["running"] == sorted(threads)
    else:
      assert out["running"] == []
    # This host's ending is posted by the thread that runs the core, the
    # agreement thread, on its way out: the closing thread only asks, and the
    # exchange has one writer at a time. Where the peer's ending (both close
    # at batch 5) ended this host's stream first, the agreement thread had
    # returned with no ending left to post, and the closing thread tells the
    # peers it left, after it. Inline, the closing thread runs the core.
    # A close asks twice, one put each: at once, into the stream's inbox,
    # that its ending is on its way (the agreement decides no more); then,
    # once the call in progress returned, the ending with its exact count.
    assert out["close_asks"] == [
      ("closer", ["close", "close", "ask"], None),
      ("closer", ["close", "close", "end", "ask"], 5),
    ], out
    calls = out["close_calls"]
    names = [name for name, _ in calls]
    if prefetch:
      assert set(names) <= {session.AGREE_THREAD, "closer"}, calls
      assert names == sorted(names, key=lambda name: name == "closer"), calls  # Never interleaved.
    else:
      assert set(names) == {"closer"}, calls
  # The ending itself (a final chunk or decision) on one host at least: the
  # one whose close reached the other first, posted by its agreement thread.
  finals = [
    (name, doing)
    for out in outs
    for name, doing in out["close_calls"]
    if doing.startswith(("posting chunk", "posting decision"))
  ]
  assert finals, [out["close_calls"] for out in outs]
  assert {name for name, _ in finals} == {session.AGREE_THREAD if prefetch else "closer"}, finals


# What a synchronisation call is: a lock, a queue, a semaphore, an event or a
# condition, called from the library's own code.
_SYNC = {
  "acquire",
  "release",
  "get",
  "put",
  "get_nowait",
  "put_nowait",
  "wait",
  "notify",
  "set",
  "__enter__",
}
_SYNC_TYPES = ("lock", "Lock", "SimpleQueue", "Queue", "Semaphore", "Event", "Condition")


def _sync_calls_in(fn: Any) -> list[str]:
  """The synchronisation calls the library makes in this thread while `fn` runs."""
  calls = []

  def profile(frame, event, arg):
    if event == "c_call":
      owner = getattr(arg, "__self__", None)
      caller = frame
    elif event == "call":
      owner = frame.f_locals.get("self")
      caller = frame.f_back
    else:
      return
    name = getattr(arg, "__name__", None) if event == "c_call" else frame.f_code.co_name
    if (
      name in _SYNC
      and caller is not None
      and "grain_jax_sync" in caller.f_code.co_filename
      and type(owner).__name__.lstrip("_").endswith(_SYNC_TYPES)
    ):
      calls.append(f"{type(owner).__name__}.{name} in {caller.f_code.co_name}")

  sys.setprofile(profile)
  try:
    fn()
  finally:
    sys.setprofile(None)
  return calls


class _CountedLock:
  """The lifetime's lock, seen by the profile (a `with` on a C lock is not)."""

  def __init__(self, lock: Any):
    self._lock = lock

  def __enter__(self) -> Any:
    return self._lock.__enter__()

  def __exit__(self, *exc: Any) -> Any:
    return self._lock.__exit__(*exc)

  def acquire(self, *args: Any, **kwargs: Any) -> Any:
    return self._lock.acquire(*args, **kwargs)

  def release(self) -> None:
    self._lock.release()


def test_the_steady_next_makes_at_most_two_synchronisation_calls():
  # Grain's thread prefetch makes one queue get; ours one get and the
  # put of the slot it frees for the build thread. The turn is one
  # atomic claim and give-back, the state one value replaced whole.
  with gjs.iter_jax_batches(_rows(400), batch_size=8, prefetch_batches=2) as it:
    for _ in range(50):
      next(it)
    it._life._lock = _CountedLock(it._life._lock)
    counts = [len(_sync_calls_in(lambda: next(it))) for _ in range(100)]
    calls = _sync_calls_in(lambda: next(it))
  assert max(counts) <= 2, calls
  assert sorted(calls) == ["SimpleQueue.get in __next__", "SimpleQueue.put in __next__"], calls


def _at_line(fn, k, act):
  """A trace that runs `act` once, in this thread, before the `k`-th line `fn` runs; `fired()` says if it did."""
  code, seen, fired = fn.__code__, [0], []

  def local(frame, event, arg):
    if event == "line":
      if seen[0] == k and not fired:
        fired.append(True)
        act()  # Untraced: Python turns tracing off while a trace function runs.
      seen[0] += 1
    return local

  def trace(frame, event, arg):
    return local if frame.f_code is code else None

  return trace, fired


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("what", [session.STOP, session.CLOSE])
@pytest.mark.parametrize("inside", ["current", "ask"])
def test_an_ask_at_each_step_of_a_streams_start_reaches_that_stream(inside, what, prefetch):
  # The start/ask race, made deterministic: the ask runs between two lines of
  # the stream's start (`Streams.current`), or the whole start runs between
  # two lines of the ask (`Streams.ask`, as another thread or a signal
  # handler would be interrupted), at every line. A stop asked before the
  # first batch ends the stream there, or (its build thread started) after
  # the batches it built meanwhile; a close gives no batch.
  for k in range(100):
    it = gjs.iter_jax_batches(_rows(6), batch_size=8, prefetch_batches=prefetch)
    streams = it._streams
    if inside == "current":
      trace, fired = _at_line(session.Streams.current, k, functools.partial(streams.ask, what))
      sys.settrace(trace)
      try:
        streams.current()
      finally:
        sys.settrace(None)
    else:
      trace, fired = _at_line(session.Streams.ask, k, streams.current)
      sys.settrace(trace)
      try:
        streams.ask(what)
      finally:
        sys.settrace(None)
    got: list[int] = []
    try:
      got += [_first(b) for b in it]
    except RuntimeError as e:  # A close asked for: no batch after it.
      assert what == session.CLOSE and str(e) == "the iterator is closed", e
    stopped_by = it.stop_requested_by
    it.close()
    if not fired:
      break
    assert got == list(range(len(got))) and len(got) <= (prefetch + 1) * (what == session.STOP)
    assert stopped_by == (0 if what == session.STOP else None), (inside, k)
  assert k > 3  # Every line of it was tried.
  assert _no_threads() == []
