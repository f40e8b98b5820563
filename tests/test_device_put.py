"""device_put: the grain.experimental.device_put drop-in with agreement."""

import inspect
import json

import grain
import jax
import numpy as np
import pytest
import scenarios_sources as ss

import grain_jax_sync as gjs
from grain_jax_sync import testing

SIZES = [13, 6]
PADDED = {"batch_size": 4, "paddings": -1, "mask_key": "mask"}


@pytest.mark.multiprocess
def test_device_put_two_processes_uneven_shards_every_example_once():
  outs = testing.values(
    testing.run_processes(
      ss.run_device_put, num_processes=2, devices_per_process=4, args=(SIZES, PADDED), timeout_s=120
    )
  )
  assert outs[0] == outs[1]
  out = outs[0]
  assert out["is_grain"]  # A grain.IterDataset whose iterator is a DatasetIterator.
  assert out["consistent"]
  real = [i for ids, m in zip(out["ids"], out["mask"]) for i, ok in zip(ids, m) if ok]
  assert sorted(real) == list(range(sum(SIZES)))
  assert len(out["ids"]) == 4


@pytest.mark.multiprocess
def test_device_put_resume_after_k_batches_continues_like_uninterrupted_run():
  outs = testing.values(
    testing.run_processes(
      ss.resume,
      num_processes=2,
      devices_per_process=4,
      args=("device_put", SIZES, 2, PADDED),
      timeout_s=120,
    )
  )
  for out in outs:
    assert out["head"] == 2
    assert out["resumed"] == out["full"]
    assert len(out["full"]["ids"]) == 4


def test_device_put_keeps_grain_first_arguments_and_defaults():
  ours = inspect.signature(gjs.device_put).parameters
  theirs = inspect.signature(grain.experimental.device_put).parameters
  assert list(ours)[:4] == list(theirs)
  for name in ("cpu_buffer_size", "device_buffer_size"):
    assert ours[name].default == theirs[name].default
    assert ours[name].kind == inspect.Parameter.KEYWORD_ONLY


def _batches(n=40, batch=8):
  return grain.MapDataset.range(n).map(lambda i: {"x": np.int32(i)}).batch(batch)


def test_device_put_single_process_yields_global_arrays_and_checkpoints():
  sharding = gjs.default_sharding()
  ds = gjs.device_put(
    _batches().to_iter_dataset(), sharding, batch_size=8, paddings=0, mask_key="m"
  )
  assert isinstance(ds, grain.IterDataset)
  it = iter(ds)
  first = next(it)
  assert isinstance(first["x"], jax.Array) and first["x"].sharding == sharding
  np.testing.assert_array_equal(np.asarray(first["x"]), np.arange(8))
  state = json.loads(json.dumps(it.get_state()))
  rest = [np.asarray(b["x"]).tolist() for b in it]
  it.close()
  assert rest == [list(range(k, k + 8)) for k in range(8, 40, 8)]
  again = iter(ds)
  again.set_state(state)
  assert [np.asarray(b["x"]).tolist() for b in again] == rest


def test_device_put_accepts_a_mesh_and_a_mapdataset():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  it = iter(gjs.device_put(_batches(16), mesh, cpu_buffer_size=0))
  got = list(it)
  assert got[0]["x"].sharding.spec == jax.sharding.PartitionSpec(("a", "b"))
  assert [np.asarray(b["x"]).tolist() for b in got] == [list(range(8)), list(range(8, 16))]


def test_device_put_needs_batch_size_with_paddings():
  with pytest.raises(ValueError, match=r"`batch_size` is required with `paddings` or `drop_last`"):
    gjs.device_put(_batches().to_iter_dataset(), paddings=0)


def test_device_put_checks_iter_jax_batches_arguments_up_front():
  with pytest.raises(ValueError, match=r"`batch_size` must be divisible by the 8 local devices"):
    gjs.device_put(_batches().to_iter_dataset(), batch_size=6, paddings=0)


def test_device_put_rejects_non_grain_datasets():
  with pytest.raises(
    ValueError, match=r"`ds` must be a grain.IterDataset or grain.MapDataset, got list"
  ):
    gjs.device_put([np.arange(8)])
