"""Stop together: an agreed stop, and a host that leaves, reach every host within seconds.

Real processes joined by `jax.distributed` (gloo, forced CPU devices). Each
host checks the rows of its own shards of every batch (no collective in the
test, so that a host that closed cannot hang a peer in a gather). Host p
feeds rows ``1000 p + i`` at batch i. The cases timed in seconds live in
benchmarks/timed_endings.py, which benchmarks/endings.py reports from.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.timed_endings import (  # noqa: E402 - the repository root, from any directory.
  DECIDE_AHEAD_S,
  LENGTH,
  SLACK_S,
  STALL_S,
  bound_s,
  data,
  first_row,
  iterator,
  launch,
  leave_at_5,
  leave_cases,
  stop_late,
  timed_stops,
)

TOPOLOGIES = [pytest.param(2, 4, id="2x4"), pytest.param(4, 2, id="4x2")]
TIMEOUT = 240
LOOKAHEAD = 10  # The default `synchronize_lookahead`.


def _stop_on_sigterm(prefetch: int, asker: int, after: int, length: int, step_s: float) -> dict:
  """`asker`'s SIGTERM handler calls request_stop() after its batch `after`; then a resume."""
  import jax

  p = jax.process_index()
  it = iterator(data(p, length), prefetch)
  previous = signal.signal(signal.SIGTERM, lambda *_: it.request_stop())
  rows = []
  try:
    for batch in it:
      rows.append(first_row(batch))
      if p == asker and len(rows) == after:
        os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(step_s)
  finally:
    signal.signal(signal.SIGTERM, previous)
  state, by = it.get_state(), it.stop_requested_by
  again = next(it, None)  # The stream stays ended.
  it.close()
  # The restarted job: a fresh iterator from the saved state, to the end.
  fresh = iterator(data(p, length), prefetch)
  fresh.set_state(state)
  resumed = [first_row(b) for b in fresh]
  fresh.close()
  return {"rows": rows, "batches": state["batches"], "by": by, "again": again, "resumed": resumed}


def _stop_by_two_at_once(prefetch: int, length: int) -> dict:
  """Hosts 0 and the last ask for a stop after the same batch."""
  import jax

  p, n = jax.process_index(), jax.process_count()
  it = iterator(data(p, length), prefetch)
  rows = []
  for batch in it:
    rows.append(first_row(batch))
    if len(rows) == 3 and p in (0, n - 1):
      it.request_stop()
      it.request_stop()  # A second request changes nothing.
    time.sleep(0.005)
  out = {"rows": rows, "batches": it.get_state()["batches"], "by": it.stop_requested_by}
  it.close()
  return out


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


