"""MaxText's MultiHostDataLoadIterator swapped for iter_jax_batches: reset() and local_iterator.

MaxText's trainer calls ``eval_data_iterator.reset()`` before each eval and
checkpoints ``data_iterator.local_iterator`` through Grain's handler. These
tests run that loop unchanged.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import grain
import numpy as np
import pytest
import scenarios
import scenarios_dropin
from helpers import check_cases, run_cases

import grain_jax_sync as gjs


def _ds(n):
  return grain.MapDataset.range(n).map(lambda i: {"x": np.int32(i)}).batch(8).to_iter_dataset()


def test_reset_restarts_the_stream_from_its_beginning():
  it = gjs.iter_jax_batches(_ds(32), batch_size=8)
  first = [np.asarray(next(it)["x"]).tolist() for _ in range(3)]
  it.reset()
  again = [np.asarray(b["x"]).tolist() for b in it]
  it.close()
  assert again[:3] == first and len(again) == 4


def test_reset_after_the_end_and_of_a_list_source():
  data = [{"x": np.arange(8) + 8 * i} for i in range(2)]
  it = gjs.iter_jax_batches(data, batch_size=8)
  assert len(list(it)) == 2
  it.reset()
  assert [np.asarray(b["x"]).tolist() for b in it] == [d["x"].tolist() for d in data]
  it.close()


def test_local_iterator_state_is_the_state_after_the_last_consumed_batch():
  it = gjs.iter_jax_batches(_ds(48), batch_size=8, prefetch_batches=3)
  next(it)
  next(it)
  assert isinstance(it.local_iterator, grain.DatasetIterator)
  assert it.local_iterator.get_state() == {"next_index": 2}  # Not the prefetched ones.
  fresh = gjs.iter_jax_batches(_ds(48), batch_size=8)
  fresh.local_iterator.set_state({"next_index": 2})
  assert [np.asarray(b["x"])[0] for b in fresh] == [16, 24, 32, 40]
  it.close()
  fresh.close()


def check_maxtext_loop_train_eval_with_reset_checkpoint_resume_two_processes(outs):
  for out in outs:
    assert out["trained"] == out["full"][:4]
    assert out["rest"] == out["full"][4:]  # Resumed from local_iterator's checkpoint.
    assert out["eval_x"][0] == out["eval_x"][1]  # reset() restarted eval on every host.
    assert out["eval_mask"][0] == out["eval_mask"][1] and len(out["eval_x"][0]) == 3
    assert out["eval_mask"][0][2] == [True] * 8 + [False] * 8  # Process 1 ran out.
  assert outs[0]["full"] == outs[1]["full"]


def test_reset_of_a_generator_source_raises_a_clear_error():
  it = gjs.iter_jax_batches((b for b in [{"x": np.arange(8)}]), batch_size=8)
  next(it)
  with pytest.raises(
    RuntimeError, match=r"`reset\(\)` cannot restart an iterator of type generator"
  ):
    it.reset()
  it.close()


def test_reset_of_a_resumable_iterator_restores_its_first_state():
  source = iter(_ds(32))  # A grain DatasetIterator: one-shot, but with get_state/set_state.
  source.set_state({"next_index": 1})
  it = gjs.iter_jax_batches(source, batch_size=8)
  assert [np.asarray(b["x"])[0] for b in it] == [8, 16, 24]
  it.reset()
  assert [np.asarray(b["x"])[0] for b in it] == [8, 16, 24]
  it.close()


def test_reset_after_set_state_restarts_from_the_beginning():
  it = gjs.iter_jax_batches(_ds(32), batch_size=8)
  next(it)
  state = it.get_state()
  it.close()
  it = gjs.iter_jax_batches(_ds(32), batch_size=8)
  it.set_state(state)
  it.reset()
  assert [np.asarray(b["x"])[0] for b in it] == [0, 8, 16, 24]
  assert it.get_state()["batches"] == 4
  it.close()


def _loader(n=48):
  source = grain.sources.RangeDataSource(0, n, 1)
  sampler = grain.samplers.IndexSampler(n, shuffle=False, num_epochs=1, seed=0)
  ops = [grain.transforms.Batch(8)]
  return grain.DataLoader(data_source=source, sampler=sampler, operations=ops, worker_count=0)


def test_local_iterator_of_a_data_loader_saves_json_bytes_and_resumes():
  loader = _loader
  it = gjs.iter_jax_batches(loader(), batch_size=8, prefetch_batches=3)
  next(it)
  next(it)
  saved = it.local_iterator.get_state()
  assert isinstance(saved, bytes) and json.loads(saved)["last_seen_indices"] == {"0": 15}
  it.close()
  fresh = gjs.iter_jax_batches(loader(), batch_size=8)
  fresh.local_iterator.set_state(saved)
  assert [np.asarray(b)[0] for b in fresh] == [16, 24, 32, 40]
  fresh.close()


@pytest.mark.parametrize("kind", ["data_loader", "iter_dataset"])
def test_local_iterator_saves_and_loads_through_orbax_v1_as_grains_iterators(tmp_path, kind):
  # Orbax v1 checkpoints a `StatefulCheckpointable` (its save/load), as
  # MaxText's newest checkpointing does Grain's iterators; a checkpoint of
  # Grain's own iterator, written before the swap, restores into ours.
  from orbax.checkpoint import v1 as ocp

  make = _loader if kind == "data_loader" else functools.partial(_ds, 48)

  def first_rows(it):
    return [int(np.asarray(b["x"] if isinstance(b, dict) else b)[0]) for b in it]

  theirs = iter(make())
  for _ in range(2):
    next(theirs)
  ocp.save_checkpointables(tmp_path / "grain", {"iter": theirs})
  ours = gjs.iter_jax_batches(make(), batch_size=8, prefetch_batches=3)
  for _ in range(3):
    next(ours)
  ocp.save_checkpointables(tmp_path / "ours", {"iter": ours.local_iterator})
  ours.close()
  for name, start in (("grain", 16), ("ours", 24)):
    fresh = gjs.iter_jax_batches(make(), batch_size=8)
    ocp.load_checkpointables(tmp_path / name, {"iter": fresh.local_iterator})
    assert first_rows(fresh) == list(range(start, 48, 8))
    fresh.close()


def test_a_local_iterator_restore_mid_stream_counts_batches_from_zero_again():
  it = gjs.iter_jax_batches(_ds(64), batch_size=8)
  for _ in range(3):
    next(it)
  saved = it.local_iterator.get_state()
  next(it)
  it.local_iterator.set_state(saved)
  assert it.get_state()["batches"] == 0  # The source state has no batch count.
  assert [np.asarray(b["x"])[0] for b in it] == [24, 32, 40, 48, 56]
  assert it.get_state()["batches"] == 5
  it.close()


def run_local_restore_mid_run() -> dict[str, Any]:
  """Both restore a `local_iterator` state saved a batch earlier into their running iterators."""
  import jax

  p = jax.process_index()

  def ds() -> Any:
    rows = grain.MapDataset.range(64).map(lambda i: {"x": np.int32(i + 1000 * p)})
    return rows.batch(8).to_iter_dataset()

  it = gjs.iter_jax_batches(ds(), batch_size=8)
  for _ in range(3):
    next(it)
  saved = it.local_iterator.get_state()
  next(it)
  it.local_iterator.set_state(saved)
  out = scenarios.consume(it)
  out["rows"] = [b["x"].tolist() for b in out.pop("batches")]
  out["count"] = it.get_state()["batches"]
  it.close()
  return out


def check_hosts_restoring_a_local_state_mid_run_resume_its_rows_and_count_from_zero(outs):
  # Host 0's 8 rows, then host 1's, for batches 3 to 7 of each host's 8.
  want = [[*range(8 * b, 8 * b + 8), *range(1000 + 8 * b, 1008 + 8 * b)] for b in range(3, 8)]
  for out in outs:
    assert out["error"] is None, out["error"]
    assert out["rows"] == want
    assert out["count"] == 5


def test_local_iterator_is_none_for_a_list_and_not_iterable_for_grain():
  assert gjs.iter_jax_batches([{"x": np.arange(8)}]).local_iterator is None
  it = gjs.iter_jax_batches(_ds(16), batch_size=8)
  with pytest.raises(TypeError, match=r"iterate the JaxBatchIterator itself"):
    next(it.local_iterator)
  it.close()


def run_reset_peer(resetter: int, prefetch: int) -> dict[str, Any]:
  """Process `resetter` resets after one batch; its peer, still iterating, raises naming it."""
  import jax

  p = jax.process_index()
  # Longer than the resetter reads ahead and holds decided (about 4 x 32
  # windows + 2: its agreement, its queue and its build stage), so that the
  # reset lands mid-stream.
  data = scenarios.make_batches(p, [8] * 400)
  it = gjs.iter_jax_batches(data, synchronize_lookahead=2, prefetch_batches=prefetch)
  next(it)
  if p == resetter:
    it.reset()
    it.close()
    return {"reset": True}
  out: dict[str, Any] = {"batches": 1, "error": None, "error_type": None}
  try:
    for _ in it:  # No collective here: the resetter is gone.
      out["batches"] += 1
  except Exception as e:  # noqa: BLE001 - returned to the test.
    out["error"], out["error_type"] = str(e), type(e).__name__
  it.close()
  return out


def check_reset_while_a_peer_iterates_raises_on_the_peer_naming_the_process(outs, resetter):
  peer = outs[1 - resetter]
  assert peer["error_type"] == "RuntimeError"
  assert f"process {resetter} reset its iterator at batch 1" in peer["error"]
  assert outs[resetter] == {"reset": True}


# -- real processes: every case in one launch, each with its own checks -----------------


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_maxtext_loop_local_restore_and_reset_across_two_processes(tmp_path):
  # The resetter cases last: the resetter leaves while its peer still reads.
  cases = {
    "maxtext_loop": (scenarios_dropin.run_maxtext_loop, (48, [24, 16], str(tmp_path / "ckpt")), {}),
    "local_restore_mid_run": (run_local_restore_mid_run, (), {}),
    "reset_by_0": (run_reset_peer, (0, 2), {}),
    "reset_by_1": (run_reset_peer, (1, 2), {}),
  }
  reset = check_reset_while_a_peer_iterates_raises_on_the_peer_naming_the_process
  check_cases(
    run_cases(2, 4, cases, timeout_s=240),
    {
      "maxtext_loop": check_maxtext_loop_train_eval_with_reset_checkpoint_resume_two_processes,
      "local_restore_mid_run": (
        check_hosts_restoring_a_local_state_mid_run_resume_its_rows_and_count_from_zero
      ),
      "reset_by_0": functools.partial(reset, resetter=0),
      "reset_by_1": functools.partial(reset, resetter=1),
    },
  )
