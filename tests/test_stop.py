"""Stop together, on real processes: what the simulated cluster cannot show.

A stop from a SIGTERM or SIGUSR1 handler, a watchdog thread's close while
its own source is stuck, and the resume from the saved state. The agreement's
part (which host ends how, and when, at every step and batch) is
tests/test_sim_cluster.py's.

Real processes joined by `jax.distributed` (gloo, forced CPU devices). Each
host checks the rows of its own shards of every batch (no collective in the
test, so that a host that closed cannot hang a peer in a gather). Host p
feeds rows ``1000 p + i`` at batch i. A stop is checked against the documented
bound, in batches and in seconds (`timed_endings.bound`); the cases timed
across steps live in benchmarks/timed_endings.py, which benchmarks/endings.py
reports from.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from grain_jax_sync._src import liveness, plan
from grain_jax_sync._src.agreement import common, decider, driver
from grain_jax_sync._src.exchange import key_value
from grain_jax_sync._src.memory_store import MemoryStore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.timed_endings import (  # noqa: E402 - the repository root, from any directory.
  LENGTH,
  STALL_S,
  bound,
  data,
  first_row,
  iterator,
  launch,
)

TIMEOUT = 240
STEP_S = 0.01  # The training step of the handler cases.


def _stop_on_sigterm(prefetch: int, asker: int, after: int) -> dict:
  """`asker`'s SIGTERM handler calls request_stop() after its batch `after`; then a resume."""
  import jax

  p = jax.process_index()
  it = iterator(data(p, LENGTH), prefetch)
  previous = signal.signal(signal.SIGTERM, lambda *_: it.request_stop())
  rows, asked = [], None
  try:
    for batch in it:
      rows.append(first_row(batch))
      if p == asker and len(rows) == after:
        asked = time.time()
        os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(STEP_S)
  finally:
    signal.signal(signal.SIGTERM, previous)
  ended = time.time()
  state, by = it.get_state(), it.stop_requested_by
  again = next(it, None)  # The stream stays ended.
  it.close()
  # The restarted job: a fresh iterator from the saved state, to the end.
  fresh = iterator(data(p, LENGTH), prefetch)
  fresh.set_state(state)
  resumed = [first_row(b) for b in fresh]
  fresh.close()
  out = {"rows": rows, "batches": state["batches"], "by": by, "again": again}
  return out | {"resumed": resumed, "asked": asked, "ended": ended}


def _stop_after_the_end(prefetch: int, length: int) -> dict:
  import jax

  p = jax.process_index()
  it = iterator(data(p, length), prefetch)
  rows = [first_row(b) for b in it]
  it.request_stop()  # After the end: nothing changes.
  out = {
    "rows": rows,
    "by": it.stop_requested_by,
    "batches": it.get_state()["batches"],
    "again": next(it, None),
  }
  it.close()
  return out


def test_a_second_threads_next_during_a_next_raises_at_once():
  import grain_jax_sync as gjs

  entered, release = threading.Event(), threading.Event()

  def source():
    for i in range(3):
      if i == 1:
        entered.set()
        release.wait(10)
      yield {"x": np.full(8, i, np.int32)}

  it = gjs.iter_jax_batches(source(), batch_size=8, prefetch_batches=0)
  assert int(np.asarray(next(it)["x"])[0]) == 0
  first: list[Any] = []
  reader = threading.Thread(target=lambda: first.append(next(it)))
  reader.start()
  assert entered.wait(10)
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match=r"next\(\) was called while next\(\) is in progress"):
    next(it)
  with pytest.raises(RuntimeError, match=r"reset\(\) was called while next\(\) is in progress"):
    it.reset()
  assert time.monotonic() - t0 < 5.0  # At once (no queue of turns), not after the 10 s read.
  release.set()
  reader.join(10)
  assert int(np.asarray(first[0]["x"])[0]) == 1
  assert int(np.asarray(next(it)["x"])[0]) == 2
  it.close()


class _Witness(MemoryStore):
  """The store; records the thread of each call, and the key of each write."""

  def __init__(self) -> None:
    super().__init__()
    self.calls: list[tuple[str, str, str]] = []  # (thread, method, key)

  def __getattribute__(self, name: str) -> Any:
    attr = super().__getattribute__(name)
    if not name.startswith(("key_value", "blocking")):
      return attr

    def call(key: str, *args: Any) -> Any:
      self.calls.append((threading.current_thread().name, name, key))
      return attr(key, *args)

    return call


class _Turn:
  """A lock that records the thread of each acquire."""

  def __init__(self) -> None:
    self._lock, self.by = threading.Lock(), []

  def acquire(self, blocking: bool = True) -> bool:
    self.by.append(threading.current_thread().name)
    return self._lock.acquire(blocking)

  def release(self) -> None:
    self._lock.release()


