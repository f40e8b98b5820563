"""Shapes that vary: which dims may differ across hosts, their buckets and masks.

`pad_shapes=` names the dims (``{"tokens": 1}``) whose sizes may differ;
signatures record them as -1. Hosts report their sizes per batch
(`messages.Report.sizes`) and agree on the maximum, rounded up to the
column's next bucket (`shape_buckets=`); every host pads to it
(`padding.fill_leaf`), with element masks where `shape_mask_keys=` asks. No JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from grain_jax_sync._src.trees import ROOT_NAME


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The three options, validated and hashable (part of `plan.Rules`)."""

  dims: tuple[tuple[str, tuple[int, ...]], ...]  # (column, the dims >= 1 that may vary) pairs.
  # (column, ascending sizes) pairs; a column without buckets pads to the agreed maximum.
  buckets: tuple[tuple[str, tuple[int, ...]], ...] = ()
  masks: tuple[tuple[str, str], ...] = ()  # (column, element mask key) pairs.

  def describe(self) -> dict[str, Any]:
    """A JSON-stable form for the settings digest."""
    return {
      "dims": {c: list(d) for c, d in self.dims},
      "buckets": {c: list(b) for c, b in self.buckets},
      "masks": dict(self.masks),
    }


def is_int(x: Any) -> bool:
  """An int, NumPy's too; not a bool."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _ints(value: Any) -> list[Any] | None:
  """The items of a list, tuple or 1-D array of ints; None for anything else (a dict, a set)."""
  if isinstance(value, np.ndarray):
    value = value.tolist() if value.ndim == 1 else None
  if not isinstance(value, (list, tuple)) or not all(map(is_int, value)):
    return None
  return [int(x) for x in value]


def _dims(column: str, value: Any) -> tuple[int, ...]:
  out = [int(value)] if is_int(value) else _ints(value)
  if out is None or any(d < 1 for d in out):
    raise ValueError(
      f"`pad_shapes` for column {column!r}: dims must be ints >= 1 (dim 0 is"
      f" the row dim, which `paddings` pads), got {value!r}"
    )
  if not out or len(set(out)) != len(out):
    raise ValueError(f"`pad_shapes` for column {column!r}: expected distinct dims, got {value!r}")
  return tuple(sorted(out))


def _buckets(column: str, value: Any) -> tuple[int, ...]:
  out = _ints(value)
  if not out or any(b < 1 for b in out) or out != sorted(set(out)):
    per_dim = " (one list for all of the column's dims, not one per dim)" * isinstance(
      value, Mapping
    )
    raise ValueError(
      f"`shape_buckets` for column {column!r}: expected a non-empty list of"
      f" ascending ints >= 1{per_dim} such as [128, 256, 512], got {value!r:.100}"
    )
  return tuple(out)


def make(
  pad_shapes: Any,
  shape_buckets: Any,
  shape_mask_keys: Any,
  paddings: Any,
  *,
  synchronized: bool = True,
) -> Shapes | None:
  """Checks the three options; None when `pad_shapes` is not given.

  `paddings` (the fill value) is required with `pad_shapes`, and so is
  `synchronized` (`synchronize_batches`, or one process): unsynchronized
  hosts cannot agree on sizes. Raises ValueError for a malformed option.
  """
  if pad_shapes is None:
    for arg, v in (("shape_buckets", shape_buckets), ("shape_mask_keys", shape_mask_keys)):
      if v is not None:
        raise ValueError(f"`{arg}` needs `pad_shapes` (the dims that vary), got {arg}={v!r}")
    return None
  if not synchronized:
    raise ValueError(
      f"`pad_shapes`={pad_shapes!r} needs `synchronize_batches=True` on several"
      " processes: the hosts agree on the padded sizes through it"
    )
  if paddings is None:
    raise ValueError(
      f"`pad_shapes`={pad_shapes!r} needs `paddings`: the value the padded"
      " elements (and rows) are filled with, e.g. paddings=0"
    )
  if not isinstance(pad_shapes, Mapping):
    pad_shapes = {ROOT_NAME: pad_shapes}  # A bare array batch.
  if not pad_shapes:
    raise ValueError("`pad_shapes` is empty; name at least one column, or pass None")
  dims = tuple(sorted((str(c), _dims(str(c), v)) for c, v in pad_shapes.items()))
  named = {c for c, _ in dims}
  given = _per_column("shape_buckets", shape_buckets, named)
  buckets = tuple(sorted((c, _buckets(c, v)) for c, v in given.items()))
  masks = []
  for c, key in sorted(_per_column("shape_mask_keys", shape_mask_keys, named).items()):
    if not isinstance(key, str):
      raise ValueError(f"`shape_mask_keys` for column {c!r} must be a str, got {key!r}")
    masks.append((c, key))
  return Shapes(dims, buckets, tuple(masks))


def _per_column(arg: str, value: Any, named: set[str]) -> dict[str, Any]:
  """A per-column option as a dict over columns that `pad_shapes` names."""
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    if len(named) != 1:
      raise ValueError(f"`{arg}` must be a dict of column name to value, got {value!r}")
    value = {next(iter(named)): value}
  unknown = sorted(str(c) for c in value if str(c) not in named)
  if unknown:
    raise ValueError(
      f"`{arg}` names columns that `pad_shapes` does not: {unknown}; `pad_shapes`"
      f" names {sorted(named)}"
    )
  return {str(c): v for c, v in value.items()}


def column_of(name: str, columns: Collection[str]) -> str | None:
  """The longest column (a leaf's path or a prefix of it) that names leaf `name`."""
  parts = name.split("/")
  for n in range(len(parts), 0, -1):
    prefix = "/".join(parts[:n])
    if prefix in columns:
      return prefix
  return None


def columns_of(
  what: str, names: Sequence[str], columns: Mapping[str, Any], kinds: str = "a scalar"
) -> list[str | None]:
  """Per leaf name, its column (`column_of`; a bare array's: the one entry, whatever its key).

  A ValueError naming `what` for a column with no leaf, or for several entries
  for a bare array (`kinds`: what `what` may be instead of a dict).
  """
  if tuple(names) == (ROOT_NAME,):
    if len(columns) != 1:
      raise ValueError(
        f"`{what}` for a single-array batch must be {kinds} or a dict with one"
        f" entry, got {dict(columns)!r}"
      )
    return list(columns)
  found = [column_of(name, columns) for name in names]
  unknown = sorted(set(columns) - set(found))
  if unknown:
    raise ValueError(
      f"`{what}` names columns that the batches do not have: {unknown};"
      f" the columns are {list(names)}"
    )
  return found


@functools.lru_cache(maxsize=64)
def leaf_dims(
  shapes: Shapes, names: tuple[str, ...], ranks: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
  """Per leaf, the trailing indices (dim - 1) that vary, () for a fixed leaf; a ValueError where
  `pad_shapes` names a column or dim that the leaves (`ranks` dims each, rows included) lack."""
  given = dict(shapes.dims)
  found = columns_of("pad_shapes", names, given, "an int, a tuple")
  out: list[tuple[int, ...]] = []
  for name, rank, column in zip(names, ranks, found, strict=True):
    dims = () if column is None else given[column]
    if dims and dims[-1] >= rank:
      raise ValueError(
        f"column {name!r}: `pad_shapes` names dim {dims[-1]}, but the leaf has"
        f" {rank} dims (rows included; dims {list(range(1, rank))} may vary)"
      )
    out.append(tuple(d - 1 for d in dims))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Flat:
  """The varying dims of one structure, in report order (leaf, then dim)."""

  names: tuple[str, ...]  # Per varying dim, ``"column dim d"`` for messages.
  buckets: tuple[tuple[int, ...], ...]  # Per varying dim, its column's buckets (() for none).


@functools.lru_cache(maxsize=64)
def flat(shapes: Shapes, names: tuple[str, ...], trailing: tuple[tuple[int, ...], ...]) -> Flat:
  """`Flat` for a signature's names and trailing shapes (-1 where a dim varies)."""
  given = dict(shapes.buckets)
  out_names: list[str] = []
  out_buckets: list[tuple[int, ...]] = []
  for name, shape in zip(names, trailing, strict=True):
    # A bare array takes its one entry, whatever its key.
    column = next(iter(given)) if names == (ROOT_NAME,) and given else column_of(name, given)
    for t, s in enumerate(shape):
      if s == -1:
        out_names.append(f"column {name!r} dim {t + 1}")
        out_buckets.append(given.get(column, ()) if column is not None else ())
  return Flat(tuple(out_names), tuple(out_buckets))


def agree(
  per_host: Sequence[tuple[int, ...] | None], layout: Flat, index: int
) -> tuple[int, ...] | str:
  """The agreed sizes at batch `index`: per varying dim the max over hosts (`per_host`, None
  where a host has no batch), up to its next bucket; the error where it is above the last."""
  got = [s for s in per_host if s is not None]
  out = []
  for k, buckets in enumerate(layout.buckets):
    size = max((s[k] for s in got), default=0)
    if buckets:
      b = bisect.bisect_left(buckets, size)
      if b == len(buckets):
        hosts = [p for p, s in enumerate(per_host) if s is not None and s[k] == size]
        return (
          f"{layout.names[k]}: size {size} at batch {index} (process {hosts[0]}) is"
          f" above the last of its `shape_buckets` {list(buckets)}; add a"
          " larger bucket, or truncate the sequences in the source"
        )
      size = buckets[b]
    out.append(size)
  return tuple(out)
