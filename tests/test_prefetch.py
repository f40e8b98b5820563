"""Prefetch: order, state, exceptions and thread lifetime, in one and several processes.

Behaviour only; speed lives in benchmarks/.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest
import scenarios
import scenarios_perf
from helpers import check_each, run_cases

import grain_jax_sync as gjs
from grain_jax_sync._src import prefetch

TIMEOUT = 180


def xs(it):
  return [np.asarray(b["x"]) for b in it]


def wait_for_no_threads(deadline_s=5.0):
  end = time.monotonic() + deadline_s
  while scenarios_perf.library_threads() and time.monotonic() < end:
    time.sleep(0.01)
  return scenarios_perf.library_threads()


# -- one process --------------------------------------------------------------


@pytest.mark.parametrize("prefetch_batches", [1, 2, 5])
def test_prefetch_order_equals_no_prefetch_single_process(prefetch_batches):
  data = scenarios.make_batches(0, [8, 8, 4, 8, 8, 2, 8])
  kw = {"batch_size": 8, "paddings": -1, "mask_key": "m"}
  with gjs.iter_jax_batches(data, prefetch_batches=0, **kw) as it:
    want = xs(it)
  with gjs.iter_jax_batches(data, prefetch_batches=prefetch_batches, **kw) as it:
    got = xs(it)
  assert len(got) == len(want) == 7
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_state_after_k_batches_equals_no_prefetch_single_process(k):
  data = scenarios.make_batches(0, [8] * 6)
  states = []
  for pf in (0, 3):
    it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=pf)
    for _ in range(k):
      next(it)
    time.sleep(0.05)  # The prefetch thread runs ahead meanwhile.
    states.append(it.get_state())
    it.close()
  assert states[0] == states[1]
  assert states[0]["batches"] == k


def test_resume_from_state_with_prefetch_continues_exactly():
  data = scenarios.make_batches(0, [8] * 6)
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=3)
  first = [np.asarray(next(it)["x"]) for _ in range(2)]
  time.sleep(0.05)
  state = it.get_state()
  it.close()
  it2 = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=3)
  it2.set_state(state)
  rest = xs(it2)
  it2.close()
  with gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=0) as it3:
    want = xs(it3)
  for g, w in zip(first + rest, want, strict=True):
    np.testing.assert_array_equal(g, w)


def _exploding_source():
  yield {"x": np.arange(8)}
  yield {"x": np.arange(8)}
  raise KeyError("record 2 is corrupt")


@pytest.mark.parametrize("prefetch_batches", [0, 2])
def test_source_exception_reraised_in_consumer_with_original_traceback(prefetch_batches):
  it = gjs.iter_jax_batches(_exploding_source(), batch_size=8, prefetch_batches=prefetch_batches)
  got = 0
  with pytest.raises(KeyError, match="record 2 is corrupt") as info:
    for _ in it:
      got += 1
  assert got == 2
  frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
  assert "_exploding_source" in frames
  it.close()
  assert wait_for_no_threads() == []


def test_close_leaves_no_thread_single_process():
  data = scenarios.make_batches(0, [8] * 50)
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=2)
  next(it)
  time.sleep(0.05)  # A step: the build thread starts (not before it is needed).
  next(it)
  time.sleep(0.05)
  assert scenarios_perf.library_threads()  # Blocked on a full queue.
  it.close()
  assert scenarios_perf.library_threads() == []
  with pytest.raises(RuntimeError, match="closed"):
    next(it)


def test_dropped_iterator_leaves_no_thread_single_process():
  data = scenarios.make_batches(0, [8] * 50)
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=2)
  next(it)
  time.sleep(0.05)  # A step: the build thread starts.
  next(it)
  time.sleep(0.05)
  assert scenarios_perf.library_threads()
  del it
  gc.collect()
  assert wait_for_no_threads() == []


def test_prefetch_zero_starts_no_thread():
  data = scenarios.make_batches(0, [8] * 5)
  with gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=0) as it:
    next(it)
    assert scenarios_perf.library_threads() == []


def test_device_put_close_leaves_no_thread():
  grain = pytest.importorskip("grain")
  ds = grain.MapDataset.range(64).map(lambda i: {"x": np.int32(i)}).batch(8).to_iter_dataset()
  it = iter(gjs.device_put(ds, gjs.default_sharding(), batch_size=8))
  first = next(it)
  np.testing.assert_array_equal(np.asarray(first["x"]), np.arange(8))
  it.close()
  assert wait_for_no_threads() == []


def test_prefetcher_close_wakes_a_blocked_consumer():
  release = threading.Event()

  def producer():
    release.wait(10)
    yield 1

  p = prefetch.Prefetcher(producer(), buffer_size=1)
  result = []
  t = threading.Thread(target=lambda: result.append(list(p)))
  t.start()
  time.sleep(0.1)
  release.set()  # Lets the producer thread finish so close() can join it.
  p.close()
  t.join(5)
  assert not t.is_alive()
  assert not p.thread.is_alive()


@pytest.mark.parametrize("size", [1, 2, 5])
def test_prefetcher_produces_at_most_its_buffer_plus_the_one_in_hand(size):
  produced = []

  def producer():
    for i in range(100):
      produced.append(i)
      yield i

  p = prefetch.Prefetcher(producer(), buffer_size=size)
  deadline = time.monotonic() + 5
  while len(produced) < size + 1 and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.2)  # Room for a producer that would run further ahead.
  assert len(produced) == size + 1
  assert [next(p) for _ in range(3)] == [0, 1, 2]
  time.sleep(0.2)
  assert len(produced) == size + 4  # Three taken: three more produced, no more.
  p.close()
  assert not p.thread.is_alive()


def test_prefetcher_wake_takes_no_lock_and_wakes_the_consumer():
  # As a signal handler would: in the consumer's own thread, between two
  # lines; the consumer's next wait ends at once with StopIteration.
  gate = threading.Event()

  def producer():
    gate.wait(10)
    yield 1

  p = prefetch.Prefetcher(producer(), buffer_size=1)
  p.wake()
  t0 = time.monotonic()
  with pytest.raises(StopIteration):
    next(p)
  assert time.monotonic() - t0 < 5.0  # At once, not when the producer's 10 s gate opens.
  gate.set()
  p.close()
  assert not p.thread.is_alive()


def test_prefetcher_rejects_zero_buffer():
  with pytest.raises(ValueError, match="buffer_size"):
    prefetch.Prefetcher(iter([]), buffer_size=0)


# -- several processes ----------------------------------------------------------


def consume_with_state(
  sizes: list[list[int]], kwargs: dict[str, Any], *, k: int, delay_s: list[float] | None = None
) -> dict[str, Any]:
  """Consumes `k` batches; returns them (gathered) and the state after them."""

  p = jax.process_index()
  data = scenarios.make_batches(p, sizes[p])
  it = gjs.iter_jax_batches(data, **kwargs)
  got = []
  for _ in range(k):
    got.append(scenarios.gather(next(it)))
  if delay_s is not None:
    time.sleep(delay_s[p])  # Let the prefetch thread run ahead.
  state = it.get_state()
  it.close()
  return {"batches": got, "state": state, "threads": scenarios_perf.library_threads()}


STATE_SIZES = [[8, 8, 8, 4, 8, 8, 8, 8], [8, 8, 8, 8, 8, 2]]
STATE_KW = {"batch_size": 8, "paddings": 0, "mask_key": "m"}


def check_state_after_k_batches_equals_no_prefetch_two_processes(by_case, k):
  outs = {pf: by_case[f"state_k={k}_prefetch={pf}"] for pf in (0, 2)}
  for p in range(2):
    assert outs[0][p]["state"] == outs[2][p]["state"]
    assert outs[0][p]["state"]["batches"] == k
    for a, b in zip(outs[0][p]["batches"], outs[2][p]["batches"], strict=True):
      np.testing.assert_array_equal(a["x"], b["x"])
      np.testing.assert_array_equal(a["m"], b["m"])
    assert outs[2][p]["threads"] == []


def consume_all(
  sizes: list[list[int]], kwargs: dict[str, Any], *, delay_s: list[float]
) -> dict[str, Any]:
  """Drains an iterator over a source that sleeps `delay_s[process]` per batch."""

  p = jax.process_index()
  data = scenarios.make_batches(p, sizes[p])
  it = gjs.iter_jax_batches(scenarios_perf.slow(data, delay_s[p]), **kwargs)
  out = scenarios.consume(it)
  it.close()
  out["threads"] = scenarios_perf.library_threads()
  return out


TIMING_KW = {
  "prefetch0": {"prefetch_batches": 0},
  "prefetch2": {"prefetch_batches": 2},
  "lookahead1": {"prefetch_batches": 2, "synchronize_lookahead": 1},
  "lookahead3": {"prefetch_batches": 4, "synchronize_lookahead": 3},
}
# Process 0 reads slowly, process 1 quickly; uneven sizes and counts.
TIMING_SIZES = [[8, 4, 8, 8, 6, 8, 8], [8, 8, 8, 2, 8]]
TIMING_BASE = {"batch_size": 8, "paddings": -1, "mask_key": "m"}


def check_decisions_do_not_depend_on_timing_two_processes(by_case, name):
  want, got = by_case["timing_want"], by_case[f"timing_{name}"]
  for w, g in zip(want, got, strict=True):
    assert g["error"] is None and w["error"] is None
    assert len(g["batches"]) == len(w["batches"]) == 7
    for a, b in zip(w["batches"], g["batches"], strict=True):
      np.testing.assert_array_equal(a["x"], b["x"])
      np.testing.assert_array_equal(a["m"], b["m"])
    assert g["threads"] == []


def _endless(process: int, delay_s: float) -> Iterator[Any]:
  """Batches of 8 rows, one every `delay_s`, without end."""
  b = 0
  while True:
    time.sleep(delay_s)
    yield {"x": scenarios.rows_for(process, b, 8).astype(np.int32)}
    b += 1


def stop_half_way(mode: str, kwargs: dict[str, Any]) -> dict[str, Any]:
  """Takes 2 batches of an endless source, then closes or drops the iterator.

  Endless, so that the stage threads are still up (blocked on full buffers)
  when it stops: the agreement and build stages together hold up to a few
  hundred batches read ahead, and a finite source could be read to its end.
  """

  from grain_jax_sync._src.exchange import key_value

  p = jax.process_index()
  it = gjs.iter_jax_batches(_endless(p, 0.001), **kwargs)
  next(it)
  next(it)
  time.sleep(0.2)  # The threads are up and blocked on a full queue.
  during = scenarios_perf.library_threads()
  # A peer's close ends this host's stream (and its agreement thread): every
  # process looks before any closes.
  key_value.distributed_client().wait_at_barrier(f"half_way/{mode}/looked", 30_000)
  if mode == "close":
    it.close()
  else:
    del it
    gc.collect()
  return {"during": during, "after": scenarios_perf.library_threads()}


def check_stopped_half_way_leaves_no_thread_two_processes(by_case, mode):
  for o in by_case[f"stopped_half_way_{mode}"]:
    assert "grain_jax_sync-prefetch" in o["during"]
    assert "grain_jax_sync-agree" in o["during"]
    assert "grain_jax_sync-read" in o["during"]
    assert o["after"] == []


def _failing_source(process: int, fail_process: int, at: int) -> Iterator[Any]:
  for b, batch in enumerate(scenarios.make_batches(process, [8] * 6)):
    if process == fail_process and b == at:
      raise KeyError(f"bad record {b}")
    yield batch


def source_error(kwargs: dict[str, Any], *, fail_process: int = 0, at: int = 3) -> dict[str, Any]:
  """The source of `fail_process` raises KeyError at batch `at`."""

  p = jax.process_index()
  it = gjs.iter_jax_batches(_failing_source(p, fail_process, at), **kwargs)
  got = 0
  out: dict[str, Any] = {}
  try:
    for _ in it:
      got += 1
  except Exception as e:  # noqa: BLE001 - returned to the test.
    out["type"] = type(e).__qualname__
    out["message"] = str(e)
    out["frames"] = [f.name for f in traceback.extract_tb(e.__traceback__)]
  it.close()
  out["got"] = got
  out["threads"] = scenarios_perf.library_threads()
  return out


def check_source_exception_reraised_with_traceback_two_processes(by_case, prefetch_batches):
  p0, p1 = by_case[f"source_error_prefetch={prefetch_batches}"]
  assert p1["type"] == "KeyError" and "bad record 3" in p1["message"]
  assert "_failing_source" in p1["frames"]
  assert p0["type"] == "RuntimeError"
  assert "process 1" in p0["message"] and "KeyError" in p0["message"]
  assert p0["got"] == p1["got"] == 3
  assert p0["threads"] == p1["threads"] == []


def test_batches_deleted_by_the_consumer_do_not_stop_the_thread():
  # A training step that donates its batch deletes the arrays, which the
  # build thread may be waiting on (`wait_ready`, to time the consumer's
  # step from the transfer's end): that wait must count as done, and the
  # stream go on whole.
  data = [{"x": np.full((16, 4), i, np.float32)} for i in range(30)]
  it = gjs.iter_jax_batches(data, batch_size=16)
  got = []
  for batch in it:
    got.append(float(np.asarray(batch["x"])[0, 0]))
    for leaf in jax.tree_util.tree_leaves(batch):
      leaf.delete()
    time.sleep(0.005)  # A step: the thread builds ahead.
  it.close()
  assert got == [float(i) for i in range(30)]
  wait_for_no_threads()
  assert not scenarios_perf.library_threads()


def drop_three_while_the_fourth_is_read(kind: str, slow: int | None = None) -> dict[str, Any]:
  """Takes and drops 3 batches while the 4th is read; what is still held then.

  With `slow` (a process index), that process's read of the 4th takes 6 s
  and the others check while their agreement waits on it. Else every host's
  source blocks on its 4th until the check is done.
  """
  import grain

  gate, alive = threading.Event(), set()
  p = jax.process_index()

  def make(i):
    if i == 3 and slow is None:
      assert gate.wait(30)
    if i == 3 and slow == p:
      time.sleep(6)
    x = np.full((16, 4), i, np.float32)
    alive.add(i)
    weakref.finalize(x, alive.discard, i)
    return {"x": x}

  if kind == "iter_jax_batches":
    it = gjs.iter_jax_batches((make(i) for i in range(5)), batch_size=16)
  else:
    ds = grain.MapDataset.range(5).map(make)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    it = iter(gjs.device_put(ds, gjs.default_sharding(), cpu_buffer_size=4, device_buffer_size=2))
  got, dropped = [], []
  for _ in range(3):
    batch = next(it)
    got.append(float(np.asarray(batch["x"].addressable_data(0))[0, 0]))
    dropped.append(weakref.ref(batch["x"]))
    del batch
  end = time.monotonic() + 3
  while (alive & {0, 1, 2} or any(r() is not None for r in dropped)) and time.monotonic() < end:
    gc.collect()
    time.sleep(0.01)
  host, built = sorted(alive & {0, 1, 2}), [i for i, r in enumerate(dropped) if r() is not None]
  gate.set()
  got += [float(np.asarray(b["x"].addressable_data(0))[0, 0]) for b in it]
  return {"got": got, "host": host, "built": built}


@pytest.mark.parametrize("kind", ["iter_jax_batches", "device_put"])
def test_a_batch_the_consumer_dropped_is_freed_while_the_source_reads_the_next(kind):
  # Host batches and global batches are large: once built, a host batch is
  # the library's no more, and once taken and dropped, a global batch is
  # freed, even while every thread waits on a slow read of the next.
  out = drop_three_while_the_fourth_is_read(kind)
  assert out == {"got": [0.0, 1.0, 2.0, 3.0, 4.0], "host": [], "built": []}


def check_a_batch_the_consumer_dropped_is_freed_while_the_decider_waits_on_a_peer(by_case):
  # Across the exchange: process 0's decider, waiting on process 1's slow
  # read, holds no run it handed to its build thread.
  p0, p1 = by_case["dropped_while_a_peer_reads"]
  assert p0 == {"got": [0.0, 1.0, 2.0, 3.0, 4.0], "host": [], "built": []}
  assert p1["got"] == [0.0, 1.0, 2.0, 3.0, 4.0]


# -- every real-process case in one launch, each with its own checks --------------------


def prefetch_cases() -> dict[str, tuple[Any, tuple, dict[str, Any]]]:
  cases: dict[str, tuple[Any, tuple, dict[str, Any]]] = {}
  for k in (1, 4):
    for pf in (0, 2):
      kw = {**STATE_KW, "prefetch_batches": pf}
      cases[f"state_k={k}_prefetch={pf}"] = (
        consume_with_state, (STATE_SIZES, kw), {"k": k, "delay_s": [0.1, 0.1]}
      )  # fmt: skip
  cases["timing_want"] = (consume_all, (TIMING_SIZES, TIMING_BASE), {"delay_s": [0.0, 0.0]})
  for name, kw in TIMING_KW.items():
    cases[f"timing_{name}"] = (
      consume_all, (TIMING_SIZES, {**TIMING_BASE, **kw}), {"delay_s": [0.01, 0.0]}
    )  # fmt: skip
  for mode in ("close", "drop"):
    cases[f"stopped_half_way_{mode}"] = (
      stop_half_way, (mode, {"batch_size": 8, "prefetch_batches": 2}), {}
    )  # fmt: skip
  for pf in (0, 2):
    cases[f"source_error_prefetch={pf}"] = (
      source_error, ({"batch_size": 8, "prefetch_batches": pf},), {"fail_process": 1, "at": 3}
    )  # fmt: skip
  cases["dropped_while_a_peer_reads"] = (
    drop_three_while_the_fourth_is_read, ("iter_jax_batches",), {"slow": 1}
  )  # fmt: skip
  return cases


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_prefetch_matches_no_prefetch_and_leaves_no_thread_two_processes():
  values = run_cases(2, 4, prefetch_cases(), timeout_s=2 * TIMEOUT)
  by_case = {case: [v[case] for v in values] for case in values[0]}
  calls = {
    f"state_k={k}": functools.partial(
      check_state_after_k_batches_equals_no_prefetch_two_processes, by_case, k
    )
    for k in (1, 4)
  }
  for name in TIMING_KW:
    calls[f"timing_{name}"] = functools.partial(
      check_decisions_do_not_depend_on_timing_two_processes, by_case, name
    )
  for mode in ("close", "drop"):
    calls[f"stopped_half_way_{mode}"] = functools.partial(
      check_stopped_half_way_leaves_no_thread_two_processes, by_case, mode
    )
  for pf in (0, 2):
    calls[f"source_error_prefetch={pf}"] = functools.partial(
      check_source_exception_reraised_with_traceback_two_processes, by_case, pf
    )
  calls["dropped_while_a_peer_reads"] = functools.partial(
    check_a_batch_the_consumer_dropped_is_freed_while_the_decider_waits_on_a_peer, by_case
  )
  check_each(calls)
