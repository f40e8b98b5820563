"""The elastic source on real processes: a state taken on N hosts resumes on M hosts.

Each test chains jobs of different process counts (one `run_processes` call
per job) over one epoch; each job restores the previous job's states. Over the
whole chain every record that the transform keeps appears exactly once among
the unmasked rows, and every masked row is padding.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import check_each, run_cases

import grain_jax_sync as gjs
from grain_jax_sync._src.sources.elastic import source as source_lib
from grain_jax_sync._src.sources.elastic import split as es
from grain_jax_sync._src.sources.elastic import state as state_lib

N = 160

# The scenarios, one job per `run_processes` call. Records carry an id; the
# transform drops ids with ``id % 3 == 1`` and batches by `BATCH`.
BATCH = 4
PAD = -1


def keep(i: int) -> bool:
  return i % 3 != 1


def records(n: int) -> list[dict[str, Any]]:
  return [{"id": np.int64(i)} for i in range(n)]


def tokens(i: int) -> int:
  return 1 + i % 3


def pack_tokens(ds: Any, batch: int) -> Any:
  """Records as `tokens(id)` tokens of value ``id + 1`` (0 pads), packed `batch` bins at a time."""
  import grain

  ds = ds.filter(lambda r: keep(int(r["id"])))
  ds = ds.map(lambda r: {"tok": np.full(tokens(int(r["id"])), r["id"] + 1, np.int64)})
  # As many bins as rows per batch: every batch ends a packed batch (the cursor is exact).
  ds = grain.experimental.FirstFitPackIterDataset(
    ds, length_struct={"tok": 8}, num_packing_bins=batch
  )
  return ds.batch(batch)


def transform(ds: Any, batch: int = BATCH, workers: int = 0, pack: bool = False) -> Any:
  if pack:
    return pack_tokens(ds, batch)
  ds = ds.map(lambda r: {"id": r["id"], "x": np.float32(2 * r["id"])})
  ds = ds.filter(lambda r: keep(int(r["id"]))).batch(batch)
  if workers:  # Grain's multiprocess prefetch: each worker reads every `workers`-th record.
    import grain
    from absl import flags

    if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return ds


def make_iterator(
  n: int,
  *,
  shuffle: bool,
  seed: int = 5,
  num_epochs: int = 1,
  batch: int = BATCH,
  workers: int = 0,
  pack: bool = False,
) -> Any:
  import grain_jax_sync as gjs

  shaped = functools.partial(transform, batch=batch, workers=workers, pack=pack)
  src = gjs.elastic_source(records(n), shaped, shuffle=shuffle, seed=seed, num_epochs=num_epochs)
  return gjs.iter_jax_batches(src, batch_size=batch, paddings=PAD, mask_key="mask")


def gather(tree: Any) -> Any:
  import jax
  from jax.experimental import multihost_utils

  return jax.tree_util.tree_map(
    lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree
  )


def _json_states(directory: str, job: int) -> list[Any]:
  folder = os.path.join(directory, f"job{job}")
  names = sorted(os.listdir(folder), key=lambda s: int(s.split("_")[1].split(".")[0]))
  return [json.load(open(os.path.join(folder, name))) for name in names]


def elastic_job(
  job: int,
  n: int,
  steps: int | None,
  directory: str,
  mode: str,
  shuffle: bool = False,
  num_epochs: int = 1,
  workers: int = 0,
  pack: bool = False,
  stop_at: int | None = None,
) -> dict[str, Any]:
  """One job: restore the previous job's state, read `steps` global batches (None: all), save.

  With `stop_at`, the last process sends itself SIGTERM once it has read
  that many batches; its handler calls `request_stop()` (docs/multihost.md's
  recipe), and every host reads on until its stream ends.

  Returns:
    The global batches read ({"id", "x", "mask"} lists), the batch count
    the iterator resumed at, and the process whose request stopped it.
  """
  import jax
  import orbax.checkpoint as ocp

  import grain_jax_sync as gjs

  p = jax.process_index()
  it = make_iterator(n, shuffle=shuffle, num_epochs=num_epochs, workers=workers, pack=pack)
  mngr = ocp.CheckpointManager(os.path.join(directory, "ckpt")) if mode == "orbax" else None
  if job:
    if mngr is None:
      it.set_state(_json_states(directory, job - 1))
    else:
      mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data=gjs.checkpoint_restore(it)))
  resumed_at = it.get_state()["batches"]
  asker = stop_at is not None and p == jax.process_count() - 1
  if asker:
    previous = signal.signal(signal.SIGTERM, lambda *_: it.request_stop())
  out = []
  for b in it:
    g = gather(b)
    out.append({k: np.asarray(v).tolist() for k, v in g.items()})
    if asker and len(out) == stop_at:
      os.kill(os.getpid(), signal.SIGTERM)
    if steps is not None and len(out) == steps:
      break
  if asker:  # Later jobs run in these same processes.
    signal.signal(signal.SIGTERM, previous)
  if mngr is not None:
    mngr.save(job + 1, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))
    mngr.wait_until_finished()
    mngr.close()
  else:
    folder = os.path.join(directory, f"job{job}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"state_{p}.json"), "w") as f:
      json.dump(it.get_state(), f)
  it.close()
  return {"batches": out, "resumed_at": resumed_at, "stopped_by": it.stop_requested_by}


def refusals(n: int, directory: str) -> dict[str, str]:
  """The errors of states that do not fit, from a 1-process job's states, on 2 processes."""
  import grain_jax_sync as gjs

  states = _json_states(directory, 0)
  out = {}
  for name, kwargs in (("seed", {"seed": 6}), ("num_records", {"n": n + 1})):
    args = {"n": n, "shuffle": True, **kwargs}
    it = make_iterator(args.pop("n"), **args)
    try:
      it.set_state(states)
    except ValueError as e:
      out[name] = str(e)
    it.close()
  it = make_iterator(n, shuffle=True, num_epochs=1)
  mid_epoch = dict(states[0], source=dict(states[0]["source"], epoch=1))
  try:
    it.set_state([mid_epoch])
  except ValueError as e:
    out["epoch"] = str(e)
  it.close()
  # Not elastic: a Grain MapDataset split by hand.
  import grain
  import jax

  ds = grain.MapDataset.source(records(n))[jax.process_index() :: jax.process_count()]
  it = gjs.iter_jax_batches(
    transform(ds.to_iter_dataset()), batch_size=BATCH, paddings=PAD, mask_key="mask"
  )
  try:
    it.set_state(states)
  except ValueError as e:
    out["not_elastic"] = str(e)
  it.close()
  return out


