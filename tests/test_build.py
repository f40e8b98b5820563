"""The build stage's layout (`build.Layout`, `build.trailing_shapes`): casts, pads, masks, keys.

`Layout.of` is computed once from the agreed structure; its checks raise
before the first batch is built.
"""

from __future__ import annotations

import numpy as np
import pytest

import grain_jax_sync as gjs
from grain_jax_sync._src import batches
from grain_jax_sync._src import build as build_lib
from grain_jax_sync._src import shapes as shapes_lib


def _signature(batch, **kwargs):
  return batches.validate(batch, process_index=0, batch_index=0, **kwargs).signature


_SIG = {"x": np.arange(8, dtype=np.int32), "y": np.ones((8, 2), np.float32)}


def test_layout_pads_in_the_host_dtype_and_keeps_the_dict_keys():
  layout = build_lib.Layout.of(
    _signature(_SIG), dtypes=None, paddings={"x": -1, "y": 0.5}, mask_key="mask"
  )
  assert layout.host == [np.dtype(np.int32), np.dtype(np.float32)]
  assert [p.dtype for p in layout.pads] == layout.host
  assert [p.tolist() for p in layout.pads] == [-1, 0.5]
  assert layout.keys == ("x", "y") and layout.as_read and layout.masks == ()


def test_layout_with_dtypes_casts_on_the_host_and_is_no_longer_as_read():
  layout = build_lib.Layout.of(
    _signature(_SIG), dtypes={"x": "int16", "y": None}, paddings=None, mask_key=None
  )
  assert layout.host == [np.dtype(np.int16), np.dtype(np.float32)]
  assert layout.pads is None and not layout.as_read


def test_layout_refuses_a_mask_key_that_is_already_a_column():
  with pytest.raises(ValueError, match="`mask_key`='x' is already a column of the batches"):
    build_lib.Layout.of(_signature(_SIG), dtypes=None, paddings=None, mask_key="x")


def test_trailing_shapes_set_only_the_varying_dims_to_the_agreed_sizes():
  shapes = shapes_lib.make({"a": 1}, None, None, 0)
  varying = lambda names, ranks: shapes_lib.leaf_dims(shapes, names, ranks)  # noqa: E731
  sig = _signature({"a": np.ones((2, 3)), "b": np.ones((2, 4))}, varying=varying)
  assert sig.shapes == ((-1,), (4,))
  assert build_lib.trailing_shapes(sig, (7,)) == [(7,), (4,)]


def test_mask_key_requires_dict_batches():
  with pytest.raises(ValueError, match="`mask_key`='mask' needs dict batches"):
    list(gjs.iter_jax_batches([np.zeros(8)], batch_size=8, mask_key="mask"))
