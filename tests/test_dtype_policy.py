"""The dtype policy: shrinking casts on the host, widening casts on the device."""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import scenarios

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src import build, padding

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
  h, d = build.split_casts([np.dtype(src)], [want])
  assert h == [np.dtype(host)]
  assert d == [None if device is None else np.dtype(device)]


def test_bytes_handed_to_the_transfer_halve_for_float32_to_bfloat16():
  leaf = np.ones((256, 1024), np.float32)
  host, _ = build.split_casts([leaf.dtype], [BF16])
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


def dtype_values(kwargs: dict[str, Any]) -> dict[str, Any]:
  """Float32/float64/int64/uint8 columns through the dtype policy and after."""
  import jax

  p = jax.process_index()
  rng = np.random.default_rng(p)
  data = [
    {
      "f32": rng.normal(size=(n, 3)).astype(np.float32) * 1000,
      "f64": rng.normal(size=(n,)) * 1e6,
      "i64": rng.integers(-(2**30), 2**30, size=(n,)),
      "u8": rng.integers(0, 256, size=(n, 2), dtype=np.uint8),
    }
    for n in (8, 8, 4)
  ]
  dtypes = {"f32": ml_dtypes.bfloat16, "f64": np.float32, "i64": np.int32, "u8": np.float32}
  policy = [scenarios.gather(b) for b in gjs.iter_jax_batches(data, dtypes=dtypes, **kwargs)]
  after = [
    scenarios.gather({k: v.astype(dtypes[k]) for k, v in b.items()})
    for b in gjs.iter_jax_batches(data, **kwargs)
  ]
  return {"policy": policy, "after": after}


@pytest.mark.multiprocess
def test_values_equal_whether_cast_on_host_or_on_device_two_processes():
  outs = testing.values(
    testing.run_processes(
      dtype_values,
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


# -- values out of a dtype's range ---------------------------------------------

OUT_OF_RANGE = np.array([-300.0, -129.0, -0.7, 127.9, 200.0, 3e9, np.nan, np.inf, -np.inf])


@pytest.mark.parametrize(
  ("src", "want"),
  [
    (src, want)
    for src in (np.float64, np.float32, np.float16, BF16)
    for want in (np.int8, np.uint8, np.int16, np.int32, np.uint32, ml_dtypes.int4, ml_dtypes.uint4)
    if np.dtype(want).itemsize <= np.dtype(src).itemsize  # Narrowing: on the host.
  ],
)
def test_a_host_cast_converts_out_of_range_floats_as_the_device_does(src, want):
  # NumPy's float -> int of an out-of-range value or NaN is undefined (int8
  # of -300.0 gave -44); XLA saturates and makes NaN 0. Narrowing casts run
  # on the host, so they must give what `jax.Array.astype` gives.
  import jax.numpy as jnp

  with np.errstate(over="ignore"):
    leaf = OUT_OF_RANGE.astype(src)
  host, device = build.split_casts([leaf.dtype], [want])
  assert device == [None]  # Narrower or equal: cast on the host.
  sent = padding.fill_leaf(leaf, target=9, shape=(), dtype=host[0], pad=None)
  want_values = np.asarray(jnp.asarray(leaf).astype(want))
  np.testing.assert_array_equal(sent, want_values)


def test_iterated_narrowing_casts_equal_jax_astype():
  data = [{"x": OUT_OF_RANGE[:8], "y": OUT_OF_RANGE[:8].astype(np.float32)}]
  dtypes = {"x": np.int8, "y": np.uint8}
  with gjs.iter_jax_batches(data, batch_size=8, dtypes=dtypes) as it:
    (got,) = list(it)
  with gjs.iter_jax_batches(data, batch_size=8) as it:
    (raw,) = list(it)
  assert got["x"].tolist() == [-128, -128, 0, 127, 127, 127, 0, 127]
  assert got["y"].tolist() == [0, 0, 0, 127, 200, 255, 0, 255]
  for k, dtype in dtypes.items():
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(raw[k].astype(dtype)))


@pytest.mark.parametrize(
  ("column", "pad", "dtypes", "want"),
  [
    (np.uint8, -1, None, "it would become 255"),
    (np.uint8, 300, None, "it would become 44"),
    (np.int64, 2**40, None, "int32: it would become 0"),  # x64 off: int64 travels as int32.
    (np.int32, 0.5, None, "it would become 0"),
    (np.bool_, 2, None, "it would become True"),
    (np.float16, 1e6, None, "it would become inf"),
    (np.float32, -1, np.uint8, "it would become 255"),  # Narrowed to uint8 on the host.
    (ml_dtypes.int4, 8, None, "it would become -8"),  # 4-bit ints are kind 'V' in NumPy.
    (ml_dtypes.uint4, -1, None, "it would become 15"),
    (np.float32, 300, ml_dtypes.int4, "it would become -4"),
    (np.float32, 1 + 2j, None, r"it would become 1\.0"),  # The imaginary part was dropped.
  ],
)
def test_a_padding_value_that_does_not_fit_its_column_raises_naming_it(column, pad, dtypes, want):
  data = [{"label": np.ones((8,), column)}, {"label": np.ones((5,), column)}]
  kw = {} if dtypes is None else {"dtypes": {"label": dtypes}}
  with pytest.raises(
    ValueError, match=rf"`paddings` value .* for column 'label' does not fit .*{want}"
  ):
    list(gjs.iter_jax_batches(data, batch_size=8, paddings={"label": pad}, mask_key="mask", **kw))


@pytest.mark.parametrize(
  ("column", "pad", "dtypes", "pad_out"),
  [
    (np.float32, 0.1, None, np.float32(0.1)),  # Rounds: fine for a float.
    (np.float32, np.nan, None, np.nan),
    (np.int32, True, None, 1),
    (np.uint8, -1, np.float32, -1.0),  # Widened: cast on the host so that -1 survives.
    (np.uint8, 7, np.float32, 7.0),  # Fits uint8: widened on the device.
    (ml_dtypes.uint4, -1, np.float32, -1.0),  # Was 15.0: -1 wrapped into uint4 first.
    (ml_dtypes.int4, 7, None, 7),
    (np.complex64, 1 + 2j, None, 1 + 2j),
  ],
)
def test_padding_values_that_fit_their_column(column, pad, dtypes, pad_out):
  data = [{"label": np.full((8,), 3, column)}, {"label": np.full((5,), 3, column)}]
  kw = {} if dtypes is None else {"dtypes": {"label": dtypes}}
  with gjs.iter_jax_batches(
    data, batch_size=8, paddings={"label": pad}, mask_key="mask", **kw
  ) as it:
    first, last = list(it)
  want_dtype = np.dtype(dtypes or column)
  assert last["label"].dtype == want_dtype
  np.testing.assert_array_equal(np.asarray(last["label"])[:5], np.full(5, 3, want_dtype))
  np.testing.assert_array_equal(np.asarray(last["label"])[5:], np.full(3, pad_out, want_dtype))
  assert np.asarray(last["mask"]).tolist() == [True] * 5 + [False] * 3


@pytest.mark.parametrize("bad", [object, str, "datetime64[s]", np.longdouble, ">i4", "V4"])
def test_a_requested_dtype_jax_cannot_hold_raises_naming_the_column(bad):
  # Was a raw JAX TypeError from inside the transfer, naming neither.
  want = np.dtype(bad)
  with pytest.raises(ValueError, match=rf"`dtypes` asks for {re.escape(str(want))} for column 'x'"):
    list(gjs.iter_jax_batches([{"x": np.arange(8.0)}], batch_size=8, dtypes={"x": bad}))
