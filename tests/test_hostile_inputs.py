"""Hostile input on one host: the same clear error on every host, or correct rows.

Process 1 of 2 (4 devices each) yields an unusual `y` column at batch 1. Bad
leaves must raise, on both processes, a ValueError that names the process, the
batch, the column and what was expected; unusual but valid arrays
(non-contiguous, negative strides, read-only, big-endian, Fortran order, bool,
lists of numbers) must arrive with their exact values. One run of two
processes covers every kind; single-process checks repeat the valid kinds.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import scenarios
import scenarios_faults
from helpers import check_each

import grain_jax_sync as gjs
from grain_jax_sync import testing

N, D, B = 2, 4, 8
BAD = 1  # The process that yields the hostile column.
TIMEOUT = 150

# kind -> substrings of the error, after "process 1, batch 1".
INVALID = {
  "string": ["column 'y': a string array (dtype <U2); expected a numeric or bool dtype"],
  "bytes": ["column 'y': a bytes array (dtype |S1); expected a numeric or bool dtype"],
  "object": ["column 'y': an object array (dtype object); expected a numeric or bool dtype"],
  "structured": ["column 'y': a structured array", "expected a numeric or bool dtype"],
  "ragged": [
    ": leaves have different leading sizes ('x': 8, 'y': 7)",
    "expected every leaf to share the row dimension",
  ],
  "zero_d": ["column 'y': 0-d leaf (a scalar of dtype float32)", "expected an array whose first"],
  "python_scalar": ["column 'y': 0-d leaf (a scalar of dtype float64)"],
  # None is an empty node (as in JAX): the column is gone from this batch.
  "none": ["the batch structure changed mid-stream (columns only in the first: ['y']"],
  "masked": ["column 'y': a NumPy masked array; expected a plain array", "`arr.filled(value)`"],
  "longdouble": ["column 'y': a float128 array; JAX has no float128 type: cast it first"],
  "ragged_list": [
    "column 'y': cannot convert a list to one array",
    "expected a rectangular array of numbers",
  ],
}
# Errors that concern the whole batch rather than a column.
BATCH_LEVEL = {
  "too_big_padded": [
    "Uneven batch sizes detected across JAX workers at batch 1: process 1 has 16 rows, more"
    " than the full batch size 8 (`batch_size`)",
    "(process 0: 8, process 1: 16)",
  ],
  "too_big": [
    "Uneven batch sizes detected across JAX workers at batch 1: host batch sizes range",
    "(process 0: 8, process 1: 16)",
  ],
}
# A bad record for `pack_sequences` (`scenarios_faults.packed_source`) -> substrings
# of the error, after "process 1, batch 1: pack_sequences: ". Never a cast.
FLOAT_AMONG_INT32 = (
  "feature 'tok' is float64 in a record (array([1.5, 2.5])), int32 in the first record"
)
PACK = {
  "pack_zero_d": ["feature 'tok': a 0-d array of shape (); expected a 1-D sequence of tokens"],
  "pack_2d": ["feature 'tok': a 2-d array of shape (2, 2); expected a 1-D sequence of tokens"],
  "pack_strings": ["feature 'tok': a string array (dtype <U1); expected a numeric or bool dtype"],
  "pack_float_joins": [FLOAT_AMONG_INT32, "must have one dtype"],
  "pack_float_opens": [FLOAT_AMONG_INT32, "must have one dtype"],
}
# Records 0 to 15, two to a row, on every host.
PACKED_BATCH_0 = [[20 * i + 1, 20 * i + 2, 20 * i + 11, 20 * i + 12] for i in range(8)]
VALID_ONE_BATCH = [
  "non_contiguous",
  "negative_stride",
  "read_only",
  "big_endian",
  "fortran",
  "subclass",
]
VALID_EVERY_HOST = sorted(scenarios_faults.EVERY_HOST_KINDS)
KINDS = [*INVALID, *BATCH_LEVEL, *VALID_ONE_BATCH, *VALID_EVERY_HOST, *PACK]

_RUN: dict = {}


def _outs(kind):
  """Both processes' outcomes for `kind` (one shared run, failure kept)."""
  if "run" not in _RUN:
    try:
      outcomes = testing.run_processes(
        scenarios_faults.run_hostile,
        num_processes=N,
        devices_per_process=D,
        args=(BAD, KINDS),
        timeout_s=TIMEOUT,
      )
      per_process = testing.values(outcomes)
      _RUN["run"] = {k: [per_process[p][i] for p in range(N)] for i, k in enumerate(KINDS)}
    except Exception as e:  # noqa: BLE001 - re-raised by every reader.
      _RUN["run"] = e
  if isinstance(_RUN["run"], Exception):
    raise _RUN["run"]
  outs = _RUN["run"][kind]
  for out in outs:
    assert out["elapsed_s"] < 30
  return outs


