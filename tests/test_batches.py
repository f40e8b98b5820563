"""Batch flattening, validation and signatures (pure NumPy)."""

import collections
import dataclasses
import json
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from grain_jax_sync._src import batches, trees

Point = collections.namedtuple("Point", ["a", "b"])


@pytest.mark.parametrize(
  "batch",
  [
    np.arange(4),
    {"x": np.arange(4), "y": {"z": np.ones((4, 2))}},
    (np.arange(4), [np.arange(4), np.zeros(4)]),
    {"p": Point(np.arange(4), np.arange(4.0))},
  ],
)
def test_flatten_unflatten_round_trip(batch):
  leaves, names, spec = batches.flatten(batch)
  rebuilt = trees.unflatten(spec, leaves)
  assert type(rebuilt) is type(batch)
  l2, n2, s2 = batches.flatten(rebuilt)
  assert n2 == names and s2 == spec
  for a, b in zip(leaves, l2):
    np.testing.assert_array_equal(a, b)


def test_flatten_names_are_paths_in_sorted_key_order():
  _, names, _ = batches.flatten({"b": np.zeros(1), "a": {"d": np.zeros(1), "c": (np.zeros(1),)}})
  assert names == ["a/c/0", "a/d", "b"]


def test_validate_rows_and_signature():
  hb = batches.validate(
    {"x": np.zeros((4, 3), np.float32), "m": np.ones(4, bool)}, process_index=0, batch_index=0
  )
  assert hb.rows == 4
  assert hb.signature.dtypes == ("bool", "float32") and hb.signature.shapes == ((), (3,))


def test_validate_big_endian_becomes_native_and_bfloat16_is_numeric():
  hb = batches.validate(
    {"be": np.arange(4, dtype=">i4"), "bf": np.ones(4, ml_dtypes.bfloat16)},
    process_index=0,
    batch_index=0,
  )
  assert hb.leaves[0].dtype.isnative and list(hb.leaves[0]) == [0, 1, 2, 3]
  assert hb.signature.dtypes[1] == "bfloat16"


def test_none_is_an_empty_node_as_in_jax():
  hb = batches.validate({"x": np.arange(3), "n": None}, process_index=0, batch_index=0)
  assert hb.signature.names == ("x",) and hb.rows == 3
  rebuilt = trees.unflatten(hb.signature.spec, hb.leaves)
  assert rebuilt["n"] is None and rebuilt["x"].tolist() == [0, 1, 2]
  with pytest.raises(ValueError, match=r"process 1, batch 5: the batch is None; expected an"):
    batches.validate(None, process_index=1, batch_index=5)


def test_validate_list_of_numbers_is_one_leaf():
  hb = batches.validate({"x": [1, 2, 3]}, process_index=0, batch_index=0)
  assert hb.rows == 3 and hb.leaves[0].tolist() == [1, 2, 3]


@pytest.mark.parametrize(
  ("batch", "match"),
  [
    ({"s": np.array(["a", "b"])}, r"process 1, batch 5, column 's': a string array"),
    ({"o": np.array([object(), 1], dtype=object)}, r"column 'o': an object array"),
    ({"r": np.zeros(2, dtype=[("a", "i4")])}, r"column 'r': a structured array"),
    ({"z": np.float32(1.0)}, r"column 'z': 0-d leaf"),
    (
      {"a": np.zeros(3), "b": np.zeros(2)},
      r"process 1, batch 5: leaves have different leading sizes \('a': 3, 'b': 2\)",
    ),
    ({"l": [[1, 2], [3]]}, r"column 'l': cannot convert"),
    ({"t": "text"}, r"column 't': leaf is a Python str"),
  ],
)
def test_validate_bad_leaf_names_process_batch_and_column(batch, match):
  with pytest.raises(ValueError, match=match):
    batches.validate(batch, process_index=1, batch_index=5)


@pytest.mark.parametrize(
  ("batch", "first", "second", "name"),
  [
    ({"a": {"b": np.zeros(2)}, "a/b": np.zeros(2)}, "batch['a']['b']", "batch['a/b']", "a/b"),
    ({1: np.zeros(2), "1": np.zeros(2)}, "batch[1]", "batch['1']", "1"),
    (
      {"p": Point(np.zeros(2), np.zeros(2)), "p/a": np.zeros(2)},
      "batch['p'].a",
      "batch['p/a']",
      "p/a",
    ),
    ({"x": [np.zeros(2)], "x/0": np.zeros(2)}, "batch['x'][0]", "batch['x/0']", "x/0"),
  ],
)
def test_leaves_of_the_same_name_raise_naming_both_key_paths(batch, first, second, name):
  with pytest.raises(ValueError) as e:
    batches.validate(batch, process_index=1, batch_index=5)
  assert str(e.value).startswith(
    f"process 1, batch 5: leaves {first} and {second} have the same name {name!r}, by which"
    " `paddings`, `dtypes`, `pad_shapes` and messages tell leaves apart"
  ), str(e.value)