def test_inline_a_stop_asked_from_a_handler_takes_no_lock_and_calls_no_store_in_the_handler():
  # Inline, `request_stop()` between two calls reaches `Driver.ask` (a put,
  # then `heard`) in the asking frame, a signal handler's say. Process 1 (a
  # follower) posts its stop as a report, from the beat's thread.
  store, me = _Witness(), threading.current_thread().name
  ex = key_value.KeyValueExchange(store, "gjs/handler", process_index=1, process_count=2)
  who = common.Identity(process=1, devices=1, config={"batch_size": 8}, resume=0)
  rules = plan.Rules(batch_size=8, drop_last=False, pad=True)
  settings = {"lookahead": None, "timeout_s": 60.0, "position": 0}
  core = decider.core_for(
    rules, who, threaded=False, namespace=ex.namespace, process_count=2, **settings
  )
  beat = liveness.Beat(store, 1)
  drv = driver.Driver(core, iter(()), ex, None, beat=beat)
  drv.turn = _Turn()  # type: ignore[assignment]
  try:
    store.calls.clear()  # The first beat's write.
    drv.ask(3)  # The handler.
    assert [c for c in store.calls if c[0] == me] == [] and me not in drv.turn.by
    deadline = time.monotonic() + 10
    while core.stop_pending() or not any(c[2].startswith("gjs/handler/") for c in store.calls):
      assert time.monotonic() < deadline, "the stop was not posted"
      time.sleep(0.01)
  finally:
    beat.stop()
  posts = [c for c in store.calls if c[2].startswith("gjs/handler/")]
  assert {(t, m) for t, m, _ in posts} == {("gjs-beat-1", "key_value_set")}, posts
  assert drv.turn.by == ["gjs-beat-1"]
  assert "stopped" in store.key_value_try_get(posts[0][2])


# -- what needs a real process: a signal handler, a watchdog thread --------------------
#
# The bounds in seconds of every ending, at any step, are checked on the
# simulated cluster (tests/test_sim_cluster.py); here the real driver's part.
CLOSE_IN_A_STALL_S = 1.0  # `close()` returns within this while its own source is stuck.


def _stalling(p: int, stalled_host: int, at: int, stalled: Any, release: Any) -> Any:
  """Host `stalled_host`'s source waits before its batch `at` until `release` (at most STALL_S)."""
  for i, batch in enumerate(data(p, LENGTH)):
    if p == stalled_host and i == at:
      stalled.set()
      release.wait(STALL_S)
    yield batch


def _close_in_a_stall(prefetch: int, step_s: float) -> dict:
  """A watchdog on process 1 calls close() 2 s into its source's stall before its batch 10."""
  import jax

  p = jax.process_index()
  stalled, release = threading.Event(), threading.Event()
  it = iterator(_stalling(p, 1, 10, stalled, release), prefetch)
  closing: dict[str, float] = {}

  def watchdog() -> None:
    if stalled.wait(60):
      time.sleep(2.0)
      closing["at"] = time.time()
      it.close()
      closing["returned"] = time.time()

  dog = threading.Thread(target=watchdog, daemon=True)
  if p == 1:
    dog.start()
  rows, error = [], None
  try:
    for batch in it:
      rows.append(first_row(batch))
      time.sleep(step_s)
  except RuntimeError as e:
    error = str(e)
  ended = time.time()
  if p == 1:
    dog.join(60)
  release.set()
  it.close()
  return {"rows": rows, "error": error, "ended": ended, "batches": len(rows)} | closing


class _Signalling:
  """Rows ``1000 p + i``; sends SIGUSR1 to this process as it reads row `at` (inside `next()`)."""

  def __init__(self, p: int, at: int):
    self._rows, self._i, self._at = data(p, LENGTH), 0, at

  def __iter__(self) -> _Signalling:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._i == len(self._rows):
      raise StopIteration
    if self._i == self._at:
      os.kill(os.getpid(), signal.SIGUSR1)  # Inline: read in the consumer's call.
    self._i += 1
    return self._rows[self._i - 1]

  def get_state(self) -> dict[str, int]:
    return {"i": self._i}

  def set_state(self, state: dict[str, int]) -> None:
    self._i = state["i"]


def _inline_stop(how: str, asker: int, step_s: float) -> dict:
  """Inline, `asker` asks for a stop (`how`); then a resume.

  ``between``: from its loop after its batch 3, between two calls;
  ``handler``: from a SIGUSR1 handler inside the call that reads its row 5;
  ``thread``: from a thread started after its batch 3, racing its next call.
  """
  import jax

  p = jax.process_index()
  asked: list[float] = []
  it: Any = None

  def ask() -> None:
    asked.append(time.time())
    it.request_stop()

  source = _Signalling(p, 5 if how == "handler" and p == asker else -1)
  previous = signal.signal(signal.SIGUSR1, lambda *_: ask())
  it, rows, racer = iterator(source, 0), [], None
  try:
    for batch in it:
      rows.append(first_row(batch))
      if p == asker and len(rows) == 3 and how == "between":
        ask()
      if p == asker and len(rows) == 3 and how == "thread":
        racer = threading.Thread(target=ask)
        racer.start()
      time.sleep(step_s)
  finally:
    signal.signal(signal.SIGUSR1, previous)
  ended = time.time()
  if racer is not None:
    racer.join(10)
  state, by = it.get_state(), it.stop_requested_by
  it.close()
  fresh = iterator(_Signalling(p, -1), 0)
  fresh.set_state(state)
  resumed = [first_row(b) for b in fresh]
  fresh.close()
  out = {"rows": rows, "batches": state["batches"], "by": by, "ended": ended}
  return out | {"resumed": resumed, "asked": asked[0] if asked else None}


