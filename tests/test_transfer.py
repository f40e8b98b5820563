"""transfer.py: NumPy -> global jax.Array, as `make_array_from_process_local_data` makes it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grain_jax_sync._src import placement, transfer


def _leaves(rows=16):
  rng = np.random.default_rng(0)
  return [
    rng.integers(0, 255, (rows, 8, 8, 3), dtype=np.uint8),
    np.arange(rows, dtype=np.int32),
    np.arange(rows * 5, dtype=np.float32).reshape(rows, 5),
  ]


@pytest.mark.parametrize(
  "spec", [("data",), ("data", None), (("data", "model"),), (None,)], ids=str
)
def test_to_global_leaves_in_one_process_equals_make_array_from_process_local_data(spec):
  # One process puts the batch with `jax.device_put`, which is what
  # `make_array_from_process_local_data` does there: same values, shapes,
  # shardings and per-device rows, for any spec over a 2-D mesh.
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  place = placement.placement_for(NamedSharding(mesh, PartitionSpec(*spec)), "test")
  assert place.single_process
  leaves = _leaves()
  ours = transfer.to_global_leaves(leaves, place)
  shardings, shapes = transfer.global_targets([x.shape for x in leaves], place)
  want = jax.make_array_from_process_local_data(shardings, leaves, shapes)
  for got, ref, host in zip(ours, want, leaves, strict=True):
    assert got.shape == ref.shape == host.shape
    assert got.sharding == ref.sharding
    np.testing.assert_array_equal(np.asarray(got), host)
    for a, b in zip(got.addressable_shards, ref.addressable_shards, strict=True):
      assert a.device == b.device and a.index == b.index
      np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_to_global_leaves_casts_on_the_device_where_asked():
  mesh = Mesh(np.array(jax.devices()), ("data",))
  place = placement.placement_for(NamedSharding(mesh, PartitionSpec("data")), "test")
  leaves = _leaves()
  out = transfer.to_global_leaves(leaves, place, [np.dtype(np.float32), None, None])
  assert [x.dtype for x in out] == [np.float32, np.int32, np.float32]
  np.testing.assert_array_equal(np.asarray(out[0]), leaves[0].astype(np.float32))


@pytest.mark.parametrize("dtype", [None, np.dtype(np.float32)], ids=str)
def test_a_large_leaf_for_one_device_crosses_as_pieces_joined_on_the_device(monkeypatch, dtype):
  # A leaf bound for one device goes as several puts of rows (views, no host
  # copy), joined there: the same values, shape and sharding as one put.
  monkeypatch.setattr(transfer, "PIECE_BYTES", 1024)
  monkeypatch.setattr(transfer, "NO_LINK", frozenset())  # As on an accelerator.
  one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec("data"))
  place = placement.placement_for(one, "test")
  leaves = _leaves(rows=18)  # 3456 bytes of images: 3 pieces; 72 bytes of int32: 1.
  shardings, _ = transfer.global_targets([x.shape for x in leaves], place)
  assert [transfer.pieces(x, s) for x, s in zip(leaves, shardings)] == [3, 1, 1]
  out = transfer.to_global_leaves(leaves, place, [dtype, None, None])
  for got, host in zip(out, leaves, strict=True):
    assert got.shape == host.shape
    assert got.sharding == jax.device_put(host, one).sharding
  assert out[0].dtype == (dtype or np.uint8)
  np.testing.assert_array_equal(np.asarray(out[0]), leaves[0].astype(dtype or np.uint8))
  np.testing.assert_array_equal(np.asarray(out[2]), leaves[2])
  # Spread over several devices, a leaf already crosses as one put per device.
  many = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
  assert transfer.pieces(leaves[0], many) == 1
  monkeypatch.undo()  # CPU devices have no link: one put, however large.
  monkeypatch.setattr(transfer, "PIECE_BYTES", 1024)
  assert transfer.pieces(leaves[0], one) == 1


def test_a_leaf_in_memory_numpy_did_not_allocate_crosses_as_one_put(monkeypatch):
  # Grain's worker processes hand batches over in shared memory; a fresh
  # mapping's pages are touched first by the put, and pieces would fault them
  # from several threads at once. Such a leaf (and a view of it) goes whole;
  # a copy, or a view of an array NumPy allocated, still goes in pieces.
  from multiprocessing import shared_memory

  monkeypatch.setattr(transfer, "PIECE_BYTES", 1024)
  monkeypatch.setattr(transfer, "NO_LINK", frozenset())
  one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec("data"))
  owned = _leaves(rows=18)[0]
  shm = shared_memory.SharedMemory(create=True, size=owned.nbytes)
  try:
    mapped = np.ndarray(owned.shape, owned.dtype, buffer=shm.buf)
    mapped[:] = owned
    cases = {
      "shared memory": mapped,
      "a view of it": mapped[2:],
      "bytes": np.frombuffer(owned.tobytes(), owned.dtype).reshape(owned.shape),
      "a copy of it": mapped.copy(),
      "NumPy's own": owned,
      "a view of NumPy's own": owned[2:],
    }
    got = {name: transfer.pieces(leaf, one) for name, leaf in cases.items()}
    assert got == {
      "shared memory": 1,
      "a view of it": 1,
      "bytes": 1,
      "a copy of it": 3,
      "NumPy's own": 3,
      "a view of NumPy's own": 3,
    }
    place = placement.placement_for(one, "test")
    np.testing.assert_array_equal(np.asarray(transfer.to_global_leaves([mapped], place)[0]), owned)
    del mapped, cases
  finally:
    shm.close()
    shm.unlink()
