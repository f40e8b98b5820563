"""device_put: the grain.experimental.device_put drop-in with agreement."""

import inspect
import json
import os
import sys
import time
from typing import Any

import grain
import jax
import numpy as np
import pytest
import scenarios_dropin as ss_dropin
import scenarios_sources as ss
from helpers import check_cases, run_cases

import grain_jax_sync as gjs
from grain_jax_sync import testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.timed_endings import bound  # noqa: E402 - the repository root, from any directory.

SIZES = [13, 6]
PADDED = {"batch_size": 4, "paddings": -1, "mask_key": "mask"}


def run_device_put(sizes: list[int], kwargs: dict[str, Any]) -> dict[str, Any]:

  ds = gjs.device_put(ss.grain_source("iterdataset", sizes), gjs.default_sharding(), **kwargs)

  it = iter(ds)
  batches = [ss.gather(b) for b in it]
  out = ss.summarize(batches)
  out["is_grain"] = isinstance(ds, grain.IterDataset) and isinstance(it, grain.DatasetIterator)
  return out


def check_device_put_two_processes_uneven_shards_every_example_once(outs):
  assert outs[0] == outs[1]
  out = outs[0]
  assert out["is_grain"]  # A grain.IterDataset whose iterator is a DatasetIterator.
  assert out["consistent"]
  real = [i for ids, m in zip(out["ids"], out["mask"]) for i, ok in zip(ids, m) if ok]
  assert sorted(real) == list(range(sum(SIZES)))
  assert len(out["ids"]) == 4


def check_device_put_resume_after_k_batches_continues_like_uninterrupted_run(outs):
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


def _counted(n):
  """A MapDataset of n 8-row batches that counts the elements read (no read-ahead of its own)."""
  read = []

  def make(i):
    read.append(i)
    return {"x": np.full(8, i, np.int32)}

  ds = grain.MapDataset.range(n).map(make)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)), read


def _settled(read, want, deadline_s=10.0):
  """How many elements are read once the pipeline stops reading (its buffers full).

  Distinct elements, should one be read twice.
  """
  end = time.monotonic() + deadline_s
  while len(set(read)) < want and time.monotonic() < end:
    time.sleep(0.01)
  time.sleep(0.2)  # Nothing more comes once both buffers are full.
  return len(set(read))


@pytest.mark.parametrize(("cpu", "device"), [(1, 1), (4, 2), (2, 5), (0, 2), (3, 0)])
def test_device_put_reads_ahead_at_most_its_two_buffer_sizes(cpu, device):
  # As Grain's: each stage holds its buffer and one more in its thread's
  # hand, so `cpu_buffer_size + 1` read and not yet built (the one being
  # built included) and `device_buffer_size + 1` built ahead of the consumer
  # (one fewer where a stage has no buffer, and so no thread).
  ahead = cpu + device + (cpu > 0) + (device > 0)
  ds, read = _counted(40)
  it = iter(gjs.device_put(ds, cpu_buffer_size=cpu, device_buffer_size=device))
  theirs, read_theirs = _counted(40)
  grains = iter(
    grain.experimental.device_put(theirs, None, cpu_buffer_size=cpu, device_buffer_size=device)
  )
  for k in range(1, 4):
    assert np.asarray(next(it)["x"]).tolist() == [k - 1] * 8
    next(grains)
    assert _settled(read, k + ahead) == k + ahead
    assert _settled(read_theirs, k + ahead) == k + ahead  # The same.
  assert [int(np.asarray(b["x"])[0]) for b in it] == list(range(3, 40))
  it.close()
  grains.close()


