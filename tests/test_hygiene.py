"""Nothing left behind: threads, processes and exchange keys after every ending.

Across 2 real processes (`scenarios_faults.run_hygiene`) an iterator is
drained, closed early, left by a `with` block, ended by an agreed error, ended
by a source error, and garbage-collected; after each, once every process has
got there, no `grain_jax_sync` thread, no child process and no key under
``grain_jax_sync/`` in the coordination service's store may remain. In one
process the same holds for threads, and a Grain `DataLoader`'s worker
processes stop on `close()`.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref

import numpy as np
import psutil
import pytest
import scenarios
import scenarios_faults
from helpers import check_each

import grain_jax_sync as gjs
from grain_jax_sync import testing

ENDINGS = ["drained", "closed_early", "context", "error_no_close", "source_error_no_close"]
ENDINGS += ["collected"]


def check_nothing_left_behind_across_processes(outs, ending):
  for out in outs:
    left = dict(out[ending])
    streams = left.pop("streams")
    assert left == {"threads": [], "children": [], "keys": []}
    if ending.endswith("_no_close"):  # Still open (it may reset): only its own record.
      name = ending.removesuffix("_no_close")
      assert streams and all(s.startswith(f"grain_jax_sync/{name}/") for s in streams), streams
    else:
      assert streams == [], streams  # A closed iterator leaves nothing recorded.


def check_hygiene_cases_ended_as_intended(outs):
  for out in outs:
    assert out["drained_n"] == 12
    assert out["error_message"].startswith(
      "Uneven number of batches detected across JAX workers: process 0 ran out"
    )
  assert [out["source_error_type"] for out in outs] == ["OSError", "RuntimeError"]


@pytest.mark.multiprocess
@pytest.mark.timeout(210)
def test_nothing_left_behind_after_every_ending_across_processes():
  # One launch runs every ending (`run_hygiene`); each ending's own checks.
  outs = testing.values(
    testing.run_processes(
      scenarios_faults.run_hygiene, num_processes=2, devices_per_process=4, timeout_s=150
    )
  )
  calls = {
    ending: functools.partial(check_nothing_left_behind_across_processes, outs, ending)
    for ending in ENDINGS
  }
  calls["ended_as_intended"] = functools.partial(check_hygiene_cases_ended_as_intended, outs)
  check_each(calls)


# -- one process -------------------------------------------------------------------


def _our_threads():
  return [t for t in threading.enumerate() if t.name.startswith("grain_jax_sync")]


def _wait_for(predicate, timeout_s=10.0):
  deadline = time.monotonic() + timeout_s
  while not predicate() and time.monotonic() < deadline:
    time.sleep(0.05)
  return predicate()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_no_thread_left_after_an_exception(prefetch):
  data = scenarios.make_batches(0, [8, 8]) + [{"x": np.zeros(8), "y": "text"}]
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch)
  with pytest.raises(ValueError, match="process 0, batch 2, column 'y': leaf is a Python str"):
    for _ in it:
      pass
  assert _our_threads() == []  # Even before close().
  it.close()
  assert _our_threads() == []


def _raise_from(kind):
  def source():
    yield from scenarios.make_batches(0, [8, 8])
    if kind == "source":
      raise KeyError("boom")
    yield {"x": np.zeros(8), "y": "text"}

  return source()


def _catch_in_a_frame(kind, prefetch):
  """One iterator raises in this frame; another (started) stays in it."""
  failing = gjs.iter_jax_batches(_raise_from(kind), batch_size=8, prefetch_batches=prefetch)
  sibling = gjs.iter_jax_batches(scenarios.make_batches(0, [8] * 9), prefetch_batches=prefetch)
  next(sibling)
  try:
    for _ in failing:
      pass
  except (KeyError, ValueError) as e:
    assert "boom" in str(e) or "column 'y'" in str(e)
  return weakref.ref(failing), weakref.ref(sibling)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("kind", ["source", "bad_data"])
def test_iterators_in_a_frame_that_caught_an_ending_go_with_the_frame(kind, prefetch):
  # The ending's traceback held the library's frames, whose locals held the
  # ending: a cycle that kept the catching frame, and the iterators in it,
  # alive until a garbage collection (a peer waited for the sibling).
  gc.disable()
  try:
    failing, sibling = _catch_in_a_frame(kind, prefetch)
    assert failing() is None and sibling() is None  # Closed by their finalizers.
  finally:
    gc.enable()
  assert _wait_for(lambda: _our_threads() == [])


def test_no_thread_left_after_garbage_collection():
  it = gjs.iter_jax_batches(scenarios.make_batches(0, [8] * 20), batch_size=8, prefetch_batches=2)
  next(it)
  time.sleep(0.05)  # A step: the build thread starts (not before it is needed).
  next(it)
  assert len(_our_threads()) >= 1
  del it
  gc.collect()
  assert _wait_for(lambda: _our_threads() == [])


def test_no_thread_left_after_closing_mid_stream_with_a_blocked_consumer_queue():
  it = gjs.iter_jax_batches(scenarios.make_batches(0, [8] * 20), batch_size=8, prefetch_batches=1)
  next(it)
  time.sleep(0.2)  # Let the producer fill the queue and block on it.
  it.close()
  assert _our_threads() == []
  with pytest.raises(RuntimeError, match="closed"):
    next(it)


def _workers():
  """Child processes, less multiprocessing's resource tracker (it lives until exit)."""
  out = set()
  for child in psutil.Process().children(recursive=True):
    try:
      if not any("resource_tracker" in part for part in child.cmdline()):
        out.add(child.pid)
    except psutil.NoSuchProcess:
      pass
  return out


def test_grain_dataloader_workers_stop_on_close():
  from absl import flags

  if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags.
    flags.FLAGS.mark_as_parsed()
  loader = scenarios_faults.grain_shard("loader", 0, 1, 64, 8, worker_count=1)
  before = _workers()
  it = gjs.iter_jax_batches(loader, batch_size=8)
  batch = next(it)
  np.testing.assert_array_equal(np.asarray(batch["id"]), np.arange(8))
  assert _workers() - before  # A worker runs.
  it.close()
  assert _wait_for(lambda: not (_workers() - before))
  assert _our_threads() == []
