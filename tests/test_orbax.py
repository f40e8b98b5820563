"""Orbax: save and restore the iterator with Grain's handler, one file per process."""

import functools
import json

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest
import scenarios_sources as ss
from helpers import check_cases, run_cases

import grain_jax_sync as gjs

SIZES = [13, 6]
PADDED = {"batch_size": 4, "paddings": -1, "mask_key": "mask"}


KINDS = ["dataloader", "iterdataset", "device_put"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_orbax_checkpoint_manager_resumes_exactly_on_every_host(tmp_path):
  # One launch runs every kind, each with its own checkpoint folder; each kind's own checks.
  cases = {
    kind: (ss.orbax_resume, (kind, SIZES, 2, PADDED, str(tmp_path / kind / "ckpt")), {})
    for kind in KINDS
  }
  check_cases(
    run_cases(2, 4, cases, timeout_s=240),
    {kind: functools.partial(check_orbax_resume, folder=tmp_path / kind) for kind in KINDS},
  )


def check_orbax_resume(outs, folder):
  for out in outs:
    assert out["step"] == 2
    assert [f for f in out["files"] if f.endswith(".json")] == [
      "process_0-of-2.json",
      "process_1-of-2.json",
    ]
    assert out["resumed"] == out["full"]
    assert len(out["full"]["ids"]) == 4
  assert outs[0]["full"] == outs[1]["full"]
  # Each process's file holds that process's state after 2 batches.
  for p in range(2):
    state = json.loads((folder / "ckpt" / "2" / "data" / f"process_{p}-of-2.json").read_text())
    assert (state["process_index"], state["process_count"], state["batches"]) == (p, 2, 2)


def _loader():
  return grain.DataLoader(
    data_source=list(range(32)),
    sampler=grain.samplers.IndexSampler(
      num_records=32, shard_options=grain.sharding.NoSharding(), shuffle=True, seed=3, num_epochs=1
    ),
    operations=[grain.transforms.Batch(8)],
    worker_count=0,
  )


def test_checkpoint_save_restore_single_process_with_grain_handler(tmp_path):
  full = [np.asarray(b).tolist() for b in gjs.iter_jax_batches(_loader(), batch_size=8)]
  it = gjs.iter_jax_batches(_loader(), batch_size=8)
  head = [np.asarray(next(it)).tolist()]
  mngr = ocp.CheckpointManager(tmp_path)
  mngr.save(1, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))
  mngr.wait_until_finished()
  it.close()
  fresh = gjs.iter_jax_batches(_loader(), batch_size=8)
  mngr.restore(1, args=ocp.args.Composite(data=gjs.checkpoint_restore(fresh)))
  mngr.close()
  assert head + [np.asarray(b).tolist() for b in fresh] == full
  assert sorted(p.name for p in (tmp_path / "1" / "data").iterdir() if p.suffix == ".json") == [
    "process_0-of-1.json"
  ]


def test_an_elastic_mixture_takes_new_weights_and_batch_size_from_orbax_on_the_same_count(
  tmp_path,
):
  sources = [[{"x": np.int32(i)} for i in range(10)], [{"x": np.int32(100 + i)} for i in range(20)]]

  def pipeline(weights, batch_size):
    src = gjs.elastic_mixture(sources, weights, lambda ds: ds.batch(batch_size), num_epochs=1)
    return gjs.iter_jax_batches(src, batch_size=batch_size, paddings=0, mask_key="mask")

  def rows(it):
    return [int(x) for b in it for x, m in zip(b["x"], b["mask"], strict=True) if m]

  with pipeline([1, 2], 8) as it, ocp.CheckpointManager(tmp_path) as mngr:
    head = rows([next(it), next(it)])
    state = json.loads(json.dumps(it.get_state()))
    mngr.save(2, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))
  with pipeline([3, 1], 16) as listed:  # Restored from the list: the documented switch.
    listed.set_state([state])
    want = rows(listed)
  with pipeline([3, 1], 16) as it, ocp.CheckpointManager(tmp_path) as mngr:
    mngr.restore(2, args=ocp.args.Composite(data=gjs.checkpoint_restore(it)))
    assert [s["weight"] for s in it.stats()["sources"]] == [0.75, 0.25]
    assert rows(it) == want and len(head) + len(want) == 30


def test_checkpoint_save_passes_grain_iterators_through():
  it = iter(gjs.device_put(grain.MapDataset.range(8).batch(8)))
  assert gjs.checkpoint_save(it).item is it


def test_checkpoint_save_rejects_objects_without_state():
  with pytest.raises(ValueError, match=r"must have get_state\(\) and set_state\(\).*got list"):
    gjs.checkpoint_save([1, 2])