def test_device_put_iterator_stats_are_those_of_its_batches():
  it = iter(gjs.device_put(_batches(n=40).to_iter_dataset(), gjs.default_sharding()))
  assert it.stats() is None  # Nothing read yet: stats() reads nothing either.
  for _ in range(3):
    next(it)
  stats = it.stats()
  assert (stats["batches"], stats["real_rows"], stats["padded_rows"]) == (3, 24, 0)
  assert it.stats(all_hosts=True)["hosts"][0]["batches"] == 3
  it.close()
  plain = iter(gjs.device_put(grain.MapDataset.range(4).to_iter_dataset(), None))
  assert int(next(plain)) == 0
  assert plain.stats() is None  # Unbatched elements, placed one by one.
  plain.close()


def test_device_put_checks_iter_jax_batches_arguments_up_front():
  with pytest.raises(ValueError, match=r"`batch_size` must be divisible by the 8 local devices"):
    gjs.device_put(_batches().to_iter_dataset(), batch_size=6, paddings=0)


def test_device_put_refuses_prefetch_batches_its_device_buffer_size_stands_for():
  with pytest.raises(
    TypeError, match=r"device_put\(\) got an unexpected keyword argument .prefetch_batches."
  ):
    gjs.device_put(_batches().to_iter_dataset(), prefetch_batches=1)


def test_device_put_rejects_non_grain_datasets():
  with pytest.raises(
    ValueError,
    match=r"`ds` must be a grain.IterDataset or grain.MapDataset, or a Hugging Face source, got list",
  ):
    gjs.device_put([np.arange(8)])


# -- everything Grain's device_put accepts on one process -----------------------------


class _PlainIterator:
  """Batches of 8 ids from an `IterDataset` whose iterator is no Grain `DatasetIterator`."""

  def __init__(self):
    self.i = 0

  def __iter__(self):
    return self

  def __next__(self):
    if self.i == 32:
      raise StopIteration
    self.i += 8
    return {"x": np.arange(self.i - 8, self.i)}

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]


class _PlainDataset(grain.IterDataset):
  def __iter__(self):
    return _PlainIterator()


def test_device_put_reads_an_iter_dataset_whose_iterator_is_not_grains_as_grain_does():
  # Grain's device_put reads it through its prefetch, which takes any
  # iterator with get_state; ours failed building its iterator.
  want = [np.asarray(b["x"]).tolist() for b in grain.experimental.device_put(_PlainDataset(), None)]
  assert want == [list(range(k, k + 8)) for k in (0, 8, 16, 24)]
  it = iter(gjs.device_put(_PlainDataset(), gjs.default_sharding()))
  got = [np.asarray(next(it)["x"]).tolist()]
  state = it.get_state()
  got += [np.asarray(b["x"]).tolist() for b in it]
  it.set_state(state)
  again = [np.asarray(b["x"]).tolist() for b in it]
  it.close()
  assert got == want
  assert again == want[1:]
  unread = iter(gjs.device_put(_PlainDataset(), gjs.default_sharding()))
  unread.close()  # The parent has no close(): nothing to close, nothing raised.


def _grain_and_ours(ds, device, **ours_kwargs):
  """Grain's device_put and ours over the same dataset: lists of elements."""
  theirs = iter(grain.experimental.device_put(ds, device, cpu_buffer_size=0, device_buffer_size=0))
  want = list(theirs)
  theirs.close()
  got = list(iter(gjs.device_put(ds, device, **ours_kwargs)))
  return want, got


def _assert_same_placement(want, got):
  assert len(want) == len(got)
  for w, g in zip(want, got, strict=True):
    assert jax.tree_util.tree_structure(w) == jax.tree_util.tree_structure(g)
    for a, b in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(g), strict=True):
      assert isinstance(b, jax.Array)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      assert a.dtype == b.dtype and a.shape == b.shape
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def _records(n=6):
  return grain.MapDataset.range(n).map(
    lambda i: {"label": np.int32(i), "image": np.full((3, 2), i, np.float32)}
  )


