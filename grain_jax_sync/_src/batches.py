"""What a batch is: leaves, row count, and the structure signature hosts compare.

`validate` turns what a source yielded into a `HostBatch`; `Matcher` takes
batches of a known structure without its full walk.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from grain_jax_sync._src.leaves import dtype_ok, row_count, to_leaf_array, where
from grain_jax_sync._src.trees import (
  LEAF,
  NONE,
  TreeSpec,
  check_spec,
  flat_dict_keys,
  flatten,
  key_paths,
)

# A trailing size that `pad_shapes` lets vary, as a signature records it.
VARYING = -1


def _shape_ok(shape: tuple[int, ...], trailing: tuple[int, ...]) -> bool:
  """Whether a leaf's shape has these trailing sizes (any size where one varies)."""
  if shape[1:] == trailing:
    return True
  if len(shape) != len(trailing) + 1 or VARYING not in trailing:
    return False
  return all(t in (x, VARYING) for x, t in zip(shape[1:], trailing))


@dataclasses.dataclass(frozen=True)
class Signature:
  """The structure of a batch, without its row count.

  Per leaf, in leaf order: name, dtype name, trailing shape (`VARYING` where it may vary).
  """

  spec: TreeSpec
  names: tuple[str, ...]
  dtypes: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]

  @classmethod
  def of(
    cls,
    leaves: Sequence[np.ndarray],
    names: Sequence[str],
    spec: TreeSpec,
    varying: Sequence[tuple[int, ...]] | None = None,
  ) -> Signature:
    """The signature of validated leaves.

    `varying`: per leaf, trailing indices whose size may vary (`pad_shapes`),
    recorded as -1 so that batches that differ only there compare equal.
    """
    shapes = [[int(d) for d in a.shape[1:]] for a in leaves]
    for shape, dims in zip(shapes, varying or (), strict=False):
      for t in dims:
        shape[t] = VARYING
    return cls(
      spec=spec,
      names=tuple(names),
      dtypes=tuple(a.dtype.name for a in leaves),
      shapes=tuple(tuple(s) for s in shapes),
    )

  @functools.cached_property
  def varying(self) -> tuple[tuple[int, ...], ...]:
    """Per leaf, the trailing indices that vary (-1 in `shapes`); () where none does."""
    return tuple(tuple(t for t, d in enumerate(s) if d == VARYING) for s in self.shapes)

  def matches(self, leaves: Sequence[np.ndarray], names: Sequence[str], spec: TreeSpec) -> bool:
    """Whether `Signature.of(leaves, names, spec)` would equal this one (cheaper)."""
    if len(leaves) != len(self.names) or spec != self.spec or tuple(names) != self.names:
      return False
    return all(
      a.dtype.name == d and _shape_ok(a.shape, s)
      for a, d, s in zip(leaves, self.dtypes, self.shapes, strict=True)
    )

  def to_json(self) -> dict[str, Any]:
    return {
      "spec": self.spec,
      "leaves": [[n, d, list(s)] for n, d, s in zip(self.names, self.dtypes, self.shapes)],
    }

  @classmethod
  def from_json(cls, obj: Mapping[str, Any]) -> Signature:
    leaves = obj["leaves"]
    return cls(
      spec=obj["spec"],
      names=tuple(n for n, _, _ in leaves),
      dtypes=tuple(d for _, d, _ in leaves),
      shapes=tuple(tuple(s) for _, _, s in leaves),
    )

  def np_dtypes(self) -> list[np.dtype]:
    return [_np_dtype(d) for d in self.dtypes]

  def describe(self) -> str:
    return ", ".join(
      f"{n}: {d}[rows{''.join(f', {x if x != VARYING else chr(42)}' for x in s)}]"
      for n, d, s in zip(self.names, self.dtypes, self.shapes)
    )


def _np_dtype(name: str) -> np.dtype:
  return np.dtype(getattr(ml_dtypes, name, name))


