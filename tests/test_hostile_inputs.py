"""Hostile input: a clear error naming the argument or column, the same on every host, or correct rows.

Process 1 of 2 (4 devices each) yields an unusual `y` column at batch 1, or a
bad record to `pack_sequences`. Bad leaves and records must raise, on both
processes, a ValueError that names the process, the batch, the column or
feature and what was expected; unusual but valid arrays (non-contiguous,
negative strides, read-only, big-endian, Fortran order, bool, lists of
numbers) must arrive with their exact values. One run of two processes covers
every kind; single-process checks repeat them. Then the public entry points'
arguments (NumPy numbers are numbers; non-finite numbers, bools as numbers,
truthy flags and other forms are refused by name), a batch structure read
from a peer (data of its form, or refused; nothing imported or unpickled)
and `hf_pipeline`'s ragged columns (one dtype, never a cast).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import numpy as np
import pytest
import scenarios
import scenarios_faults
from helpers import check_each

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src import batches, trees

N, D, B = 2, 4, 8
BAD = 1  # The process that yields the hostile column.
TIMEOUT = 150

# kind -> substrings of the error, after "process 1, batch 1".
INVALID = {
  "string": ["column 'y': a string array (dtype <U2); expected a numeric or bool dtype"],
  "bytes": ["column 'y': a bytes array (dtype |S1); expected a numeric or bool dtype"],
  "object": ["column 'y': an object array (dtype object); expected a numeric or bool dtype"],
  "structured": ["column 'y': a structured array", "expected a numeric or bool dtype"],
  "ragged": [
    ": leaves have different leading sizes ('x': 8, 'y': 7)",
    "expected every leaf to share the row dimension",
  ],
  "zero_d": ["column 'y': 0-d leaf (a scalar of dtype float32)", "expected an array whose first"],
  "python_scalar": ["column 'y': 0-d leaf (a scalar of dtype float64)"],
  # None is an empty node (as in JAX): the column is gone from this batch.
  "none": ["the batch structure changed mid-stream (columns only in the first: ['y']"],
  "masked": ["column 'y': a NumPy masked array; expected a plain array", "`arr.filled(value)`"],
  "longdouble": ["column 'y': a float128 array; JAX has no float128 type: cast it first"],
  "ragged_list": [
    "column 'y': cannot convert a list to one array",
    "expected a rectangular array of numbers",
  ],
}
# Errors that concern the whole batch rather than a column.
BATCH_LEVEL = {
  "too_big_padded": [
    "Uneven batch sizes detected across JAX workers at batch 1: process 1 has 16 rows, more"
    " than the full batch size 8 (`batch_size`)",
    "(process 0: 8, process 1: 16)",
  ],
  "too_big": [
    "Uneven batch sizes detected across JAX workers at batch 1: host batch sizes range",
    "(process 0: 8, process 1: 16)",
  ],
}
# A bad record for `pack_sequences` (`scenarios_faults.packed_source`) -> substrings
# of the error, after "process 1, batch 1: pack_sequences: ". Never a cast.
FLOAT_AMONG_INT32 = (
  "feature 'tok' is float64 in a record (array([1.5, 2.5])), int32 in the first record"
)
PACK = {
  "pack_zero_d": ["feature 'tok': a 0-d array of shape (); expected a 1-D sequence of tokens"],
  "pack_2d": ["feature 'tok': a 2-d array of shape (2, 2); expected a 1-D sequence of tokens"],
  "pack_strings": ["feature 'tok': a string array (dtype <U1); expected a numeric or bool dtype"],
  "pack_float_joins": [FLOAT_AMONG_INT32, "must have one dtype"],
  "pack_float_opens": [FLOAT_AMONG_INT32, "must have one dtype"],
}
# Records 0 to 15, two to a row, on every host.
PACKED_BATCH_0 = [[20 * i + 1, 20 * i + 2, 20 * i + 11, 20 * i + 12] for i in range(8)]
VALID_ONE_BATCH = [
  "non_contiguous",
  "negative_stride",
  "read_only",
  "big_endian",
  "fortran",
  "subclass",
]
VALID_EVERY_HOST = sorted(scenarios_faults.EVERY_HOST_KINDS)
KINDS = [*INVALID, *BATCH_LEVEL, *VALID_ONE_BATCH, *VALID_EVERY_HOST, *PACK]

_RUN: dict = {}


def _outs(kind):
  """Both processes' outcomes for `kind` (one shared run, failure kept)."""
  if "run" not in _RUN:
    try:
      outcomes = testing.run_processes(
        scenarios_faults.run_hostile,
        num_processes=N,
        devices_per_process=D,
        args=(BAD, KINDS),
        timeout_s=TIMEOUT,
      )
      per_process = testing.values(outcomes)
      _RUN["run"] = {k: [per_process[p][i] for p in range(N)] for i, k in enumerate(KINDS)}
    except Exception as e:  # noqa: BLE001 - re-raised by every reader.
      _RUN["run"] = e
  if isinstance(_RUN["run"], Exception):
    raise _RUN["run"]
  outs = _RUN["run"][kind]
  for out in outs:
    assert out["elapsed_s"] < 30
  return outs