@dataclasses.dataclass
class Chain:
  """Jobs of one scenario, in order: job k runs on ``counts[k]`` processes and reads ``steps[k]``.

  `kwargs` go to every `elastic_job` (`first` to job 0 only); with `then`, a
  last job runs that function instead, on ``then[1]`` processes.
  """

  counts: list[int]
  steps: list[int | None]
  mode: str = "json"
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  first: dict[str, Any] = dataclasses.field(default_factory=dict)
  n: int = N
  then: tuple[Any, int] | None = None


def chains() -> dict[str, Chain]:
  shuffled = {"shuffle": True}
  return {
    "resizes_json": Chain([2, 4, 2, 1, 2, 4, 3], [2, 1, 2, 3, 2, 1, None]),
    "resizes_orbax": Chain([2, 4, 2, 1, 2, 4, 3], [2, 1, 2, 3, 2, 1, None], "orbax"),
    "requested_stop": Chain([2, 3], [None, None], first={"stop_at": 3}, n=800),
    "shuffled_orbax": Chain([4, 1, 3], [2, 2, None], "orbax", shuffled),
    "two_epochs": Chain([4, 2], [2, None], kwargs={**shuffled, "num_epochs": 2}, n=40),
    "mp_prefetch": Chain([2, 2, 3], [2, 2, None], kwargs={**shuffled, "workers": 2}),
    "packing": Chain([2, 3], [2, None], "orbax", {**shuffled, "pack": True}),
    "refusals": Chain([1], [2], kwargs=shuffled, then=(refusals, 2)),
  }