def stop_cases(prefetch: int, asker: int, after: int) -> dict:
  return {
    "signal": _stop_on_sigterm(prefetch, asker, after, length=200, step_s=0.01),
    "two": _stop_by_two_at_once(prefetch, length=200),
    "after_end": _stop_after_the_end(prefetch, length=6),
  }


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_request_stop_ends_every_host_at_one_batch_and_resumes_exactly(n, d, prefetch):
  rng = random.Random(f"{n}x{d}/{prefetch}")
  asker, after = rng.randrange(n), rng.randint(1, 20)
  outs = launch(stop_cases, n, d, prefetch, asker, after, timeout_s=TIMEOUT)
  bound = 2 * (LOOKAHEAD + prefetch)
  # A SIGTERM handler's request: every host stops at one batch, named alike.
  sig = [o["signal"] for o in outs]
  stopped_at = sig[0]["batches"]
  assert after <= stopped_at <= after + bound, (after, stopped_at)
  for p, o in enumerate(sig):
    assert o["rows"] == [1000 * p + i for i in range(stopped_at)]
    assert o["batches"] == stopped_at
    assert o["by"] == asker
    assert o["again"] is None
    # The restart from the saved state goes on exactly where every host stopped.
    assert o["resumed"] == [1000 * p + i for i in range(stopped_at, 200)]
  # Two hosts ask at once: one stop, one named asker, the same everywhere.
  two = [o["two"] for o in outs]
  assert len({o["batches"] for o in two}) == 1 and len({o["by"] for o in two}) == 1
  assert two[0]["by"] in (0, n - 1)
  assert 3 <= two[0]["batches"] <= 3 + bound
  for p, o in enumerate(two):
    assert o["rows"] == [1000 * p + i for i in range(two[0]["batches"])]
  # A request after the end changes nothing.
  for p, o in enumerate(outs):
    end = o["after_end"]
    assert end == {
      "rows": [1000 * p + i for i in range(6)],
      "by": None,
      "batches": 6,
      "again": None,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("length", [40, 400])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_a_host_that_closes_is_known_within_a_few_batches_and_never_ends_a_peer_normally(
  n, d, prefetch, length
):
  outs = launch(leave_at_5, n, d, prefetch, "close", 0.05, length, timeout_s=TIMEOUT)
  bound = 5 + 2 * (LOOKAHEAD + prefetch)
  leaver = outs[n - 1]
  assert (leaver["rows"], leaver["error"]) == ([1000 * (n - 1) + i for i in range(5)], None)
  for p in range(n - 1):
    rows, error = outs[p]["rows"], outs[p]["error"]
    assert error == f"RuntimeError: process {n - 1} closed its iterator at batch 5", (p, error)
    assert 5 <= len(rows) <= bound, (p, len(rows))
    assert rows == [1000 * p + i for i in range(len(rows))]


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
  assert time.monotonic() - t0 < 1.0  # At once: no queue of turns.
  release.set()
  reader.join(10)
  assert int(np.asarray(first[0]["x"])[0]) == 1
  assert int(np.asarray(next(it)["x"])[0]) == 2
  it.close()


# -- endings in seconds (issue 40) ----------------------------------------------------
#
# The bound of every ending, in seconds from the event to the end of each
# host's loop, is `timed_endings.bound_s`.
CLOSE_IN_A_STALL_S = 1.0  # `close()` returns within this while its own source is stuck.


def _stop_late_s(outs: list[dict], case: tuple[float, int, int]) -> float:
  """Seconds from the request to the last host's loop end (printed: the figure)."""
  step_s, after, asker = case
  late, batches = stop_late(outs, case)
  print(
    f"step {step_s} s, asked by {asker} after batch {after}: every host ended {late:.2f} s"
    f" after the request, {batches} batches after it"
  )
  return late


def _check_stop(outs: list[dict], case: tuple[float, int, int]) -> None:
  """Every host stopped at one batch, named the asker, and resumed exactly."""
  _, after, asker = case
  stopped_at = outs[0]["batches"]
  for p, o in enumerate(outs):
    assert o["batches"] == stopped_at and o["by"] == asker, (case, p, o["batches"], o["by"])
    assert o["rows"] == [1000 * p + i for i in range(stopped_at)], (case, p)
    assert o["resumed"] == [1000 * p + i for i in range(stopped_at, LENGTH)], (case, p)
  assert after <= stopped_at < LENGTH, (case, stopped_at)


# Per launch (processes, devices, prefetch): (step_s, after, asker). The 4 x 2
# launches and the 2 s step run a reduced set (the suite's time).
STOP_CASES = {
  (2, 4, 0): [(0.005, 3, 1), (0.005, 37, 0), (0.05, 3, 0), (0.05, 17, 1), (0.5, 3, 1)]
  + [(0.5, 8, 0), (2.0, 3, 1)],
  (2, 4, 2): [(0.005, 3, 0), (0.005, 37, 1), (0.05, 3, 1), (0.05, 17, 0), (0.5, 3, 0)]
  + [(0.5, 8, 1)],
  (4, 2, 0): [(0.005, 37, 3), (0.5, 3, 0)],
  (4, 2, 2): [(0.005, 3, 0), (0.5, 8, 3), (2.0, 3, 2)],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
  ("n", "d", "prefetch"), [pytest.param(*k, id=f"{k[0]}x{k[1]}-prefetch{k[2]}") for k in STOP_CASES]
)
def test_request_stop_ends_every_host_within_seconds_at_any_step_and_resumes_exactly(
  n, d, prefetch
):
  cases = STOP_CASES[(n, d, prefetch)]
  outs = launch(timed_stops, n, d, prefetch, cases)
  per_case = [[o[i] for o in outs] for i in range(len(cases))]
  late = {c: _stop_late_s(o, c) for c, o in zip(cases, per_case, strict=True)}
  for case, case_outs in zip(cases, per_case, strict=True):
    _check_stop(case_outs, case)
  # (step_s, after, asker): the seconds, where over the bound.
  over = {c: round(s, 2) for c, s in late.items() if s > bound_s(prefetch, c[0])}
  assert not over, f"over {DECIDE_AHEAD_S} + (prefetch + 1) steps + {SLACK_S} s: {over}"


def _stalling(p: int, stalled_host: int, at: int, stalled: Any, release: Any) -> Any:
  """Host `stalled_host`'s source waits before its batch `at` until `release` (at most STALL_S)."""
  for i, batch in enumerate(data(p, LENGTH)):
    if p == stalled_host and i == at:
      stalled.set()
      release.wait(STALL_S)
    yield batch


def _stop_in_a_stall(prefetch: int, step_s: float) -> dict:
  """Process 1's source stalls before its batch 10; process 0 asks for a stop after its batch 6.

  The request comes from another thread of process 0, as a watchdog's would.
  """
  import jax

  p = jax.process_index()
  stalled, release = threading.Event(), threading.Event()
  it = iterator(_stalling(p, 1, 10, stalled, release), prefetch)
  rows, asked = [], []
  try:
    for batch in it:
      rows.append(first_row(batch))
      if p == 0 and len(rows) == 6:
        asker = threading.Thread(target=lambda: (asked.append(time.time()), it.request_stop()))
        asker.start()
        asker.join()
      time.sleep(step_s)
  finally:
    ended = time.time()
    release.set()  # The source wakes once this host's loop has ended.
  out = {"rows": rows, "batches": len(rows), "by": it.stop_requested_by}
  it.close()
  return out | {"asked": asked[0] if asked else None, "ended": ended}


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


def stall_cases(prefetch: int, step_s: float) -> dict:
  return {"stop": _stop_in_a_stall(prefetch, step_s), "close": _close_in_a_stall(prefetch, step_s)}


@pytest.mark.multiprocess
def test_a_stop_and_a_close_during_a_peers_20_s_source_stall_end_every_host_within_seconds():
  # With prefetch (the reading thread). With `prefetch_batches=0` the source
  # is read in the loop's own `next()`, which a stuck source holds.
  prefetch, step_s = 2, 0.05
  outs = launch(stall_cases, 2, 4, prefetch, step_s)
  stop, closer, peer = [o["stop"] for o in outs], outs[1]["close"], outs[0]["close"]
  seen = {
    "stop: every host's end after the request": max(o["ended"] for o in stop) - stop[0]["asked"],
    "close: the peer's raise after the close": peer["ended"] - closer["at"],
    "close: the stalled host's loop end after the close": closer["ended"] - closer["at"],
  }
  took = closer["returned"] - closer["at"]
  print(f"close() took {took:.2f} s;", {k: round(v, 2) for k, v in seen.items()})
  # The stop: one batch everywhere, named alike, and no host waits for the stalled source.
  stopped_at = stop[0]["batches"]
  for p, o in enumerate(stop):
    assert (o["batches"], o["by"]) == (stopped_at, 0), (p, o["batches"], o["by"])
    assert o["rows"] == [1000 * p + i for i in range(stopped_at)], p
  assert 6 <= stopped_at <= 10, stopped_at
  # The close: it returns at once on the stalled host, and the peer raises it.
  assert closer["error"] in (None, "the iterator is closed"), closer["error"]
  assert peer["error"] == f"process 1 closed its iterator at batch {closer['batches']}", peer
  for p, o in enumerate((peer, closer)):
    assert o["rows"] == [1000 * p + i for i in range(len(o["rows"]))], p
  bound = bound_s(prefetch, step_s)
  late = {k: round(v, 2) for k, v in seen.items() if v > bound}
  assert took <= CLOSE_IN_A_STALL_S and not late, (
    f"close() took {took:.2f} s (bound {CLOSE_IN_A_STALL_S} s); over the bound {bound:.2f} s: {late}"
  )


# Per `prefetch_batches`, at 2 x 4: (how the last host leaves, step_s); the 2 s step split
# between them. The failing source waits for its own consumer, which the reading
# thread allows: with `prefetch_batches=0` the source is read in that consumer's
# `next()`, ahead of it, so only the close runs there.
LEAVE_CASES = {
  0: [("close", 0.02), ("close", 2.0)],
  2: [("close", 0.02), ("error", 0.02), ("error", 2.0)],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", list(LEAVE_CASES))
def test_a_close_or_a_source_error_at_batch_5_reaches_the_peer_within_seconds(prefetch):
  cases = LEAVE_CASES[prefetch]
  outs = launch(leave_cases, 2, 4, prefetch, cases)
  per_case = [(outs[0][i], outs[1][i]) for i in range(len(cases))]
  late = []
  for (kind, step_s), (peer, leaver) in zip(cases, per_case, strict=True):
    took, bound = peer["ended"] - leaver["left"], bound_s(prefetch, step_s)
    figure = f"{kind} at batch 5, step {step_s} s: the peer raised {took:.2f} s after it"
    print(figure, f"(bound {bound:.2f} s), after {len(peer['rows'])} batches")
    late += [f"{figure} (bound {bound:.2f} s)"] if took > bound else []
  for (kind, step_s), (peer, leaver) in zip(cases, per_case, strict=True):
    assert leaver["rows"] == [1000 + j for j in range(5)], (kind, step_s)
    # The batches decided before the failing read reached the job while that read waited.
    assert leaver["opened"] is (None if kind == "close" else True), (kind, step_s)
    cause = "closed its iterator at batch 5" if kind == "close" else "failed while reading batch 5"
    assert leaver["error"] == (None if kind == "close" else "SourceFailed: the shard vanished")
    # Never ended normally: the peer raises, naming the process.
    assert peer["error"] is not None and f"RuntimeError: process 1 {cause}" in peer["error"], peer
    assert len(peer["rows"]) >= 5 and peer["rows"] == list(range(len(peer["rows"]))), kind
  assert not late, "\n".join(late)


# -- inline (prefetch_batches=0): a stop asked for between calls is posted at once ---


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


def inline_stops(cases: list[tuple[str, int, float]]) -> list[dict]:
  return [_inline_stop(*case) for case in cases]


# (how, asker, step_s). At a 3 s step a stop posted only at the asker's next
# call would be seen by process 0 a step later than its next decision (6 s
# against a bound of 5): a follower's request goes through the store.
INLINE_CASES = {
  (2, 4): [("between", 1, 3.0), ("handler", 1, 3.0), ("thread", 1, 0.01), ("thread", 0, 0.01)],
  (4, 2): [("between", 2, 3.0), ("handler", 3, 3.0)],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), [pytest.param(*k, id=f"{k[0]}x{k[1]}") for k in INLINE_CASES])
def test_inline_a_stop_asked_between_or_during_calls_reaches_every_host_within_the_bound(n, d):
  cases = INLINE_CASES[(n, d)]
  outs = launch(inline_stops, n, d, cases)
  for i, case in enumerate(cases):
    how, asker, step_s = case
    case_outs = [o[i] for o in outs]
    _check_stop(case_outs, (step_s, 3 if how != "handler" else 1, asker))
    late = _stop_late_s(case_outs, (step_s, 3, asker))
    assert late <= bound_s(0, step_s), (case, round(late, 2))