def _normal_y(process, batch):
  x = scenarios.rows_for(process, batch, B).astype(np.float32)
  return np.stack([x, -x], axis=1)


def check_hostile_leaf_on_one_host_raises_same_error_on_every_host(kind):
  outs = _outs(kind)
  assert len({out["error"] for out in outs}) == 1  # Word for word the same.
  for out in outs:
    assert out["error_type"] == "ValueError", out
    if kind in INVALID:
      assert out["error"].startswith("process 1, batch 1"), out["error"]
    for needle in INVALID.get(kind) or BATCH_LEVEL[kind]:
      assert needle in out["error"], (needle, out["error"])
    assert out["n"] == 1  # The batch before the bad one, on every host.
    np.testing.assert_array_equal(
      out["batches"][0], np.concatenate([_normal_y(p, 0) for p in range(N)])
    )


def check_unusual_but_valid_array_on_one_host_arrives_exactly(kind):
  odd = np.asarray(scenarios_faults.hostile_leaf(kind, B), np.float32)
  for out in _outs(kind):
    assert out["error"] is None and out["n"] == 3
    for b, y in enumerate(out["batches"]):
      assert y.dtype == np.float32 and y.shape == (N * B, 2)
      want = [_normal_y(p, b) for p in range(N)]
      if b == 1:
        want[BAD] = odd
      np.testing.assert_array_equal(y, np.concatenate(want))


EVERY_HOST_DTYPES = {"bool": np.bool_, "list_of_lists": np.float32}


def check_bool_and_python_lists_on_every_host_convert(kind, dtype):
  # Lists of floats become float64 in NumPy and float32 on the device (JAX
  # without x64), the same on every host.
  local = np.asarray(scenarios_faults.hostile_leaf(kind, B))
  for out in _outs(kind):
    assert out["error"] is None and out["n"] == 3
    for y in out["batches"]:
      assert y.dtype == dtype
      np.testing.assert_array_equal(y, np.concatenate([local] * N).astype(dtype))


def check_bad_record_to_pack_on_one_host_raises_same_error_on_every_host(kind):
  outs = _outs(kind)
  assert len({out["error"] for out in outs}) == 1  # Word for word the same.
  for out in outs:
    assert out["error_type"] == "ValueError", out
    assert out["error"].startswith("process 1, batch 1: pack_sequences: "), out["error"]
    for needle in PACK[kind]:
      assert needle in out["error"], (needle, out["error"])
    assert out["n"] == 1  # The batch before the bad record, on every host; nothing cast.
    assert out["batches"][0].tolist() == PACKED_BATCH_0 * N


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_hostile_and_unusual_leaves_across_real_processes():
  # One launch runs every kind (`KINDS`); each kind's own checks.
  calls = {
    kind: functools.partial(check_hostile_leaf_on_one_host_raises_same_error_on_every_host, kind)
    for kind in [*INVALID, *BATCH_LEVEL]
  }
  for kind in VALID_ONE_BATCH:
    calls[kind] = functools.partial(check_unusual_but_valid_array_on_one_host_arrives_exactly, kind)
  for kind, dtype in EVERY_HOST_DTYPES.items():
    calls[kind] = functools.partial(check_bool_and_python_lists_on_every_host_convert, kind, dtype)
  for kind in PACK:
    calls[kind] = functools.partial(
      check_bad_record_to_pack_on_one_host_raises_same_error_on_every_host, kind
    )
  check_each(calls)