def rounds(all_chains: dict[str, Chain]) -> list[tuple[int, dict[str, tuple]]]:
  """The chains' jobs packed into launches: each launch runs one job of several chains.

  Greedy in order: a chain's next job joins the first launch after its
  previous job's that has its process count, or a new launch at the end.
  """
  launches: list[tuple[int, dict[str, tuple]]] = []
  for name, chain in all_chains.items():
    jobs = [
      (
        count,
        (
          elastic_job,
          (k, chain.n, step, "{dir}/" + name, chain.mode),
          {**chain.kwargs, **(chain.first if k == 0 else {})},
        ),
      )
      for k, (count, step) in enumerate(zip(chain.counts, chain.steps, strict=True))
    ]
    if chain.then is not None:
      jobs.append((chain.then[1], (chain.then[0], (chain.n, "{dir}/" + name), {})))
    after = -1
    for count, job in jobs:
      at = next((i for i in range(after + 1, len(launches)) if launches[i][0] == count), None)
      if at is None:
        launches.append((count, {}))
        at = len(launches) - 1
      launches[at][1][name] = job
      after = at
  return launches


def run_chains(all_chains: dict[str, Chain], directory: str) -> dict[str, list[list[Any]]]:
  """Every chain's jobs, a few launches in all; per chain, each job's values per process."""
  out: dict[str, list[list[Any]]] = {name: [] for name in all_chains}
  for count, jobs in rounds(all_chains):
    cases = {
      name: (
        fn,
        tuple(a.replace("{dir}", directory) if isinstance(a, str) else a for a in args),
        kw,
      )
      for name, (fn, args, kw) in jobs.items()
    }
    values = run_cases(count, 1, cases, timeout_s=300)
    for name in jobs:
      out[name].append([v[name] for v in values])
  return out


def same_on_every_host(jobs: list[list[Any]]) -> list[Any]:
  """Each job's value, after checking that every host sees the same global batches."""
  for outs in jobs:
    assert all(o == outs[0] for o in outs)
  return [outs[0] for outs in jobs]


def check_exactly_once(jobs, counts, *, n=N, num_epochs=1):
  seen = []
  for job, count in zip(jobs, counts, strict=True):
    for b in job["batches"]:
      ids, x, mask = (np.asarray(b[k]) for k in ("id", "x", "mask"))
      assert ids.shape == (BATCH * count,)
      assert np.all(ids[~mask] == PAD) and np.all(x[~mask] == PAD)
      assert np.array_equal(x[mask], 2 * ids[mask])
      seen += ids[mask].tolist()
  expected = Counter({i: num_epochs for i in range(n) if keep(i)})
  assert Counter(seen) == expected
  # Each job resumes at the batch count the previous one reached.
  at = 0
  for job in jobs:
    assert job["resumed_at"] == at
    at += len(job["batches"])


def check_resizes_2_4_2_1_2_4_3_mid_epoch_every_record_once(jobs, tmp_path, mode):
  counts = [2, 4, 2, 1, 2, 4, 3]  # 2->4, 4->2, 2->1, 1->2, 2->4->3 (two resizes).
  steps = [2, 1, 2, 3, 2, 1, None]
  jobs = same_on_every_host(jobs)
  check_exactly_once(jobs, counts)
  for job, k in zip(jobs[:-1], steps[:-1], strict=True):
    assert len(job["batches"]) == k  # Every resize was mid-epoch.
  assert len(jobs[-1]["batches"]) > 1
  if mode == "json":
    state = json.loads((tmp_path / "job5" / "state_0.json").read_text())
  else:  # Job 5 (4 processes) saved step 6: one file per process, as Grain writes them.
    state = orbax_states(str(tmp_path), 6)[0]
    assert len(orbax_states(str(tmp_path), 6)) == 4
  assert [c for c, _ in state["source"]["splits"][0][1]] == [2, 4, 2, 1, 2]


def check_a_requested_stop_saves_one_position_that_resumes_on_another_count(jobs, tmp_path):
  # A SIGTERM handler on host 1 asks for the stop after its batch 3: both
  # hosts end at one batch and save; a job of 3 processes goes on from
  # there, and over both jobs every record is read once. The documented bound, k <= B <= k + 2R
  # (docs/guarantees.md section 10), counts `decide_ahead_s` of steps in R: the job has no step of
  # its own, so 2R is longer than its stream, and the stop is checked to land before the end.
  n = 800
  first, second = same_on_every_host(jobs)
  assert first["stopped_by"] == 1 and len(first["batches"]) >= 3
  assert second["stopped_by"] is None and second["batches"]  # Stopped before the end.
  check_exactly_once([first, second], [2, 3], n=n)


