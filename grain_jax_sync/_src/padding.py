"""Padding, dummy batches and masks: pure NumPy.

Padding is written into one preallocated buffer per leaf, already in the dtype
that crosses to the device, so a short batch costs one copy and a full batch
that needs no cast costs none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_jax_sync._src import batches as batches_lib


def per_leaf(value: Any, signature: batches_lib.Signature, *, what: str) -> list[Any]:
  """Resolves a scalar-or-per-column setting (`paddings`, `dtypes`) per leaf.

  A dict maps column names to values. A column is a leaf's full path
  (``"features/ids"``) or any prefix of it (``"features"``); the longest match
  wins. A bare array batch takes a scalar, or a dict with a single entry.

  Args:
    value: None, a scalar/dtype, or a dict of column name to value.
    signature: The batch structure.
    what: The argument's name, for errors.

  Returns:
    One value (or None) per leaf.

  Raises:
    ValueError: If a dict names a column that does not exist.
  """
  names = signature.names
  if value is None:
    return [None] * len(names)
  if not isinstance(value, Mapping):
    return [value] * len(names)
  if names == (batches_lib.ROOT_NAME,):
    if len(value) != 1:
      raise ValueError(
        f"`{what}` for a single-array batch must be a scalar or a dict with"
        f" one entry, got {dict(value)!r}"
      )
    return [next(iter(value.values()))]
  keys = {str(k): v for k, v in value.items()}
  out: list[Any] = []
  used: set[str] = set()
  for name in names:
    parts = name.split("/")
    hit = None
    for n in range(len(parts), 0, -1):
      prefix = "/".join(parts[:n])
      if prefix in keys:
        hit = prefix
        break
    if hit is not None:
      used.add(hit)
      out.append(keys[hit])
    else:
      out.append(None)
  unknown = sorted(set(keys) - used)
  if unknown:
    raise ValueError(
      f"`{what}` names columns that the batches do not have: {unknown};"
      f" the columns are {list(names)}"
    )
  return out


def check_pad_values(
  pads: Sequence[Any], dtypes: Sequence[np.dtype], names: Sequence[str]
) -> list[np.ndarray]:
  """Converts each padding value to its leaf's dtype, or raises naming it."""
  out = []
  for pad, dtype, name in zip(pads, dtypes, names):
    if pad is None:
      raise ValueError(
        f"`paddings` has no value for column {name!r}; give a scalar for"
        " every column or a dict that covers each one"
      )
    try:
      arr = np.asarray(pad)
      if arr.ndim != 0:
        raise ValueError(f"expected a scalar, got shape {arr.shape}")
      out.append(np.asarray(arr.astype(dtype, casting="unsafe")))
    except (TypeError, ValueError) as e:
      raise ValueError(
        f"`paddings` value {pad!r} for column {name!r} does not fit dtype {dtype}: {e}"
      ) from e
  return out


def fill_leaf(
  leaf: np.ndarray | None,
  *,
  target: int,
  shape: tuple[int, ...],
  dtype: np.dtype,
  pad: np.ndarray | None,
) -> np.ndarray:
  """Returns `leaf` with `target` rows in `dtype`, padded at the end.

  Args:
    leaf: The real rows, or None for a dummy batch.
    target: Rows wanted.
    shape: Trailing shape.
    dtype: Output dtype.
    pad: Fill value (already of `dtype`); needed when rows are missing.

  Returns:
    `leaf` itself when it already has `target` rows and `dtype`; otherwise a
    new buffer.
  """
  rows = 0 if leaf is None else leaf.shape[0]
  if leaf is not None and rows == target and leaf.dtype == dtype:
    return leaf
  if rows < target and pad is None:
    raise ValueError("internal: padding needed without a padding value")
  buf = np.empty((target, *shape), dtype)
  if leaf is not None and rows:
    buf[:rows] = leaf
  if rows < target:
    buf[rows:] = pad
  return buf


def mask(real_rows: int, target: int) -> np.ndarray:
  """Boolean (target,) array: True for real rows, False for padding."""
  m = np.zeros((target,), np.bool_)
  m[:real_rows] = True
  return m