def test_key_paths_name_every_leaf_in_leaf_order():
  _, names, spec = batches.flatten(
    {"b": np.zeros(1), "a": {"d": [np.zeros(1)], "c": (None, Point(np.zeros(1), np.zeros(1)))}}
  )
  assert names == ["a/c/1/a", "a/c/1/b", "a/d/0", "b"]
  assert trees.key_paths(spec) == [
    "batch['a']['c'][1].a",
    "batch['a']['c'][1].b",
    "batch['a']['d'][0]",
    "batch['b']",
  ]
  assert trees.key_paths(batches.flatten(np.zeros(1))[2]) == ["batch"]


def test_signature_json_round_trip_and_diff():
  hb = batches.validate({"x": np.zeros((2, 3), np.float32)}, process_index=0, batch_index=0)
  sig = hb.signature
  assert batches.Signature.from_json(sig.to_json()) == sig
  other = batches.validate(
    {"x": np.zeros((2, 4), np.int32), "y": np.zeros(2)}, process_index=0, batch_index=0
  ).signature
  d = batches.diff(sig, other)
  assert "columns only in the second: ['y']" in d
  assert "column 'x': dtype float32 vs int32" in d
  assert "column 'x': trailing shape (3,) vs (4,)" in d


def test_validate_leaves_no_reference_cycle_holding_arrays():
  import gc
  import weakref

  class Leaf(np.ndarray):
    pass

  x = np.zeros(4).view(Leaf)
  ref = weakref.ref(x)
  gc.disable()
  try:
    hb = batches.validate({"a": x, "b": (x, [x])}, process_index=0, batch_index=0)
    rebuilt = trees.unflatten(hb.signature.spec, hb.leaves)
    del hb, rebuilt, x
    assert ref() is None  # Freed by reference counting alone.
  finally:
    gc.enable()


def _same_as_validate(first, later):
  """`Matcher.match(later)`, checked against `validate(later)` where it matches."""
  sig = batches.validate(first, process_index=0, batch_index=0).signature
  matcher = batches.Matcher.compile(first, sig)
  assert matcher is not None
  got = matcher.match(later)
  if got is not None:
    want = batches.validate(later, process_index=0, batch_index=1, expected=sig)
    assert got.signature is want.signature is sig
    assert got.rows == want.rows
    assert len(got.leaves) == len(want.leaves)
    for a, b in zip(got.leaves, want.leaves, strict=True):
      assert a is b
  return got


_F4 = np.zeros((4, 3), np.float32)
_I4 = np.arange(4, dtype=np.int32)


@pytest.mark.parametrize(
  ("first", "later"),
  [
    ({"x": _F4, "y": _I4}, {"y": _I4[:2], "x": _F4[:2]}),
    ({"a": {"b": _F4, "c": (_I4, [_I4])}}, {"a": {"c": (_I4, [_I4]), "b": _F4}}),
    (Point(_F4, _I4), Point(_F4, _I4)),
    (_F4, _F4[:1]),
    ({"x": _F4}, {"x": _F4[:0]}),
  ],
)
def test_matcher_takes_batches_of_the_same_structure_as_validate_would(first, later):
  assert _same_as_validate(first, later) is not None


@pytest.mark.parametrize(
  "later",
  [
    {"x": _F4},  # A missing key.
    {"x": _F4, "y": _I4, "z": _I4},  # An extra key.
    {"x": _F4, "z": _I4},  # Another key.
    {"x": _F4.astype(np.float64), "y": _I4},  # Another dtype.
    {"x": _F4.astype(">f4"), "y": _I4},  # Big-endian: validate makes a native copy.
    {"x": np.zeros((4, 2), np.float32), "y": _I4},  # Another trailing shape.
    {"x": np.zeros((4, 3, 1), np.float32), "y": _I4},  # Another rank.
    {"x": _F4, "y": _I4[:3]},  # Different row counts.
    {"x": _F4, "y": np.int32(3)},  # A 0-d leaf.
    {"x": _F4, "y": [0, 1, 2, 3]},  # A list of numbers (one leaf, converted).
    {"x": _F4, "y": None},
    collections.OrderedDict(x=_F4, y=_I4),  # Another container type.
    (_F4, _I4),
  ],
)
def test_matcher_leaves_every_other_batch_to_validate(later):
  assert _same_as_validate({"x": _F4, "y": _I4}, later) is None