def orbax_states(directory, step):
  folder = os.path.join(directory, "ckpt", str(step), "data")
  files = sorted(f for f in os.listdir(folder) if f.endswith(".json"))
  return [json.loads(Path(folder, f).read_text()) for f in files]


def predicted(states, count, *, n=N, shuffle=True, seed=5):
  """The unmasked ids of each global batch after restoring `states` on `count` processes."""
  spec = source_lib.ElasticSource(records(n), transform, shuffle, seed, 1)
  olds, positions = [], []
  for s in states:
    epoch_shares, position, _ = state_lib.check_source_state(s["source"], spec, n)
    olds.append(epoch_shares)
    positions.append((position,))
  first, splits = es.resume(olds, positions)
  hosts = []
  for p in range(count):
    epoch_shares = es.EpochShares(n, 1, first, splits, count, p)
    order = es.epoch_order(n, shuffle=shuffle, seed=seed, epoch=0)
    ids = [int(order[epoch_shares.locate(j)[1]]) for j in range(epoch_shares.length)]
    ids = [i for i in ids if keep(i)]
    hosts.append([ids[k : k + BATCH] for k in range(0, len(ids), BATCH)])
  longest = max(len(h) for h in hosts)
  return [sum((h[b] for h in hosts if b < len(h)), []) for b in range(longest)]


def check_shuffled_resizes_4_1_3_through_orbax_follow_the_seed_and_history(jobs, tmp_path):
  counts = [4, 1, 3]
  jobs = same_on_every_host(jobs)
  check_exactly_once(jobs, counts)
  # Each resumed order is the one the seed and the resize history give.
  for job in (1, 2):
    want = predicted(orbax_states(str(tmp_path), job), counts[job])
    got = [[i for i, m in zip(b["id"], b["mask"]) if m] for b in jobs[job]["batches"]]
    assert got == want[: len(got)]
  assert len(jobs[2]["batches"]) == len(predicted(orbax_states(str(tmp_path), 2), counts[2]))
  # The first batch is shuffled, not in record order.
  first = [i for i, m in zip(jobs[0]["batches"][0]["id"], jobs[0]["batches"][0]["mask"]) if m]
  assert first != sorted(first)


def check_two_epochs_resized_while_hosts_straddle_the_epoch_boundary(jobs, tmp_path):
  n = 40  # 26 kept records: 4 hosts read ~7 each per epoch.
  counts = [4, 2]
  jobs = same_on_every_host(jobs)
  check_exactly_once(jobs, counts, n=n, num_epochs=2)
  epochs = {json.loads(f.read_text())["source"]["epoch"] for f in (tmp_path / "job0").iterdir()}
  assert epochs == {0, 1}  # Some hosts were still in epoch 0, others in epoch 1.


def check_mp_prefetch_workers_resume_on_the_same_count_then_resplit_2_3(jobs, tmp_path):
  # Two mp_prefetch workers per host, each reading every other record of the host's share.
  counts = [2, 2, 3]
  jobs = same_on_every_host(jobs)
  check_exactly_once(jobs, counts)
  for job in (0, 1):
    for f in (tmp_path / f"job{job}").iterdir():
      source = json.loads(f.read_text())["source"]
      assert source["resplittable"] is True and len(source["strided"]) == 2
      # The workers' thresholds differ (the filter drops records unevenly): not a prefix.
      assert source["position"] == min(source["strided"])
  assert any(
    len(set(json.loads(f.read_text())["source"]["strided"])) == 2
    for f in (tmp_path / "job1").iterdir()
  )


def check_packing_that_ends_a_packed_batch_with_each_batch_resplits_2_3_exactly(jobs, tmp_path):
  counts = [2, 3]
  jobs = same_on_every_host(jobs)
  seen = Counter()
  for job, count in zip(jobs, counts, strict=True):
    for b in job["batches"]:
      tok, mask = np.asarray(b["tok"]), np.asarray(b["mask"])
      assert tok.shape == (BATCH * count, 8)
      assert np.all(tok[~mask] == PAD)
      seen.update(int(t) - 1 for t in tok[mask].ravel() if t > 0)
  # Every kept record's tokens once (a record's tokens stay in one bin).
  assert seen == Counter({i: tokens(i) for i in range(N) if keep(i)})
  assert len(jobs[0]["batches"]) == 2 and jobs[1]["resumed_at"] == 2