def stop_cases(prefetch: int, stops: list[tuple[int, int]]) -> dict:
  """One launch: a SIGTERM handler's stop per (asker, after), a stop after the end; inline, a
  SIGUSR1 handler's stop inside `next()`; with prefetch, a watchdog's close during its own
  source's stall."""
  out = {
    "signal": [_stop_on_sigterm(prefetch, asker, after) for asker, after in stops],
    "after_end": _stop_after_the_end(prefetch, length=6),
  }
  if prefetch == 0:
    out["handler"] = _inline_stop("handler", 1, 0.01)
  else:
    out["close"] = _close_in_a_stall(prefetch, 0.05)
  return out


def _check_stop(outs: list[dict], prefetch: int, asker: int, after: int) -> None:
  """Every host stopped at one batch B, after <= B <= after + 2R, within T of the request,
  with exactly its rows 0..B-1, named `asker`, and resumed exactly at B."""
  most = bound(prefetch, STEP_S)
  stopped_at = outs[0]["batches"]
  assert after <= stopped_at <= after + most.batches, (after, stopped_at, most)
  took = max(o["ended"] for o in outs) - outs[asker]["asked"]
  assert took <= most.seconds, (after, stopped_at, took, most)
  for p, o in enumerate(outs):
    assert o["rows"] == [1000 * p + i for i in range(stopped_at)], (p, after, stopped_at)
    assert (o["batches"], o["by"], o["again"]) == (stopped_at, asker, None), (p, after)
    # The restart from the saved state goes on exactly where every host stopped.
    assert o["resumed"] == [1000 * p + i for i in range(stopped_at, LENGTH)], (p, after)


def _check_inline_handler(outs: list[dict]) -> None:
  """Every host stopped at one batch, named process 1, and resumed exactly."""
  stopped_at = outs[0]["batches"]
  for p, o in enumerate(outs):
    assert (o["batches"], o["by"]) == (stopped_at, 1), (p, o["batches"], o["by"])
    assert o["rows"] == [1000 * p + i for i in range(stopped_at)], p
    assert o["resumed"] == [1000 * p + i for i in range(stopped_at, LENGTH)], p
  assert 1 <= stopped_at < LENGTH, stopped_at


def _check_close_in_a_stall(closer: dict, peer: dict) -> None:
  """close() returns at once on the stalled host, and the peer raises it, naming its count."""
  took = closer["returned"] - closer["at"]
  assert took <= CLOSE_IN_A_STALL_S, f"close() took {took:.2f} s"
  assert closer["error"] in (None, "the iterator is closed"), closer["error"]
  assert peer["error"] == f"process 1 closed its iterator at batch {closer['batches']}", peer
  for p, o in enumerate((peer, closer)):
    assert o["rows"] == [1000 * p + i for i in range(len(o["rows"]))], p


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [0, 2])
def test_request_stop_from_a_handler_ends_every_host_at_one_batch_and_resumes_exactly(prefetch):
  # The agreement's part (every step, every batch, two askers, a close or an
  # error at batch 5, a stall, inline) runs on the simulated cluster.
  n, d = 2, 4
  rng = random.Random(f"{n}x{d}/{prefetch}")
  # One stop during the read-ahead's ramp, one past it (the horizon, R batches, is full),
  # from the other host: the decider asks once, a follower once.
  r = int(bound(prefetch, STEP_S).batches / 2)
  asker = rng.randrange(n)
  stops = [(asker, rng.randint(1, 20)), ((asker + 1) % n, rng.randint(r, r + 40))]
  assert stops[1][1] + bound(prefetch, STEP_S).batches < LENGTH  # The stop, not the end.
  outs = launch(stop_cases, n, d, prefetch, stops, timeout_s=TIMEOUT)
  # A SIGTERM handler's request: every host stops at one batch, named alike.
  for k, (asker, after) in enumerate(stops):
    _check_stop([o["signal"][k] for o in outs], prefetch, asker, after)
  # A request after the end changes nothing.
  for p, o in enumerate(outs):
    want = {"rows": [1000 * p + i for i in range(6)], "by": None, "batches": 6, "again": None}
    assert o["after_end"] == want
  if prefetch == 0:
    _check_inline_handler([o["handler"] for o in outs])
  else:
    _check_close_in_a_stall(outs[1]["close"], outs[0]["close"])
