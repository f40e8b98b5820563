"""`pack_sequences`: packed rows whose state names the records in flight.

Checked in one process over the library's per-process iterators (no JAX) at
random stops, then on real processes at 2 x 4 -> 3 x 2.
"""

from __future__ import annotations

from collections import Counter

import lm_jobs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_jax_sync as gjs
from grain_jax_sync._src.sources.elastic import split as es
from grain_jax_sync._src.sources.elastic import state as state_lib

SIZES = (40, 80, 200)  # 1:2:5 of 320 rows: one mixture epoch holds each record once.


def tokens_of(batches) -> Counter:
  return Counter(
    r for per_process in batches for b in per_process for r in lm_jobs.packed_records(b)
  )


def every_record() -> Counter:
  return Counter(lm_jobs.token_counts([lm_jobs.texts(k, n) for k, n in enumerate(SIZES)]).items())


@settings(max_examples=25, deadline=None)
@given(counts=st.sampled_from([(2, 3), (3, 2), (2, 1), (1, 4)]), stop=st.integers(0, 12))
def test_a_state_at_any_batch_resumes_exactly_and_resplits_every_token_once(counts, stop):
  src = lm_jobs.mixture("pack", SIZES, 2, seed=4, num_epochs=1)
  head, states = lm_jobs.play(src, counts[0], stop)
  rest, _ = lm_jobs.play(src, counts[1], None, states)
  assert tokens_of(head) + tokens_of(rest) == every_record()
  whole, _ = lm_jobs.play(src, counts[0], None)
  same, _ = lm_jobs.play(src, counts[0], None, states)
  for a, b in zip(same, whole, strict=True):  # The same count: exactly the rest.
    assert len(b) == min(stop, len(b)) + len(a)
    for x, y in zip(a, b[stop:], strict=True):
      assert all(np.array_equal(x[k], y[k]) for k in x)


def test_rows_are_filled_first_fit_and_the_state_names_the_records_in_flight():
  src = lm_jobs.mixture("pack", SIZES, 2, seed=4, num_epochs=1)
  (got,), (state,) = lm_jobs.play(src, 1, 3)
  used = [int((s > 0).sum()) for b in got for s in b["tok_segment_ids"]]
  assert len(used) == 6 and np.mean(used) > 0.8 * 64
  source = state["source"]
  holes = state_lib.unpack_ints(source["holes"])
  assert source["resplittable"] is True and holes and max(holes) < source["position"]
  read = {
    r
    for r, _ in lm_jobs.packed_records(
      {k: np.stack([b[k] for b in got]).reshape(6, 64) for k in got[0]}
    )
  }
  assert len(read) + len(holes) == source["position"]  # Delivered, or in flight.
  # The holes, re-split: read again by the next job, and no other record before the cursor.
  shares = es.shares(320, [(1, (es.Holes(source["position"], tuple(holes)),))], 1)
  assert es.take(shares[0], 0, len(holes)) == es.take([(j, j + 1) for j in holes], 0, len(holes))


def test_pack_sequences_checks_its_arguments_and_trims_long_records():
  import grain

  with pytest.raises(ValueError, match="`length` must be a positive int, got 0"):
    gjs.pack_sequences(grain.MapDataset.range(3).to_iter_dataset(), length=0)
  ds = grain.MapDataset.source(
    [{"tok": np.arange(1, 10)}, {"tok": np.arange(1, 3)}]
  ).to_iter_dataset()
  rows = list(gjs.pack_sequences(ds, length=4, num_bins=1))
  assert [r["tok"].tolist() for r in rows] == [[1, 2, 3, 4], [1, 2, 0, 0]]
  assert [r["tok_segment_ids"].tolist() for r in rows] == [[1, 1, 1, 1], [1, 1, 0, 0]]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_2x4_mid_packed_batch_resumes_exactly_on_2x4_and_resplits_on_3x2(tmp_path):
  # One launch of 2 x 4 (the head, the whole run, the rest from the head's
  # states), then one of 3 x 2 (the rest, re-split); process 0's values.
  jobs = {"head": (None, 3), "whole": (None, None), "same": ("head", None)}
  two = lm_jobs.run_jobs(2, 4, "pack", SIZES, 8, str(tmp_path), jobs)
  head, whole, same = (two[name][0] for name in jobs)
  assert head["state"]["source"]["holes"]  # Records in flight: mid packed batch.
  three = lm_jobs.run_jobs(3, 2, "pack", SIZES, 8, str(tmp_path), {"three": ("head", None)})
  three = three["three"][0]
  assert head["batches"] == whole["batches"][:3] and same["batches"] == whole["batches"][3:]
  assert tokens_of([head["batches"], three["batches"]]) == every_record()