def check_states_that_do_not_fit_raise_on_every_host_naming_the_field(jobs, tmp_path):
  same_on_every_host(jobs[:1])
  outs = jobs[1]  # The refusals, on 2 processes: each names its process.
  for p, out in enumerate(outs):
    assert out["seed"].startswith(f"process {p}: ")
    assert "`state['source']['seed']` is 5, but this elastic source has seed=6" in out["seed"]
    assert f"`state['source']['num_records']` is {N}" in out["num_records"]
    assert (
      "`state['source']['epoch']` is 1, but this elastic source has num_epochs=1" in (out["epoch"])
    )
    assert "cannot be re-split over another process count" in out["not_elastic"]
    assert "the states are from 1 processes, this job has 2" in out["not_elastic"]
    assert "elastic_source" in out["not_elastic"]


# -- every chain: a few launches in all, each chain with its own checks -------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_states_resume_on_other_process_counts_every_record_once(tmp_path):
  # Each job restores its chain's previous job's states; the chains' jobs of
  # one process count share a launch (`rounds`).
  jobs = run_chains(chains(), str(tmp_path))
  resizes = check_resizes_2_4_2_1_2_4_3_mid_epoch_every_record_once
  checks = {
    "resizes_json": functools.partial(resizes, mode="json"),
    "resizes_orbax": functools.partial(resizes, mode="orbax"),
    "requested_stop": check_a_requested_stop_saves_one_position_that_resumes_on_another_count,
    "shuffled_orbax": check_shuffled_resizes_4_1_3_through_orbax_follow_the_seed_and_history,
    "two_epochs": check_two_epochs_resized_while_hosts_straddle_the_epoch_boundary,
    "mp_prefetch": check_mp_prefetch_workers_resume_on_the_same_count_then_resplit_2_3,
    "packing": check_packing_that_ends_a_packed_batch_with_each_batch_resplits_2_3_exactly,
    "refusals": check_states_that_do_not_fit_raise_on_every_host_naming_the_field,
  }
  check_each(
    {name: functools.partial(check, jobs[name], tmp_path / name) for name, check in checks.items()}
  )


# -- one process ---------------------------------------------------------------------


def ids_of(it):
  return [i for b in it for i, m in zip(np.asarray(b["id"]), np.asarray(b["mask"])) if m]


def test_same_count_resume_is_grains_own_exact_resume_in_one_process():
  it = make_iterator(N, shuffle=True, batch=8)
  full = ids_of(it)
  it = make_iterator(N, shuffle=True, batch=8)
  head = ids_of(b for _, b in zip(range(3), it))
  state = it.get_state()
  it.close()
  assert state["source"]["grain"] == {
    "grain_jax_sync_elastic_stream": {"next_index": state["source"]["position"]}
  }
  for given in (state, [state]):  # One state, or the list of every process's.
    resumed = make_iterator(N, shuffle=True, batch=8)
    resumed.set_state(json.loads(json.dumps(given)))
    assert head + ids_of(resumed) == full
  assert sorted(full) == [i for i in range(N) if keep(i)]


def test_one_state_of_a_bigger_job_asks_for_the_list():
  it = make_iterator(N, shuffle=False, batch=8)
  state = dict(it.get_state(), process_count=2)
  with pytest.raises(ValueError, match="one process's state of a job of 2 processes.*the list"):
    it.set_state(state)
  it.close()


def test_a_list_on_the_same_count_restores_this_process_s_state_for_any_source():
  data = [{"x": np.full((8,), i, np.int32)} for i in range(6)]
  it = gjs.iter_jax_batches(data, batch_size=8)
  next(it)
  state = it.get_state()
  fresh = gjs.iter_jax_batches(data, batch_size=8)
  fresh.set_state([state])
  assert [int(np.asarray(b["x"])[0]) for b in fresh] == [1, 2, 3, 4, 5]
  with pytest.raises(ValueError, match=r"`state\[0\]` was taken by process 1 of 1"):
    fresh.set_state([dict(state, process_index=1)])
  it.close()
  fresh.close()


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"num_epochs": 0}, r"`num_epochs` must be a positive int or None \(forever\), got 0"),
    ({"seed": -1}, "`seed` must be an int >= 0, got -1"),
    ({"transform": 3}, "`transform` must be callable or None, got int"),
  ],
)
def test_elastic_source_checks_its_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    gjs.elastic_source(list(range(4)), **kwargs)
  with pytest.raises(ValueError, match="random-access sequence, got generator"):
    gjs.elastic_source(i for i in range(4))


