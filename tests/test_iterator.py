"""The core engine across real JAX processes: every rule of iter_jax_batches.

Topologies: 1 process x 8 devices (in-process, see conftest.py), 2 processes x
4 devices and 4 processes x 2 devices (real processes joined by
jax.distributed with gloo). Every check reads the rows of the global arrays.
"""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
import threading
import time

import grain
import numpy as np
import pytest
import scenarios
import scenarios_dropin
import scenarios_endings

import grain_jax_sync as gjs
from grain_jax_sync import testing

MULTI = [pytest.param(2, 4, id="2x4"), pytest.param(4, 2, id="4x2")]
TIMEOUT = 180


def wait_for_no_threads(deadline_s=10.0):
  end = time.monotonic() + deadline_s

  def names():
    return [t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync-")]

  while names() and time.monotonic() < end:
    time.sleep(0.01)
  return names()


def run(fn, n, d, *args, **kwargs):
  return testing.run_processes(
    fn, num_processes=n, devices_per_process=d, args=args, kwargs=kwargs, timeout_s=TIMEOUT
  )


def expected_x(sizes, out_index_to_source, target, pad):
  """Global 'x' for one output batch: per process its rows padded to target."""
  parts = []
  for p, src in enumerate(out_index_to_source):
    rows = np.full(target, pad, np.int64)
    if src is not None:
      n = sizes[p][src]
      rows[:n] = scenarios.rows_for(p, src, n)
    parts.append(rows)
  return np.concatenate(parts)


# -- equal batches ---------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_equal_batches_rows_in_process_order(n, d):
  sizes = [[8, 8, 8]] * n
  for out in testing.values(run(scenarios.run_iter, n, d, sizes, {"batch_size": 8})):
    assert out["error"] is None and len(out["batches"]) == 3
    for b, batch in enumerate(out["batches"]):
      want = expected_x(sizes, [b] * n, 8, 0)
      np.testing.assert_array_equal(batch["x"], want)
      np.testing.assert_array_equal(batch["y"], np.stack([want, -want], 1).astype(np.float32))
      assert batch["x"].dtype == np.int32


def test_single_process_takes_the_no_exchange_fast_path():
  from grain_jax_sync._src import exchange

  ex = exchange.make_exchange(synchronize=True, namespace=None)
  assert isinstance(ex, exchange.LocalExchange)
  assert ex.all_gather(0, "report") == ["report"]


def test_single_process_yields_rows_and_structure():
  data = scenarios.make_batches(0, [8, 16])
  with gjs.iter_jax_batches(data, batch_size=16) as it:
    out = list(it)
  assert [o["x"].shape for o in out] == [(8,), (16,)]
  np.testing.assert_array_equal(np.asarray(out[1]["x"]), scenarios.rows_for(0, 1, 16))
  assert out[1]["y"].sharding.spec == gjs.default_sharding().spec
  assert len(out[1]["x"].addressable_shards) == 8


# -- uneven numbers of batches -----------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_uneven_counts_with_paddings_yield_masked_dummies(n, d):
  sizes = [[8, 8, 4]] + [[8]] * (n - 1)
  kwargs = {"batch_size": 8, "paddings": {"x": -1, "y": 0.5}, "mask_key": "mask"}
  for out in testing.values(run(scenarios.run_iter, n, d, sizes, kwargs)):
    assert out["error"] is None and len(out["batches"]) == 3
    for b, batch in enumerate(out["batches"]):
      src = [b] + [b if b == 0 else None] * (n - 1)
      want = expected_x(sizes, src, 8, -1)
      np.testing.assert_array_equal(batch["x"], want)
      real = np.concatenate(
        [np.arange(8) < (sizes[p][s] if s is not None else 0) for p, s in enumerate(src)]
      )
      np.testing.assert_array_equal(batch["mask"], real)
      np.testing.assert_array_equal(
        batch["y"][~real], np.full((int((~real).sum()), 2), 0.5, np.float32)
      )


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_uneven_counts_with_drop_last_stop_at_shortest(n, d):
  sizes = [[8, 8, 8]] + [[8, 8]] * (n - 1)
  for out in testing.values(
    run(scenarios.run_iter, n, d, sizes, {"batch_size": 8, "drop_last": True})
  ):
    assert out["error"] is None and len(out["batches"]) == 2
    np.testing.assert_array_equal(out["batches"][1]["x"], expected_x(sizes, [1] * n, 8, 0))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_uneven_counts_without_options_raise_on_every_host(n, d):
  sizes = [[8, 8]] + [[8]] * (n - 1)
  outs = testing.values(run(scenarios.run_iter, n, d, sizes, {"batch_size": 8}))
  for out in outs:
    assert out["error_type"] == "ValueError"
    assert out["error"].startswith("Uneven number of batches detected across JAX workers: ")
    assert "ran out of data at batch 1 while process 0 still has batches" in out["error"]
    assert len(out["batches"]) == 1
  assert len({o["error"] for o in outs}) == 1


# -- uneven row counts ---------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_uneven_rows_padded_to_batch_size_and_masked(n, d):
  sizes = [[8, 6 - 2 * (p % 2)] for p in range(n)]
  kwargs = {"batch_size": 8, "paddings": 0, "mask_key": "mask"}
  for out in testing.values(run(scenarios.run_iter, n, d, sizes, kwargs)):
    last = out["batches"][1]
    np.testing.assert_array_equal(last["x"], expected_x(sizes, [1] * n, 8, 0))
    want_mask = np.concatenate([np.arange(8) < sizes[p][1] for p in range(n)])
    np.testing.assert_array_equal(last["mask"], want_mask)


def test_single_process_pads_short_batch_and_masks_it():
  data = scenarios.make_batches(0, [8, 5])
  with gjs.iter_jax_batches(
    data, batch_size=8, paddings={"x": -1, "y": 9.0}, mask_key="mask"
  ) as it:
    out = list(it)
  assert len(out) == 2
  np.testing.assert_array_equal(
    np.asarray(out[1]["x"]), np.r_[scenarios.rows_for(0, 1, 5), [-1] * 3]
  )
  np.testing.assert_array_equal(np.asarray(out[1]["y"])[5:], np.full((3, 2), 9.0))
  np.testing.assert_array_equal(np.asarray(out[1]["mask"]), np.arange(8) < 5)
  np.testing.assert_array_equal(np.asarray(out[0]["mask"]), np.ones(8, bool))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_uneven_rows_without_paddings_raise_range(n, d):
  sizes = [[8]] + [[4]] * (n - 1)
  for out in testing.values(run(scenarios.run_iter, n, d, sizes, {"batch_size": 8})):
    assert out["error_type"] == "ValueError"
    assert out["error"].startswith("Uneven batch sizes detected across JAX workers at batch 0")
    assert "host batch sizes range from 4 to 8" in out["error"]


@pytest.mark.multiprocess
def test_rows_not_divisible_by_local_devices_raise_everywhere():
  outs = testing.values(run(scenarios.run_iter, 2, 4, [[6], [6]], {"batch_size": 8}))
  for out in outs:
    assert out["error_type"] == "ValueError"
    assert out["error"].startswith(
      "The local batch size (6) must be evenly divisible by the number of local JAX devices (4)"
    )
    assert "batch 0 has 6 rows per host, not divisible by process 0's 4 data shards" in out["error"]


def test_single_process_rows_not_divisible_raise():
  with pytest.raises(
    ValueError,
    match=r"^The local batch size \(6\) must be evenly divisible by the number of local JAX"
    r" devices \(8\) of process 0: batch 0 has 6 rows per host",
  ):
    list(gjs.iter_jax_batches(scenarios.make_batches(0, [6]), batch_size=8))


# -- the reference's defects ---------------------------------------------------------


@pytest.mark.multiprocess
def test_drop_last_without_sync_drops_short_final_batch_two_hosts():
  sizes = [[8, 8, 5], [8, 8, 3]]
  kwargs = {"drop_last": True, "batch_size": 8, "synchronize_batches": False}
  for out in testing.values(run(scenarios.run_iter, 2, 4, sizes, kwargs, compat=True)):
    assert out["error"] is None and len(out["batches"]) == 2
    np.testing.assert_array_equal(out["batches"][1]["x"], expected_x(sizes, [1, 1], 8, 0))


def test_drop_last_without_sync_drops_short_final_batch_one_host():
  out = list(
    gjs.jax_sync_generator(scenarios.make_batches(0, [8, 8, 5]), drop_last=True, batch_size=8)
  )
  assert len(out) == 2
  np.testing.assert_array_equal(np.asarray(out[1]["x"]), scenarios.rows_for(0, 1, 8))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
  ("variants", "needle"),
  [
    (["plain", "extra_column"], "columns only in the second: ['extra']"),
    (["plain", "float"], "column 'x': dtype int32 vs float32"),
  ],
)
def test_structure_mismatch_raises_naming_processes_and_columns(variants, needle):
  outs = testing.values(run(scenarios.run_structured, 2, 4, variants, {"batch_size": 4}))
  for out in outs:
    assert out["error_type"] == "ValueError"
    assert "processes 0 and 1 yield batches of different structure" in out["error"]
    assert needle in out["error"]
    assert out["batches"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_empty_host_with_paddings_builds_dummies_from_peer_structure(n, d):
  sizes = [[8, 8]] + [[]] * (n - 1)
  kwargs = {"batch_size": 8, "paddings": {"x": -7, "y": 0}, "mask_key": "mask"}
  for out in testing.values(run(scenarios.run_iter, n, d, sizes, kwargs)):
    assert out["error"] is None and len(out["batches"]) == 2
    for b, batch in enumerate(out["batches"]):
      np.testing.assert_array_equal(batch["x"], expected_x(sizes, [b] + [None] * (n - 1), 8, -7))
      np.testing.assert_array_equal(batch["mask"], np.arange(8 * n) < 8)
      assert batch["y"].shape == (8 * n, 2)


@pytest.mark.multiprocess
def test_empty_host_compat_generator_synchronized():
  sizes = [[8], []]
  kwargs = {"drop_last": False, "batch_size": 8, "paddings": 0, "synchronize_batches": True}
  outs = testing.values(run(scenarios.run_iter, 2, 4, sizes, kwargs, compat=True))
  for out in outs:
    assert out["error"] is None and len(out["batches"]) == 1
    np.testing.assert_array_equal(out["batches"][0]["x"], expected_x(sizes, [0, None], 8, 0))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_source_failure_raises_promptly_on_every_host(n, d):
  sizes = [[8, 8, 8]] * n
  outs = testing.values(
    run(scenarios.run_failing, n, d, sizes, {1: 2}, {"batch_size": 8, "synchronize_lookahead": 10})
  )
  assert outs[1]["error_type"] == "KeyError" and "record 2 is missing" in outs[1]["error"]
  for p, out in enumerate(outs):
    assert len(out["batches"]) == 2  # Batches before the failure, on every host.
    assert out["elapsed_s"] < 60
    if p != 1:
      assert out["error_type"] == "RuntimeError"
      assert "process 1 failed while reading batch 2 from its source: KeyError" in out["error"]


def test_paddings_batch_size_not_divisible_checked_before_first_batch():
  with pytest.raises(
    ValueError,
    match="`batch_size` must be divisible by the 8 local devices when `paddings` is given, got 6",
  ):
    gjs.iter_jax_batches([], batch_size=6, paddings=0)
  gen = gjs.jax_sync_generator([{"x": np.zeros(8)}], drop_last=False, batch_size=6, paddings=0)
  with pytest.raises(ValueError, match="got 6"):
    next(gen)


# -- dtypes, pytrees, mask -----------------------------------------------------------


@pytest.mark.multiprocess
def test_dtypes_per_column_across_hosts():
  sizes = [[8], [8]]
  kwargs = {"batch_size": 8, "dtypes": {"x": "int16", "y": "bfloat16"}}
  for out in testing.values(run(scenarios.run_iter, 2, 4, sizes, kwargs)):
    batch = out["batches"][0]
    assert batch["x"].dtype == np.int16 and batch["y"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(batch["x"], expected_x(sizes, [0, 0], 8, 0))


def test_dtypes_scalar_and_bare_array_batches():
  data = [np.arange(8, dtype=np.float64).reshape(8, 1) for _ in range(2)]
  out = list(gjs.iter_jax_batches(data, batch_size=8, dtypes="float16"))
  assert out[0].dtype == np.float16 and out[0].shape == (8, 1)
  np.testing.assert_array_equal(np.asarray(out[1])[:, 0], np.arange(8))


@pytest.mark.multiprocess
def test_nested_pytree_batches_keep_structure_across_hosts():
  outs = testing.values(
    run(scenarios.run_structured, 2, 4, ["nested", "nested"], {"batch_size": 4})
  )
  for out in outs:
    batch = out["batches"][1]
    x = np.concatenate([scenarios.rows_for(p, 1, 4) for p in range(2)])
    np.testing.assert_array_equal(batch["a"]["ids"], x)
    assert isinstance(batch["a"]["pair"], tuple) and isinstance(batch["b"], list)
    np.testing.assert_array_equal(batch["a"]["pair"][0], 2 * x)
    assert batch["a"]["pair"][1].shape == (8, 1)
    np.testing.assert_array_equal(batch["b"][0], x + 1)


def test_mask_key_requires_dict_batches():
  with pytest.raises(ValueError, match="`mask_key`='mask' needs dict batches"):
    list(gjs.iter_jax_batches([np.zeros(8)], batch_size=8, mask_key="mask"))


def test_paddings_dict_with_unknown_column_raises():
  with pytest.raises(
    ValueError, match=r"`paddings` names columns that the batches do not have: \['z'\]"
  ):
    list(
      gjs.iter_jax_batches(
        scenarios.make_batches(0, [8]), batch_size=8, paddings={"x": 0, "y": 0, "z": 1}
      )
    )


def test_a_bare_array_batch_takes_a_one_entry_dict_whatever_its_key_as_the_reference_does():
  data = [np.arange(8, dtype=np.int64), np.arange(5, dtype=np.int64)]
  out = list(gjs.iter_jax_batches(data, batch_size=8, paddings={"any": 7}, dtypes={"x": "int8"}))
  assert [a.dtype for a in out] == [np.int8, np.int8]
  assert np.asarray(out[1]).tolist() == [0, 1, 2, 3, 4, 7, 7, 7]
  with pytest.raises(
    ValueError, match=r"`dtypes` for a single-array batch must be a scalar or a dict with one entry"
  ):
    list(gjs.iter_jax_batches(data, batch_size=8, dtypes={"a": "int8", "b": "int16"}))


def test_empty_batches_are_skipped():
  data = [{"x": np.zeros(0)}, {}, {"x": np.arange(8)}]
  out = list(gjs.iter_jax_batches(data, batch_size=8))
  assert len(out) == 1 and np.asarray(out[0]["x"]).tolist() == list(range(8))


# -- state -------------------------------------------------------------------------


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.multiprocess
@pytest.mark.parametrize("k", [1, 4])
def test_resume_continues_exactly_across_hosts(k):
  sizes = [[8, 8, 8, 8, 8, 5], [8, 8, 8]]
  kwargs = {"batch_size": 8, "paddings": 0, "mask_key": "mask", "synchronize_lookahead": 3}
  for out in testing.values(run(scenarios.run_resume, 2, 4, sizes, kwargs, k)):
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


# -- paddings without a mask ---------------------------------------------------------


@pytest.mark.parametrize(
  ("kwargs", "warnings"),
  [
    ({"paddings": 0}, 1),
    ({"paddings": 0, "mask_key": None}, 0),
    ({"paddings": 0, "mask_key": "mask"}, 0),
    ({}, 0),
  ],
)
def test_paddings_without_mask_key_warn_once_unless_none_is_passed(caplog, kwargs, warnings):
  data = scenarios.make_batches(0, [8, 5] if kwargs else [8, 8])
  with (
    caplog.at_level("WARNING", logger="grain_jax_sync"),
    gjs.iter_jax_batches(data, batch_size=8, **kwargs) as it,
  ):
    got = list(it)
  assert caplog.text.count("indistinguishable from real rows") == warnings
  assert [b["x"].shape for b in got] == [(8,), (8,)]


@pytest.mark.parametrize(
  ("kwargs", "shapes"),
  [
    ({}, [(16,), (8,)]),
    ({"paddings": 0, "mask_key": None}, [(16,), (16,)]),
    ({"drop_last": True}, [(16,)]),
  ],
)
def test_batch_size_left_unset_is_the_first_batch_size_with_paddings_or_drop_last(kwargs, shapes):
  data = scenarios.make_batches(0, [16, 8])
  with gjs.iter_jax_batches(data, **kwargs) as it:
    assert [b["x"].shape for b in it] == shapes


# -- the full batch size derived, exact "last batch" -------------------------------------


def test_without_batch_size_paddings_pad_to_the_first_batch_and_resume_keeps_it():
  data = scenarios.make_batches(0, [24, 24, 16])
  kwargs = {"paddings": -1, "mask_key": "mask"}
  with gjs.iter_jax_batches(data, **kwargs) as it:
    got = list(it)
  assert [b["x"].shape for b in got] == [(24,)] * 3
  np.testing.assert_array_equal(np.asarray(got[2]["mask"]), np.arange(24) < 16)
  with gjs.iter_jax_batches(data, **kwargs) as it:
    next(it)
    next(it)
    state = it.get_state()
  with gjs.iter_jax_batches(data, **kwargs) as it:
    it.set_state(state)  # Resumed before the short batch: still judged by 24.
    rest = list(it)
  assert [b["x"].shape for b in rest] == [(24,)]
  np.testing.assert_array_equal(np.asarray(rest[0]["mask"]), np.arange(24) < 16)


def test_without_batch_size_drop_last_drops_only_the_short_last_batch():
  data = scenarios.make_batches(0, [24, 24, 16])
  with gjs.iter_jax_batches(data, drop_last=True) as it:
    assert [b["x"].shape for b in it] == [(24,), (24,)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_drop_last_short_batch_that_is_not_the_last_raises_naming_both_sizes(prefetch):
  data = scenarios.make_batches(0, [24, 16, 24])
  with (
    pytest.raises(
      ValueError, match=r"process 0, batch 1: 16 rows, fewer than the full batch size 24"
    ),
    gjs.iter_jax_batches(data, batch_size=24, drop_last=True, prefetch_batches=prefetch) as it,
  ):
    list(it)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_single_process_decisions_reused_for_repeated_sizes_keep_positions_and_masks(prefetch):
  # One process reuses the decision for a window of the same sizes; an error
  # must still name its own batch, and every padded batch its own mask.
  data = scenarios.make_batches(0, [8] * 12 + [4, 8])
  with (
    pytest.raises(ValueError, match=r"process 0, batch 12: 4 rows, fewer than the full"),
    gjs.iter_jax_batches(data, batch_size=8, drop_last=True, prefetch_batches=prefetch) as it,
  ):
    list(it)
  data = scenarios.make_batches(0, [8, 4, 8, 4, 8, 4])
  kw = {"batch_size": 8, "paddings": -1, "mask_key": "m", "prefetch_batches": prefetch}
  with gjs.iter_jax_batches(data, **kw) as it:
    got = [(np.asarray(b["x"]), np.asarray(b["m"])) for b in it]
  assert len(got) == len(data)
  for (x, m), batch in zip(got, data, strict=True):
    n = len(batch["x"])
    np.testing.assert_array_equal(x[:n], batch["x"])
    assert (x[n:] == -1).all()
    np.testing.assert_array_equal(m, np.arange(8) < n)


_SIZES: dict = {}


def _size_outs(prefetch):
  if prefetch not in _SIZES:
    _SIZES[prefetch] = testing.values(
      testing.run_processes(
        scenarios_dropin.run_size_cases,
        num_processes=2,
        devices_per_process=4,
        args=(prefetch,),
        timeout_s=180,
      )
    )
  return _SIZES[prefetch]


@pytest.mark.multiprocess
@pytest.mark.parametrize("short", [0, 1])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_two_processes_short_batch_that_is_not_the_last_raises_on_every_host(prefetch, short):
  outs = _size_outs(prefetch)
  case = f"short_not_last/{short}"
  for out in outs:
    res = out[case]
    assert res["error_type"] == "ValueError"
    assert f"process {short}, batch 1: 16 rows, fewer than the full batch size 24" in res["error"]
    assert len(res["batches"]) == 1
  assert outs[0][case]["error"] == outs[1][case]["error"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [0, 2])
def test_two_processes_without_batch_size_pad_or_drop_by_the_first_batch(prefetch):
  for out in _size_outs(prefetch):
    pad = out["derived_pad"]
    assert pad["error"] is None and [len(b["x"]) for b in pad["batches"]] == [48] * 3
    mask = pad["batches"][2]["mask"].tolist()
    assert mask == [True] * 16 + [False] * 8 + [True] * 24
    assert pad["batches"][2]["x"].tolist()[:24] == [*scenarios.rows_for(0, 2, 16), *[-1] * 8]
    drop = out["derived_drop"]
    assert drop["error"] is None and [len(b["x"]) for b in drop["batches"]] == [48, 48]
    assert out["state_batch_size"] == 24
    rest = out["resumed"]
    assert rest["error"] is None and [len(b["x"]) for b in rest["batches"]] == [48]
    assert rest["batches"][0]["mask"].tolist() == ([True] * 16 + [False] * 8) * 2


# -- batches that are registered pytree nodes ---------------------------------------


def test_a_registered_dataclass_batch_keeps_its_type_static_fields_and_none_leaves():
  import scenarios_pytree

  data = scenarios_pytree.make(0, [8, 8, 5], tag="eval")
  with gjs.iter_jax_batches(data, batch_size=8, paddings={"x": -1, "extra": 0}) as it:
    got = list(it)
  assert [type(b) for b in got] == [scenarios_pytree.Batch] * 3
  assert all(b.tag == "eval" and b.extra["none"] is None for b in got)
  assert np.asarray(got[2].x).tolist() == [20, 21, 22, 23, 24, -1, -1, -1]
  np.testing.assert_array_equal(np.asarray(got[1].extra["y"])[:, 1], -np.arange(10, 18))
  assert np.asarray(got[2].extra["y"])[5:].tolist() == [[0, 0]] * 3


def test_a_registered_dataclass_batch_names_its_columns_in_errors():
  import scenarios_pytree

  data = scenarios_pytree.make(0, [8, 8])
  data[1].extra["y"] = data[1].extra["y"].astype(np.float64)
  with pytest.raises(ValueError, match=r"batch 1.*column 'extra/y'.*float32"):
    list(gjs.iter_jax_batches(data, batch_size=8))


@pytest.mark.multiprocess
def test_two_processes_registered_dataclass_batches_and_an_empty_host():
  import scenarios_pytree

  sizes = [[8, 8], []]  # Process 1 builds dummy Batches from process 0's structure.
  kwargs = {"batch_size": 8, "paddings": 0}
  outs = testing.values(run(scenarios_pytree.run, 2, 4, sizes, kwargs, ["train", "train"]))
  for out in outs:
    assert out["error"] is None, out["error"]
    assert out["types"] == ["Batch", "Batch"] and out["tags"] == ["train", "train"]
    for b, batch in enumerate(out["batches"]):
      assert batch["x"].tolist() == [10 * b + r for r in range(8)] + [0] * 8
      assert batch["y"].shape == (16, 2) and batch["none"] is None
  # A static field that differs between hosts is a different structure: the
  # same error on every host.
  outs = testing.values(run(scenarios_pytree.run, 2, 4, [[8], [8]], kwargs, ["train", "eval"]))
  assert outs[0]["error"] == outs[1]["error"] and "structure" in outs[0]["error"]
  assert "Batch[('train',)]" in outs[0]["error"] and "Batch[('eval',)]" in outs[0]["error"]
  assert "'p':" not in outs[0]["error"]  # Named by the node, not by its pickled treedef.


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
def test_two_threads_share_one_iterator_from_its_first_batch(prefetch):
  # Unserialized, both threads started the stream (prefetch 2: two
  # pipelines) or ran the source generator at once (0: "generator already
  # executing", then a silent early end for the other thread).
  data = (({"x": np.full(8, b, np.int32)}) for b in range(2000))
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch)
  got, errors = _take_all_from_two_threads(it)
  it.close()
  assert errors == []
  assert sorted(got[0] + got[1]) == list(range(2000))
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
def test_set_state_or_reset_from_another_thread_takes_turns_with_next(prefetch, how):
  # Called while the consumer iterates: the stream ended silently (next()
  # marked it exhausted after the restart), or the batch in flight moved the
  # restored count on. Now the call waits for that next(), and the rows go on
  # from the restored batch with a count that matches the source.
  data = [{"x": np.full(8, i, np.int32)} for i in range(400)]
  with _switching_often():
    for _ in range(10):
      it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch)
      got: list[int] = []
      t = None
      done = None  # Batches received when the restore was seen done.
      for b in it:
        got.append(int(np.asarray(b["x"])[0]))
        if len(got) == 100:
          saved = it.get_state()
        if len(got) == 120:
          restore = functools.partial(it.set_state, saved) if how == "set_state" else it.reset
          t = threading.Thread(target=restore)
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


def test_close_from_a_signal_handler_takes_no_lock_the_interrupted_next_may_hold():
  # A SIGTERM handler runs in the consumer's thread between two bytecodes of
  # the interrupted `next()`, which may hold the build stage's lock (a plain
  # lock): close() took it and the process hung for good. Here the thread
  # holds the turn and that lock, as the handler finds them; the close is
  # finished when the turn ends, as `next()` ends it.
  data = [{"x": np.full(8, i, np.int32)} for i in range(400)]
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=2)
  assert int(np.asarray(next(it)["x"])[0]) == 0
  stage = it._life._stages._threads[0]  # The build stage.
  returned = threading.Event()

  def interrupted_next():
    it._life.take_turn("next()")
    try:
      with stage._cond:
        it.close()  # What the handler calls.
        returned.set()
    finally:
      it._life.give_turn()

  t = threading.Thread(target=interrupted_next, daemon=True)
  t.start()
  assert returned.wait(10), "close() from inside next() waited for a lock next() held"
  t.join(10)
  assert wait_for_no_threads() == []
  with pytest.raises(RuntimeError, match="the iterator is closed"):
    next(it)


def test_close_from_a_signal_handler_between_the_lines_of_next_returns_and_closes():
  # The handler lands in `next()` after it took its turn (the lifetime's lock
  # released or not): close() waited for the turn its own thread held, for good.
  data = [{"x": np.full(8, i, np.int32)} for i in range(400)]
  it = gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=2)
  next(it)
  returned = threading.Event()

  def handler_between_lines():
    it._life.take_turn("next()")  # As `__next__` holds it there.
    try:
      with it._life._lock:  # And between the lines that hold the lock.
        it.close()
        returned.set()
    finally:
      it._life.give_turn()

  t = threading.Thread(target=handler_between_lines, daemon=True)
  t.start()
  assert returned.wait(10), "close() waited for the lock its own thread held"
  t.join(10)
  assert [t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync")] == []
  with pytest.raises(RuntimeError, match="the iterator is closed"):
    next(it)


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
  assert time.monotonic() - start < 5.0 and box["inner_s"] < 1.0, box


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
