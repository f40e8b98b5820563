"""placement.py: meshes, data axes, processes that share rows, shape helpers.

The default-order tests use fake device objects (mesh_utils only reads their
attributes); the other single-process tests run on this process's 8 CPU
devices (conftest.py); 2x4 and 4x2 in real processes, one run per topology
(`cases_2x4`, `cases_4x2`) and one test each, a `check_*` per case; every check on the rows of the global arrays. Rows
encode their input shard: 1000 * shard + 10 * batch + row.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from typing import Any

import grain
import jax
import numpy as np
import pytest
import scenarios
from helpers import check_each
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src import placement

TIMEOUT = 240
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mesh(shape=(4, 2), axes=("data", "model")):
  return Mesh(np.array(jax.devices()).reshape(shape), axes)


def _shards(batch, per_shard_rows):
  """Global x of one batch: each input shard's rows, in shard order."""
  return np.concatenate([scenarios.rows_for(s, batch, n) for s, n in enumerate(per_shard_rows)])


def _launch(fn, n, d):
  return testing.values(
    testing.run_processes(fn, num_processes=n, devices_per_process=d, timeout_s=TIMEOUT)
  )


# -- 1 process x 8 devices -------------------------------------------------------------


def _device_rows(arr):
  return {s.device.id: np.asarray(s.data).tolist() for s in arr.addressable_shards}


def test_1x8_mesh_4x2_rows_over_data_replicated_over_model():
  mesh = _mesh()
  with gjs.iter_jax_batches(scenarios.make_batches(0, [8, 8]), batch_size=8, mesh=mesh) as it:
    out = list(it)
    assert it.placement.local_blocks == (0, 1, 2, 3) and it.placement.shard_count == 1
  assert len(out) == 2
  x = out[1]["x"]
  assert x.shape == (8,) and x.sharding == NamedSharding(mesh, PartitionSpec("data"))
  np.testing.assert_array_equal(np.asarray(x), scenarios.rows_for(0, 1, 8))
  rows = _device_rows(x)
  for d in range(4):  # Both model devices of data index d hold rows 2d, 2d + 1.
    for m in range(2):
      want = scenarios.rows_for(0, 1, 8)[2 * d : 2 * d + 2].tolist()
      assert rows[mesh.devices[d, m].id] == want
  assert out[1]["y"].sharding.spec == PartitionSpec("data")
  np.testing.assert_array_equal(np.asarray(out[1]["y"])[:, 1], -scenarios.rows_for(0, 1, 8))


def test_1x8_sharding_spec_longer_than_a_leaf_is_cut_to_its_rank():
  mesh = _mesh()
  sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
  with gjs.iter_jax_batches(scenarios.make_batches(0, [8]), batch_size=8, sharding=sharding) as it:
    (batch,) = list(it)
  assert batch["x"].sharding.spec == PartitionSpec("data")
  assert batch["y"].sharding == sharding
  y = scenarios.rows_for(0, 0, 8).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(batch["y"]), np.stack([y, -y], 1))
  # The feature column of y is split over the model axis.
  assert {s.data.shape for s in batch["y"].addressable_shards} == {(2, 1)}


def test_1x8_partition_spec_applies_to_mesh_and_to_context_mesh():
  mesh = _mesh()
  data = scenarios.make_batches(0, [8])
  with gjs.iter_jax_batches(data, batch_size=8, mesh=mesh, sharding=PartitionSpec("model")) as it:
    assert it.sharding == NamedSharding(mesh, PartitionSpec("model"))
    np.testing.assert_array_equal(np.asarray(next(it)["x"]), scenarios.rows_for(0, 0, 8))
  with jax.set_mesh(mesh), gjs.iter_jax_batches(data, batch_size=8) as it:
    assert it.sharding == NamedSharding(mesh, PartitionSpec("data"))
    assert "the context mesh" in it.placement.chosen_by
  with gjs.iter_jax_batches(data, batch_size=8, mesh=mesh, data_axes=("model", "data")) as it:
    assert it.sharding.spec == PartitionSpec(("model", "data"))
    assert it.placement.num_blocks == 8


def test_1x8_device_put_over_data_model_mesh_splits_rows_over_data_only():
  mesh = _mesh()
  ds = grain.MapDataset.range(16).map(lambda i: {"x": np.int32(i)}).batch(8)
  it = iter(gjs.device_put(ds, mesh, cpu_buffer_size=0))
  got = list(it)
  assert got[0]["x"].sharding == NamedSharding(mesh, PartitionSpec("data"))
  assert [np.asarray(b["x"]).tolist() for b in got] == [list(range(8)), list(range(8, 16))]
  assert _device_rows(got[1]["x"])[mesh.devices[3, 1].id] == [14, 15]
  it = iter(gjs.device_put(ds, mesh, data_axes=("data", "model"), cpu_buffer_size=0))
  assert next(it)["x"].sharding.spec == PartitionSpec(("data", "model"))


