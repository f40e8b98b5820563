"""A batch's tree: its leaves, their names and a JSON spec of the containers.

A batch is a NumPy array or a pytree of them: dicts, lists, tuples,
namedtuples, None (an empty node, as in JAX) and nodes registered with
`jax.tree_util` (a `flax.struct.dataclass` batch). The spec travels in the
exchange, so a host with no data of its own builds dummy batches from it; it
is data only, checked (`check_spec`) and rebuilt without unpickling or
importing anything. JAX only for registered nodes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import numbers
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

# A JSON encoding of a tree's containers. "*" is a leaf; "~" None (no leaf);
# {"d": [[key, sub]...]} a dict with keys in sorted order; {"l": [...]} a
# list; {"t": [...]} a tuple; {"t": [...], "nt": "module:QualName", "f":
# [fields]} a namedtuple; {"o": "module:QualName", "a": str(node), "c":
# [[name, sub]...], "x": aux} a node registered with `jax.tree_util`, "x" its
# aux data where that is plain data (`_to_data`), which rebuilds it from the
# registered type.
TreeSpec = Any
LEAF = "*"
NONE = "~"
ROOT_NAME = "<batch>"


def _is_scalar_sequence(x: Any) -> bool:
  """A (nested) list of numbers: one leaf that NumPy converts unambiguously."""
  if not isinstance(x, list) or not x:
    return False
  scalar = (numbers.Number, np.generic)
  return all(
    (isinstance(e, scalar) and not isinstance(e, (str, bytes))) or _is_scalar_sequence(e) for e in x
  )


def _child_name(prefix: str, key: Any) -> str:
  return str(key) if not prefix else f"{prefix}/{key}"


def flatten(batch: Any) -> tuple[list[Any], list[str], TreeSpec]:
  """Flattens a batch into its leaves (as given), their names and the spec `unflatten` inverts.

  Names are slash-joined paths (``"features/ids"``; ``"<batch>"`` for a bare
  array). Dicts go in sorted key order (as in `jax.tree_util`); a list of
  numbers is one leaf.
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
      keys = sorted(x.keys(), key=lambda k: (type(k).__name__, k))
    except TypeError as e:
      raise ValueError(f"dict keys must be str or int, got {list(x.keys())!r}") from e
    return {"d": [[k, _walk(x[k], _child_name(prefix, k), leaves, names)] for k in keys]}
  if isinstance(x, tuple) and hasattr(type(x), "_fields"):  # A namedtuple.
    t: Any = type(x)
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
    spec = {
      "o": f"{type(x).__module__}:{type(x).__qualname__}",
      "a": str(treedef),
      "c": [[k, _walk(v, _child_name(prefix, k), leaves, names)] for k, v in children],
    }
    return _own_node(spec, treedef)
  leaves.append(x)
  names.append(prefix or ROOT_NAME)
  return LEAF


def _registered_node(x: Any) -> tuple[list[tuple[str, Any]], Any] | None:
  """A node registered with `jax.tree_util`: its (name, child) pairs and one-level treedef;
  None for leaves (arrays, anything with ``__array__``, numbers, strings)."""
  if isinstance(x, (np.ndarray, np.generic, numbers.Number, str, bytes, list)) or hasattr(
    x, "__array__"
  ):
    return None
  import jax  # Only for objects that no container above takes.

  flat, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
  if jax.tree_util.treedef_is_leaf(treedef):
    return None
  return [(jax.tree_util.keystr(path, simple=True, separator="/"), v) for path, v in flat], treedef


# The one-level treedefs of the registered nodes this process flattened, by
# `_node_key`: a process rebuilds its own structures without reading their
# aux data back. A bounded cache whose every access is one atomic dict call
# (a set, a `popitem`, a `get`), so it needs no lock: reading threads write
# it, building threads read it; two writers at once may each evict one.
_OWN: collections.OrderedDict[str, Any] = collections.OrderedDict()
_OWN_LIMIT = 64  # Distinct registered-node structures; a batch has a handful.


def _node_key(spec: Mapping[str, Any]) -> str:
  return json.dumps([spec["o"], spec["a"], spec.get("x"), len(spec["c"])])


def _own_node(spec: dict[str, Any], treedef: Any) -> dict[str, Any]:
  """`spec` with its aux data where plain ("x"); `treedef` kept as this process's own."""
  try:
    spec["x"] = _to_data(treedef.node_data()[1])
  except (TypeError, RecursionError):
    pass  # Not plain data: rebuilt only where a batch of it was flattened.
  _OWN[_node_key(spec)] = treedef
  if len(_OWN) > _OWN_LIMIT:
    _OWN.popitem(last=False)  # The first one kept.
  return spec


