"""The iterator's state: get_state / set_state / reset, across hosts and beside the read-ahead.

`get_state()` is the state after the last batch the consumer received (not
the read-ahead's), JSON, and `set_state()` resumes the exact stream, on 1 and 2
processes.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any

import numpy as np
import pytest
import scenarios
import scenarios_endings
from helpers import TIMEOUT, check_cases, run_cases

import grain_jax_sync as gjs

# -- state -------------------------------------------------------------------------


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def run_resume(sizes: list[list[int]], kwargs: dict[str, Any], k: int) -> dict[str, Any]:
  """In each process: an uninterrupted run vs state after k batches restored in a fresh iterator."""
  import jax

  p = jax.process_index()
  data = scenarios.make_batches(p, sizes[p])
  with gjs.iter_jax_batches(data, **kwargs) as it:
    full = scenarios.consume(it)
  with gjs.iter_jax_batches(data, **kwargs) as it:
    first = scenarios.consume(it, limit=k)
    state = json.loads(json.dumps(it.get_state()))
    # Prefetched-but-unconsumed batches must not leak into the state.
  with gjs.iter_jax_batches(data, **kwargs) as it2:
    it2.set_state(state)
    rest = scenarios.consume(it2)
  return {"full": full, "first": first, "rest": rest, "state": state}


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_resume_continues_exactly_across_hosts():
  # One launch: a state after 1 batch, then after 4; each case's own checks.
  sizes = [[8, 8, 8, 8, 8, 5], [8, 8, 8]]
  kwargs = {"batch_size": 8, "paddings": 0, "mask_key": "mask", "synchronize_lookahead": 3}
  cases = {f"k={k}": (run_resume, (sizes, kwargs, k), {}) for k in (1, 4)}
  checks = {f"k={k}": functools.partial(check_resume_continues_exactly, k=k) for k in (1, 4)}
  check_cases(run_cases(2, 4, cases), checks)


def check_resume_continues_exactly(outs, k):
  for out in outs:
    assert out["full"]["error"] is None and len(out["full"]["batches"]) == 6
    assert out["state"]["batches"] == k
    _assert_same_batches(out["first"]["batches"], out["full"]["batches"][:k])
    _assert_same_batches(out["rest"]["batches"], out["full"]["batches"][k:])


@pytest.mark.parametrize("prefetch", [0, 3])
def test_state_reflects_consumed_batches_not_prefetched(prefetch):
  data = scenarios.make_batches(0, [8] * 6)
  with gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch) as it:
    next(it)
    next(it)
    assert it.get_state()["source"] == {"index": 2}
    state = it.get_state()
    rest = [np.asarray(b["x"]) for b in it]
  with gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch) as it2:
    it2.set_state(state)
    again = [np.asarray(b["x"]) for b in it2]
  assert len(rest) == 4
  for a, b in zip(rest, again):
    np.testing.assert_array_equal(a, b)


class _GatedSource(scenarios_endings.StatefulSource):
  """A `StatefulSource` whose read of batch `gate_at` waits for `gate`."""

  def __init__(self, data, gate_at):
    super().__init__(data)
    self._gate_at = gate_at
    self.gate, self.waiting = threading.Event(), threading.Event()

  def __next__(self):
    if self._i == self._gate_at and not self.gate.is_set():
      self.waiting.set()
      assert self.gate.wait(30), "the gate never opened"
    return super().__next__()


def test_set_state_while_the_build_thread_reads_loses_no_batch():
  # A consumer with a step: the build thread reads ahead, and is inside the
  # source (batch 3) when `set_state` moves the source back to batch 1. The
  # stages stop before the source moves, so the read in flight cannot take
  # batch 1 from the restarted stream.
  data = scenarios.make_batches(0, [8] * 6)
  src = _GatedSource(data, gate_at=3)
  with gjs.iter_jax_batches(src, batch_size=8, prefetch_batches=2) as it:
    next(it)
    state = it.get_state()
    for _ in range(2):
      time.sleep(0.05)  # A training step: reads move to the build thread.
      next(it)
    assert src.waiting.wait(30)
    threading.Timer(0.3, src.gate.set).start()
    it.set_state(state)
    rest = [np.asarray(b["x"]) for b in it]
  assert len(rest) == 5
  for got, want in zip(rest, data[1:], strict=True):
    np.testing.assert_array_equal(got, want["x"])


def test_get_state_on_generator_source_raises_clearly():
  it = gjs.iter_jax_batches((b for b in scenarios.make_batches(0, [8])), batch_size=8)
  with pytest.raises(RuntimeError, match="cannot report its position"):
    it.get_state()
  it.close()


def test_set_state_rejects_other_process_count():
  it = gjs.iter_jax_batches(scenarios.make_batches(0, [8]), batch_size=8)
  with pytest.raises(ValueError, match="process_count=2"):
    it.set_state(
      {"version": 1, "batches": 0, "process_index": 0, "process_count": 2, "source": {"index": 0}}
    )
  it.close()


class _StateTurnsOpaque:
  """An iterator whose state is JSON for its first 2 batches, then an object."""

  def __init__(self, n):
    self._i, self._n = 0, n

  def __iter__(self):
    return self

  def __next__(self):
    if self._i >= self._n:
      raise StopIteration
    self._i += 1
    return {"x": np.full(8, self._i, np.int32)}

  def get_state(self):
    return {"i": self._i} if self._i < 2 else {"i": object()}

  def set_state(self, state):
    self._i = state["i"]


def test_a_state_that_stops_being_json_raises_when_asked_for_naming_the_source():
  # Only the first state is checked while iterating; later ones are checked
  # when a checkpoint asks for them, not each batch.
  it = gjs.iter_jax_batches(_StateTurnsOpaque(4), batch_size=8, prefetch_batches=0)
  next(it)
  assert it.get_state()["source"] == {"i": 1}
  assert [int(np.asarray(b["x"])[0]) for b in it] == [2, 3, 4]
  with pytest.raises(
    RuntimeError, match=r"the state of an iterator of type _StateTurnsOpaque is not"
  ):
    it.get_state()
  it.close()


class _LiveState:
  """An iterator whose get_state() returns its own dict, which reads then change."""

  def __init__(self, n=40):
    self._state = {"next": 0, "seen": []}
    self._n = n

  def __iter__(self):
    return self

  def __next__(self):
    i = self._state["next"]
    if i >= self._n:
      raise StopIteration
    self._state["next"] = i + 1
    self._state["seen"].append(i)
    return {"x": np.full((8,), i, np.int32)}

  def get_state(self):
    return self._state

  def set_state(self, state):
    self._state = {"next": state["next"], "seen": list(state["seen"])}


def _grain_live_state():
  import grain

  class LiveGrain(grain.DatasetIterator):
    def __init__(self):
      super().__init__()
      self._inner = _LiveState()

    def __next__(self):
      return next(self._inner)

    def get_state(self):
      return self._inner.get_state()

    def set_state(self, state):
      self._inner.set_state(state)

  return LiveGrain()


@pytest.mark.parametrize("make", [_LiveState, _grain_live_state], ids=["iterator", "grain"])
def test_a_live_state_dict_is_copied_so_the_read_ahead_does_not_leak_into_it(make):
  # The build thread reads ahead while the consumer steps: the state kept
  # beside each batch must be that batch's, not the iterator's latest.
  it = gjs.iter_jax_batches(make(), batch_size=8, prefetch_batches=2)
  for _ in range(3):
    next(it)
    time.sleep(0.1)
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  assert state["batches"] == 3 and state["source"] == {"next": 3, "seen": [0, 1, 2]}
  resumed = gjs.iter_jax_batches(make(), batch_size=8)
  resumed.set_state(state)
  assert [int(np.asarray(b["x"])[0]) for b in resumed] == list(range(3, 40))
  resumed.close()
