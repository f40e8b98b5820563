"""Nothing lost, nothing duplicated: real Grain pipelines across 2 and 4 processes.

Records ``0..N-1`` are sharded unevenly over the processes, two ways: uneven
contiguous `MapDataset` slices (203 records: different batch counts and a short
last batch per process), and a `DataLoader` with Grain's `ShardOptions` (204
records: every process ends with a short batch; 204 because Grain 0.2.18's
`ShardOptions(drop_remainder=False)` itself leaves out records when the count
does not divide by the shard count). With `paddings` and `mask_key`, the union of
unmasked rows over every batch and process is the dataset, each record once.
With `drop_last`, the rows yielded are exactly the documented ones: every
process stops when any runs out, and a position where any process's batch is
shorter than `batch_size` is dropped on every process.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import scenarios_faults
from helpers import check_each

from grain_jax_sync import testing

TOPOLOGIES = [pytest.param(2, 4, id="2x4"), pytest.param(4, 2, id="4x2")]
TIMEOUT = 150
NUM_RECORDS = {"map_slices": 203, "loader": 204}
BATCH = 8
KINDS = ["map_slices", "loader"]
MODES = {
  "padded": {"batch_size": BATCH, "paddings": -1, "mask_key": "mask"},
  "drop_last": {"batch_size": BATCH, "drop_last": True},
}
CASES = [(kind, mode) for kind in KINDS for mode in MODES]

_RUNS: dict = {}


def _outs(n, d, kind, mode):
  """Every process's outcome for one case (one run per topology, failure kept)."""
  if (n, d) not in _RUNS:
    cases = [
      {"kind": k, "num_records": NUM_RECORDS[k], "batch": BATCH, "kwargs": MODES[m]}
      for k, m in CASES
    ]
    try:
      outcomes = testing.run_processes(
        scenarios_faults.run_conservation,
        num_processes=n,
        devices_per_process=d,
        args=(cases,),
        timeout_s=TIMEOUT,
      )
      per_process = testing.values(outcomes)
      _RUNS[(n, d)] = {c: [per_process[p][i] for p in range(n)] for i, c in enumerate(CASES)}
    except Exception as e:  # noqa: BLE001 - re-raised by every reader.
      _RUNS[(n, d)] = e
  if isinstance(_RUNS[(n, d)], Exception):
    raise _RUNS[(n, d)]
  outs = _RUNS[(n, d)][(kind, mode)]
  for out in outs:
    assert out["error"] is None, out["error"]
    assert out["elapsed_s"] < 60
  return outs


def _local_batches(kind, n):
  """Each process's source batches of ids, built here with the same Grain code."""
  local = [
    [b["id"] for b in scenarios_faults.grain_shard(kind, p, n, NUM_RECORDS[kind], BATCH)]
    for p in range(n)
  ]
  # The shards partition the dataset (a check of the set-up, not the library).
  every = sorted(int(i) for bs in local for b in bs for i in b)
  assert every == list(range(NUM_RECORDS[kind]))
  return local


def check_padded_union_of_unmasked_rows_is_the_dataset_each_record_once(n, d, kind):
  outs = _outs(n, d, kind, "padded")
  local = _local_batches(kind, n)
  assert [o["local_sizes"] for o in outs] == [[len(b) for b in bs] for bs in local]
  assert len({len(bs) for bs in local}) > 1 or len({len(b) for bs in local for b in bs}) > 1
  first = None
  for out in outs:
    assert len(out["batches"]) == max(len(bs) for bs in local)
    ids = []
    for batch in out["batches"]:
      mask = batch["mask"]
      assert mask.shape == (BATCH * n,)
      assert (batch["id"][~mask] == -1).all()  # Padded rows carry `paddings`.
      ids.extend(batch["id"][mask].tolist())
      np.testing.assert_array_equal(
        batch["v"][mask], np.stack([batch["id"][mask]] * 2, 1) * [1, -1]
      )
    assert sorted(ids) == list(range(NUM_RECORDS[kind]))  # Each record exactly once.
    if first is None:
      first = ids
    assert ids == first  # Every process sees the same global batches.


def check_drop_last_drops_exactly_the_documented_rows(n, d, kind):
  outs = _outs(n, d, kind, "drop_last")
  local = _local_batches(kind, n)
  shortest = min(len(bs) for bs in local)
  kept = [k for k in range(shortest) if all(len(bs[k]) == BATCH for bs in local)]
  want = [np.concatenate([bs[k] for bs in local]) for k in kept]
  dropped = sorted(set(range(NUM_RECORDS[kind])) - {int(i) for w in want for i in w})
  assert dropped  # The shards are uneven: some records must go.
  for out in outs:
    assert len(out["batches"]) == len(kept)
    for batch, expected in zip(out["batches"], want):
      np.testing.assert_array_equal(batch["id"], expected)
    got = sorted(int(i) for batch in out["batches"] for i in batch["id"])
    assert sorted(set(range(NUM_RECORDS[kind])) - set(got)) == dropped
    assert len(got) == len(set(got))  # No record twice.


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_every_record_once_padded_and_exactly_the_documented_rows_dropped(n, d):
  # One launch per topology runs every kind and mode; each case's own checks.
  calls = {}
  for kind in KINDS:
    calls[f"padded/{kind}"] = functools.partial(
      check_padded_union_of_unmasked_rows_is_the_dataset_each_record_once, n, d, kind
    )
    calls[f"drop_last/{kind}"] = functools.partial(
      check_drop_last_drops_exactly_the_documented_rows, n, d, kind
    )
  check_each(calls)
