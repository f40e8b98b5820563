"""The dtype policy: shrinking casts on the host, widening casts on the device."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import scenarios_perf

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src import padding, sharding

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize(
  ("src", "want", "host", "device"),
  [
    (np.float32, BF16, BF16, None),
    (np.float64, np.float32, np.float32, None),
    (np.int64, np.int32, np.int32, None),
    (np.float32, np.float16, np.float16, None),
    (np.uint8, np.float32, np.uint8, np.float32),
    (np.int8, np.int32, np.int8, np.int32),
    (np.float32, None, np.float32, None),
  ],
)
def test_split_casts_shrinks_on_host_grows_on_device(src, want, host, device):
  h, d = sharding.split_casts([np.dtype(src)], [want])
  assert h == [np.dtype(host)]
  assert d == [None if device is None else np.dtype(device)]


def test_bytes_handed_to_the_transfer_halve_for_float32_to_bfloat16():
  leaf = np.ones((256, 1024), np.float32)
  host, _ = sharding.split_casts([leaf.dtype], [BF16])
  sent = padding.fill_leaf(leaf, target=256, shape=(1024,), dtype=host[0], pad=None)
  assert sent.dtype == BF16
  assert sent.nbytes * 2 == leaf.nbytes


def test_fill_leaf_makes_no_copy_when_nothing_to_do():
  leaf = np.arange(16, dtype=np.float32).reshape(8, 2)
  assert padding.fill_leaf(leaf, target=8, shape=(2,), dtype=leaf.dtype, pad=None) is leaf


def test_fill_leaf_pads_and_casts_into_one_buffer():
  leaf = np.arange(6, dtype=np.float32).reshape(3, 2)
  out = padding.fill_leaf(leaf, target=4, shape=(2,), dtype=BF16, pad=np.asarray(-1, BF16))
  assert out.dtype == BF16 and out.shape == (4, 2)
  np.testing.assert_array_equal(out[:3].astype(np.float32), leaf)
  np.testing.assert_array_equal(out[3].astype(np.float32), [-1, -1])


def _columns(n):
  rng = np.random.default_rng(0)
  return {
    "f32": (rng.normal(size=(n, 3)) * 1000).astype(np.float32),
    "f64": rng.normal(size=(n,)) * 1e6,
    "i64": rng.integers(-(2**30), 2**30, size=(n,)),
    "u8": rng.integers(0, 256, size=(n, 2), dtype=np.uint8),
  }


DTYPES = {"f32": BF16, "f64": np.float32, "i64": np.int32, "u8": np.float32}


@pytest.mark.parametrize("prefetch_batches", [0, 2])
def test_values_equal_whether_cast_on_host_or_on_device_single_process(prefetch_batches):
  data = [_columns(8), _columns(8), _columns(4)]
  kw = {"batch_size": 8, "paddings": 0, "prefetch_batches": prefetch_batches}
  with gjs.iter_jax_batches(data, dtypes=DTYPES, **kw) as it:
    policy = list(it)
  with gjs.iter_jax_batches(data, **kw) as it:
    after = [{k: v.astype(DTYPES[k]) for k, v in b.items()} for b in it]
  assert len(policy) == len(after) == 3
  for a, b in zip(policy, after, strict=True):
    for k in DTYPES:
      assert a[k].dtype == b[k].dtype == np.dtype(DTYPES[k])
      np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


@pytest.mark.multiprocess
def test_values_equal_whether_cast_on_host_or_on_device_two_processes():
  outs = testing.values(
    testing.run_processes(
      scenarios_perf.dtype_values,
      num_processes=2,
      devices_per_process=4,
      args=({"batch_size": 8, "paddings": 0},),
      timeout_s=180,
    )
  )
  for o in outs:
    assert len(o["policy"]) == len(o["after"]) == 3
    for a, b in zip(o["policy"], o["after"], strict=True):
      for k in DTYPES:
        assert a[k].dtype == b[k].dtype
        np.testing.assert_array_equal(a[k], b[k])