def _two_process_copies(state):
  """`state` as if every process of a 2-process job had saved it (for the checks only)."""
  return [
    dict(
      state,
      process_index=i,
      process_count=2,
      source=dict(state["source"], process_index=i, process_count=2),
    )
    for i in range(2)
  ]


def test_thread_prefetch_keeps_the_cursor_exact_and_packing_mid_packed_batch_refuses_a_resplit():
  grain_exp = pytest.importorskip("grain.experimental")
  recs = [{"id": np.int64(i), "tok": np.arange(1 + i % 5, dtype=np.int32)} for i in range(64)]

  def threaded(ds):
    ds = ds.map(lambda r: {"id": r["id"]}).batch(8)
    return grain_exp.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=4)

  it = gjs.iter_jax_batches(gjs.elastic_source(recs, threaded), batch_size=8)
  for _ in range(3):
    next(it)
  state = it.get_state()
  it.close()
  assert (state["source"]["position"], state["source"]["resplittable"]) == (24, True)

  def packed(ds, bins):
    ds = ds.map(lambda r: {"tok": r["tok"], "id": np.full(len(r["tok"]), r["id"])})
    lengths = {"tok": 8, "id": 8}
    return grain_exp.FirstFitPackIterDataset(
      ds, length_struct=lengths, num_packing_bins=bins
    ).batch(8)

  # 3 bins, batches of 8 rows: the first batch ends within the third packed batch.
  src = gjs.elastic_source(recs, functools.partial(packed, bins=3))
  it = gjs.iter_jax_batches(src, batch_size=8)
  next(it)
  state = it.get_state()
  it.close()
  assert state["source"]["resplittable"] is False
  assert "next_row=2" in state["source"]["why_not_resplittable"]
  it = gjs.iter_jax_batches(src, batch_size=8)
  with pytest.raises(ValueError, match=r"`state\[0\]\['source'\]` cannot be re-split.*packing"):
    it.set_state(_two_process_copies(state))
  it.close()
  # 2 bins: each batch of 8 rows ends a packed batch; its cursor is exact.
  it = gjs.iter_jax_batches(
    gjs.elastic_source(recs, functools.partial(packed, bins=2)), batch_size=8
  )
  ids = np.asarray(next(it)["id"])
  state = it.get_state()
  it.close()
  assert state["source"]["resplittable"] is True
  # The cursor is past the records packed into the batch, before the next one's.
  assert state["source"]["position"] == int(ids.max()) + 1


def test_a_transform_that_drops_the_records_stream_is_named():
  import grain

  src = gjs.elastic_source(
    list(range(8)), lambda ds: grain.MapDataset.range(8).batch(8).to_iter_dataset()
  )
  it = gjs.iter_jax_batches(src, batch_size=8)
  next(it)
  with pytest.raises(RuntimeError, match="does not hold its stream's position"):
    it.get_state()
  it.close()
  with pytest.raises(ValueError, match="`transform` must return a grain.IterDataset, got list"):
    gjs.iter_jax_batches(gjs.elastic_source(list(range(8)), lambda ds: [1]), batch_size=8)


def test_one_state_of_another_count_for_a_non_elastic_source_points_to_elastic_source():
  data = [{"x": np.full((8,), i, np.int32)} for i in range(3)]
  it = gjs.iter_jax_batches(data, batch_size=8)
  state = dict(it.get_state(), process_count=2)
  with pytest.raises(ValueError, match=r"process_count=2.*cannot be re-split.*elastic_source"):
    it.set_state(state)
  it.close()


