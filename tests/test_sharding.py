"""sharding.py: the row digest that processes sharing a data shard compare."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

from grain_jax_sync._src import sharding


def _batch(seed=0, rows=16):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 255, (rows, 8, 8, 3), dtype=np.uint8), np.arange(rows, dtype=np.int32)]


def test_rows_digest_equal_rows_equal_digest_any_layout():
  a = _batch()
  b = [np.asfortranarray(a[0]), a[1].astype(">i4").astype(np.int32)]  # Same values, other layout.
  assert sharding.rows_digest(a) == sharding.rows_digest(b)
  assert len(sharding.rows_digest(a)) == 16


@pytest.mark.parametrize(
  "change",
  [
    lambda x, y: (x, y[::-1].copy()),  # Another order (another shuffle).
    lambda x, y: (x, y + 16),  # Another shard.
    lambda x, y: (x[:8], y[:8]),  # Fewer rows.
    lambda x, y: (x, y.astype(np.int64)),  # Another dtype.
    lambda x, y: (x.reshape(16, 8, 24), y),  # Another shape.
  ],
)
def test_rows_digest_differs_for_other_rows(change):
  x, y = _batch()
  assert sharding.rows_digest([x, y]) != sharding.rows_digest(list(change(x, y)))


def test_rows_digest_large_leaves_are_sampled_but_see_each_sampled_row():
  rng = np.random.default_rng(1)
  big = rng.integers(0, 255, (256, 64, 64, 3), dtype=np.uint8)  # 3 MiB: sampled.
  assert big.nbytes > sharding.DIGEST_FULL_BYTES
  base = sharding.rows_digest([big])
  other = big.copy()
  other[255, 0, 0, 0] ^= 1  # The last row and its first element are always sampled.
  assert sharding.rows_digest([other]) != base
  shuffled = big[rng.permutation(256)]
  assert sharding.rows_digest([shuffled]) != base
  bf16 = big[:, :1, :1, 0].astype(ml_dtypes.bfloat16)
  assert sharding.rows_digest([bf16]) == sharding.rows_digest([bf16.copy()])


def test_rows_digest_is_cheap_for_a_large_batch():
  big = np.zeros((256, 224, 224, 3), np.uint8)  # 38.5 MB of images.
  labels = np.zeros(256, np.int32)
  sharding.rows_digest([big, labels])
  start = time.perf_counter()
  for _ in range(5):
    sharding.rows_digest([big, labels])
  per_call = (time.perf_counter() - start) / 5
  assert per_call < 0.02, per_call  # Measured about 1 ms on 2 shared cores.


def test_shared_rows_error_names_the_processes_and_the_batch():
  groups = [(0, 1), (2, 3)]
  same = ["a", "a", "b", "b"]
  assert sharding.shared_rows_error(same, groups, 3) is None
  assert sharding.shared_rows_error(["a", "a", None, None], groups, 3) is None  # Both dummies.
  # A dummy on one replica and rows on the other: copies of one global array
  # would differ from process to process.
  assert sharding.shared_rows_error(["a", "a", "b", None], groups, 3) == (
    "batch 3: processes [2, 3] hold the same data shards (input shard 1) and must"
    " feed identical rows, but process 3 had no batch 3 (its source ended) while"
    " process 2 had one. Processes that share data shards must feed the same number"
    " of batches: load the data with grain_jax_sync.data_shard_info(mesh) as the"
    " shard (tfds_pipeline(mesh=...) does) and the same seed on every process"
  )
  message = sharding.shared_rows_error(["a", "a", "b", "c"], groups, 3)
  assert message == (
    "batch 3: processes [2, 3] hold the same data shards (input shard 1) and"
    " must feed identical rows, but their rows differ (row digests process 2:"
    " b, process 3: c). Load the data with grain_jax_sync.data_shard_info(mesh)"
    " as the shard (tfds_pipeline(mesh=...) does) and the same seed on every process"
  )
  assert sharding.shared_rows_error(["a", "b"], [(0,), (1,)], 0) is None  # No sharing.


@pytest.mark.parametrize(
  "spec", [("data",), ("data", None), (("data", "model"),), (None,)], ids=str
)
def test_to_global_leaves_in_one_process_equals_make_array_from_process_local_data(spec):
  # One process puts the batch with `jax.device_put`, which is what
  # `make_array_from_process_local_data` does there: same values, shapes,
  # shardings and per-device rows, for any spec over a 2-D mesh.
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from grain_jax_sync._src import placement as placement_lib

  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
  place = placement_lib.placement_for(NamedSharding(mesh, PartitionSpec(*spec)), "test")
  assert place.single_process
  leaves = [*_batch(rows=16), np.arange(16 * 5, dtype=np.float32).reshape(16, 5)]
  ours = sharding.to_global_leaves(leaves, place)
  shardings, shapes = sharding.global_targets([x.shape for x in leaves], place)
  want = jax.make_array_from_process_local_data(shardings, leaves, shapes)
  for got, ref, host in zip(ours, want, leaves, strict=True):
    assert got.shape == ref.shape == host.shape
    assert got.sharding == ref.sharding
    np.testing.assert_array_equal(np.asarray(got), host)
    for a, b in zip(got.addressable_shards, ref.addressable_shards, strict=True):
      assert a.device == b.device and a.index == b.index
      np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