# -- one process: the same conversions without the exchange ---------------------------


@pytest.mark.parametrize("kind", [*VALID_ONE_BATCH, "bool", "list_of_lists"])
def test_single_process_valid_kinds_keep_values(kind):
  leaf = scenarios_faults.hostile_leaf(kind, 8)
  with gjs.iter_jax_batches([{"y": leaf}], batch_size=8) as it:
    (batch,) = list(it)
  np.testing.assert_array_equal(np.asarray(batch["y"]), np.asarray(leaf))


def _one_process_source(kind):
  """Process 0's source with the bad leaf (or record to pack) of `kind` at batch 1."""
  if kind in PACK:
    return scenarios_faults.packed_source(kind, 0, 0)
  batches = scenarios.make_batches(0, [8, 8])
  batches[1] = {**batches[1], "y": scenarios_faults.hostile_leaf(kind, 8)}
  return batches


@pytest.mark.parametrize("kind", [*INVALID, *PACK])
def test_single_process_invalid_kinds_raise_naming_batch_and_column(kind):
  with gjs.iter_jax_batches(_one_process_source(kind), batch_size=8) as it:
    first = next(it)
    with pytest.raises(ValueError) as info:
      next(it)
  message = str(info.value)
  if kind in PACK:
    assert np.asarray(first["tok"]).tolist() == PACKED_BATCH_0
    assert message.startswith("process 0, batch 1: pack_sequences: ")
  assert message.startswith("process 0, batch 1")
  for needle in {**INVALID, **PACK}[kind]:
    assert needle in message


# -- arguments of the language-model APIs ----------------------------------------------


SOURCES = [list(range(10)), list(range(20)), list(range(50))]


@pytest.mark.parametrize(
  "weights",
  [np.array([1, 2, 5]), [np.float32(1), 2, 5], (1.0, np.int64(2), np.array(5.0)), [0.5, 1, 2.5]],
)
def test_elastic_mixture_takes_numpy_numbers_as_weights(weights):
  src = gjs.elastic_mixture(SOURCES, weights)
  assert src.mixture.proportions == (100, 200, 500)


@pytest.mark.parametrize(
  ("weights", "error", "needles"),
  [
    ([1, np.inf, 2], ValueError, ["`weights` must be 3 finite numbers > 0", "(inf is not)"]),
    ([1, float("nan"), 2], ValueError, ["(nan is not)"]),
    ([1, 10**400, 2], ValueError, ["finite numbers > 0", "is not)"]),
    ([True, 1, 2], ValueError, ["(True is not)"]),
    ([1, -1, 2], ValueError, ["(-1 is not)"]),
    ([1, 2], ValueError, ["must be 3 finite numbers > 0", "(2 given)"]),
    ([1, "2", 3], ValueError, ["('2' is not)"]),
    (np.array([[1, 2, 5]]), ValueError, ["(array([1, 2, 5]) is not)"]),
    ([1e-300, 1, 1e300], ValueError, ["span too wide a range"]),
    (3, TypeError, ["`weights` must be a list of 3 numbers, got 3"]),
    ("125", TypeError, ["`weights` must be a list of 3 numbers, got '125'"]),
  ],
)
def test_elastic_mixture_refuses_weights_that_are_not_finite_numbers(weights, error, needles):
  with pytest.raises(error) as info:
    gjs.elastic_mixture(SOURCES, weights)
  for needle in needles:
    assert needle in str(info.value)


@pytest.mark.parametrize(
  ("shape_buckets", "needle"),
  [
    (
      {"a": {1: [4, 16], 2: [8]}},
      "`shape_buckets` for column 'a': expected a non-empty list of ascending ints >= 1 (one"
      " list for all of the column's dims, not one per dim) such as [128, 256, 512], got {1:",
    ),
    ({"a": {4, 16}}, "expected a non-empty list of ascending ints >= 1 such as"),
    ({"a": [16, 4]}, "got [16, 4]"),
    ({"a": [True, 4]}, "got [True, 4]"),
    ({"a": [4.0, 16]}, "got [4.0, 16]"),
  ],
)
def test_shape_buckets_in_another_form_are_refused_when_built(shape_buckets, needle):
  with pytest.raises(ValueError) as info:
    gjs.iter_jax_batches([], paddings=0, pad_shapes={"a": (1, 2)}, shape_buckets=shape_buckets)
  assert needle in str(info.value)


