"""One leaf of a batch: the conversion to a NumPy array, its dtype, the row count.

Errors name the process, batch and column (`where`). NumPy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

_NUMERIC_KINDS = frozenset("biufc")


class DataError(ValueError):
  """Bad data a source finds in its own records (a packer's): raised on every host as a bad leaf."""


def where(process_index: int, batch_index: int, name: str | None = None) -> str:
  """The prefix of every data error: process, batch and column."""
  s = f"process {process_index}, batch {batch_index}"
  return s if name is None else f"{s}, column {name!r}"


def dtype_ok(dtype: np.dtype) -> bool:
  """Whether a jax.Array can hold `dtype` (native byte order)."""
  return dtype.isnative and _dtype_ok(dtype)


def _dtype_ok(dtype: np.dtype) -> bool:
  """Whether a jax.Array can hold `dtype`, whatever its byte order."""
  if dtype.kind in _NUMERIC_KINDS:
    # Not float128 / complex256 (`np.longdouble`), which JAX has no type for.
    return dtype.itemsize <= (16 if dtype.kind == "c" else 8)
  # ml_dtypes types (bfloat16, float8_*, int4) have kind 'V' but are numeric.
  return dtype.fields is None and isinstance(getattr(ml_dtypes, dtype.name, None), type)


def to_leaf_array(x: Any, *, context: str) -> np.ndarray:
  """`to_array` with >= 1 dim (the rows), of an ndarray, anything with ``__array__`` (a
  jax.Array, an eager tf.Tensor) or a list of numbers: copied only to change its byte order."""
  x = to_array(x, context=context)
  if x.ndim == 0:
    raise ValueError(
      f"{context}: 0-d leaf (a scalar of dtype {x.dtype}); expected an array"
      " whose first dimension is the row (batch) dimension. Batch the"
      " elements first (e.g. Grain's `.batch(n)` or tf.data's `.batch(n)`)"
    )
  return x


def to_array(x: Any, *, context: str) -> np.ndarray:
  """`x` as a native-byte-order NumPy array of any rank that a jax.Array can hold; a ValueError,
  prefixed with `context`, for None, strings, masked, ragged or non-numeric values."""
  x = _as_array(x, context)
  _check_dtype(x.dtype, context)
  return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))


def _as_array(x: Any, context: str) -> np.ndarray:
  """`x` as a plain ndarray of any dtype; raises for None, strings, masked or ragged leaves."""
  if x is None:
    raise ValueError(
      f"{context}: leaf is None; expected a NumPy array with a leading row dimension"
    )
  if isinstance(x, (str, bytes)):
    raise ValueError(
      f"{context}: leaf is a Python {type(x).__name__}; expected a numeric"
      " array (strings cannot become jax.Arrays: tokenize or drop the column)"
    )
  if isinstance(x, np.ma.MaskedArray):
    raise ValueError(
      f"{context}: a NumPy masked array; expected a plain array (JAX drops"
      " the mask): fill it first (`arr.filled(value)`), and pass the mask as"
      " a column of its own if the model needs it"
    )
  if type(x) is np.ndarray:
    return x
  try:  # Subclasses too (np.matrix, np.memmap): a plain view.
    return np.asarray(x)
  except ValueError as e:
    raise ValueError(
      f"{context}: cannot convert a {type(x).__name__} to one array ({e});"
      " expected a rectangular array of numbers"
    ) from e


# What a dtype that no jax.Array holds is, by its kind, in messages.
_NON_NUMERIC = {
  "U": "a string",
  "S": "a bytes",
  "O": "an object",
  "V": "a structured",
  "M": "a datetime",
  "m": "a timedelta",
}


def _check_dtype(dtype: np.dtype, context: str) -> None:
  """Raises, naming `dtype`, unless a jax.Array can hold it (in either byte order)."""
  if _dtype_ok(dtype):
    return
  if dtype.kind in "fc":
    raise ValueError(
      f"{context}: a {dtype} array; JAX has no {dtype} type: cast it first"
      f" (e.g. to {'float64' if dtype.kind == 'f' else 'complex128'})"
    )
  what = _NON_NUMERIC.get(dtype.kind, "a non-numeric")
  raise ValueError(
    f"{context}: {what} array (dtype {dtype}); expected a numeric or bool"
    " dtype that a jax.Array can hold (tokenize/encode it, or drop the"
    " column)"
  )


def row_count(leaves: Sequence[np.ndarray], names: Sequence[str], *, context: str) -> int:
  """Returns the shared leading dimension, or raises naming the leaves."""
  if not leaves:
    return 0
  sizes = {n: int(a.shape[0]) for n, a in zip(names, leaves)}
  distinct = set(sizes.values())
  if len(distinct) > 1:
    shown = ", ".join(f"{n!r}: {s}" for n, s in sizes.items())
    raise ValueError(
      f"{context}: leaves have different leading sizes ({shown}); expected"
      " every leaf to share the row dimension. The elements look unbatched:"
      " batch them first (Grain `.batch(n)`, tf.data `.batch(n)`)"
    )
  return distinct.pop()