def test_1x8_device_put_resolves_the_context_mesh_when_called():
  mesh = _mesh()
  ds = grain.MapDataset.range(8).map(lambda i: {"x": np.int32(i)}).batch(8)
  with jax.set_mesh(mesh):
    synced = gjs.device_put(ds, cpu_buffer_size=0)
  (batch,) = list(iter(synced))  # Iterated outside the context: still its mesh.
  assert batch["x"].sharding == NamedSharding(mesh, PartitionSpec("data"))


def test_1x8_rows_must_divide_among_the_data_shards_up_front():
  with pytest.raises(
    ValueError,
    match=r"`batch_size` must be divisible by the 4 data shards that this process's 8 local"
    r" devices hold when `paddings` is given, got 6",
  ):
    gjs.iter_jax_batches([], batch_size=6, paddings=0, mesh=_mesh())
  gjs.iter_jax_batches([], batch_size=4, paddings=0, mesh=_mesh()).close()


_MESH = _mesh()
BAD_ARGUMENTS = [
  (
    {"mesh": _MESH, "sharding": NamedSharding(_MESH, PartitionSpec("data"))},
    r"`sharding` is a full jax.sharding.Sharding, so `mesh` and `data_axes` must be None",
  ),
  ({"mesh": _MESH, "data_axes": "fsdp"}, r"\['fsdp'\] not in the mesh"),
  (
    {"data_axes": "data", "sharding": PartitionSpec("data")},
    r"pass `data_axes` or a PartitionSpec",
  ),
  (
    {"mesh": _MESH, "sharding": PartitionSpec("fsdp")},
    r"`sharding` P\('fsdp',\) does not fit the mesh \{'data': 4, 'model': 2\}",
  ),
  ({"mesh": _MESH.abstract_mesh}, r"`mesh` must be a concrete jax.sharding.Mesh, got AbstractMesh"),
  (
    {"sharding": "data"},
    r"`sharding` must be a jax.sharding.Sharding, a PartitionSpec or None, got str",
  ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_ARGUMENTS)
def test_bad_mesh_arguments_raise_naming_them(kwargs, message):
  with pytest.raises(ValueError, match=message):
    gjs.iter_jax_batches([], batch_size=8, **kwargs)


@pytest.mark.parametrize(
  ("spec", "local", "want"),
  [
    (PartitionSpec("data"), (8, 3), (8, 3)),
    (PartitionSpec("data", "model"), (8, 4), (8, 4)),
    (PartitionSpec(), (5, 2), (5, 2)),
  ],
)
def test_shapes_single_process_are_the_local_shape(spec, local, want):
  sharding = NamedSharding(_mesh(), spec)
  assert gjs.local_to_global_shape(local, sharding) == want
  assert gjs.global_to_local_shape(want, sharding) == local


def test_shapes_rows_not_divisible_raise_with_the_numbers():
  sharding = NamedSharding(_mesh(), PartitionSpec("data"))
  with pytest.raises(
    ValueError, match=r"dimension 0 has 6 entries on process 0, not divisible by the 4 blocks"
  ):
    gjs.local_to_global_shape((6, 2), sharding)
  with pytest.raises(ValueError, match=r"dimension 0 has 6 entries, not divisible by the 4 blocks"):
    gjs.global_to_local_shape((6, 2), sharding)
  assert gjs.local_to_global_shape((8,), _mesh()) == (8,)  # A mesh: rows over "data".


def test_1x8_single_process_accepts_a_mesh_over_some_devices():
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  with gjs.iter_jax_batches(scenarios.make_batches(0, [8]), batch_size=8, mesh=mesh) as it:
    (batch,) = list(it)
  assert batch["x"].sharding.device_set == set(jax.devices()[:4])
  np.testing.assert_array_equal(np.asarray(batch["x"]), scenarios.rows_for(0, 0, 8))


def test_data_shard_info_single_process_is_one_shard():
  assert gjs.data_shard_info(_mesh()) == (0, 1)
  assert gjs.data_shard_info() == gjs.DataShardInfo(shard_index=0, shard_count=1)
  options = grain.sharding.ShardOptions(*gjs.data_shard_info(_mesh()))
  assert (options.shard_index, options.shard_count) == (0, 1)


def test_tfds_pipeline_takes_its_shard_from_the_mesh():
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=8, policy=tfds.testing.MockPolicy.USE_CODE):
    by_mesh = [
      b["label"].tolist()
      for b in gjs.tfds_pipeline("mnist", split="train", batch_size=8, mesh=_mesh())
    ]
    plain = [b["label"].tolist() for b in gjs.tfds_pipeline("mnist", split="train", batch_size=8)]
    assert by_mesh == plain and len(by_mesh[0]) == 8
    with pytest.raises(ValueError, match=r"pass `process_index`/`process_count`, or `mesh`"):
      gjs.tfds_pipeline("mnist", split="train", batch_size=8, mesh=_mesh(), process_count=2)