def _normal_y(process, batch):
  x = scenarios.rows_for(process, batch, B).astype(np.float32)
  return np.stack([x, -x], axis=1)


def check_hostile_leaf_on_one_host_raises_same_error_on_every_host(kind):
  outs = _outs(kind)
  assert len({out["error"] for out in outs}) == 1  # Word for word the same.
  for out in outs:
    assert out["error_type"] == "ValueError", out
    if kind in INVALID:
      assert out["error"].startswith("process 1, batch 1"), out["error"]
    for needle in INVALID.get(kind) or BATCH_LEVEL[kind]:
      assert needle in out["error"], (needle, out["error"])
    assert out["n"] == 1  # The batch before the bad one, on every host.
    np.testing.assert_array_equal(
      out["batches"][0], np.concatenate([_normal_y(p, 0) for p in range(N)])
    )


def check_unusual_but_valid_array_on_one_host_arrives_exactly(kind):
  odd = np.asarray(scenarios_faults.hostile_leaf(kind, B), np.float32)
  for out in _outs(kind):
    assert out["error"] is None and out["n"] == 3
    for b, y in enumerate(out["batches"]):
      assert y.dtype == np.float32 and y.shape == (N * B, 2)
      want = [_normal_y(p, b) for p in range(N)]
      if b == 1:
        want[BAD] = odd
      np.testing.assert_array_equal(y, np.concatenate(want))


EVERY_HOST_DTYPES = {"bool": np.bool_, "list_of_lists": np.float32}


def check_bool_and_python_lists_on_every_host_convert(kind, dtype):
  # Lists of floats become float64 in NumPy and float32 on the device (JAX
  # without x64), the same on every host.
  local = np.asarray(scenarios_faults.hostile_leaf(kind, B))
  for out in _outs(kind):
    assert out["error"] is None and out["n"] == 3
    for y in out["batches"]:
      assert y.dtype == dtype
      np.testing.assert_array_equal(y, np.concatenate([local] * N).astype(dtype))


def check_bad_record_to_pack_on_one_host_raises_same_error_on_every_host(kind):
  outs = _outs(kind)
  assert len({out["error"] for out in outs}) == 1  # Word for word the same.
  for out in outs:
    assert out["error_type"] == "ValueError", out
    assert out["error"].startswith("process 1, batch 1: pack_sequences: "), out["error"]
    for needle in PACK[kind]:
      assert needle in out["error"], (needle, out["error"])
    assert out["n"] == 1  # The batch before the bad record, on every host; nothing cast.
    assert out["batches"][0].tolist() == PACKED_BATCH_0 * N


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_hostile_and_unusual_leaves_across_real_processes():
  # One launch runs every kind (`KINDS`); each kind's own checks.
  calls = {
    kind: functools.partial(check_hostile_leaf_on_one_host_raises_same_error_on_every_host, kind)
    for kind in [*INVALID, *BATCH_LEVEL]
  }
  for kind in VALID_ONE_BATCH:
    calls[kind] = functools.partial(check_unusual_but_valid_array_on_one_host_arrives_exactly, kind)
  for kind, dtype in EVERY_HOST_DTYPES.items():
    calls[kind] = functools.partial(check_bool_and_python_lists_on_every_host_convert, kind, dtype)
  for kind in PACK:
    calls[kind] = functools.partial(
      check_bad_record_to_pack_on_one_host_raises_same_error_on_every_host, kind
    )
  check_each(calls)