@pytest.mark.parametrize(
  "device",
  [
    pytest.param(lambda: jax.devices()[3], id="device"),
    pytest.param(lambda: jax.sharding.SingleDeviceSharding(jax.devices()[1]), id="sharding"),
    pytest.param(lambda: None, id="none"),
  ],
)
def test_device_put_unbatched_records_placed_as_grains(device):
  want, got = _grain_and_ours(_records().to_iter_dataset(), device())
  _assert_same_placement(want, got)
  assert [int(g["label"]) for g in got] == list(range(6))


def test_device_put_unbatched_scalars_placed_as_jax_device_put():
  want, got = _grain_and_ours(grain.MapDataset.range(5).to_iter_dataset(), jax.devices()[2])
  _assert_same_placement(want, got)
  assert [int(g) for g in got] == list(range(5))


def test_device_put_unbatched_elements_with_a_mesh_are_replicated():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  got = list(iter(gjs.device_put(_records(3).to_iter_dataset(), mesh)))
  assert got[2]["image"].sharding == jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  np.testing.assert_array_equal(np.asarray(got[2]["image"]), np.full((3, 2), 2, np.float32))


def test_device_put_pytree_of_shardings_placed_as_grains():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  device = {
    "x": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    "y": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
  }
  ds = grain.MapDataset.range(32).map(lambda i: {"x": np.int32(i), "y": np.float32(i)}).batch(8)
  want, got = _grain_and_ours(ds.to_iter_dataset(), device)
  _assert_same_placement(want, got)
  assert got[1]["y"].sharding.spec == jax.sharding.PartitionSpec()


def test_device_put_pytree_of_one_sharding_builds_agreed_global_batches():
  sharding = gjs.default_sharding()
  ds = _batches(16).to_iter_dataset()
  got = list(iter(gjs.device_put(ds, {"x": sharding}, batch_size=8, paddings=0, mask_key="m")))
  assert [np.asarray(b["x"]).tolist() for b in got] == [list(range(8)), list(range(8, 16))]
  assert got[0]["m"].sharding == sharding