def _to_data(x: Any) -> Any:
  """Aux data as JSON data: None, bools, ints, finite floats, str, and lists, tuples
  (``{"t": [...]}``) and str-keyed dicts (``{"d": [[k, v]...]}``) of them, exactly
  those types. Raises TypeError for anything else."""
  kind = type(x)
  if kind in (type(None), bool, int, str) or (kind is float and math.isfinite(x)):
    return x
  if kind is list:
    return [_to_data(v) for v in x]
  if kind is tuple:
    return {"t": [_to_data(v) for v in x]}
  if kind is dict and all(type(k) is str for k in x):
    return {"d": [[k, _to_data(v)] for k, v in x.items()]}
  raise TypeError(f"not plain data: {kind.__name__}")


def _from_data(x: Any) -> Any:
  """The inverse of `_to_data`, for data read from a peer: ValueError for anything else."""
  kind = type(x)
  if kind in (type(None), bool, int, str) or (kind is float and math.isfinite(x)):
    return x
  if kind is list:
    return [_from_data(v) for v in x]
  if kind is dict and len(x) == 1 and type(x.get("t")) is list:
    return tuple(_from_data(v) for v in x["t"])
  if kind is dict and len(x) == 1 and _pair_subtrees(x.get("d"), (str,)) is not None:
    return {k: _from_data(v) for k, v in x["d"]}
  raise ValueError(f"aux data {x!r:.80} is not plain data")


def _imported(path: str) -> Any:
  """What `path` ("module:QualName") names in modules imported already (imports none), or None."""
  module, _, qualname = path.partition(":")
  obj = sys.modules.get(module)
  for part in qualname.split("."):
    if obj is None or not part.isidentifier():
      return None
    obj = getattr(obj, part, None)
  return obj


@functools.lru_cache(maxsize=64)
def _namedtuple_type(path: str, fields: tuple[str, ...]) -> type:
  """The namedtuple type `path` names, where imported with these fields; else one made so."""
  found = _imported(path)
  if (
    isinstance(found, type)
    and issubclass(found, tuple)
    and getattr(found, "_fields", None) == fields
  ):
    return found
  return collections.namedtuple(path.partition(":")[2].rpartition(".")[2], fields)  # type: ignore[misc]


@functools.lru_cache(maxsize=64)
def _rebuilt(path: str, shown: str, data: str | None, children: int) -> Any:
  """A registered node's one-level treedef from its imported type and aux data, or a ValueError
  naming the node."""
  import jax  # Only for registered nodes.

  where = f"the batch's node {shown} ({path})"
  if data is None:
    raise ValueError(
      f"{where}: its aux data (static fields) is not plain data, so a process that"
      " read no batch of this structure cannot rebuild it; make the static fields"
      " None, bools, ints, floats, strings, or lists, tuples and dicts of them"
    )
  kind = _imported(path)
  if not isinstance(kind, type) or kind.__module__ in ("builtins", "collections"):
    raise ValueError(f"{where}: names no registered pytree node type of an imported module")
  aux = _from_data(json.loads(data))
  _check_arity(kind, aux, children, where)
  make = getattr(jax.tree_util.PyTreeDef, "from_node_data_and_children", None)
  if make is None:
    raise ValueError(
      f"{where}: a process that read no batch of this structure rebuilds it with"
      " jax>=0.8 (`PyTreeDef.from_node_data_and_children`); upgrade jax and jaxlib"
    )
  leaf = jax.tree_util.tree_structure(0)
  try:
    return make(jax.tree_util.default_registry, (kind, aux), [leaf] * children)
  except Exception as e:  # noqa: BLE001 - JAX's words, as a ValueError naming the node.
    raise ValueError(f"{where}: cannot be rebuilt ({type(e).__name__}: {e})") from e


def _check_arity(kind: type, aux: Any, children: int, where: str) -> None:
  """A dataclass node has a child per field not in `aux` (JAX does not check it from data)."""
  if not dataclasses.is_dataclass(kind) or not isinstance(aux, tuple):
    return
  fields = sum(1 for f in dataclasses.fields(kind) if f.init)
  if children + len(aux) != fields:
    raise ValueError(
      f"{where}: {children} children and {len(aux)} static fields, but the dataclass"
      f" has {fields} fields"
    )


def unflatten(spec: TreeSpec, leaves: Sequence[Any]) -> Any:
  """Rebuilds a batch from `flatten`'s spec and a list of leaves."""
  return _build(spec, iter(leaves))