# -- one process: the same conversions without the exchange ---------------------------


@pytest.mark.parametrize("kind", [*VALID_ONE_BATCH, "bool", "list_of_lists"])
def test_single_process_valid_kinds_keep_values(kind):
  leaf = scenarios_faults.hostile_leaf(kind, 8)
  with gjs.iter_jax_batches([{"y": leaf}], batch_size=8) as it:
    (batch,) = list(it)
  np.testing.assert_array_equal(np.asarray(batch["y"]), np.asarray(leaf))


def _one_process_source(kind):
  """Process 0's source with the bad leaf (or record to pack) of `kind` at batch 1."""
  if kind in PACK:
    return scenarios_faults.packed_source(kind, 0, 0)
  batches = scenarios.make_batches(0, [8, 8])
  batches[1] = {**batches[1], "y": scenarios_faults.hostile_leaf(kind, 8)}
  return batches


@pytest.mark.parametrize("kind", [*INVALID, *PACK])
def test_single_process_invalid_kinds_raise_naming_batch_and_column(kind):
  with gjs.iter_jax_batches(_one_process_source(kind), batch_size=8) as it:
    first = next(it)
    with pytest.raises(ValueError) as info:
      next(it)
  message = str(info.value)
  if kind in PACK:
    assert np.asarray(first["tok"]).tolist() == PACKED_BATCH_0
    assert message.startswith("process 0, batch 1: pack_sequences: ")
  assert message.startswith("process 0, batch 1")
  for needle in {**INVALID, **PACK}[kind]:
    assert needle in message


# -- arguments of the language-model APIs ----------------------------------------------


SOURCES = [list(range(10)), list(range(20)), list(range(50))]


@pytest.mark.parametrize(
  "weights",
  [np.array([1, 2, 5]), [np.float32(1), 2, 5], (1.0, np.int64(2), np.array(5.0)), [0.5, 1, 2.5]],
)
def test_elastic_mixture_takes_numpy_numbers_as_weights(weights):
  src = gjs.elastic_mixture(SOURCES, weights)
  assert src.mixture.proportions == (100, 200, 500)


@pytest.mark.parametrize(
  ("weights", "error", "needles"),
  [
    ([1, np.inf, 2], ValueError, ["`weights` must be 3 finite numbers > 0", "(inf is not)"]),
    ([1, float("nan"), 2], ValueError, ["(nan is not)"]),
    ([1, 10**400, 2], ValueError, ["finite numbers > 0", "is not)"]),
    ([True, 1, 2], ValueError, ["(True is not)"]),
    ([1, -1, 2], ValueError, ["(-1 is not)"]),
    ([1, 2], ValueError, ["must be 3 finite numbers > 0", "(2 given)"]),
    ([1, "2", 3], ValueError, ["('2' is not)"]),
    (np.array([[1, 2, 5]]), ValueError, ["(array([1, 2, 5]) is not)"]),
    ([1e-300, 1, 1e300], ValueError, ["span too wide a range"]),
    (3, TypeError, ["`weights` must be a list of 3 numbers, got 3"]),
    ("125", TypeError, ["`weights` must be a list of 3 numbers, got '125'"]),
  ],
)
def test_elastic_mixture_refuses_weights_that_are_not_finite_numbers(weights, error, needles):
  with pytest.raises(error) as info:
    gjs.elastic_mixture(SOURCES, weights)
  for needle in needles:
    assert needle in str(info.value)
