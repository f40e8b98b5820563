"""The core engine across real JAX processes: every rule of iter_jax_batches.

Topologies: 1 process x 8 devices (in-process, see conftest.py), 2 processes x
4 devices and 4 processes x 2 devices (real processes joined by
jax.distributed with gloo). Every check reads the rows of the global arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import pytest
import scenarios
from helpers import MULTI, run

import grain_jax_sync as gjs
from grain_jax_sync import testing


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


def run_failing(
  sizes: list[list[int]], fail_at: dict[int, int], kwargs: dict[str, Any]
) -> dict[str, Any]:
  """In each process: process p's source raises at batch fail_at[p] (if given)."""
  import jax

  p = jax.process_index()
  data = scenarios.make_batches(p, sizes[p])
  source = scenarios.FailingSource(data, fail_at[p]) if p in fail_at else data
  with gjs.iter_jax_batches(source, **kwargs) as it:
    return scenarios.consume(it)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_source_failure_raises_promptly_on_every_host(n, d):
  sizes = [[8, 8, 8]] * n
  outs = testing.values(
    run(run_failing, n, d, sizes, {1: 2}, {"batch_size": 8, "synchronize_lookahead": 10})
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


def test_empty_batches_are_skipped():
  data = [{"x": np.zeros(0)}, {}, {"x": np.arange(8)}]
  out = list(gjs.iter_jax_batches(data, batch_size=8))
  assert len(out) == 1 and np.asarray(out[0]["x"]).tolist() == list(range(8))


# -- batches that are registered pytree nodes ---------------------------------------


# Registered at import (JAX at the top: grain_jax_sync imports it anyway).
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
  """A batch as a registered dataclass, with a static field and a None leaf."""

  x: np.ndarray
  extra: dict[str, Any]
  tag: str = dataclasses.field(default="train", metadata={"static": True})


def make(process: int, sizes: list[int], tag: str = "train") -> list[Batch]:
  out = []
  for b, n in enumerate(sizes):
    x = scenarios.rows_for(process, b, n).astype(np.int32)
    out.append(Batch(x, {"y": np.stack([x, -x], axis=1).astype(np.float32), "none": None}, tag))
  return out


def test_a_registered_dataclass_batch_keeps_its_type_static_fields_and_none_leaves():
  data = make(0, [8, 8, 5], tag="eval")
  with gjs.iter_jax_batches(data, batch_size=8, paddings={"x": -1, "extra": 0}) as it:
    got = list(it)
  assert [type(b) for b in got] == [Batch] * 3
  assert all(b.tag == "eval" and b.extra["none"] is None for b in got)
  assert np.asarray(got[2].x).tolist() == [20, 21, 22, 23, 24, -1, -1, -1]
  np.testing.assert_array_equal(np.asarray(got[1].extra["y"])[:, 1], -np.arange(10, 18))
  assert np.asarray(got[2].extra["y"])[5:].tolist() == [[0, 0]] * 3


def test_a_registered_dataclass_batch_names_its_columns_in_errors():
  data = make(0, [8, 8])
  data[1].extra["y"] = data[1].extra["y"].astype(np.float64)
  with pytest.raises(ValueError, match=r"batch 1.*column 'extra/y'.*float32"):
    list(gjs.iter_jax_batches(data, batch_size=8))


def run_dataclass_batches(
  per_process_sizes: list[list[int]], kwargs: dict[str, Any], tags: list[str]
) -> dict[str, Any]:
  """In each process: iter_jax_batches over `Batch` batches; host p's static field is tags[p]."""
  import jax

  p = jax.process_index()
  with gjs.iter_jax_batches(make(p, per_process_sizes[p], tags[p]), **kwargs) as it:
    out = scenarios.consume(it)
  out["types"] = [type(b).__name__ for b in out["batches"]]
  out["tags"] = [b.tag for b in out["batches"]]
  out["batches"] = [{"x": b.x, "y": b.extra["y"], "none": b.extra["none"]} for b in out["batches"]]
  return out


@pytest.mark.multiprocess
def test_two_processes_registered_dataclass_batches_and_an_empty_host():
  sizes = [[8, 8], []]  # Process 1 builds dummy Batches from process 0's structure.
  kwargs = {"batch_size": 8, "paddings": 0}
  outs = testing.values(run(run_dataclass_batches, 2, 4, sizes, kwargs, ["train", "train"]))
  for out in outs:
    assert out["error"] is None, out["error"]
    assert out["types"] == ["Batch", "Batch"] and out["tags"] == ["train", "train"]
    for b, batch in enumerate(out["batches"]):
      assert batch["x"].tolist() == [10 * b + r for r in range(8)] + [0] * 8
      assert batch["y"].shape == (16, 2) and batch["none"] is None
  # A static field that differs between hosts is a different structure: the
  # same error on every host.
  outs = testing.values(run(run_dataclass_batches, 2, 4, [[8], [8]], kwargs, ["train", "eval"]))
  assert outs[0]["error"] == outs[1]["error"] and "structure" in outs[0]["error"]
  assert "Batch[('train',)]" in outs[0]["error"] and "Batch[('eval',)]" in outs[0]["error"]
  assert "'p':" not in outs[0]["error"]  # Named by the node, not by its pickled treedef.