def test_pad_shapes_and_shape_buckets_take_numpy_ints():
  data = [{"a": np.ones((8, 3), np.int32)}]
  kwargs = {"pad_shapes": {"a": np.int64(1)}, "shape_buckets": {"a": np.array([4, 16])}}
  with gjs.iter_jax_batches(data, batch_size=8, paddings=0, mask_key=None, **kwargs) as it:
    (batch,) = list(it)
  assert np.asarray(batch["a"]).tolist() == [[1, 1, 1, 0]] * 8


@pytest.mark.parametrize(
  ("keywords", "error", "needle"),
  [
    ({"sync_timeout_s": np.inf}, ValueError, "`sync_timeout_s` must be a finite number of"),
    ({"sync_timeout_s": True}, ValueError, "seconds > 0, got True"),
    ({"decide_ahead_s": np.nan}, ValueError, "`decide_ahead_s` must be a finite number of"),
    ({"decide_ahead_s": -1}, ValueError, "seconds >= 0, got -1"),
    ({"drop_last": 1}, TypeError, "`drop_last` must be True or False, got 1"),
    ({"drop_last": "False"}, TypeError, "`drop_last` must be True or False, got 'False'"),
    ({"synchronize_batches": None}, TypeError, "`synchronize_batches` must be True or False"),
    ({"name": 3}, ValueError, "`name` must be a str or None, got 3"),
    ({"batch_size": 8.0}, ValueError, "`batch_size` must be a positive int or None, got 8.0"),
    ({"prefetch_batches": True}, ValueError, "`prefetch_batches` must be an int >= 0, got True"),
  ],
)
def test_iter_jax_batches_refuses_non_finite_bool_and_mistyped_options(keywords, error, needle):
  with pytest.raises(error) as info:
    gjs.iter_jax_batches([], **keywords)
  assert needle in str(info.value)


@pytest.mark.parametrize("batch_size", [8.0, 8.5, "8"])
def test_jax_sync_generator_refuses_a_batch_size_that_is_no_int_never_truncating_it(batch_size):
  with pytest.raises(ValueError, match=r"`batch_size` must be a positive int or None, got"):
    next(gjs.jax_sync_generator(scenarios.make_batches(0, [8]), False, batch_size=batch_size))


def test_iter_jax_batches_takes_numpy_numbers_and_bools_as_options():
  kwargs = {
    "batch_size": np.int64(8),
    "sync_timeout_s": np.float32(30),
    "decide_ahead_s": np.array(0.5),
    "drop_last": np.True_,
  }
  with gjs.iter_jax_batches(scenarios.make_batches(0, [8, 8, 3]), **kwargs) as it:
    assert [np.asarray(b["x"]).tolist() for b in it] == [list(range(8)), list(range(10, 18))]


# paddings value -> the error, for the int32 column `x` and the float32 column `y`.
BAD_PADDINGS = {
  True: "`paddings` value True for column 'x' does not fit dtype int32: a bool pads bool columns only",
  "0": "`paddings` value '0' for column 'x' does not fit dtype int32: expected a number, got a value",
  np.nan: "`paddings` value nan for column 'x' does not fit dtype int32: it would become",
  2**40: "`paddings` value 1099511627776 for column 'x' does not fit dtype int32: it would become",
  10**400: "for column 'x' does not fit dtype int32: int too large to convert to float",
  1j: "`paddings` value 1j for column 'x' does not fit dtype int32: it would become 0",
}


@pytest.mark.parametrize("pad", list(BAD_PADDINGS), ids=[str(p)[:10] for p in BAD_PADDINGS])
def test_a_padding_value_that_is_no_value_of_its_column_is_refused_naming_it(pad):
  it = gjs.iter_jax_batches(scenarios.make_batches(0, [8]), batch_size=8, paddings=pad)
  with it, pytest.raises(ValueError) as info:
    next(it)
  assert BAD_PADDINGS[pad] in str(info.value)


