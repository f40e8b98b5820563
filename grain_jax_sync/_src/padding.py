"""Padding, dummy batches and masks: pure NumPy.

Padding is written into one buffer per leaf, in the dtype that crosses to the
device: a short batch costs one copy, a full batch that needs no cast none.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import shapes as shapes_lib


def per_leaf(value: Any, signature: batches_lib.Signature, *, what: str) -> list[Any]:
  """A scalar-or-per-column setting (`what`: `paddings`, `dtypes`) per leaf: a dict maps columns
  (`shapes.column_of`; one entry for a bare array) to values, ValueError for one no leaf has."""
  names = signature.names
  if value is None:
    return [None] * len(names)
  if not isinstance(value, Mapping):
    return [value] * len(names)
  keys = {str(k): v for k, v in value.items()}
  return [None if c is None else keys[c] for c in shapes_lib.columns_of(what, names, keys)]


def check_pad_values(
  pads: Sequence[Any], dtypes: Sequence[np.dtype], names: Sequence[str]
) -> list[np.ndarray]:
  """Converts each padding value to its leaf's dtype, or raises naming it."""
  out = []
  for pad, dtype, name in zip(pads, dtypes, names, strict=True):
    if pad is None:
      raise ValueError(
        f"`paddings` has no value for column {name!r}; give a scalar for"
        " every column or a dict that covers each one"
      )
    try:
      out.append(_pad_value(pad, dtype))
    except (TypeError, ValueError, OverflowError) as e:
      raise ValueError(
        f"`paddings` value {pad!r:.60} for column {name!r} does not fit dtype {dtype}: {e}"
      ) from e
  return out


def fits(pad: Any, dtype: np.dtype) -> bool:
  """Whether the padding value `pad` is a value of `dtype` (see `_same_value`)."""
  try:
    _pad_value(pad, dtype)
  except (TypeError, ValueError, OverflowError):
    return False
  return True


def _pad_value(pad: Any, dtype: np.dtype) -> np.ndarray:
  """`pad` as a 0-d array of `dtype`; raises where it is not a value of it."""
  if isinstance(pad, int) and not -(2**63) <= pad < 2**64:  # NumPy holds it as an object.
    pad = float(pad)  # Raises OverflowError past float64; no integer column holds it either.
  arr = np.asarray(pad)
  if arr.ndim != 0:
    raise ValueError(f"expected a scalar, got shape {arr.shape}")
  if not (arr.dtype.kind in "biufc" or _is_float(arr.dtype) or _is_int(arr.dtype)):
    raise ValueError(f"expected a number, got a value of dtype {arr.dtype}")
  with np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
    warnings.simplefilter("ignore", np.exceptions.ComplexWarning)  # Judged below.
    value = np.asarray(arr.astype(dtype, casting="unsafe"))
  if not _same_value(arr, value):
    raise ValueError(f"it would become {value.item()!r}")
  return value


def _same_value(pad: np.ndarray, value: np.ndarray) -> bool:
  """Whether `value` (a padding value cast to its column's dtype) still is `pad`.

  Integer and bool columns take exactly representable values only (-1 is not
  a uint8, 0.5 not an int32, 2**40 not an int32); float columns any value that
  stays finite (0.1 rounds in float32, 1e40 would become inf).
  """
  if value.dtype.kind == "c":
    return True
  if pad.dtype.kind == "c":  # Into a real column: only with no imaginary part.
    return bool(pad.item().imag == 0) and _same_value(np.asarray(pad.item().real), value)
  if value.dtype.kind in "iub" or _is_int(value.dtype):
    return bool(value.item() == pad.item())
  return bool(np.isfinite(value.astype(np.float64)) or not np.isfinite(pad.astype(np.float64)))


def _is_float(dtype: np.dtype) -> bool:
  """NumPy floats and ml_dtypes' (bfloat16, float8_*: kind 'V')."""
  return dtype.kind == "f" or (dtype.kind == "V" and dtype.name.startswith(("float", "bfloat")))


def _is_int(dtype: np.dtype) -> bool:
  """NumPy integers and ml_dtypes' (int4, uint4, int2, uint2: kind 'V')."""
  return dtype.kind in "iu" or (dtype.kind == "V" and dtype.name.startswith(("int", "uint")))


def cast_into(out: np.ndarray, x: np.ndarray) -> None:
  """Writes `x` into `out`, converting values as XLA does (`jax.Array.astype`).

  NumPy's float to integer conversion of an out-of-range value or NaN is
  undefined; XLA saturates and makes NaN 0, and so does this. Integer to
  integer wraps in both.
  """
  if not _is_int(out.dtype) or not _is_float(x.dtype):
    with np.errstate(over="ignore"):  # float -> narrower float: inf, as XLA.
      out[...] = x
    return
  with np.errstate(over="ignore", invalid="ignore"):  # Mended below.
    out[...] = x
  info = ml_dtypes.iinfo(out.dtype)  # NumPy's and ml_dtypes' integers alike.
  wide = x.astype(np.float64) if x.dtype.kind == "V" else x
  high = wide >= float(info.max) + 1.0  # A power of two: exact in every float.
  low = wide < float(info.min)
  nan = np.isnan(wide)
  if high.any() or low.any() or nan.any():
    out[high] = info.max
    out[low] = info.min
    out[nan] = 0


def fill_leaf(
  leaf: np.ndarray | None,
  *,
  target: int,
  shape: tuple[int, ...],
  dtype: np.dtype,
  pad: np.ndarray | None,
) -> np.ndarray:
  """`leaf` (None: a dummy) as `target` rows of trailing `shape` in `dtype`, padded with `pad`:
  `leaf` itself where it already is that."""
  rows = 0 if leaf is None else leaf.shape[0]
  grown = leaf is not None and leaf.shape[1:] != shape  # `pad_shapes`: trailing dims pad too.
  if leaf is not None and rows == target and leaf.dtype == dtype and not grown:
    return leaf
  if (rows < target or grown) and pad is None:
    raise ValueError("internal: padding needed without a padding value")
  buf = np.empty((target, *shape), dtype)
  if grown:
    buf[...] = pad
  elif rows < target:
    buf[rows:] = pad
  if leaf is not None and rows:
    cast_into(buf[tuple(slice(0, n) for n in leaf.shape)], leaf)
  return buf


def element_mask(
  leaf_shape: tuple[int, ...] | None, target: int, shape: tuple[int, ...], dims: tuple[int, ...]
) -> np.ndarray:
  """The element mask of a padded leaf (`shape_mask_keys`).

  Shaped ``(target, *shape[:dims[-1] + 1])``: True for the real elements of
  `leaf_shape` (None: a dummy), False for the padding; `dims` are the
  trailing indices that vary, ascending.
  """
  out = np.zeros((target, *shape[: dims[-1] + 1]), np.bool_)
  if leaf_shape is None or not leaf_shape[0]:
    return out
  real = [slice(0, leaf_shape[0])]
  for t in range(dims[-1] + 1):
    real.append(slice(0, leaf_shape[1 + t]) if t in dims else slice(None))
  out[tuple(real)] = True
  return out


def mask(real_rows: int, target: int) -> np.ndarray:
  """Boolean (target,) array: True for real rows, False for padding."""
  return np.arange(target) < real_rows