def _build(s: TreeSpec, it: Iterator[Any]) -> Any:
  if s == LEAF:
    return next(it)
  if s == NONE:
    return None
  if "o" in s:  # A registered node: its one-level treedef, this process's own or rebuilt.
    treedef = _OWN.get(_node_key(s))
    if treedef is None:
      data = json.dumps(s["x"]) if "x" in s else None
      treedef = _rebuilt(s["o"], s["a"], data, len(s["c"]))
    return treedef.unflatten([_build(sub, it) for _, sub in s["c"]])
  if "d" in s:
    return {k: _build(sub, it) for k, sub in s["d"]}
  if "l" in s:
    return [_build(sub, it) for sub in s["l"]]
  values = [_build(sub, it) for sub in s["t"]]
  if "nt" in s:
    return _namedtuple_type(s["nt"], tuple(s["f"]))(*values)
  return tuple(values)


def key_paths(spec: TreeSpec, prefix: str = "batch") -> list[str]:
  """Each leaf's key path, in leaf order: ``batch['a']['b']``, ``batch[0]``, ``batch.field``.

  Unlike a leaf's name (slash-joined), a key path tells apart leaves whose
  names are the same (``{"a": {"b": x}, "a/b": y}``).
  """
  if spec == LEAF:
    return [prefix]
  if spec == NONE:
    return []
  if "o" in spec:  # A registered node: its children by their `keystr` names.
    children = [(f"{prefix}.{k}", sub) for k, sub in spec["c"]]
  elif "d" in spec:
    children = [(f"{prefix}[{k!r}]", sub) for k, sub in spec["d"]]
  elif "nt" in spec:
    children = [(f"{prefix}.{f}", sub) for f, sub in zip(spec["f"], spec["t"], strict=True)]
  else:
    children = [
      (f"{prefix}[{i}]", sub) for i, sub in enumerate(spec["t"] if "t" in spec else spec["l"])
    ]
  return [p for path, sub in children for p in key_paths(sub, path)]


def is_dict_spec(spec: TreeSpec) -> bool:
  return isinstance(spec, dict) and "d" in spec


def flat_dict_keys(spec: TreeSpec) -> tuple[Any, ...] | None:
  """The keys, in leaf order, of a dict of leaves only; None for any other tree."""
  if not is_dict_spec(spec) or any(sub != LEAF for _, sub in spec["d"]):
    return None
  return tuple(k for k, _ in spec["d"])


def spec_keys(spec: TreeSpec) -> list[Any]:
  return [k for k, _ in spec["d"]] if is_dict_spec(spec) else []


def check_spec(spec: Any) -> TreeSpec:
  """`spec` if it is a spec that `flatten` makes (data only), else a ValueError saying where not
  (a peer's spec is checked before any host builds from it)."""
  try:
    _check(spec)
  except RecursionError as e:
    raise ValueError("a batch structure nested too deeply") from e
  return spec


def _check(s: Any) -> None:
  if type(s) is str and s in (LEAF, NONE):
    return
  subs = _subtrees(s)
  if subs is None:
    raise ValueError(f"a batch structure with {s!r:.100}, which is not a tree spec")
  for sub in subs:
    _check(sub)


_KEYS = (str, int, float, bool, type(None))  # A dict key as JSON carries it.


def _subtrees(s: Any) -> list[Any] | None:
  """The subtrees of container spec `s`, or None if `s` is none of `flatten`'s forms."""
  form = set(s) if type(s) is dict else set()
  if form in ({"l"}, {"t"}, {"t", "nt", "f"}):
    subs = s.get("l", s.get("t"))
    if type(subs) is not list:
      return None
    names = s.get("f")
    if "nt" in form and not (
      type(s["nt"]) is str
      and type(names) is list
      and len(names) == len(subs)
      and all(type(n) is str for n in names)
    ):
      return None
    return subs
  if form == {"d"}:
    return _pair_subtrees(s["d"], _KEYS)
  if form in ({"o", "a", "c"}, {"o", "a", "c", "x"}):
    if type(s["o"]) is not str or type(s["a"]) is not str:
      return None
    if "x" in s:
      _from_data(s["x"])
    return _pair_subtrees(s["c"], (str,))
  return None


def _pair_subtrees(pairs: Any, keys: tuple[type, ...]) -> list[Any] | None:
  """The subtrees of ``[[key, sub]...]`` whose keys are of the types `keys` (exactly)."""
  if type(pairs) is not list or not all(
    type(kv) is list and len(kv) == 2 and type(kv[0]) in keys for kv in pairs
  ):
    return None
  return [sub for _, sub in pairs]