def test_matcher_tells_a_namedtuple_from_a_tuple_and_checks_nested_lengths():
  assert _same_as_validate(Point(_F4, _I4), (_F4, _I4)) is None
  assert _same_as_validate({"a": [_F4, _F4]}, {"a": [_F4]}) is None
  assert _same_as_validate({"a": [_F4, _F4]}, {"a": [_F4, _F4, _F4]}) is None


# -- registered nodes travel as data, rebuilt from the registered type ------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Node:
  """A registered dataclass node with static fields of plain data."""

  x: np.ndarray
  y: dict
  tag: str = dataclasses.field(default="train", metadata={"static": True})
  sizes: tuple = dataclasses.field(default=(1, (2.5, None)), metadata={"static": True})


class Custom:
  """A node registered with its own functions, and aux data that is no plain data."""

  def __init__(self, a, b, aux):
    self.a, self.b, self.aux = a, b, aux


jax.tree_util.register_pytree_node(
  Custom, lambda c: ((c.a, c.b), c.aux), lambda aux, children: Custom(*children, aux)
)


# JAX rebuilds a node from its type and aux data from 0.8 (a process that
# read no batch of the structure needs it).
needs_rebuild = pytest.mark.skipif(
  not hasattr(jax.tree_util.PyTreeDef, "from_node_data_and_children"),
  reason="jax<0.8 has no PyTreeDef.from_node_data_and_children",
)


def _as_if_from_a_peer(spec):
  """`spec` through JSON, on a process that flattened no batch of it."""
  trees._OWN.clear()
  trees._rebuilt.cache_clear()
  return trees.check_spec(json.loads(json.dumps(spec)))


@needs_rebuild
def test_a_registered_dataclass_is_rebuilt_from_its_type_and_plain_aux_data():
  batch = {"n": Node(np.arange(4), {"z": np.ones(4)}, tag="eval", sizes=(3, {"k": [1.5]}))}
  leaves, _, spec = batches.flatten(batch)
  node = spec["d"][0][1]
  assert node["o"] == f"{__name__}:Node" and node["x"] == {
    "t": ["eval", {"t": [3, {"d": [["k", [1.5]]]}]}]
  }
  assert "p" not in node
  rebuilt = trees.unflatten(_as_if_from_a_peer(spec), leaves)
  assert type(rebuilt["n"]) is Node and rebuilt["n"].tag == "eval"
  assert rebuilt["n"].sizes == (3, {"k": [1.5]})
  assert rebuilt["n"].y["z"] is leaves[1]


def test_a_node_whose_aux_data_is_not_plain_rebuilds_where_flattened_and_says_why_elsewhere():
  batch = Custom(np.arange(2), np.arange(3), aux=np.dtype("int8"))
  leaves, _, spec = batches.flatten(batch)
  assert "x" not in spec
  same = trees.unflatten(spec, leaves)  # This process flattened one.
  assert type(same) is Custom and same.aux == np.dtype("int8") and same.b is leaves[1]
  with pytest.raises(ValueError) as info:
    trees.unflatten(_as_if_from_a_peer(spec), leaves)
  assert f"({__name__}:Custom): its aux data (static fields) is not plain data" in str(info.value)


@needs_rebuild
def test_a_custom_node_with_plain_aux_data_is_rebuilt_from_data():
  batch = Custom(np.arange(2), np.arange(3), aux={"name": "c", "dims": (1, 2)})
  leaves, _, spec = batches.flatten(batch)
  rebuilt = trees.unflatten(_as_if_from_a_peer(spec), leaves)
  assert type(rebuilt) is Custom and rebuilt.aux == {"name": "c", "dims": (1, 2)}


def test_a_namedtuple_type_is_found_only_among_imported_modules():
  leaves, _, spec = batches.flatten({"p": Point(np.arange(2), np.arange(2))})
  assert type(trees.unflatten(_as_if_from_a_peer(spec), leaves)["p"]) is Point
  spec["d"][0][1]["nt"] = "gjs_never_imported:Point"  # Not imported: never imported here.
  rebuilt = trees.unflatten(spec, leaves)["p"]
  assert "gjs_never_imported" not in sys.modules
  assert type(rebuilt) is not Point and rebuilt._fields == ("a", "b")