def checked_json(obj: Any) -> Any:
  """`obj` if it is a `Signature.to_json` (data only, of dtypes a jax.Array holds), else a ValueError.

  A peer's signature is checked when it is read, before any host builds from it.
  """
  if obj is None:
    return None
  leaves = obj.get("leaves") if type(obj) is dict else None
  if (
    type(obj) is not dict
    or set(obj) != {"spec", "leaves"}
    or type(leaves) is not list
    or not all(type(leaf) is list and len(leaf) == 3 and _leaf_ok(*leaf) for leaf in leaves)
  ):
    raise ValueError(f"a batch signature {obj!r:.100} that is not one")
  check_spec(obj["spec"])
  return obj


def _leaf_ok(name: Any, dtype: Any, shape: Any) -> bool:
  """A signature's leaf: its name, a dtype name that a jax.Array holds, its trailing sizes."""
  if type(name) is not str or type(dtype) is not str or type(shape) is not list:
    return False
  if not all(type(d) is int and d >= VARYING for d in shape):
    return False
  try:
    found = _np_dtype(dtype)
  except (TypeError, ValueError):
    return False
  return found.name == dtype and dtype_ok(found)


def diff(a: Signature, b: Signature) -> list[str]:
  """Human-readable differences between two signatures ("a" vs "b")."""
  out: list[str] = []
  la = {n: (d, s) for n, d, s in zip(a.names, a.dtypes, a.shapes)}
  lb = {n: (d, s) for n, d, s in zip(b.names, b.dtypes, b.shapes)}
  for which, names, other in (("first", a.names, lb), ("second", b.names, la)):
    only = [n for n in names if n not in other]
    if only:
      out.append(f"columns only in the {which}: {only}")
  for n in a.names:
    if n in lb and la[n] != lb[n]:
      (da, sa), (db, sb) = la[n], lb[n]
      if da != db:
        out.append(f"column {n!r}: dtype {da} vs {db}")
      if sa != sb:
        out.append(f"column {n!r}: trailing shape {_shape_text(sa)} vs {_shape_text(sb)}")
  if not out and a.spec != b.spec:
    out.append(f"tree structure {a.spec!r} vs {b.spec!r}")
  return out


def _shape_text(shape: Sequence[int]) -> str:
  """A trailing shape as a tuple, ``*`` where it varies (`pad_shapes`)."""
  parts = ["*" if d == VARYING else str(d) for d in shape]
  return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


@dataclasses.dataclass
class HostBatch:
  """One validated local batch: native-order NumPy leaves sharing `rows`, their first dimension."""

  leaves: list[np.ndarray]
  rows: int
  signature: Signature

  @property
  def sizes(self) -> tuple[int, ...]:
    """This batch's sizes of the varying dims (`pad_shapes`), leaf by leaf; () if none."""
    return tuple(
      leaf.shape[1 + t]
      for leaf, dims in zip(self.leaves, self.signature.varying, strict=True)
      for t in dims
    )

  @property
  def nbytes(self) -> int:
    """The bytes of every leaf."""
    return sum(leaf.nbytes for leaf in self.leaves)


def validate(
  batch: Any,
  *,
  process_index: int,
  batch_index: int,
  expected: Signature | None = None,
  varying: Callable[[tuple[str, ...], tuple[int, ...]], Sequence[tuple[int, ...]]] | None = None,
) -> HostBatch:
  """Flattens and checks one source batch (``rows == 0`` for an empty one).

  A batch that matches `expected` gets that very `Signature`. `varying`
  (`shapes.leaf_dims`) maps (leaf names, ranks) to each leaf's varying dims.
  """
  raw, names, spec = flatten(batch)
  context = where(process_index, batch_index)
  if spec == NONE:
    raise ValueError(f"{context}: the batch is None; expected an array or a pytree of arrays")
  if len(set(names)) != len(names):
    _name_collision(names, spec, context)
  leaves = [
    to_leaf_array(x, context=where(process_index, batch_index, n)) for x, n in zip(raw, names)
  ]
  rows = row_count(leaves, names, context=context)
  if expected is not None and expected.matches(leaves, names, spec):
    return HostBatch(leaves=leaves, rows=rows, signature=expected)
  dims = None
  if varying is not None:
    try:
      dims = varying(tuple(names), tuple(a.ndim for a in leaves))
    except ValueError as e:
      raise ValueError(f"{context}: {e}") from e
  return HostBatch(leaves=leaves, rows=rows, signature=Signature.of(leaves, names, spec, dims))