def test_numpy_scalars_and_0d_arrays_pad_as_numbers():
  paddings = {"x": np.int8(-1), "y": np.array(0.5, np.float32)}
  with gjs.iter_jax_batches(scenarios.make_batches(0, [3]), batch_size=8, paddings=paddings) as it:
    (batch,) = list(it)
  assert np.asarray(batch["x"]).tolist() == [0, 1, 2] + [-1] * 5
  assert np.asarray(batch["y"])[3:].tolist() == [[0.5, 0.5]] * 5


@pytest.mark.parametrize(
  ("function", "shape", "error", "needle"),
  [
    (
      "local_to_global_shape",
      (8.0, 3),
      ValueError,
      "`local_shape` must be ints >= 0, got (8.0, 3)",
    ),
    ("local_to_global_shape", (True, 3), ValueError, "`local_shape` must be ints >= 0, got (True"),
    ("global_to_local_shape", (-8, 3), ValueError, "`global_shape` must be ints >= 0, got (-8, 3)"),
    ("global_to_local_shape", 8, TypeError, "`global_shape` must be a sequence of ints (a shape)"),
  ],
)
def test_shape_helpers_refuse_what_is_not_a_shape(function, shape, error, needle):
  with pytest.raises(error) as info:
    getattr(gjs, function)(shape, gjs.default_mesh())
  assert needle in str(info.value)


def test_shape_helpers_take_numpy_ints_and_give_python_ints():
  mesh = gjs.default_mesh()
  for function in (gjs.local_to_global_shape, gjs.global_to_local_shape):
    out = function(np.array([8, 3]), mesh)
    assert out == (8, 3) and all(type(d) is int for d in out)


@pytest.mark.parametrize(
  ("call", "error", "needle"),
  [
    (lambda: gjs.elastic_source([1, 2], shuffle="yes"), TypeError, "`shuffle` must be True or"),
    (lambda: gjs.elastic_mixture([[1], [2]], [1, 1], shuffle=1), TypeError, "`shuffle` must be"),
    (lambda: gjs.elastic_source([1, 2], seed=1.5), ValueError, "`seed` must be an int >= 0"),
    (lambda: gjs.elastic_source([1, 2], num_epochs=np.inf), ValueError, "`num_epochs` must be"),
    (lambda: gjs.pack_sequences(None, length=64.0), ValueError, "`length` must be a positive int"),
    (lambda: gjs.pack_sequences(None, length=True), ValueError, "`length` must be a positive int"),
  ],
)
def test_source_builders_refuse_mistyped_numbers_and_flags(call, error, needle):
  with pytest.raises(error) as info:
    call()
  assert needle in str(info.value)


def test_source_builders_take_numpy_ints_and_bools():
  src = gjs.elastic_source(
    list(range(4)), shuffle=np.True_, seed=np.int64(3), num_epochs=np.int8(2)
  )
  assert (src.shuffle, src.seed, src.num_epochs) == (True, 3, 2)
  assert type(src.seed) is int


# -- a batch structure read from a peer: data of its form, or refused -----------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Node:
  x: np.ndarray
  tag: str = dataclasses.field(default="train", metadata={"static": True})


def _node(**fields):
  return {"o": f"{__name__}:Node", "a": "PyTreeDef(CustomNode(Node[('e',)], [*]))", **fields}


@pytest.mark.parametrize(
  ("spec", "needle"),
  [
    (_node(c=[["x", "*"]], p="gASV"), "a batch structure with {'o': "),  # The old pickle.
    (_node(c=[["x", "*"]], x={"evil": 1}), "aux data {'evil': 1} is not plain data"),
    (_node(c=[["x", "*"]], x=float("inf")), "aux data inf is not plain data"),
    ({"d": [[["k"], "*"]]}, "a batch structure with {'d': [[['k'], '*']]}, which is not"),
    ({"t": ["*"], "nt": "m:P", "f": ["a", "b"]}, "which is not a tree spec"),
    ({"l": "*"}, "a batch structure with {'l': '*'}, which is not a tree spec"),
    ("**", "a batch structure with '**', which is not a tree spec"),
    (functools.reduce(lambda s, _: {"l": [s]}, range(100_000), "*"), "nested too deeply"),
  ],
  ids=["pickle", "aux_form", "aux_inf", "dict_key", "fields", "list", "leaf", "deep"],
)
def test_a_peer_structure_of_another_form_is_refused_when_read(spec, needle):
  with pytest.raises(ValueError) as info:
    trees.check_spec(spec)
  assert needle in str(info.value)


