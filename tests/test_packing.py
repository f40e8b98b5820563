"""`pack_sequences`: packed rows whose state names the records in flight.

Checked in one process over the library's per-process iterators (no JAX) at
random stops and inside long documents, then on real processes at 2 x 4 -> 3 x 2.
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
from grain_jax_sync._src.sources.elastic.stream import ElasticIterator

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


@pytest.mark.parametrize(
  ("options", "tokens", "positions", "counted"),
  [
    ({}, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 1, 2, 0]], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 0, 1, 0]], 0),
    (
      {"restart_positions": True},
      [[1, 2, 3, 4], [5, 6, 7, 8], [9, 1, 2, 0]],
      [[0, 1, 2, 3], [0, 1, 2, 3], [0, 0, 1, 0]],
      0,
    ),
    ({"trim": True}, [[1, 2, 3, 4], [1, 2, 0, 0]], [[0, 1, 2, 3], [0, 1, 0, 0]], 5),
  ],
)
def test_a_long_record_goes_over_rows_in_consecutive_pieces_unless_trimmed(
  options, tokens, positions, counted
):
  import grain

  from grain_jax_sync._src.sources.elastic import packing

  with pytest.raises(ValueError, match="`length` must be a positive int, got 0"):
    gjs.pack_sequences(grain.MapDataset.range(3).to_iter_dataset(), length=0)
  with pytest.raises(
    ValueError,
    match=r"`ds` must be a grain.IterDataset or grain.MapDataset of records, got list; wrap a"
    r" sequence of records as grain.MapDataset.source\(records\)$",
  ):
    gjs.pack_sequences([{"tok": np.arange(1, 10)}], length=4)
  ds = grain.MapDataset.source(
    [{"tok": np.arange(1, 10)}, {"tok": np.arange(1, 3)}]
  ).to_iter_dataset()
  it = iter(gjs.pack_sequences(ds, length=4, num_bins=1, **options))
  rows = list(it)
  assert [r["tok"].tolist() for r in rows] == tokens
  assert [r["tok_positions"].tolist() for r in rows] == positions
  assert rows[-1]["tok_segment_ids"].tolist() == ([1, 1, 0, 0] if counted else [1, 2, 2, 0])
  packed = 11 - counted
  assert packing.counters(it.get_state()) == {
    "tokens_packed": packed,
    "tokens_padded": 4 * len(rows) - packed,
    "tokens_trimmed": counted,
  }


DOCUMENTS = 300  # Of 1 to 1,000 tokens: 157,845 tokens, packed at length 64.


def test_documents_of_1_to_1000_tokens_are_packed_whole_across_a_stop_mid_document():
  src = lm_jobs.mixture("docs", (DOCUMENTS,), 8, seed=3, num_epochs=1)
  docs = lm_jobs.documents(DOCUMENTS)
  head, states = lm_jobs.play(src, 2, 37)
  partial = [s["source"].get("partial") for s in states]
  assert all(partial)  # Each process stopped with documents partly delivered.
  whole, _ = lm_jobs.play(src, 2, None)
  for count in (3, 2, 1):
    rest, _ = lm_jobs.play(src, count, None, states)
    pieces = lm_jobs.document_pieces([head, rest])
    assert sorted(pieces) == list(range(DOCUMENTS))
    for d, got in pieces.items():  # Every token once, in order, in consecutive pieces.
      assert np.array_equal(np.concatenate(got), np.arange(len(docs[d]["tok"])))
    if count == 2:  # The same count: exactly the rest of the run.
      for a, b in zip(rest, whole, strict=True):
        assert len(b) == 37 + len(a)
        for x, y in zip(a, b[37:], strict=True):
          assert all(np.array_equal(x[k], y[k]) for k in x)
  # The tokens in and out, and `stats()`'s count of them on each process.
  its = [ElasticIterator(src, index=p, count=2) for p in range(2)]
  rows = [[next(it) for _ in range(37)] for it in its]
  for it, got in zip(its, rows, strict=True):
    real = sum(int((b["tok_segment_ids"] > 0).sum()) for b in got)
    assert it.stats(it.get_state())["packing"] == {
      "tokens_packed": real,
      "tokens_padded": 37 * 8 * 64 - real,
      "tokens_trimmed": 0,
    }
  out = sum(len(p) for got in lm_jobs.document_pieces([whole]).values() for p in got)
  assert out == sum(len(d["tok"]) for d in docs) == 157_845


@pytest.mark.parametrize("middle", [(1, 2, 3), (1, 1, 1)])
def test_new_weights_after_a_resize_keep_a_document_an_earlier_job_left_in_part_whole(middle):
  # 2 hosts stop inside documents; 1 host (the old weights, or new ones) reads one batch, so
  # process 1's documents in part are not reached; new weights then. Each is read whole.
  docs = lm_jobs.documents(60)
  sources = [docs[:10], docs[10:30], docs[30:]]

  def mixture(weights):
    pack = lambda ds: gjs.pack_sequences(ds, length=64).batch(4)  # noqa: E731
    return gjs.elastic_mixture(sources, weights, pack, seed=0, num_epochs=1)

  jobs, states = [], None
  for count, weights, steps in ((2, (1, 2, 3), 3), (1, middle, 1), (1, (5, 1, 1), None)):
    got, states = lm_jobs.play(mixture(list(weights)), count, steps, states)
    jobs.append(got)
  for d, pieces in lm_jobs.document_pieces(jobs).items():  # A source repeats: whole each time.
    counts = np.bincount(np.concatenate(pieces), minlength=len(docs[d]["tok"]))
    assert counts.min() == counts.max(), (d, counts)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_2x4_stop_mid_document_resumes_exactly_on_2x4_and_resplits_on_3x2(tmp_path):
  # One launch of 2 x 4 (the head, the whole run, the rest from the head's
  # states), then one of 3 x 2 (the rest, re-split); process 0's values.
  jobs = {"head": (None, 20), "whole": (None, None), "same": ("head", None)}
  two = lm_jobs.run_jobs(2, 4, "docs", (DOCUMENTS,), 8, str(tmp_path), jobs)
  head, whole, same = (two[name][0] for name in jobs)
  assert head["state"]["source"]["partial"]  # A document partly delivered.
  three = lm_jobs.run_jobs(3, 2, "docs", (DOCUMENTS,), 8, str(tmp_path), {"three": ("head", None)})
  three = three["three"][0]
  assert head["batches"] == whole["batches"][:20] and same["batches"] == whole["batches"][20:]
  docs = lm_jobs.documents(DOCUMENTS)
  pieces = lm_jobs.document_pieces([[head["batches"]], [three["batches"]]])
  assert sorted(pieces) == list(range(DOCUMENTS))
  for d, got in pieces.items():
    assert np.array_equal(np.concatenate(got), np.arange(len(docs[d]["tok"])))
