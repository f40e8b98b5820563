"""Grain sources: DataLoader, IterDataset, MapDataset and started iterators."""

import json
from typing import Any

import grain
import numpy as np
import pytest
import scenarios_sources as ss
from helpers import check_cases, run_cases

import grain_jax_sync as gjs

SIZES = [13, 6]  # Uneven shards: 4 vs 2 batches of 4 on the two hosts.
PADDED = {"batch_size": 4, "paddings": -1, "mask_key": "mask"}


def _unmasked(out):
  return [i for ids, mask in zip(out["ids"], out["mask"]) for i, m in zip(ids, mask) if m]


def run_grain(kind: str, sizes: list[int], kwargs: dict[str, Any]) -> dict[str, Any]:
  """Drains a Grain source through iter_jax_batches (or device_put)."""

  src = ss.grain_source(kind, sizes)
  batches, error = [], None
  try:
    with gjs.iter_jax_batches(src, **kwargs) as it:
      for b in it:
        batches.append(ss.gather(b))
  except Exception as e:  # noqa: BLE001 - returned to the test.
    error = f"{type(e).__name__}: {e}"
  out = ss.summarize(batches)
  out["error"] = error
  return out


SOURCE_KINDS = ["dataloader", "iterdataset", "mapdataset", "iterdataset_raw"]
RESUME_KINDS = ["dataloader", "iterdataset"]


def check_grain_source_two_processes_uneven_shards_every_example_once(outs):
  assert outs[0] == outs[1]  # Every host sees the same global batches.
  out = outs[0]
  assert out["error"] is None
  assert out["consistent"]  # Nested dict/tuple leaves stay with their id.
  assert sorted(_unmasked(out)) == list(range(sum(SIZES)))
  assert len(out["ids"]) == 4  # The longer shard's batch count.
  # Host 1 ran out after 2 batches: its rows of batches 2 and 3 are dummies.
  for b in (2, 3):
    assert out["mask"][b][4:] == [False] * 4
    assert out["ids"][b][4:] == [-1] * 4
  assert all(
    i == -1 for ids, mask in zip(out["ids"], out["mask"]) for i, m in zip(ids, mask) if not m
  )