@pytest.mark.parametrize(
  ("node", "needle"),
  [
    ({"o": "os:system", "x": "touch /tmp/gjs"}, "(os:system): names no registered pytree node"),
    ({"o": "builtins:dict", "x": ["x"]}, "(builtins:dict): names no registered pytree node"),
    ({"o": "gjs_never_imported:Node", "x": None}, "names no registered pytree node type"),
    pytest.param(
      {"o": "subprocess:Popen", "x": None},
      "(subprocess:Popen): cannot be rebuilt (RuntimeError",
      marks=pytest.mark.skipif(
        not hasattr(jax.tree_util.PyTreeDef, "from_node_data_and_children"),
        reason="jax<0.8 rebuilds no node from data",
      ),
    ),
    ({"x": {"t": ["e", "f"]}}, "1 children and 2 static fields, but the dataclass has 2 fields"),
  ],
  ids=["function", "builtin", "not_imported", "unregistered", "arity"],
)
def test_a_peer_node_that_is_no_registered_type_of_this_process_is_refused(node, needle):
  spec = {**_node(c=[["x", "*"]]), **node}
  trees._OWN.clear()
  with pytest.raises(ValueError) as info:
    trees.unflatten(trees.check_spec(spec), [np.arange(2)])
  assert needle in str(info.value)
  assert "gjs_never_imported" not in sys.modules


def test_a_dataclass_node_with_too_few_children_is_refused_not_crashed():
  # JAX rebuilds a dataclass node without its children; unflattening it would crash.
  trees._OWN.clear()
  with pytest.raises(ValueError, match="0 children and 1 static fields, but the dataclass has 2"):
    trees.unflatten(_node(c=[], x={"t": ["e"]}), [])


@pytest.mark.parametrize(
  "signature",
  [
    {"spec": "*", "leaves": [["x", "object", []]]},
    {"spec": "*", "leaves": [["x", "__loader__", []]]},
    {"spec": "*", "leaves": [["x", "int32", [-2]]]},
    {"spec": "*", "leaves": [["x", "int32"]]},
    {"spec": "*", "leaves": [], "more": 1},
    ["*"],
  ],
)
def test_a_peer_signature_of_another_form_is_refused_when_read(signature):
  with pytest.raises(ValueError, match="a batch signature .* that is not one"):
    batches.checked_json(signature)


# -- hf_pipeline's ragged columns: one dtype, a pad that fits, never a cast ------------


def _ragged(*rows):
  column = np.empty(len(rows), dtype=object)
  column[:] = [np.asarray(r) for r in rows]
  return column


@pytest.mark.parametrize(
  ("rows", "pad_id", "needle"),
  [
    (([1, 2], [1.5]), 0, "ragged column 't' has rows of dtypes ['float64', 'int64']; every row"),
    (([1, 2], [3]), 0.5, "`pad_id` 0.5 is no value of ragged column 't' (int64)"),
    (([1, 2], [3]), True, "`pad_id` True is no value of ragged column 't' (int64)"),
    ((np.array([1], np.uint8), np.array([2], np.uint8)), -1, "`pad_id` -1 is no value"),
    ((5, [1]), 0, "ragged column 't' has rows of shapes [(), (1,)]; expected rows of one"),
    ((np.ones((2, 2)), np.ones((1, 3))), 0, "rows of shapes [(1, 3), (2, 2)]"),
  ],
  ids=["mixed_dtypes", "float_pad", "bool_pad", "negative_pad", "zero_d", "trailing"],
)
def test_a_ragged_column_of_mixed_rows_or_a_pad_that_does_not_fit_is_refused(rows, pad_id, needle):
  from grain_jax_sync._src.sources import hugging_face

  with pytest.raises(ValueError) as info:
    hugging_face.collate({"t": _ragged(*rows)}, ragged=["t"], pad_id=pad_id)
  assert needle in str(info.value)


def test_an_empty_ragged_row_keeps_the_columns_dtype():
  from grain_jax_sync._src.sources import hugging_face

  out = hugging_face.collate({"t": _ragged([], [1, 2])}, ragged=["t"], pad_id=-1)
  assert out["t"].dtype == np.int64 and out["t"].tolist() == [[-1, -1], [1, 2]]
  assert out["t_mask"].tolist() == [[False, False], [True, True]]
