"""A batch's tree: its leaves, their names and a JSON spec of the containers.

A batch is a NumPy array or a pytree of them: dicts, lists, tuples,
namedtuples, None (an empty node, as in JAX) and nodes registered with
`jax.tree_util` (a `flax.struct.dataclass` batch). The spec is JSON so that
it can travel in the exchange and let a host with no data of its own build
dummy batches. NumPy only, except for registered nodes, which JAX flattens.
"""

from __future__ import annotations

import base64
import collections
import functools
import importlib
import numbers
import pickle
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

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
  """Flattens a batch into its leaves (as given), their names and the spec `unflatten` inverts.

  Names are slash-joined paths (``"features/ids"``; ``"<batch>"`` for a bare
  array). Dicts are walked in sorted key order (as `jax.tree_util` does); a
  list of numbers is one leaf, not a container of scalar leaves.
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


def key_paths(spec: TreeSpec) -> list[str]:
  """Each leaf's key path, in leaf order: ``batch['a']['b']``, ``batch[0]``, ``batch.field``.

  Unlike a leaf's name (slash-joined), a key path tells apart leaves whose
  names are the same (``{"a": {"b": x}, "a/b": y}``).
  """
  out: list[str] = []
  _paths(spec, "batch", out)
  return out


def _paths(s: TreeSpec, prefix: str, out: list[str]) -> None:
  if s == LEAF:
    out.append(prefix)
    return
  if s == NONE:
    return
  if "o" in s:  # A registered node: its children by their `keystr` names.
    children = [(f"{prefix}.{k}", sub) for k, sub in s["c"]]
  elif "d" in s:
    children = [(f"{prefix}[{k!r}]", sub) for k, sub in s["d"]]
  elif "nt" in s:
    children = [(f"{prefix}.{f}", sub) for f, sub in zip(s["f"], s["t"], strict=True)]
  else:
    children = [(f"{prefix}[{i}]", sub) for i, sub in enumerate(s["t"] if "t" in s else s["l"])]
  for path, sub in children:
    _paths(sub, path, out)


def is_dict_spec(spec: TreeSpec) -> bool:
  return isinstance(spec, dict) and "d" in spec


def flat_dict_keys(spec: TreeSpec) -> tuple[Any, ...] | None:
  """The keys, in leaf order, of a dict of leaves only; None for any other tree."""
  if not is_dict_spec(spec) or any(sub != LEAF for _, sub in spec["d"]):
    return None
  return tuple(k for k, _ in spec["d"])


def spec_keys(spec: TreeSpec) -> list[Any]:
  return [k for k, _ in spec["d"]] if is_dict_spec(spec) else []


def readable(spec: TreeSpec) -> TreeSpec:
  """`spec` without registered nodes' pickled treedefs (their "a" names them)."""
  if isinstance(spec, dict):
    return {k: readable(v) for k, v in spec.items() if k != "p"}
  if isinstance(spec, list):
    return [readable(v) for v in spec]
  return spec
