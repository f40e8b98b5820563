"""One (re)start of the stream (`session.Stream`): its threads, and their close in reverse.

Driven through the public API: the threads a start runs (none without
prefetch; the build thread, and with the key-value store the reading and
agreement threads), the order in which its close stops them (the user's end first), and
a restart (`reset`, `set_state`) stopping the old start before the new one runs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src import session

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
  it.close()  # Mid-stream, on every host at the same batch.
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
