"""The core engine across real JAX processes: every rule of iter_jax_batches.

Topologies: 1 process x 8 devices (in-process, see conftest.py), 2 processes x
4 devices and 4 processes x 2 devices (real processes joined by
jax.distributed with gloo). Every check reads the rows of the global arrays.
Each topology's real-process cases run in turn in one launch
(`test_every_rule_holds_across_real_processes`); a `check_*` function holds
each case's assertions, and a failure names the case.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
import pytest
import scenarios
from helpers import MULTI, TIMEOUT, check_cases, run_cases

import grain_jax_sync as gjs


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


def _equal_sizes(n):
  return [[8, 8, 8]] * n


def check_equal_batches_rows_in_process_order(outs, n):
  sizes = _equal_sizes(n)
  for out in outs:
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


def _uneven_counts_sizes(n):
  return [[8, 8, 4]] + [[8]] * (n - 1)


UNEVEN_COUNTS_KW = {"batch_size": 8, "paddings": {"x": -1, "y": 0.5}, "mask_key": "mask"}


def check_uneven_counts_with_paddings_yield_masked_dummies(outs, n):
  sizes = _uneven_counts_sizes(n)
  for out in outs:
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


def _drop_last_sizes(n):
  return [[8, 8, 8]] + [[8, 8]] * (n - 1)


def check_uneven_counts_with_drop_last_stop_at_shortest(outs, n):
  sizes = _drop_last_sizes(n)
  for out in outs:
    assert out["error"] is None and len(out["batches"]) == 2
    np.testing.assert_array_equal(out["batches"][1]["x"], expected_x(sizes, [1] * n, 8, 0))


def check_uneven_counts_without_options_raise_on_every_host(outs, n):
  for out in outs:
    assert out["error_type"] == "ValueError"
    assert out["error"].startswith("Uneven number of batches detected across JAX workers: ")
    assert "ran out of data at batch 1 while process 0 still has batches" in out["error"]
    assert len(out["batches"]) == 1
  assert len({o["error"] for o in outs}) == 1


# -- uneven row counts ---------------------------------------------------------------


def _uneven_rows_sizes(n):
  return [[8, 6 - 2 * (p % 2)] for p in range(n)]


def check_uneven_rows_padded_to_batch_size_and_masked(outs, n):
  sizes = _uneven_rows_sizes(n)
  for out in outs:
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


def check_uneven_rows_without_paddings_raise_range(outs, n):
  for out in outs:
    assert out["error_type"] == "ValueError"
    assert out["error"].startswith("Uneven batch sizes detected across JAX workers at batch 0")
    assert "host batch sizes range from 4 to 8" in out["error"]


def check_rows_not_divisible_by_local_devices_raise_everywhere(outs, n):
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


COMPAT_DROP_SIZES = [[8, 8, 5], [8, 8, 3]]
COMPAT_DROP_KW = {"drop_last": True, "batch_size": 8, "synchronize_batches": False}


def check_drop_last_without_sync_drops_short_final_batch_two_hosts(outs, n):
  sizes = COMPAT_DROP_SIZES
  for out in outs:
    assert out["error"] is None and len(out["batches"]) == 2
    np.testing.assert_array_equal(out["batches"][1]["x"], expected_x(sizes, [1, 1], 8, 0))


def test_drop_last_without_sync_drops_short_final_batch_one_host():
  out = list(
    gjs.jax_sync_generator(scenarios.make_batches(0, [8, 8, 5]), drop_last=True, batch_size=8)
  )
  assert len(out) == 2
  np.testing.assert_array_equal(np.asarray(out[1]["x"]), scenarios.rows_for(0, 1, 8))


STRUCTURE_MISMATCHES = {
  "extra_column": "columns only in the second: ['extra']",
  "float": "column 'x': dtype int32 vs float32",
}


def check_structure_mismatch_raises_naming_processes_and_columns(outs, n, needle):
  for out in outs:
    assert out["error_type"] == "ValueError"
    assert "processes 0 and 1 yield batches of different structure" in out["error"]
    assert needle in out["error"]
    assert out["batches"] == []


def _empty_host_sizes(n):
  return [[8, 8]] + [[]] * (n - 1)


EMPTY_HOST_KW = {"batch_size": 8, "paddings": {"x": -7, "y": 0}, "mask_key": "mask"}


def check_empty_host_with_paddings_builds_dummies_from_peer_structure(outs, n):
  sizes = _empty_host_sizes(n)
  for out in outs:
    assert out["error"] is None and len(out["batches"]) == 2
    for b, batch in enumerate(out["batches"]):
      np.testing.assert_array_equal(batch["x"], expected_x(sizes, [b] + [None] * (n - 1), 8, -7))
      np.testing.assert_array_equal(batch["mask"], np.arange(8 * n) < 8)
      assert batch["y"].shape == (8 * n, 2)


COMPAT_EMPTY_KW = {"drop_last": False, "batch_size": 8, "paddings": 0, "synchronize_batches": True}


def check_empty_host_compat_generator_synchronized(outs, n):
  sizes = [[8], []]
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


def check_source_failure_raises_promptly_on_every_host(outs, n):
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


DTYPES_KW = {"batch_size": 8, "dtypes": {"x": "int16", "y": "bfloat16"}}


def check_dtypes_per_column_across_hosts(outs, n):
  sizes = [[8], [8]]
  for out in outs:
    batch = out["batches"][0]
    assert batch["x"].dtype == np.int16 and batch["y"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(batch["x"], expected_x(sizes, [0, 0], 8, 0))


def test_dtypes_scalar_and_bare_array_batches():
  data = [np.arange(8, dtype=np.float64).reshape(8, 1) for _ in range(2)]
  out = list(gjs.iter_jax_batches(data, batch_size=8, dtypes="float16"))
  assert out[0].dtype == np.float16 and out[0].shape == (8, 1)
  np.testing.assert_array_equal(np.asarray(out[1])[:, 0], np.arange(8))


def check_nested_pytree_batches_keep_structure_across_hosts(outs, n):
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


DATACLASS_KW = {"batch_size": 8, "paddings": 0}


def check_registered_dataclass_batches_and_an_empty_host(outs, n):
  # Process 1 (sizes [[8, 8], []]) builds dummy Batches from process 0's structure.
  for out in outs:
    assert out["error"] is None, out["error"]
    assert out["types"] == ["Batch", "Batch"] and out["tags"] == ["train", "train"]
    for b, batch in enumerate(out["batches"]):
      assert batch["x"].tolist() == [10 * b + r for r in range(8)] + [0] * 8
      assert batch["y"].shape == (16, 2) and batch["none"] is None


def check_registered_dataclass_static_field_differs_raises_the_same_error(outs, n):
  # A static field that differs between hosts is a different structure: the
  # same error on every host.
  assert outs[0]["error"] == outs[1]["error"] and "structure" in outs[0]["error"]
  assert "Batch[('train',)]" in outs[0]["error"] and "Batch[('eval',)]" in outs[0]["error"]
  assert "'p':" not in outs[0]["error"]  # Named by the node, not by its pickled treedef.


# -- every real-process case: one launch per topology ---------------------------------


def cases_for(n: int) -> dict[str, tuple[Any, tuple, dict[str, Any]]]:
  """The scenarios run in turn in one launch of n processes; the 2-process ones at n == 2."""
  it = scenarios.run_iter
  cases = {
    "equal": (it, (_equal_sizes(n), {"batch_size": 8}), {}),
    "uneven_counts_paddings": (it, (_uneven_counts_sizes(n), UNEVEN_COUNTS_KW), {}),
    "uneven_counts_drop_last": (it, (_drop_last_sizes(n), {"batch_size": 8, "drop_last": True}), {}),
    "uneven_counts_raise": (it, ([[8, 8]] + [[8]] * (n - 1), {"batch_size": 8}), {}),
    "uneven_rows_padded": (
      it, (_uneven_rows_sizes(n), {"batch_size": 8, "paddings": 0, "mask_key": "mask"}), {}
    ),
    "uneven_rows_raise": (it, ([[8]] + [[4]] * (n - 1), {"batch_size": 8}), {}),
    "empty_host": (it, (_empty_host_sizes(n), EMPTY_HOST_KW), {}),
    "source_failure": (
      run_failing, (_equal_sizes(n), {1: 2}, {"batch_size": 8, "synchronize_lookahead": 10}), {}
    ),
  }  # fmt: skip
  if n != 2:
    return cases
  structured = scenarios.run_structured
  return {
    **cases,
    "not_divisible": (it, ([[6], [6]], {"batch_size": 8}), {}),
    "compat_drop_last": (it, (COMPAT_DROP_SIZES, COMPAT_DROP_KW), {"compat": True}),
    "structure_extra_column": (structured, (["plain", "extra_column"], {"batch_size": 4}), {}),
    "structure_float": (structured, (["plain", "float"], {"batch_size": 4}), {}),
    "compat_empty_host": (it, ([[8], []], COMPAT_EMPTY_KW), {"compat": True}),
    "dtypes": (it, ([[8], [8]], DTYPES_KW), {}),
    "nested": (structured, (["nested", "nested"], {"batch_size": 4}), {}),
    "dataclass_empty_host": (
      run_dataclass_batches, ([[8, 8], []], DATACLASS_KW, ["train", "train"]), {}
    ),
    "dataclass_static_differs": (
      run_dataclass_batches, ([[8], [8]], DATACLASS_KW, ["train", "eval"]), {}
    ),
  }  # fmt: skip


def checks_for(n: int) -> dict[str, Any]:
  """Each case's assertions, by case name (as `cases_for`)."""
  checks = {
    "equal": check_equal_batches_rows_in_process_order,
    "uneven_counts_paddings": check_uneven_counts_with_paddings_yield_masked_dummies,
    "uneven_counts_drop_last": check_uneven_counts_with_drop_last_stop_at_shortest,
    "uneven_counts_raise": check_uneven_counts_without_options_raise_on_every_host,
    "uneven_rows_padded": check_uneven_rows_padded_to_batch_size_and_masked,
    "uneven_rows_raise": check_uneven_rows_without_paddings_raise_range,
    "empty_host": check_empty_host_with_paddings_builds_dummies_from_peer_structure,
    "source_failure": check_source_failure_raises_promptly_on_every_host,
  }
  if n == 2:
    checks.update(
      {
        "not_divisible": check_rows_not_divisible_by_local_devices_raise_everywhere,
        "compat_drop_last": check_drop_last_without_sync_drops_short_final_batch_two_hosts,
        "compat_empty_host": check_empty_host_compat_generator_synchronized,
        "dtypes": check_dtypes_per_column_across_hosts,
        "nested": check_nested_pytree_batches_keep_structure_across_hosts,
        "dataclass_empty_host": check_registered_dataclass_batches_and_an_empty_host,
        "dataclass_static_differs": (
          check_registered_dataclass_static_field_differs_raises_the_same_error
        ),
      }
    )
    for variant, needle in STRUCTURE_MISMATCHES.items():
      checks[f"structure_{variant}"] = functools.partial(
        check_structure_mismatch_raises_naming_processes_and_columns, needle=needle
      )
  return {name: functools.partial(check, n=n) for name, check in checks.items()}


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize(("n", "d"), MULTI)
def test_every_rule_holds_across_real_processes(n, d):
  # One launch per topology runs every case in turn; each case's own checks.
  check_cases(run_cases(n, d, cases_for(n)), checks_for(n))
