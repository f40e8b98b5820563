"""What a batch is: leaves, row count, structure signature, validation.

A batch is a NumPy array or a pytree of them: dicts, lists, tuples and
namedtuples, None (an empty node, as in JAX), and any other node registered
with `jax.tree_util` (a `jax.tree_util.register_dataclass` or
`flax.struct.dataclass` batch). Every leaf shares the leading (row)
dimension. The structure signature (tree shape, per-leaf dtype and trailing
shape) is what hosts compare to make sure they build the same global arrays;
it is JSON so that it can travel in the exchange and let a host with no data
of its own build dummy batches.

NumPy only, except for registered nodes, which JAX flattens.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import functools
import importlib
import numbers
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

# A JSON encoding of a tree's containers. "*" is a leaf; "~" None (no leaf);
# {"d": [[key, sub]...]} a dict with keys in sorted order; {"l": [...]} a
# list; {"t": [...]} a tuple; {"t": [...], "nt": "module:QualName", "f":
# [fields]} a namedtuple; {"o": "module:QualName", "a": str(node), "c":
# [[name, sub]...], "p": node} a node registered with `jax.tree_util`, "p"
# its one-level `PyTreeDef` pickled (base64), which rebuilds it.
TreeSpec = Any
LEAF = "*"
NONE = "~"
ROOT_NAME = "<batch>"

_NUMERIC_KINDS = frozenset("biufc")


def _key_order(key: Any) -> tuple[str, Any]:
  return (type(key).__name__, key)


def _is_namedtuple(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_scalar(x: Any) -> bool:
  return isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, (str, bytes))


def _is_scalar_sequence(x: Any) -> bool:
  """A (nested) list of numbers: one leaf that NumPy converts unambiguously."""
  if not isinstance(x, list) or not x:
    return False
  return all(_is_scalar(e) or _is_scalar_sequence(e) for e in x)


def _child_name(prefix: str, key: Any) -> str:
  return str(key) if not prefix else f"{prefix}/{key}"


def flatten(batch: Any) -> tuple[list[Any], list[str], TreeSpec]:
  """Flattens a batch into leaves, leaf names and a JSON tree spec.

  Dicts are walked in sorted key order (as `jax.tree_util` does). A list of
  numbers is one leaf, not a container of scalar leaves.

  Args:
    batch: An array or a pytree of arrays.

  Returns:
    (leaves, names, spec): leaves as given (not yet converted), their
    slash-joined paths (``"features/ids"``; ``"<batch>"`` for a bare array) and
    the tree spec that `unflatten` inverts.
  """
  leaves: list[Any] = []
  names: list[str] = []
  spec = _walk(batch, "", leaves, names)
  return leaves, names, spec


def _walk(x: Any, prefix: str, leaves: list[Any], names: list[str]) -> TreeSpec:
  # Module-level rather than a closure: a self-referencing closure makes a
  # reference cycle per batch that keeps its arrays alive until the next GC.
  if isinstance(x, Mapping):
    try:
      keys = sorted(x.keys(), key=_key_order)
    except TypeError as e:
      raise ValueError(f"dict keys must be str or int, got {list(x.keys())!r}") from e
    return {"d": [[k, _walk(x[k], _child_name(prefix, k), leaves, names)] for k in keys]}
  if _is_namedtuple(x):
    t = type(x)
    return {
      "t": [_walk(v, _child_name(prefix, f), leaves, names) for f, v in zip(t._fields, x)],
      "nt": f"{t.__module__}:{t.__qualname__}",
      "f": list(t._fields),
    }
  if isinstance(x, tuple):
    return {"t": [_walk(v, _child_name(prefix, i), leaves, names) for i, v in enumerate(x)]}
  if isinstance(x, list) and not _is_scalar_sequence(x):
    return {"l": [_walk(v, _child_name(prefix, i), leaves, names) for i, v in enumerate(x)]}
  if x is None:
    return NONE
  node = _registered_node(x)
  if node is not None:
    children, treedef = node
    return {
      "o": f"{type(x).__module__}:{type(x).__qualname__}",
      "a": str(treedef),
      "c": [[k, _walk(v, _child_name(prefix, k), leaves, names)] for k, v in children],
      "p": base64.b64encode(pickle.dumps(treedef)).decode("ascii"),
    }
  leaves.append(x)
  names.append(prefix or ROOT_NAME)
  return LEAF


def _registered_node(x: Any) -> tuple[list[tuple[str, Any]], Any] | None:
  """A node registered with `jax.tree_util`: its (name, child) pairs and one-level treedef.

  None for leaves: arrays, anything with ``__array__``, numbers, strings.
  """
  if isinstance(x, (np.ndarray, np.generic, numbers.Number, str, bytes, list)) or hasattr(
    x, "__array__"
  ):
    return None
  import jax  # Only for objects that no container above takes.

  flat, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
  if jax.tree_util.treedef_is_leaf(treedef):
    return None
  return [(jax.tree_util.keystr(path, simple=True, separator="/"), v) for path, v in flat], treedef


@functools.lru_cache(maxsize=64)
def _treedef(blob: str) -> Any:
  """A pickled one-level `PyTreeDef` (a spec's "p"), loaded once per structure."""
  return pickle.loads(base64.b64decode(blob))  # noqa: S301 - a spec of this job's own hosts.


def _namedtuple_type(path: str, fields: Sequence[str]) -> type:
  module, _, qualname = path.partition(":")
  try:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
      obj = getattr(obj, part)
    return obj
  except (ImportError, AttributeError):
    return collections.namedtuple(qualname.rsplit(".", 1)[-1], fields)  # type: ignore[misc]


def unflatten(spec: TreeSpec, leaves: Sequence[Any]) -> Any:
  """Rebuilds a batch from `flatten`'s spec and a list of leaves."""
  return _build(spec, iter(leaves))


def _build(s: TreeSpec, it: Iterator[Any]) -> Any:
  if s == LEAF:
    return next(it)
  if s == NONE:
    return None
  if "o" in s:
    return _treedef(s["p"]).unflatten([_build(sub, it) for _, sub in s["c"]])
  if "d" in s:
    return {k: _build(sub, it) for k, sub in s["d"]}
  if "l" in s:
    return [_build(sub, it) for sub in s["l"]]
  values = [_build(sub, it) for sub in s["t"]]
  if "nt" in s:
    return _namedtuple_type(s["nt"], s["f"])(*values)
  return tuple(values)


def is_dict_spec(spec: TreeSpec) -> bool:
  return isinstance(spec, dict) and "d" in spec


def flat_dict_keys(spec: TreeSpec) -> tuple[Any, ...] | None:
  """The keys, in leaf order, of a dict of leaves only; None for any other tree."""
  if not is_dict_spec(spec) or any(sub != LEAF for _, sub in spec["d"]):
    return None
  return tuple(k for k, _ in spec["d"])


def spec_keys(spec: TreeSpec) -> list[Any]:
  return [k for k, _ in spec["d"]] if is_dict_spec(spec) else []


def where(process_index: int, batch_index: int, name: str | None = None) -> str:
  """The prefix of every data error: process, batch and column."""
  s = f"process {process_index}, batch {batch_index}"
  return s if name is None else f"{s}, column {name!r}"


def dtype_ok(dtype: np.dtype) -> bool:
  """Whether a jax.Array can hold `dtype` (native byte order)."""
  return dtype.isnative and _dtype_ok(dtype)


def _dtype_ok(dtype: np.dtype) -> bool:
  if dtype.kind in _NUMERIC_KINDS:
    # Not float128 / complex256 (`np.longdouble`), which JAX has no type for.
    return dtype.itemsize <= (16 if dtype.kind == "c" else 8)
  # ml_dtypes types (bfloat16, float8_*, int4) have kind 'V' but are numeric.
  return dtype.fields is None and isinstance(getattr(ml_dtypes, dtype.name, None), type)


def to_leaf_array(x: Any, *, context: str) -> np.ndarray:
  """Converts one leaf to a native-byte-order NumPy array with >= 1 dim.

  Args:
    x: The leaf: an ndarray, anything with ``__array__`` (a jax.Array, a
      tf.Tensor in eager mode) or a list of numbers.
    context: The error prefix, from `where`.

  Returns:
    The array; a copy only when the byte order had to change.

  Raises:
    ValueError: For None, strings, objects, structured dtypes, 0-d leaves and
      ragged lists, naming the column and batch.
  """
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
  if type(x) is not np.ndarray:  # Subclasses too (np.matrix, np.memmap): a plain view.
    try:
      x = np.asarray(x)
    except ValueError as e:
      raise ValueError(
        f"{context}: cannot convert a {type(x).__name__} to one array ({e});"
        " expected a rectangular array of numbers"
      ) from e
  dtype = x.dtype
  if not _dtype_ok(dtype) and dtype.kind in "fc":
    raise ValueError(
      f"{context}: a {dtype} array; JAX has no {dtype} type: cast it first"
      f" (e.g. to {'float64' if dtype.kind == 'f' else 'complex128'})"
    )
  if not _dtype_ok(dtype):
    what = {
      "U": "a string",
      "S": "a bytes",
      "O": "an object",
      "V": "a structured",
      "M": "a datetime",
      "m": "a timedelta",
    }.get(dtype.kind, "a non-numeric")
    raise ValueError(
      f"{context}: {what} array (dtype {dtype}); expected a numeric or bool"
      " dtype that a jax.Array can hold (tokenize/encode it, or drop the"
      " column)"
    )
  if x.ndim == 0:
    raise ValueError(
      f"{context}: 0-d leaf (a scalar of dtype {dtype}); expected an array"
      " whose first dimension is the row (batch) dimension. Batch the"
      " elements first (e.g. Grain's `.batch(n)` or tf.data's `.batch(n)`)"
    )
  if not dtype.isnative:
    x = x.astype(dtype.newbyteorder("="))
  return x


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

  Attributes:
    spec: The tree spec from `flatten`.
    names: Leaf names, in leaf order.
    dtypes: NumPy dtype names (``"float32"``, ``"bfloat16"``), in leaf order.
    shapes: Trailing shapes (all but the row dimension), in leaf order.
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

    Args:
      leaves: The leaves.
      names: Their names.
      spec: The tree spec.
      varying: Per leaf, trailing indices whose size may vary (`pad_shapes`):
        recorded as -1, so batches that differ only there compare equal.
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
    for a, d, s in zip(leaves, self.dtypes, self.shapes):
      if a.dtype.name != d or not _shape_ok(a.shape, s):
        return False
    return True

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
    return [
      np.dtype(d) if not hasattr(ml_dtypes, d) else np.dtype(getattr(ml_dtypes, d))
      for d in self.dtypes
    ]

  def describe(self) -> str:
    return ", ".join(
      f"{n}: {d}[rows{''.join(f', {x if x != VARYING else chr(42)}' for x in s)}]"
      for n, d, s in zip(self.names, self.dtypes, self.shapes)
    )


def diff(a: Signature, b: Signature) -> list[str]:
  """Human-readable differences between two signatures ("a" vs "b")."""
  out: list[str] = []
  la = {n: (d, s) for n, d, s in zip(a.names, a.dtypes, a.shapes)}
  lb = {n: (d, s) for n, d, s in zip(b.names, b.dtypes, b.shapes)}
  only_a = [n for n in a.names if n not in lb]
  only_b = [n for n in b.names if n not in la]
  if only_a:
    out.append(f"columns only in the first: {only_a}")
  if only_b:
    out.append(f"columns only in the second: {only_b}")
  for n in a.names:
    if n in lb and la[n] != lb[n]:
      (da, sa), (db, sb) = la[n], lb[n]
      if da != db:
        out.append(f"column {n!r}: dtype {da} vs {db}")
      if sa != sb:
        out.append(f"column {n!r}: trailing shape {_shape_text(sa)} vs {_shape_text(sb)}")
  if not out and a.spec != b.spec:
    out.append(f"tree structure {_readable(a.spec)!r} vs {_readable(b.spec)!r}")
  return out


def _shape_text(shape: Sequence[int]) -> str:
  """A trailing shape as a tuple, ``*`` where it varies (`pad_shapes`)."""
  parts = ["*" if d == VARYING else str(d) for d in shape]
  return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _readable(spec: TreeSpec) -> TreeSpec:
  """`spec` without registered nodes' pickled treedefs (their "a" names them)."""
  if isinstance(spec, dict):
    return {k: _readable(v) for k, v in spec.items() if k != "p"}
  if isinstance(spec, list):
    return [_readable(v) for v in spec]
  return spec


@dataclasses.dataclass
class HostBatch:
  """One validated local batch.

  Attributes:
    leaves: Native-order NumPy arrays sharing the leading dimension.
    rows: That leading dimension.
    signature: The batch's structure.
  """

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
  """Flattens and checks one source batch.

  Args:
    batch: What the source yielded.
    process_index: This process, for error messages.
    batch_index: The source batch's index on this host, for error messages.
    expected: The structure of the earlier batches: a batch that matches it
      gets that very `Signature` (no new one is built per batch).
    varying: With `pad_shapes`: (leaf names, ranks) -> per leaf the trailing
      indices that may vary (`shapes.leaf_dims`); its ValueError (a column
      or dim that the batch lacks) is raised naming the batch.

  Returns:
    The validated batch (``rows == 0`` for an empty batch).

  Raises:
    ValueError: Naming the process, batch and column of any bad leaf.
  """
  raw, names, spec = flatten(batch)
  if spec == NONE:
    raise ValueError(
      f"{where(process_index, batch_index)}: the batch is None; expected an array"
      " or a pytree of arrays"
    )
  leaves = [
    to_leaf_array(x, context=where(process_index, batch_index, n)) for x, n in zip(raw, names)
  ]
  rows = row_count(leaves, names, context=where(process_index, batch_index))
  if expected is not None and expected.matches(leaves, names, spec):
    return HostBatch(leaves=leaves, rows=rows, signature=expected)
  dims = None
  if varying is not None:
    try:
      dims = varying(tuple(names), tuple(a.ndim for a in leaves))
    except ValueError as e:
      raise ValueError(f"{where(process_index, batch_index)}: {e}") from e
  return HostBatch(leaves=leaves, rows=rows, signature=Signature.of(leaves, names, spec, dims))


class Matcher:
  """Takes batches of one known structure without `validate`'s full walk.

  Compiled from a batch that `validate` accepted and its signature: the exact
  container types and keys, and per leaf the dtype, rank and trailing shape.
  `match` returns the `HostBatch` of a batch with those containers whose
  leaves are plain native-order ndarrays of those dtypes and trailing shapes
  sharing one row count, and None for anything else, which then goes through
  `validate` (and its errors). A match is what `validate` would return, with
  the same `Signature` object.

  Measured (`docs/performance.md`): 2 to 3 us for a dict of two image
  columns where `validate` takes 26 us; about 0.3 us per further column.
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
