"""meshes.py: the default mesh choice, the context mesh and the data axes.

The default-order tests use fake device objects (mesh_utils only reads their
attributes); everything else runs on this process's 8 CPU devices.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import pytest
import scenarios
from jax.experimental import mesh_utils
from jax.sharding import Mesh, PartitionSpec

import grain_jax_sync as gjs
from grain_jax_sync._src import meshes


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
  order, reason = meshes.default_device_order(devices)
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
  order, reason = meshes.default_device_order(devices)
  want = mesh_utils.create_hybrid_device_mesh((4,), (2,), devices).reshape(-1)
  assert _ids(order) == _ids(want)
  # Slices are the outer (data-parallel) blocks: slice 0's devices first.
  assert [d.slice_index for d in order] == [0] * 4 + [1] * 4
  assert _ids(order[:4]) == _ids(mesh_utils.create_device_mesh((4,), devices[4:]).flat)
  assert "2 slice_index values: create_hybrid_device_mesh" in reason


def test_default_order_falls_back_to_process_then_id():
  # TPU devices whose coordinates make no cuboid: create_device_mesh fails.
  devices = [FakeTpu(i, i // 2, (0, 0, 0)) for i in reversed(range(4))]
  order, reason = meshes.default_device_order(devices)
  assert _ids(order) == [0, 1, 2, 3]
  assert reason.startswith("create_device_mesh failed (AssertionError")
  assert reason.endswith("devices ordered by process, then id")


def test_default_order_uneven_slices_fall_back_to_process_then_id():
  devices = [
    FakeTpu(i, 1 - i // 4, (i % 2, (i // 2) % 2, 0), slice_index=int(i >= 2)) for i in range(8)
  ]
  order, reason = meshes.default_device_order(devices)
  assert _ids(order) == [4, 5, 6, 7, 0, 1, 2, 3]
  assert "2 slice_index values but create_hybrid_device_mesh failed" in reason


def test_default_mesh_is_1d_over_every_device_and_logs_why(caplog):
  meshes._logged.clear()
  with caplog.at_level(logging.INFO, logger="grain_jax_sync"):
    mesh = gjs.default_mesh()
    gjs.default_mesh()
  assert mesh.axis_names == ("data",) and mesh.devices.shape == (8,)
  assert set(mesh.devices.flat) == set(jax.devices())
  logged = [r.getMessage() for r in caplog.records if "default mesh" in r.getMessage()]
  assert logged == [
    "grain_jax_sync: default mesh: 1-D 'data' axis over 8 devices;"
    " one slice: create_device_mesh (topology-aware order)"
  ]
  assert gjs.default_sharding().spec == PartitionSpec("data")


def _mesh(shape=(4, 2), axes=("data", "model")):
  return Mesh(np.array(jax.devices()).reshape(shape), axes)


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
  assert meshes.data_spec(_mesh(axes=axes), data_axes) == want


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
    meshes.data_axes_of(_mesh(), data_axes)


def test_context_mesh_is_read_from_jax_set_mesh():
  mesh = _mesh()
  assert meshes.context_mesh() is None
  with jax.set_mesh(mesh):
    assert meshes.context_mesh() == mesh
  assert meshes.context_mesh() is None


def test_jax_sync_generator_keeps_the_1d_default_mesh_inside_set_mesh():
  data = scenarios.make_batches(0, [8])
  with jax.set_mesh(_mesh()):
    out = list(gjs.jax_sync_generator(data, drop_last=False, batch_size=8))
    with gjs.iter_jax_batches(data, batch_size=8) as it:
      ours = list(it)
  assert out[0]["x"].sharding.mesh.axis_names == ("data",)
  assert out[0]["x"].sharding.mesh.devices.shape == (8,)
  assert ours[0]["x"].sharding.mesh == _mesh()