def test_device_put_none_places_batches_as_grains_on_the_default_device():
  # `device=None` is `jax.device_put`'s default device, uncommitted: batches
  # of 2 rows on 8 devices work, as with Grain; left unset, the default mesh.
  ds = grain.MapDataset.range(8).map(lambda i: {"x": np.full((3,), i, np.int32)}).batch(2)
  want, got = _grain_and_ours(ds.to_iter_dataset(), None)
  _assert_same_placement(want, got)
  assert not got[0]["x"].committed and got[0]["x"].devices() == {jax.devices()[0]}
  assert [np.asarray(b["x"])[:, 0].tolist() for b in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
  unset = next(iter(gjs.device_put(_batches(16).to_iter_dataset())))
  assert unset["x"].sharding.is_equivalent_to(gjs.default_sharding(), 1)


def test_device_put_pytree_with_none_leaves_placed_as_grains():
  sharding = gjs.default_sharding()
  ds = grain.MapDataset.range(16).map(lambda i: (np.int32(i), np.float32(i))).batch(8)
  want, got = _grain_and_ours(ds.to_iter_dataset(), (sharding, None))
  _assert_same_placement(want, got)
  assert got[0][0].sharding == sharding and got[0][1].devices() == {jax.devices()[0]}


def test_device_put_none_refuses_batch_options_naming_why():
  it = iter(gjs.device_put(_batches(16).to_iter_dataset(), None, batch_size=8, paddings=0))
  with pytest.raises(ValueError, match=r"`paddings` need global batches, but `device` is None"):
    next(it)
  with pytest.raises(ValueError, match=r"pass `device`, or `mesh`/`sharding`/`data_axes`"):
    gjs.device_put(_batches(16).to_iter_dataset(), None, mesh=gjs.default_mesh())


def test_device_put_unbatched_elements_refuse_batch_options_naming_them():
  ds = _records().to_iter_dataset()
  it = iter(gjs.device_put(ds, jax.devices()[0], batch_size=8, paddings=0, mask_key="m"))
  with pytest.raises(
    ValueError,
    match=r"`paddings`, `mask_key` need global batches, but the first element is unbatched"
    r" \(it has a scalar \(0-d\) leaf\).*Batch the dataset first",
  ):
    next(it)


def test_device_put_unbatched_state_resumes_in_grains_format():
  ds = _records(6).to_iter_dataset()
  it = iter(gjs.device_put(ds, jax.devices()[0]))
  head = [int(next(it)["label"]) for _ in range(2)]
  state = json.loads(json.dumps(it.get_state()))
  assert head == [0, 1] and state["batches"] == 2
  again = iter(gjs.device_put(ds, jax.devices()[0]))
  again.set_state(state)
  assert [int(e["label"]) for e in again] == [2, 3, 4, 5]
  theirs = iter(grain.experimental.device_put(ds, jax.devices()[0]))
  next(theirs)
  grain_state = theirs.get_state()
  theirs.close()
  again = iter(gjs.device_put(ds, jax.devices()[0]))
  again.set_state(grain_state)  # Grain's own format: its parent's state.
  assert [int(e["label"]) for e in again] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("restored", [False, True])
def test_device_put_makes_each_element_once_the_first_handed_on_not_read_again(restored):
  # Rewinding the source after the read that chooses the mode would drop
  # what Grain's threads or workers read ahead, and make it again.
  ds, read = _counted(12)
  it = iter(gjs.device_put(ds))
  if restored:
    it.set_state({"next_index": 4})  # As Grain's own `device_put` saved it.
  got = [int(np.asarray(b["x"])[0]) for b in it]
  start = 4 if restored else 0
  assert got == read == list(range(start, 12))


def test_device_put_restores_a_checkpoint_written_by_grains_device_put():
  ds = _batches(40).to_iter_dataset()
  theirs = iter(grain.experimental.device_put(ds, jax.devices()[0]))
  head = [np.asarray(next(theirs)["x"]).tolist() for _ in range(2)]
  grain_state = json.loads(json.dumps(theirs.get_state()))
  theirs.close()
  assert head == [list(range(8)), list(range(8, 16))] and grain_state == {"next_index": 2}
  ours = iter(gjs.device_put(ds, gjs.default_sharding(), batch_size=8, paddings=0, mask_key="m"))
  ours.set_state(grain_state)
  rest = list(ours)
  assert [np.asarray(b["x"]).tolist() for b in rest] == [
    list(range(k, k + 8)) for k in range(16, 40, 8)
  ]
  assert ours.get_state()["source"] == {"next_index": 5}


def test_device_put_source_error_ends_the_stream_where_grains_reads_on():
  def record(i):
    if i == 12:
      raise KeyError("bad record 12")
    return {"x": np.int32(i)}

  def run(put):
    it = iter(put(grain.MapDataset.range(32).map(record).batch(8), gjs.default_sharding()))
    first = np.asarray(next(it)["x"]).tolist()
    with pytest.raises(KeyError, match="bad record 12"):
      next(it)
    after = next(it, None)
    it.close()
    return first, None if after is None else np.asarray(after["x"]).tolist()

  # Grain's next() reads on past the failing batch; ours ends there, as every
  # ending (on every host), until set_state().
  assert run(grain.experimental.device_put) == (list(range(8)), list(range(16, 24)))
  assert run(gjs.device_put) == (list(range(8)), None)


def test_device_put_warns_once_for_paddings_without_mask_key(caplog):
  with caplog.at_level("WARNING", logger="grain_jax_sync"):
    ds = gjs.device_put(_batches(16).to_iter_dataset(), batch_size=8, paddings=0)
    list(iter(ds))
    list(iter(ds))
  assert caplog.text.count("indistinguishable from real rows") == 1


# -- several processes ------------------------------------------------------------------


def check_device_put_two_processes_grain_checkpoint_and_unbatched_elements(outs):
  for p, out in enumerate(outs):
    # Grain's own iterator saved its parent's state; ours resumes from it.
    assert out["grain_state"] == {"next_index": 2}
    assert out["grain_head"] == [[1000 * p + i for i in range(k, k + 8)] for k in (0, 8)]
    assert len(out["full"]) == 5 and out["resumed"] == out["full"][2:]
    assert out["state_after"] == {"next_index": 5}
    # Unbatched elements on several processes: the same error on every host.
    assert out["unbatched"]["error_type"] == "ValueError"
    assert "0-d leaf" in out["unbatched"]["error"]
    assert "Batch the elements first" in out["unbatched"]["error"]
    assert out["pytree_error"].startswith("ValueError: `device` is a pytree of 2 different")
    assert out["none"] == out["full"]
    assert out["none_default"]
    assert out["none_leaf"] is None
    # A sharding over every host: Grain's needs the same element on each host;
    # ours reads each host's element as its own rows (docs/sources.md).
    if jax.__version_info__ >= (0, 10):  # Run from 0.10 (scenarios_dropin says why).
      assert "passed to device_put is not the same on each process" in out["grain_own_rows"]
    assert out["grain_same"] == list(range(8))
    assert out["ours_same"] == [*range(8), *range(8)]
  assert outs[0]["unbatched"]["error"] == outs[1]["unbatched"]["error"]
  full = outs[0]["full"]
  assert full[0] == [*range(8), *range(1000, 1008)]


def test_device_put_without_batch_size_pads_to_the_first_batch():
  ds = gjs.device_put(_batches(36).to_iter_dataset(), paddings=-1, mask_key="m")
  got = list(iter(ds))
  assert [b["x"].shape for b in got] == [(8,)] * 5
  assert np.asarray(got[4]["x"]).tolist() == [32, 33, 34, 35, -1, -1, -1, -1]
  assert np.asarray(got[4]["m"]).tolist() == [True] * 4 + [False] * 4


# -- an agreed stop ---------------------------------------------------------------------


def _worker_pipeline(p: int, records: int, workers: int) -> Any:
  """Host `p`'s batches of 8 records ``1000 p + i``, read by `workers` Grain worker processes."""
  from absl import flags

  if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags.
    flags.FLAGS.mark_as_parsed()
  ds = grain.MapDataset.range(records).map(lambda i: {"x": np.int32(1000 * p + i)}).batch(8)
  ds = ds.to_iter_dataset()
  return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else ds


def _host_first(batch: Any) -> int:
  """This host's first row (no collective: the peers may have stopped iterating)."""
  shard = min(batch["x"].addressable_shards, key=lambda s: s.index[0].start or 0)
  return int(np.asarray(shard.data)[0])


@pytest.mark.timeout(120)
def test_device_put_over_two_worker_processes_yields_every_batch_in_order_and_resumes():
  # Its state taken first, Grain starts the workers one after the other:
  # every batch once, in Grain's order, and a resume in the middle.
  def firsts(it, n=None):
    out = []
    for b in it:
      out.append(int(np.asarray(b["x"])[0]))
      if len(out) == n:
        break
    return out

  it = iter(gjs.device_put(_worker_pipeline(0, 80, 2), gjs.default_sharding()))
  head = firsts(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  again = iter(gjs.device_put(_worker_pipeline(0, 80, 2), gjs.default_sharding()))
  again.set_state(state)
  tail = firsts(again)
  again.close()
  assert head + tail == list(range(0, 80, 8)) and state["batches"] == 3


def stop_device_put_on_sigterm(asker: int, after: int, records: int, directory: str) -> dict:
  """`asker`'s SIGTERM handler calls `request_stop()` after its batch `after`; saved and
  restored through Orbax and Grain's handler, over Grain worker processes."""
  import signal

  import orbax.checkpoint as ocp

  p = jax.process_index()
  full = [int(b["x"][0]) for b in _worker_pipeline(p, records, 0)]  # The uninterrupted stream.
  it = iter(gjs.device_put(_worker_pipeline(p, records, 1), batch_size=8))
  previous = signal.signal(signal.SIGTERM, lambda *_: it.request_stop())
  rows = []
  try:
    for batch in it:
      rows.append(_host_first(batch))
      if p == asker and len(rows) == after:
        os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.01)
  finally:
    signal.signal(signal.SIGTERM, previous)
  by, batches = it.stop_requested_by, it.get_state()["batches"]
  mngr = ocp.CheckpointManager(directory)
  mngr.save(batches, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  mngr.wait_until_finished()
  mngr.close()
  it.close()
  fresh = iter(gjs.device_put(_worker_pipeline(p, records, 1), batch_size=8))
  mngr = ocp.CheckpointManager(directory)
  mngr.restore(batches, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
  mngr.close()
  resumed = [_host_first(b) for b in fresh]
  fresh.close()
  return {"full": full, "rows": rows, "batches": batches, "by": by, "resumed": resumed}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_device_put_two_processes_every_example_once_resumes_and_checkpoints_through_grain():
  # One launch runs the three scenarios in turn; each case's own checks.
  cases = {
    "uneven_shards": (run_device_put, (SIZES, PADDED), {}),
    "resume_after_k": (ss.resume, ("device_put", SIZES, 2, PADDED), {}),
    "grain_checkpoint_and_unbatched": (ss_dropin.run_device_put_cases, (40, 8, 2), {}),
  }
  check_cases(
    run_cases(2, 4, cases, timeout_s=240),
    {
      "uneven_shards": check_device_put_two_processes_uneven_shards_every_example_once,
      "resume_after_k": check_device_put_resume_after_k_batches_continues_like_uninterrupted_run,
      "grain_checkpoint_and_unbatched": (
        check_device_put_two_processes_grain_checkpoint_and_unbatched_elements
      ),
    },
  )


@pytest.mark.multiprocess
def test_device_put_request_stop_from_sigterm_ends_every_host_at_one_batch_and_resumes(tmp_path):
  # 4 x 2, Grain worker processes: a SIGTERM handler's request_stop() on host 2
  # after its batch 3 ends every host at one batch, names host 2 everywhere,
  # and Orbax through Grain's handler resumes each host exactly after it.
  outs = testing.values(
    testing.run_processes(
      stop_device_put_on_sigterm,
      num_processes=4,
      devices_per_process=2,
      args=(2, 3, 8 * 40, str(tmp_path / "ckpt")),
      timeout_s=240,
    )
  )
  stopped_at = outs[0]["batches"]
  # k <= B <= k + 2R (docs/guarantees.md section 10) at the loop's step of at least 10 ms and
  # device_put's prefetch (`device_buffer_size` + 1 = 3): 2R is longer than the 40 batches.
  most = bound(3, 0.01)
  assert 3 + most.batches > 40 and 3 <= stopped_at < 40, (stopped_at, most)
  for p, o in enumerate(outs):
    assert o["full"] == [1000 * p + 8 * i for i in range(40)]
    assert (o["batches"], o["by"]) == (stopped_at, 2)
    assert o["rows"] == o["full"][:stopped_at]
    assert o["resumed"] == o["full"][stopped_at:]


def test_device_put_request_stop_before_the_first_batch_then_set_state_starts_untouched():
  # Asked before the iterator exists inside: it still ends the stream (one
  # process: at most the read-ahead); a restored state starts a stream no
  # request touched.
  it = iter(gjs.device_put(_batches(200).to_iter_dataset(), batch_size=8))
  start = it.get_state()
  it.request_stop()
  got = [int(np.asarray(b["x"])[0]) for b in it]
  assert it.stop_requested_by == 0 and got == list(range(0, 8 * len(got), 8)) and len(got) < 12
  it.set_state(start)
  assert it.stop_requested_by is None
  assert [int(np.asarray(b["x"])[0]) for b in it] == list(range(0, 200, 8))
  it.close()