def test_fingerprint_tells_meshes_apart_by_shape_spec_and_device_order():
  def fp(mesh, spec=None):
    spec = PartitionSpec("data") if spec is None else spec
    return placement.placement_for(NamedSharding(mesh, spec), "test").fingerprint()

  base = fp(_mesh())
  assert base == fp(_mesh())  # Built twice the same way.
  assert base["sharding"] == "mesh {'data': 4, 'model': 2}, spec ('data',)"
  reordered = fp(Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model")))
  assert reordered["sharding"] == base["sharding"]
  assert reordered["sharding_device_order"] != base["sharding_device_order"]
  assert reordered["sharding_device_order"].startswith("8 devices, digest ")
  assert fp(_mesh((2, 4)))["sharding"] == "mesh {'data': 2, 'model': 4}, spec ('data',)"
  assert fp(_mesh(), PartitionSpec(("data", "model")))["sharding"].endswith(
    "spec (('data', 'model'),)"
  )


def test_placement_groups_from_a_uniform_sharding_of_fake_processes():
  # The pure layout over a real 8-device sharding: one process here, so one group.
  lay = placement.dim_layout(NamedSharding(_mesh(), PartitionSpec("data")), 0, 1)
  assert (lay.num_blocks, lay.groups, lay.group_blocks) == (4, ((0,),), ((0, 1, 2, 3),))


# -- meshes: the default order, the data axes, the context mesh -------------------


@dataclasses.dataclass(frozen=True)
class FakeTpu:
  """The attributes mesh_utils reads from a TPU v4 device."""

  id: int
  process_index: int
  coords: tuple[int, int, int]
  slice_index: int | None = None
  platform: str = "tpu"
  device_kind: str = "TPU v4"
  core_on_chip: int = 0


def _ids(order):
  return [d.id for d in order]


def test_default_order_one_slice_is_create_device_mesh_topology_order():
  # A 2x2x2 TPU v4 slice, ids in x-fastest order, 4 chips per process.
  devices = [FakeTpu(i, i // 4, (i % 2, (i // 2) % 2, i // 4), slice_index=0) for i in range(8)]
  order, reason = placement.default_device_order(devices)
  assert _ids(order) == _ids(mesh_utils.create_device_mesh((8,), devices).flat)
  assert _ids(order) != list(range(8))  # Not the id order: the torus order.
  assert reason == "one slice: create_device_mesh (topology-aware order)"


def test_default_order_several_slices_is_hybrid_data_parallel_across_slices():
  # Two slices of 2x2x1 chips; the devices arrive slice 1 first.
  devices = [
    FakeTpu(4 * s + i, 2 * s + i // 2, (i % 2, i // 2, 0), slice_index=s)
    for s in (1, 0)
    for i in range(4)
  ]
  order, reason = placement.default_device_order(devices)
  want = mesh_utils.create_hybrid_device_mesh((4,), (2,), devices).reshape(-1)
  assert _ids(order) == _ids(want)
  # Slices are the outer (data-parallel) blocks: slice 0's devices first.
  assert [d.slice_index for d in order] == [0] * 4 + [1] * 4
  assert _ids(order[:4]) == _ids(mesh_utils.create_device_mesh((4,), devices[4:]).flat)
  assert "2 slice_index values: create_hybrid_device_mesh" in reason


def test_default_order_falls_back_to_process_then_id():
  # TPU devices whose coordinates make no cuboid: create_device_mesh fails.
  devices = [FakeTpu(i, i // 2, (0, 0, 0)) for i in reversed(range(4))]
  order, reason = placement.default_device_order(devices)
  assert _ids(order) == [0, 1, 2, 3]
  assert reason.startswith("create_device_mesh failed (AssertionError")
  assert reason.endswith("devices ordered by process, then id")


def test_default_order_uneven_slices_fall_back_to_process_then_id():
  devices = [
    FakeTpu(i, 1 - i // 4, (i % 2, (i // 2) % 2, 0), slice_index=int(i >= 2)) for i in range(8)
  ]
  order, reason = placement.default_device_order(devices)
  assert _ids(order) == [4, 5, 6, 7, 0, 1, 2, 3]
  assert "2 slice_index values but create_hybrid_device_mesh failed" in reason


def test_default_mesh_is_1d_over_every_device_and_logs_why_once_per_process():
  mesh = gjs.default_mesh()
  assert mesh.axis_names == ("data",) and mesh.devices.shape == (8,)
  assert set(mesh.devices.flat) == set(jax.devices())
  assert gjs.default_sharding().spec == PartitionSpec("data")
  # Once per process: a fresh interpreter, whose first call logs.
  code = (
    "import logging, sys\n"
    "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(message)s')\n"
    "import grain_jax_sync as gjs\n"
    "gjs.default_mesh(); gjs.default_mesh(); gjs.default_sharding()\n"
  )
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert [line for line in proc.stdout.splitlines() if "default mesh" in line] == [
    "grain_jax_sync: default mesh: 1-D 'data' axis over 8 devices;"
    " one slice: create_device_mesh (topology-aware order)"
  ]


@pytest.mark.parametrize(
  ("axes", "data_axes", "want"),
  [
    (("data", "model"), None, PartitionSpec("data")),
    (("batch", "model"), None, PartitionSpec(("batch", "model"))),
    (("batch", "model"), "batch", PartitionSpec("batch")),
    (("data", "model"), ("model", "data"), PartitionSpec(("model", "data"))),
    (("data", "model"), ["data"], PartitionSpec("data")),
  ],
)
def test_data_spec_defaults_to_data_axis_else_every_axis(axes, data_axes, want):
  assert placement.data_spec(_mesh(axes=axes), data_axes) == want


@pytest.mark.parametrize(
  ("data_axes", "message"),
  [
    ("fsdp", r"\['fsdp'\] not in the mesh"),
    (("data", "data"), r"must be distinct axis names of the mesh \{'data': 4, 'model': 2\}"),
    ((), "must name at least one axis"),
  ],
)
def test_data_axes_bad_names_raise(data_axes, message):
  with pytest.raises(ValueError, match=message):
    placement.data_axes_of(_mesh(), data_axes)


def test_context_mesh_is_read_from_jax_set_mesh():
  mesh = _mesh()
  assert placement.context_mesh() is None
  with jax.set_mesh(mesh):
    assert placement.context_mesh() == mesh
  assert placement.context_mesh() is None


def test_jax_sync_generator_keeps_the_1d_default_mesh_inside_set_mesh():
  data = scenarios.make_batches(0, [8])
  with jax.set_mesh(_mesh()):
    out = list(gjs.jax_sync_generator(data, drop_last=False, batch_size=8))
    with gjs.iter_jax_batches(data, batch_size=8) as it:
      ours = list(it)
  assert out[0]["x"].sharding.mesh.axis_names == ("data",)
  assert out[0]["x"].sharding.mesh.devices.shape == (8,)
  assert ours[0]["x"].sharding.mesh == _mesh()


# -- identical rows where processes share a data shard -----------------------------


def _devices_by_process() -> list[list[Any]]:
  import jax

  by: dict[int, list[Any]] = {}
  for d in jax.devices():
    by.setdefault(d.process_index, []).append(d)
  return [sorted(by[p], key=lambda d: d.id) for p in sorted(by)]


def _grid(shape: tuple[int, ...], pick: Any) -> np.ndarray:
  """An object array of `shape` whose entry at `index` is ``pick(*index)``."""
  out = np.empty(shape, dtype=object)
  for index in np.ndindex(*shape):
    out[index] = pick(*index)
  return out


def _run(
  kwargs: dict[str, Any],
  sizes: list[int],
  *,
  by_process: bool = False,
  differ_from: int | None = None,
) -> dict[str, Any]:
  """iter_jax_batches over this process's input shard; global rows and layout.

  With `by_process`, each process feeds rows of its own (wrong where
  processes share a data shard); with `differ_from`, from that batch on.
  """
  import jax

  import grain_jax_sync as gjs

  info = gjs.data_shard_info(
    kwargs.get("mesh") if "mesh" in kwargs else kwargs.get("sharding"),
    data_axes=kwargs.get("data_axes"),
  )
  shard = jax.process_index() if by_process else info.shard_index
  data = scenarios.make_batches(shard, sizes)
  if differ_from is not None:
    data[differ_from:] = scenarios.make_batches(jax.process_index(), sizes)[differ_from:]
  with gjs.iter_jax_batches(data, **kwargs) as it:
    out = scenarios.consume(it)
    out["spec"] = str(it.sharding.spec)
    out["mesh_shape"] = dict(it.sharding.mesh.shape)
    out["local_blocks"] = list(it.placement.local_blocks)
  out["info"] = tuple(info)
  out["process"] = jax.process_index()
  return out


def _without_store(fn: Any) -> Any:
  """Runs `fn` with no key-value client: the collective fallback (lockstep)."""
  from jax._src import distributed

  client = distributed.global_state.client
  distributed.global_state.client = None
  try:
    return fn()
  finally:
    distributed.global_state.client = client


def _error(fn: Any) -> str | None:
  try:
    fn()
  except ValueError as e:
    return str(e)
  return None


def _tfds_labels(**kwargs: Any) -> list[list[int]]:
  import tensorflow_datasets as tfds

  import grain_jax_sync as gjs

  with tfds.testing.mock_data(num_examples=13, policy=tfds.testing.MockPolicy.USE_CODE):
    ds = gjs.tfds_pipeline("mnist", split="train", batch_size=4, shuffle=True, seed=3, **kwargs)
    return [b["label"].tolist() for b in ds]


def cases_2x4() -> dict[str, Any]:
  """2 processes x 4 devices: model axis inside and across processes, and more."""
  import grain
  import jax

  import grain_jax_sync as gjs

  devs = _devices_by_process()
  # (data=4, model=2), model pairs inside a process: process p holds data 2p, 2p+1.
  inside = jax.sharding.Mesh(
    _grid((4, 2), lambda d, m: devs[d // 2][2 * (d % 2) + m]), ("data", "model")
  )
  # (data=4, model=2), model pairs across the processes: both hold every data shard.
  across = jax.sharding.Mesh(_grid((4, 2), lambda d, m: devs[m][d]), ("data", "model"))
  # Rows over ("y", "x") of an (x=2, y=4) mesh whose x is the process: each
  # process holds every other data shard, so its rows are not contiguous.
  strided = jax.sharding.Mesh(_grid((2, 4), lambda x, y: devs[x][y]), ("x", "y"))
  padded = {"batch_size": 8, "paddings": -1, "mask_key": "mask"}
  out: dict[str, Any] = {
    "inside": _run({"batch_size": 8, "mesh": inside}, [8, 8]),
    "across": _run({**padded, "mesh": across}, [8, 5]),
    "across_differ": _run({"batch_size": 8, "mesh": across}, [8, 8], by_process=True),
    # The same through the collective fallback (lockstep, no key-value store);
    # the first batch agrees (both load shard 0), the second differs.
    "across_differ_lockstep": _without_store(
      lambda: _run({"batch_size": 8, "mesh": across}, [8, 8], differ_from=1)
    ),
    # Both load shard 0, but process 1 has a batch more: a dummy on one
    # replica and rows on the other must raise, not make a global array
    # whose copies differ (with the key-value store, then in lockstep).
    "across_one_ends": _run({**padded, "mesh": across}, [8, 8] + [5] * jax.process_index()),
    "across_one_ends_lockstep": _without_store(
      lambda: _run({**padded, "mesh": across}, [8, 8] + [5] * jax.process_index())
    ),
    "strided": _run({"batch_size": 8, "mesh": strided, "data_axes": ("y", "x")}, [8]),
    "sharding": _run(
      {
        "batch_size": 8,
        "sharding": jax.sharding.NamedSharding(inside, jax.sharding.PartitionSpec("data", "model")),
      },
      [8],
    ),
    "spec_on_mesh": _run(
      {"batch_size": 8, "mesh": across, "sharding": jax.sharding.PartitionSpec("data")}, [8]
    ),
  }
  # Each process builds its own mesh: the same devices in another order, or
  # the rows over other axes of the same mesh.
  mine = inside if jax.process_index() == 0 else across
  out["mesh_order_differs"] = _run({"batch_size": 8, "mesh": mine}, [8, 8])
  out["mesh_order_differs_lockstep"] = _without_store(
    lambda: _run({"batch_size": 8, "mesh": mine}, [8, 8])
  )
  out["inside_not_divisible"] = _run({"batch_size": 8, "mesh": inside}, [8, 5])
  axes = "data" if jax.process_index() == 0 else ("data", "model")
  out["data_axes_differ"] = _run({"batch_size": 8, "mesh": inside, "data_axes": axes}, [8, 8])
  with jax.set_mesh(across):
    out["context_info"] = tuple(gjs.data_shard_info())
    out["context"] = _run({"batch_size": 8}, [8])
    with gjs.iter_jax_batches([], batch_size=8) as it:
      out["context_mesh_is_user_mesh"] = it.sharding.mesh == across
    out["tfds_across"] = _tfds_labels()  # The context mesh picks the input shard.
  out["tfds_inside"] = _tfds_labels(mesh=inside)
  info = gjs.data_shard_info(inside)
  ds = grain.MapDataset.source(scenarios.make_batches(info.shard_index, [8, 8])).to_iter_dataset()
  it = iter(gjs.device_put(ds, inside, cpu_buffer_size=0))
  out["device_put"] = {
    "batches": [scenarios.gather(b) for b in it],
    "spec": str(it.sharding.spec),
  }
  it.close()
  local = jax.sharding.Mesh(np.array(jax.local_devices()).reshape(2, 2), ("data", "model"))
  out["local_mesh_error"] = _error(lambda: gjs.iter_jax_batches([], batch_size=8, mesh=local))
  out["divisible_error"] = _error(
    lambda: gjs.iter_jax_batches([], batch_size=5, paddings=0, mesh=inside)
  )
  # Process 0 holds data shards 0, 1, 2 and process 1 holds 1, 2, 3: no layout.
  slots = [[0, 0], [0, 1], [0, 1], [1, 1]]
  taken = [0, 0]

  def pick(d: int, m: int) -> Any:
    p = slots[d][m]
    taken[p] += 1
    return devs[p][taken[p] - 1]

  overlapping = jax.sharding.Mesh(_grid((4, 2), pick), ("data", "model"))
  out["uneven_error"] = _error(lambda: gjs.iter_jax_batches([], batch_size=8, mesh=overlapping))
  # Columns over "model", which spans the processes: each would hold half.
  cols = jax.sharding.NamedSharding(across, jax.sharding.PartitionSpec("data", "model"))
  out["cols_across_error"] = _error(lambda: gjs.iter_jax_batches([], sharding=cols))
  # Columns split unevenly (process 0 holds 0, 1, 2 and process 1 holds 1, 2, 3),
  # found when the iterator is built, not at the first batch.
  taken[:] = [0, 0]
  odd = jax.sharding.Mesh(_grid((1, 4, 2), lambda _, d, m: pick(d, m)), ("data", "cols", "r"))
  out["cols_uneven_error"] = _error(
    lambda: gjs.iter_jax_batches(
      [], sharding=jax.sharding.NamedSharding(odd, jax.sharding.PartitionSpec("data", "cols"))
    )
  )
  out["shapes"] = _shapes(inside, across, strided)
  return out


def _shapes(inside: Any, across: Any, strided: Any) -> dict[str, Any]:
  """Ours next to JAX's own (private) local_to_global_shape."""
  import jax
  from jax._src.sharding_impls import local_to_global_shape as jax_l2g

  import grain_jax_sync as gjs

  named = jax.sharding.NamedSharding
  spec = jax.sharding.PartitionSpec
  cases = {
    "inside": ((8, 3), named(inside, spec("data"))),
    "across": ((8, 3), named(across, spec("data"))),
    "strided_rows": ((8, 3), named(strided, spec(("y", "x")))),
    "strided_2d": ((8, 4), named(strided, spec("y", "x"))),
  }
  out = {}
  for name, (shape, sharding) in cases.items():
    glob = gjs.local_to_global_shape(shape, sharding)
    out[name] = {
      "ours": glob,
      "jax": tuple(jax_l2g(sharding, shape)),
      "back": gjs.global_to_local_shape(glob, sharding),
    }
  return out


MESH_MISMATCHES = {
  "mesh_order_differs": "sharding_device_order: '8 devices, digest ",
  "mesh_order_differs_lockstep": "sharding_device_order: '8 devices, digest ",
  "data_axes_differ": (
    "sharding: \"mesh {'data': 4, 'model': 2}, spec ('data',)\" vs"
    " \"mesh {'data': 4, 'model': 2}, spec (('data', 'model'),)\""
  ),
}


def check_model_axis_inside_a_process_rows_per_process(outs):
  for p, out in enumerate(outs):
    r = out["inside"]
    assert r["error"] is None and len(r["batches"]) == 2
    assert r["info"] == (p, 2) and r["local_blocks"] == [2 * p, 2 * p + 1]
    assert r["spec"] == "P('data',)" and r["mesh_shape"] == {"data": 4, "model": 2}
    for b, batch in enumerate(r["batches"]):
      np.testing.assert_array_equal(batch["x"], _shards(b, [8, 8]))
      assert batch["y"].shape == (16, 2)


def check_model_axis_across_processes_both_feed_the_same_rows(outs):
  for out in outs:
    r = out["across"]
    assert r["error"] is None and len(r["batches"]) == 2
    assert r["info"] == (0, 1) and r["local_blocks"] == [0, 1, 2, 3]
    first, second = r["batches"]
    np.testing.assert_array_equal(first["x"], scenarios.rows_for(0, 0, 8))  # 8 rows, not 16.
    np.testing.assert_array_equal(second["x"], np.r_[scenarios.rows_for(0, 1, 5), [-1] * 3])
    np.testing.assert_array_equal(second["mask"], np.arange(8) < 5)
    for name in ("spec_on_mesh", "context"):  # sharding=P("data") with the mesh; jax.set_mesh.
      assert out[name]["info"] == (0, 1) and out[name]["spec"] == "P('data',)"
      np.testing.assert_array_equal(out[name]["batches"][0]["x"], scenarios.rows_for(0, 0, 8))
    assert out["context_info"] == (0, 1) and out["context_mesh_is_user_mesh"]


def check_processes_sharing_a_data_shard_with_different_rows_raise_everywhere(outs):
  for out in outs:
    r = out["across_differ"]
    assert r["error_type"] == "ValueError"
    assert "processes [0, 1] hold the same data shards (input shard 0) and must feed" in r["error"]
  assert len({out["across_differ"]["error"] for out in outs}) == 1
  assert all(out["across_differ"]["batches"] == [] for out in outs)  # Raised before batch 0.


def check_shared_rows_that_differ_later_raise_everywhere_in_lockstep(outs):
  # The collective fallback: batch 0 agrees and is yielded, batch 1 differs.
  for out in outs:
    r = out["across_differ_lockstep"]
    assert r["error_type"] == "ValueError"
    assert r["error"].startswith("batch 1: processes [0, 1] hold the same data shards")
    assert len(r["batches"]) == 1
    np.testing.assert_array_equal(r["batches"][0]["x"], scenarios.rows_for(0, 0, 8))
  assert len({out["across_differ_lockstep"]["error"] for out in outs}) == 1


def check_shared_rows_where_one_replica_ran_out_raise_everywhere(outs, case):
  # Padding would give process 0 a dummy batch 2 and process 1 its rows:
  # copies of one global array that differ from host to host, silently.
  for out in outs:
    r = out[case]
    assert r["error_type"] == "ValueError"
    assert r["error"] == (
      "batch 2: processes [0, 1] hold the same data shards (input shard 0) and must"
      " feed identical rows, but process 0 had no batch 2 (its source ended) while"
      " process 1 had one. Processes that share data shards must feed the same"
      " number of batches: load the data with grain_jax_sync.data_shard_info(mesh)"
      " as the shard (tfds_pipeline(mesh=...) does) and the same seed on every process"
    )
    assert len(r["batches"]) == 2  # The batches both replicas fed.
    for b, batch in enumerate(r["batches"]):
      np.testing.assert_array_equal(batch["x"], scenarios.rows_for(0, b, 8))
      assert batch["mask"].all()


def check_processes_with_different_meshes_raise_the_same_error_before_any_batch(outs, case, key):
  # Without the check, process 1 got two batches and process 0 timed out in
  # the transfer after 30 s (gloo), with inconsistent arrays in between.
  for out in outs:
    r = out[case]
    assert r["error_type"] == "ValueError" and r["batches"] == []
    assert r["error"].startswith("processes 0 and 1 were given different settings (")
    assert key in r["error"]
    assert "and the same mesh: the same devices in the same order" in r["error"]
  assert len({out[case]["error"] for out in outs}) == 1


def check_rows_not_divisible_by_the_data_shards_name_the_shards_not_the_devices(outs):
  # 4 local devices hold 2 data shards: 5 rows fail on the shards' count.
  for out in outs:
    r = out["inside_not_divisible"]
    assert r["error_type"] == "ValueError" and len(r["batches"]) == 1
    assert r["error"].startswith(
      "The local batch size (5) must be evenly divisible by the number of local JAX devices (2)"
    )
    assert "batch 1 has 5 rows per host, not divisible by process 0's 2 data shards" in r["error"]


def check_non_contiguous_data_shards_interleave_the_processes_rows(outs):
  # Rows over (y, x) of an (x=2, y=4) mesh whose x is the process: process p
  # holds data shards p, p + 2, p + 4, p + 6, two rows each.
  for p, out in enumerate(outs):
    r = out["strided"]
    assert r["error"] is None and r["info"] == (p, 2)
    assert r["local_blocks"] == [p, p + 2, p + 4, p + 6]
    want = np.concatenate(
      [scenarios.rows_for(k % 2, 0, 8)[2 * (k // 2) : 2 * (k // 2) + 2] for k in range(8)]
    )
    np.testing.assert_array_equal(r["batches"][0]["x"], want)


def check_user_sharding_with_a_model_split_feature_column(outs):
  for out in outs:
    r = out["sharding"]
    assert r["error"] is None and r["spec"] == "P('data', 'model')"
    x = _shards(0, [8, 8])
    np.testing.assert_array_equal(r["batches"][0]["x"], x)
    np.testing.assert_array_equal(r["batches"][0]["y"], np.stack([x, -x], 1).astype(np.float32))


def check_device_put_over_data_model_mesh(outs):
  for out in outs:
    r = out["device_put"]
    assert r["spec"] == "P('data',)" and len(r["batches"]) == 2
    for b, batch in enumerate(r["batches"]):
      np.testing.assert_array_equal(batch["x"], _shards(b, [8, 8]))


def check_tfds_pipeline_shards_by_the_mesh(outs):
  # Model across processes (the context mesh): both read every example, same order.
  assert outs[0]["tfds_across"] == outs[1]["tfds_across"]
  assert sum(len(b) for b in outs[0]["tfds_across"]) == 13
  # Model inside: two shards, 6 and 7 examples, 13 in all.
  sizes = [sum(len(b) for b in o["tfds_inside"]) for o in outs]
  assert sizes == [6, 7]


def check_up_front_checks_and_shape_helpers(outs):
  for p, out in enumerate(outs):
    assert out["local_mesh_error"] == (
      "the `mesh` argument must span every device of the job: it has 4 of the 8"
      f" devices (4 devices of processes [{1 - p}] are missing). Build the mesh from"
      " jax.devices(), not jax.local_devices(), e.g. grain_jax_sync.default_mesh()"
    )
    assert out["divisible_error"] == (
      "`batch_size` must be divisible by the 2 data shards that this process's 4"
      " local devices hold when `paddings` is given, got 5"
    )
    assert out["uneven_error"].startswith("the sharding NamedSharding(")
    assert out["uneven_error"].endswith(
      " splits dimension 0 into 4 blocks that processes hold unevenly (processes [0]"
      " hold [0, 1, 2]; processes [1] hold [1, 2, 3]); expected every process to hold"
      " the same number of blocks, and any two processes the same blocks or none in"
      " common. Order the mesh devices so that each process's devices form whole blocks"
    )
    assert out["cols_across_error"] == (
      "the `sharding` argument splits dimension 1 into 2 blocks across processes"
      " (processes [0] hold [0]; processes [1] hold [1]; spec P('data',"
      " 'model')); expected the dimensions after the rows whole on every process:"
      " batches are fed whole by each process. Split them over axes within a"
      " process, or replicate them"
    )
    assert out["cols_uneven_error"].endswith(
      " splits dimension 1 into 4 blocks that processes hold unevenly (processes [0]"
      " hold [0, 1, 2]; processes [1] hold [1, 2, 3]); expected every process to hold"
      " the same number of blocks, and any two processes the same blocks or none in"
      " common. Order the mesh devices so that each process's devices form whole blocks"
    )
    shapes = out["shapes"]
    assert {k: v["ours"] for k, v in shapes.items()} == {
      "inside": (16, 3),
      "across": (8, 3),
      "strided_rows": (16, 3),
      "strided_2d": (8, 8),
    }
    for v in shapes.values():
      assert v["ours"] == v["jax"]  # JAX's own rule.
    assert {k: v["back"] for k, v in shapes.items()} == {
      "inside": (8, 3),
      "across": (8, 3),
      "strided_rows": (8, 3),
      "strided_2d": (8, 4),
    }


# -- 4 processes x 2 devices -------------------------------------------------------------


def cases_4x2() -> dict[str, Any]:
  """4 processes x 2 devices: rows over a 2-D tuple of data axes."""
  import jax

  devs = _devices_by_process()
  axes = ("replica", "fsdp", "model")
  # Model pairs across processes (0, 1) and (2, 3); rows over (replica, fsdp).
  across = jax.sharding.Mesh(_grid((2, 2, 2), lambda r, f, m: devs[2 * r + m][f]), axes)
  # Model pairs inside a process; rows over (fsdp, replica): shard order 0, 2, 1, 3.
  inside = jax.sharding.Mesh(_grid((2, 2, 2), lambda r, f, m: devs[2 * r + f][m]), axes)
  return {
    "across": _run({"batch_size": 4, "mesh": across, "data_axes": ("replica", "fsdp")}, [4, 4]),
    "inside": _run({"batch_size": 4, "mesh": inside, "data_axes": ("fsdp", "replica")}, [4]),
  }


def check_2d_data_axes_with_model_pairs_across_processes(outs):
  # Rows over (replica, fsdp); processes (0, 1) and (2, 3) share data shards.
  for p, out in enumerate(outs):
    r = out["across"]
    assert r["error"] is None and len(r["batches"]) == 2
    assert r["spec"] == "P(('replica', 'fsdp'),)"
    assert r["info"] == (p // 2, 2) and r["local_blocks"] == [2 * (p // 2), 2 * (p // 2) + 1]
    for b, batch in enumerate(r["batches"]):
      np.testing.assert_array_equal(batch["x"], _shards(b, [4, 4]))


def check_2d_data_axes_minor_first_orders_shards_by_rows(outs):
  # Rows over (fsdp, replica) with process p at (replica p // 2, fsdp p % 2):
  # data shard of process p is 2 * (p % 2) + p // 2, so shards go 0, 2, 1, 3.
  for p, out in enumerate(outs):
    r = out["inside"]
    block = 2 * (p % 2) + p // 2
    assert r["error"] is None and r["info"] == (block, 4) and r["local_blocks"] == [block]
    np.testing.assert_array_equal(r["batches"][0]["x"], _shards(0, [4, 4, 4, 4]))


# -- one launch per topology: every case above, each with its own checks --------------


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_2x4_every_placement_case_across_real_processes():
  pytest.importorskip("tensorflow_datasets")  # A case reads a TFDS mock.
  outs = _launch(cases_2x4, 2, 4)
  checks = {
    "model_axis_inside": check_model_axis_inside_a_process_rows_per_process,
    "model_axis_across": check_model_axis_across_processes_both_feed_the_same_rows,
    "across_differ": check_processes_sharing_a_data_shard_with_different_rows_raise_everywhere,
    "across_differ_lockstep": check_shared_rows_that_differ_later_raise_everywhere_in_lockstep,
    "not_divisible": check_rows_not_divisible_by_the_data_shards_name_the_shards_not_the_devices,
    "strided": check_non_contiguous_data_shards_interleave_the_processes_rows,
    "sharding": check_user_sharding_with_a_model_split_feature_column,
    "device_put": check_device_put_over_data_model_mesh,
    "tfds": check_tfds_pipeline_shards_by_the_mesh,
    "up_front": check_up_front_checks_and_shape_helpers,
  }
  calls = {name: functools.partial(check, outs) for name, check in checks.items()}
  for case in ("across_one_ends", "across_one_ends_lockstep"):
    calls[case] = functools.partial(
      check_shared_rows_where_one_replica_ran_out_raise_everywhere, outs, case
    )
  for case, key in MESH_MISMATCHES.items():
    calls[case] = functools.partial(
      check_processes_with_different_meshes_raise_the_same_error_before_any_batch, outs, case, key
    )
  check_each(calls)


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_4x2_2d_data_axes_order_the_shards_across_real_processes():
  outs = _launch(cases_4x2, 4, 2)
  check_each(
    {
      "across": functools.partial(check_2d_data_axes_with_model_pairs_across_processes, outs),
      "inside": functools.partial(check_2d_data_axes_minor_first_orders_shards_by_rows, outs),
    }
  )