def _name_collision(names: Sequence[str], spec: TreeSpec, context: str) -> None:
  """Raises naming two leaves whose names are the same (``{"a": {"b": x}, "a/b": y}``)."""
  paths = key_paths(spec)
  first: dict[str, int] = {}
  for k, name in enumerate(names):
    if name in first:
      raise ValueError(
        f"{context}: leaves {paths[first[name]]} and {paths[k]} have the same"
        f" name {name!r}, by which `paddings`, `dtypes`, `pad_shapes` and"
        " messages tell leaves apart; rename a key so that no two leaves'"
        " slash-joined paths are the same"
      )
    first[name] = k


class Matcher:
  """Takes batches of one known structure without `validate`'s full walk.

  Compiled from a batch `validate` accepted (exact container types and keys,
  per leaf dtype, rank and trailing shape). `match` returns what `validate`
  would for plain ndarrays that fit, else None (then `validate` looks).
  """

  def __init__(self, signature: Signature, tree: Any):
    self.signature = signature
    self._tree = tree
    self._checks = [
      (dt, len(shape) + 1, shape)
      for dt, shape in zip(signature.np_dtypes(), signature.shapes, strict=True)
    ]
    # A dict of leaves only (the common case): its keys, in leaf order.
    self._flat = flat_dict_keys(signature.spec)
    self._flat_type = tree[1] if self._flat is not None else None

  @classmethod
  def compile(cls, batch: Any, signature: Signature) -> Matcher | None:
    """The matcher for batches shaped like `batch`, or None if it has none."""
    try:
      return cls(signature, _compile(batch, signature.spec))
    except (KeyError, TypeError, ValueError, IndexError):
      return None

  def match(self, batch: Any) -> HostBatch | None:
    """The validated batch, or None where `validate` must look at it."""
    leaves: list[Any]
    if self._flat is not None:
      if type(batch) is not self._flat_type or len(batch) != len(self._flat):
        return None
      try:
        leaves = [batch[k] for k in self._flat]
      except (KeyError, TypeError):
        return None
    else:
      leaves = []
      if not _take(self._tree, batch, leaves):
        return None
    rows = -1
    for a, (dtype, ndim, trailing) in zip(leaves, self._checks, strict=True):
      if type(a) is not np.ndarray or a.dtype != dtype:
        return None
      shape = a.shape
      if len(shape) != ndim or (shape[1:] != trailing and not _shape_ok(shape, trailing)):
        return None
      if rows < 0:
        rows = shape[0]
      elif shape[0] != rows:
        return None
    return HostBatch(leaves=leaves, rows=max(rows, 0), signature=self.signature)


# A compiled tree node: (LEAF,) or (kind, exact container type, keys or length,
# child nodes); kind "d" (mapping, keys in leaf order) or "s" (sequence).
_LEAF_NODE = (LEAF,)
_NONE_NODE = (NONE,)


def _compile(x: Any, spec: TreeSpec) -> tuple[Any, ...]:
  if spec == LEAF:
    return _LEAF_NODE
  if spec == NONE:
    return _NONE_NODE
  if "o" in spec:
    raise ValueError("a registered node: batches go through `validate`")
  if "d" in spec:
    keys = tuple(k for k, _ in spec["d"])
    if len(x) != len(keys):
      raise ValueError("keys")
    return ("d", type(x), keys, tuple(_compile(x[k], sub) for k, sub in spec["d"]))
  subs = spec["t"] if "t" in spec else spec["l"]
  if len(x) != len(subs):
    raise ValueError("length")
  return ("s", type(x), len(subs), tuple(_compile(v, sub) for v, sub in zip(x, subs)))


def _take(node: tuple[Any, ...], x: Any, out: list[Any]) -> bool:
  """Appends the leaves of `x` to `out`; False if `x` is not shaped like `node`."""
  if node is _LEAF_NODE:
    out.append(x)
    return True
  if node is _NONE_NODE:
    return x is None
  kind, t, keys, subs = node
  if type(x) is not t:
    return False
  if kind == "d":
    if len(x) != len(keys):
      return False
    try:
      return all(_take(sub, x[k], out) for k, sub in zip(keys, subs))
    except (KeyError, TypeError):
      return False
  if len(x) != keys:
    return False
  return all(_take(sub, v, out) for v, sub in zip(x, subs))