def check_grain_resume_after_k_batches_continues_like_uninterrupted_run(outs):
  for out in outs:
    assert out["head"] == 2
    assert out["resumed"] == out["full"]
    assert len(out["full"]["ids"]) == 4
    assert sorted(_unmasked(out["full"])) == list(range(sum(SIZES)))
  assert outs[0]["full"] == outs[1]["full"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_grain_sources_two_processes_every_example_once_and_resume_exactly():
  # One launch runs every kind of source, then the resumes; each case's own checks.
  cases = {f"source/{k}": (run_grain, (k, SIZES, PADDED), {}) for k in SOURCE_KINDS}
  cases.update({f"resume/{k}": (ss.resume, (k, SIZES, 2, PADDED), {}) for k in RESUME_KINDS})
  checks = dict.fromkeys(
    (f"source/{k}" for k in SOURCE_KINDS),
    check_grain_source_two_processes_uneven_shards_every_example_once,
  )
  checks.update(
    dict.fromkeys(
      (f"resume/{k}" for k in RESUME_KINDS),
      check_grain_resume_after_k_batches_continues_like_uninterrupted_run,
    )
  )
  check_cases(run_cases(2, 4, cases, timeout_s=240), checks)


def _examples(n):
  return grain.MapDataset.source(list(range(n))).map(ss.make_example)


def test_grain_dataloader_state_is_a_json_dict_not_bytes():
  ids = list(range(16))
  loader = grain.DataLoader(
    data_source=ids,
    sampler=grain.samplers.IndexSampler(
      num_records=16, shard_options=grain.sharding.NoSharding(), num_epochs=1
    ),
    operations=[grain.transforms.Batch(8)],
    worker_count=0,
  )
  with gjs.iter_jax_batches(loader, batch_size=8, prefetch_batches=0) as it:
    first = next(it)
    state = it.get_state()
  np.testing.assert_array_equal(np.asarray(first), np.arange(8))
  assert state["source"]["last_seen_indices"] == {"0": 7}
  json.dumps(state)
  with gjs.iter_jax_batches(loader, batch_size=8, prefetch_batches=0) as it:
    it.set_state(state)
    np.testing.assert_array_equal(np.asarray(next(it)), np.arange(8, 16))
    with pytest.raises(StopIteration):
      next(it)


class _Watched(grain.DatasetIterator):
  """Batches of 8 ids; records whether its state was asked for before its first read."""

  made: list["_Watched"] = []

  def __init__(self):
    super().__init__()
    self._i, self.read, self.state_before_read = 0, False, False
    _Watched.made.append(self)

  def __next__(self):
    if self._i == 24:
      raise StopIteration
    self.read = True
    self._i += 8
    return {"ids": np.arange(self._i - 8, self._i)}

  def get_state(self):
    self.state_before_read = self.state_before_read or not self.read
    return {"i": self._i}

  def set_state(self, state):
    self._i = state["i"]


class _WatchedDataset(grain.IterDataset):
  def __iter__(self):
    return _Watched()


@pytest.mark.parametrize("how", ["iter_jax_batches", "device_put"])
def test_grain_state_before_the_first_batch_fresh_for_iter_jax_batches_as_grains_for_device_put(
  how,
):
  # Grain 0.2.18's multiprocessing iterators start their workers one after
  # the other once their state is taken before their first `next()`.
  # `iter_jax_batches` asks a fresh iterator, so they start at once;
  # `device_put` asks the one it reads, as Grain's `device_put` does.
  _Watched.made.clear()
  theirs = iter(grain.experimental.device_put(_WatchedDataset(), None))
  next(theirs)
  theirs.close()
  assert len(_Watched.made) == 1 and _Watched.made[0].state_before_read  # Grain's way.
  _Watched.made.clear()
  ds = _WatchedDataset().map(lambda b: b)
  if how == "device_put":
    it = iter(gjs.device_put(ds, gjs.default_sharding()))
  else:
    it = gjs.iter_jax_batches(ds, batch_size=8)
  start = it.get_state()
  got = [np.asarray(b["ids"]).tolist() for b in it]
  it.set_state(start)
  again = [np.asarray(b["ids"]).tolist() for b in it]
  it.close()
  assert got == again == [list(range(k, k + 8)) for k in (0, 8, 16)]
  assert start["source"] == {"i": 0}
  read = [w for w in _Watched.made if w.read]
  made = [vars(w) for w in _Watched.made]
  if how == "device_put":
    assert len(_Watched.made) == 1 and read[0].state_before_read, made
  else:
    assert read and not any(w.state_before_read for w in read), made


def test_grain_mapdataset_is_read_in_index_order():
  ds = grain.MapDataset.range(32).map(lambda i: {"i": np.int64(i)}).batch(8)
  with gjs.iter_jax_batches(ds, batch_size=8) as it:
    got = [np.asarray(b["i"]).tolist() for b in it]
  assert got == [list(range(k, k + 8)) for k in range(0, 32, 8)]


@pytest.mark.parametrize("kind", ["map", "iter"])
def test_grain_unbatched_elements_raise_with_batch_hint(kind):
  ds = _examples(16)  # Elements with 0-d leaves: not batched.
  if kind == "iter":
    ds = ds.to_iter_dataset()
  it = gjs.iter_jax_batches(ds, batch_size=8)
  with it, pytest.raises(ValueError, match=r"column 'id': 0-d leaf.*Grain's `\.batch\(n\)`"):
    next(it)


def test_grain_elements_with_different_leading_sizes_raise_as_unbatched():
  ds = grain.MapDataset.range(4).map(
    lambda i: {"tokens": np.arange(8, dtype=np.int32), "label": np.arange(3)}
  )
  it = gjs.iter_jax_batches(ds, batch_size=8)
  with (
    it,
    pytest.raises(ValueError, match=r"different leading sizes.*look unbatched.*\.batch\(n\)"),
  ):
    next(it)