def test_sequential_mp_prefetch_resumes_on_the_same_count_and_refuses_a_resplit():
  import grain
  from absl import flags

  if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags.
    flags.FLAGS.mark_as_parsed()

  def blocks(ds):  # Each worker reads a block of the stream, not every other record.
    ds = transform(ds, batch=8)
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2), sequential_slice=True)

  src = gjs.elastic_source(records(64), blocks)
  # One uninterrupted read (its state taken after 3 batches), then a resume from that state.
  it = gjs.iter_jax_batches(src, batch_size=8, paddings=PAD, mask_key="mask")
  head = ids_of(b for _, b in zip(range(3), it))
  state = json.loads(json.dumps(it.get_state()))
  full = head + ids_of(it)
  it.close()
  assert len(head) > 0 and sorted(full) == [i for i in range(64) if keep(i)]
  assert state["source"]["resplittable"] is False
  it = gjs.iter_jax_batches(src, batch_size=8, paddings=PAD, mask_key="mask")
  it.set_state(state)
  assert head + ids_of(it) == full  # Grain's own state: exact on the same count.
  with pytest.raises(ValueError, match=r"cannot be re-split.*sequential_slice=True"):
    it.set_state(_two_process_copies(state))
  it.close()


def test_num_epochs_none_repeats_forever_each_epoch_shuffled_anew_and_resumes():
  kept = [i for i in range(20) if keep(i)]  # 13 records, batches of 8 straddle epochs.
  it = make_iterator(20, shuffle=True, num_epochs=None, batch=8)
  head = ids_of(b for _, b in zip(range(2), it))
  state = json.loads(json.dumps(it.get_state()))
  tail = ids_of(b for _, b in zip(range(3), it))
  it.close()
  assert state["source"]["num_epochs"] is None and state["source"]["epoch"] == 1
  seen = head + tail
  epochs = [seen[k : k + len(kept)] for k in range(0, 3 * len(kept), len(kept))]
  assert all(sorted(e) == kept for e in epochs) and epochs[0] != epochs[1]
  resumed = make_iterator(20, shuffle=True, num_epochs=None, batch=8)
  resumed.set_state(state)
  assert ids_of(b for _, b in zip(range(3), resumed)) == tail
  resumed.close()


# -- a fixed global batch across a resize (in one process) ------------------------


def batched(batch_size: int) -> gjs.ElasticSource:
  return gjs.elastic_source(records(N), lambda ds: ds.batch(batch_size), shuffle=True, seed=5)


@pytest.mark.parametrize(("count", "batch_size"), [(1, 16), (4, 4), (2, 8), (2, 4)])
def test_a_resume_on_m_hosts_may_change_batch_size_to_keep_the_global_batch(count, batch_size):
  import lm_jobs

  head, states = lm_jobs.play(batched(8), 2, 3, batch_size=8)  # Global batch 16 on 2 hosts.
  rest, _ = lm_jobs.play(batched(batch_size), count, None, states, batch_size=batch_size)
  ids = [int(i) for job in (head, rest) for per in job for b in per for i in b["id"]]
  assert sorted(ids) == list(range(N))  # Every record exactly once.
  steps = max(len(per) for per in rest)
  global_rows = [sum(len(per[t]["id"]) for per in rest if t < len(per)) for t in range(steps)]
  assert global_rows[:-1] == [count * batch_size] * (steps - 1) and global_rows[-1] <= 16


def test_iter_jax_batches_resumes_2_hosts_of_batch_8_on_1_host_of_batch_16():
  import lm_jobs

  head, states = lm_jobs.play(batched(8), 2, 3, batch_size=8)
  with gjs.iter_jax_batches(batched(16), batch_size=16, paddings=0, mask_key="mask") as it:
    it.set_state(states)
    rest = list(it)
  assert all(b["id"].shape == (16,) for b in rest)
  ids = [int(i) for per in head for b in per for i in b["id"]]
  ids += [int(i) for b in rest for i, m in zip(b["id"], b["mask"], strict=True) if m]
  assert sorted(ids) == list(range(N))
  one = {**states[0], "process_count": 1}
  with (
    gjs.iter_jax_batches(batched(16), batch_size=16, paddings=0, mask_key="mask") as it,
    pytest.raises(ValueError, match="changes its batch size from the list of every old"),
  ):
    it.set_state(one)
  with (
    gjs.iter_jax_batches(batched(16), batch_size=16, paddings=-1, mask_key="mask") as it,
    pytest.raises(ValueError, match=r"other settings \(.*paddings: '0' vs '-1'"),
  ):
    it.set_state(states)  # Another setting beside `batch_size` is still refused.
