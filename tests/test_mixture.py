"""`elastic_mixture`: which source each global row comes from, resumed on any process count.

The selection and the re-split are checked in one process over the library's
own per-process iterators (no JAX); one test runs the real 2 x 4 -> 3 x 4 job.
"""

from __future__ import annotations

import itertools
from collections import Counter

import lm_jobs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grain_jax_sync as gjs
from grain_jax_sync._src.sources.elastic import split as es
from grain_jax_sync._src.sources.elastic import state as state_lib
from grain_jax_sync._src.sources.elastic.mixture import Mixture
from grain_jax_sync._src.sources.elastic.state import splits_from_json

SIZES = (300, 900, 2500)  # Unequal; mixed 1:2:5.


def source_of(m: Mixture, g: int) -> tuple[int, int]:
  """(source, its row count before) of global row `g`."""
  step = np.subtract(m.counts(g + 1), m.counts(g))
  k = int(np.argmax(step))
  return k, m.counts(g)[k]


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.integers(1, 9), min_size=1, max_size=5), start=st.integers(0, 10**6))
def test_counts_are_grains_mix_selection_and_every_window_keeps_the_weights(weights, start):
  import grain

  parents = [grain.MapDataset.range(10**9).map(lambda i, k=k: (k, i)) for k in range(len(weights))]
  mixed = grain.MapDataset.mix(parents, weights)
  m = gjs.elastic_mixture([[0]] * len(weights), weights).mixture
  for g in range(start, start + 40):
    assert mixed[g] == source_of(m, g)
  window = np.subtract(m.counts(start + 2000), m.counts(start))
  assert np.all(np.abs(window / 2000 - np.divide(weights, sum(weights))) < 0.01)


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.integers(1, 9), min_size=1, max_size=4), start=st.integers(0, 10**5))
def test_the_records_read_in_chunks_are_the_selection_s_and_each_source_epoch_is_a_permutation(
  weights, start
):
  sizes = [5 + 7 * k for k in range(len(weights))]
  sources = [[(k, i) for i in range(n)] for k, n in enumerate(sizes)]
  src = gjs.elastic_mixture(sources, weights, seed=3)
  rows = range(start, start + 300)
  read = src.records._getitems(list(rows))  # The stream's chunked read.
  assert read == [src.records[g] for g in rows]  # Row by row (another block).
  epochs: dict[tuple[int, int], list[int]] = {}
  for g, (k, i) in zip(rows, read, strict=True):
    sk, n = source_of(src.mixture, g)
    assert k == sk  # Grain's mix selection.
    epochs.setdefault((k, n // sizes[k]), []).append(i)
  for (k, _), got in epochs.items():  # No record twice in one epoch of its source.
    assert len(set(got)) == len(got) and set(got) <= set(range(sizes[k]))
  whole = src.records._getitems(list(range(sum(sizes) * 3)))  # Whole epochs: every record.
  for k, n in enumerate(sizes):
    mine = [i for kk, i in whole if kk == k]
    for e in range(len(mine) // n):
      assert sorted(mine[e * n : (e + 1) * n]) == list(range(n))
  assert [i for kk, i in whole if kk == 0][: sizes[0]] != list(range(sizes[0]))  # Shuffled.


def test_a_process_reads_its_share_over_an_epoch_end_where_its_rows_jump_past_a_block():
  # Process 0 of 2 reads rows 0 .. 4999 of each 10,000-row epoch: a chunk of its stream ends
  # one epoch and starts the next, rows more than a block apart.
  from grain_jax_sync._src.sources.elastic.stream import ElasticIterator

  src = gjs.elastic_mixture([list(range(5000))] * 2, [1, 1], shuffle=False, num_epochs=2)
  assert src.records._getitems([0, 9000]) == [src.records[0], src.records[9000]]
  read = list(ElasticIterator(src, index=0, count=2)._it)
  want = [src.records[e * 10_000 + g] for e in range(2) for g in range(5000)]
  assert read == want


def keys(m: Mixture, batches: list[dict], positions: list[int]) -> list[tuple[int, int, int, int]]:
  """(global row, source, source epoch, record) of each row, given each row's global position."""
  out = []
  recs = [(int(s), int(i)) for b in batches for s, i in zip(b["s"], b["i"], strict=True)]
  for g, (s, i) in zip(positions, recs, strict=True):
    k, n = (int(x[0]) for x in m.select([g]))
    assert s == k  # The source is the selection's for the row's global position.
    out.append((g, s, n // m.sizes[s], i))
  return out


def positions(m: Mixture, count: int, splits: tuple, p: int, rows: int) -> list[int]:
  """The global positions of process `p`'s first `rows` stream rows."""
  shares = es.EpochShares(m.epoch_length, None, 0, splits, count, p)
  out = []
  for j in range(rows):
    epoch, pos = shares.locate(j)
    out.append(epoch * m.epoch_length + pos)
  return out


@settings(max_examples=25, deadline=None)
@given(
  counts=st.sampled_from([(2, 3), (3, 2), (2, 1), (4, 3)]),
  stop=st.integers(0, 40),
  shuffle=st.booleans(),
)
def test_a_resize_reads_each_source_row_at_most_once_per_epoch_and_keeps_the_sources(
  counts, stop, shuffle
):
  src = lm_jobs.mixture("rows", (30, 70, 200), 4, shuffle=shuffle, seed=1, num_epochs=1)
  m = src.mixture
  first, states = lm_jobs.play(src, counts[0], stop)
  rest, _ = lm_jobs.play(src, counts[1], None, states)
  history = ((0, ((counts[0], tuple(s["source"]["position"] for s in states)),)),)
  seen = []
  for p, got in enumerate(first):
    seen += keys(m, got, positions(m, counts[0], (), p, sum(len(b["s"]) for b in got)))
  for p, got in enumerate(rest):
    seen += keys(m, got, positions(m, counts[1], history, p, sum(len(b["s"]) for b in got)))
  # One epoch of the mixture: every global row once, each source row once per source epoch.
  assert sorted(g for g, *_ in seen) == list(range(m.epoch_length))
  assert len({(s, e, i) for _, s, e, i in seen}) == len(seen)
  same, _ = lm_jobs.play(src, counts[0], None, states)
  whole, _ = lm_jobs.play(src, counts[0], None)
  for a, b in zip(same, whole, strict=True):  # The same count: exactly the rest.
    assert len(b) == min(stop, len(b)) + len(a)
    for x, y in zip(a, b[stop:], strict=True):
      assert all(np.array_equal(x[k], y[k]) for k in x)


def test_stats_give_each_source_s_rows_against_its_weight_and_a_state_keeps_the_weights():
  src = lm_jobs.mixture("rows", SIZES, 8, seed=2)
  it = gjs.iter_jax_batches(src, batch_size=8)
  got = Counter(int(s) for b in itertools.islice(it, 250) for s in b["s"])
  sources = it.stats()["sources"]
  state = it.get_state()
  it.close()
  assert [x["rows"] for x in sources] == [got[k] for k in range(3)] == [250, 500, 1250]
  assert [x["weight"] for x in sources] == [1 / 8, 2 / 8, 5 / 8]
  it = gjs.iter_jax_batches(
    gjs.elastic_mixture([lm_jobs.rows(k, n) for k, n in enumerate(SIZES)], [1, 1, 1], seed=2),
    batch_size=8,
  )
  with pytest.raises(
    ValueError, match=r"`state\['source'\]\['mixture'\]`.*the sources and weights it was saved with"
  ):
    it.set_state(state)
  it.close()


@pytest.mark.parametrize(
  ("sources", "weights", "match"),
  [
    ([[1], [2]], [1], r"`weights` must be 2 finite numbers > 0"),
    ([[1], [2]], [1, 0], r"`weights` must be 2 finite numbers > 0"),
    ([[1], []], [1, 1], r"`sources\[1\]` is empty"),
    ([[1], iter([2])], [1, 1], r"`sources\[1\]` must be a grain.MapDataset.*list_iterator"),
    ([], [], r"`sources` must be a non-empty list"),
  ],
)
def test_elastic_mixture_checks_its_arguments(sources, weights, match):
  with pytest.raises(ValueError, match=match):
    gjs.elastic_mixture(sources, weights)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_2x4_checkpoint_at_batch_7_resumes_exactly_on_2_and_elastic_on_3(tmp_path):
  batch, steps = 16, 60  # Per host; 2 hosts: 32 rows a batch, 2,144 rows in the whole run.
  m = lm_jobs.mixture("rows", SIZES, batch).mixture

  # One launch of 2 x 4 (the whole run, its first 7 batches, the rest from
  # their states), then one of 3 x 4 (the rest, re-split).
  jobs = {"whole": (None, 7 + steps), "head": (None, 7), "same": ("head", steps)}
  two = lm_jobs.run_jobs(2, 4, "rows", SIZES, batch, str(tmp_path), jobs)
  whole, head, same = (two[name] for name in jobs)
  three = lm_jobs.run_jobs(3, 4, "rows", SIZES, batch, str(tmp_path), {"three": ("head", steps)})
  three = three["three"]
  assert head[0]["batches"] == whole[0]["batches"][:7]
  assert same[0]["batches"] == whole[0]["batches"][7:]  # Exact on the same count.
  # The delivered shares over the first 2,000 rows keep the weights within 1%.
  first = [s for b in whole[0]["batches"] for s in b["s"]][:2000]
  assert np.all(np.abs(np.bincount(first) / 2000 - np.divide(lm_jobs.WEIGHTS, 8)) < 0.01)
  assert (
    sum(h["sources"][0]["rows"] for h in whole)
    == Counter(s for b in whole[0]["batches"] for s in b["s"])[0]
  )

  def by_position(batches, count, splits):
    """Each global row's (source, source epoch, record), keyed by its global position."""
    out = {}
    for p in range(count):
      mine = [{k: b[k][p * batch : (p + 1) * batch] for k in ("s", "i")} for b in batches]
      pos = positions(m, count, splits, p, batch * len(batches))
      out.update({g: tuple(rest) for g, *rest in keys(m, mine, pos)})
    return out

  cursors = tuple(s["state"]["source"]["position"] for s in head)
  history = ((0, ((2, cursors),)),)
  uninterrupted = by_position(whole[0]["batches"], 2, ())
  before, after = (
    by_position(head[0]["batches"], 2, ()),
    by_position(three[0]["batches"], 3, history),
  )
  assert not set(before) & set(after)
  rows = list(before.values()) + list(after.values())
  assert len(set(rows)) == len(rows)  # Every source row at most once per source epoch.
  common = set(after) & set(uninterrupted)
  assert len(common) > 1000  # The sources and rows at 3 hosts are those of the run at 2.
  assert all(after[g] == uninterrupted[g] for g in common)


def reread(m: Mixture, batches: list[list[dict]], states: list[dict], starts: list[int]) -> list:
  """`keys` of each process's rows, from stream index `starts[p]` of its state's split."""
  out = []
  for p, got in enumerate(batches):
    s = states[p]["source"]
    shares = es.EpochShares(
      m.epoch_length, None, s["first_epoch"], splits_from_json(s["splits"]), len(states), p
    )
    rows = range(starts[p], starts[p] + sum(len(b["s"]) for b in got))
    out += keys(m, got, [e * m.epoch_length + i for e, i in map(shares.locate, rows)])
  return out


@settings(max_examples=12, deadline=None)
@given(
  counts=st.sampled_from([(2, 2), (2, 3), (3, 2), (3, 3)]),
  stop=st.integers(0, 30),
  new=st.sampled_from([(5, 2, 1), (1, 1, 1), (2, 7, 3)]),
)
def test_new_weights_at_a_resume_reselect_every_row_not_consumed(counts, stop, new):
  sizes, w1, w3 = (30, 70, 200), lm_jobs.WEIGHTS, (3, 1, 4)
  sources = [lm_jobs.rows(k, n) for k, n in enumerate(sizes)]
  runs = [(w1, counts[0], stop), (new, counts[1], 8), (w3, counts[0], 8)]  # Two changes.
  states, reads = None, []
  for weights, count, steps in runs:
    src = gjs.elastic_mixture(sources, weights, lambda ds: ds.batch(4), seed=1, num_epochs=None)
    got, after = lm_jobs.play(src, count, steps, states)
    reads.append((got, after, [0] * count))  # A new weight re-splits: each stream from 0.
    states = after
  m = src.mixture.restored(state_lib.runs_from_json(states[0]["source"]["mixture_runs"]))
  scaled = [gjs.elastic_mixture(sources, w).mixture.proportions for w in (w1, new, w3)]
  assert [p for _, p in m.history] == scaled
  read = [reread(m, got, after, starts) for got, after, starts in reads]
  seen = [x for job in read for x in job]
  assert len({g for g, *_ in seen}) == len(seen)  # No global row twice.
  assert len({(s, e, i) for _, s, e, i in seen}) == len(seen)  # Each source row once an epoch.
  for j, (kept, _) in enumerate(m.history[1:], start=1):  # A switch keeps the rows read.
    rows = sorted(g for job in read[:j] for g, *_ in job)
    assert [g for a, b in kept for g in range(a, b)] == rows
  for job, (weights, count, _) in zip(read[1:], runs[1:], strict=True):
    for p in range(count):  # Each host's rows keep the new weights from its first batch.
      mine = [s for g, s, *_ in job[p * 32 : (p + 1) * 32]]
      assert len(mine) == 32
      assert np.all(
        np.abs(np.bincount(mine, minlength=3) - np.multiply(32 / sum(weights), weights)) <= 2
      )
  # No source row twice, and none skipped: a row below one selected before `end`
  # (a consumed row may hold a later one) is selected by a row further on.
  end = max(g for g, *_ in seen) + 500
  source, row = m.select(range(4 * end))
  picked = list(zip(source.tolist(), row.tolist(), strict=True))
  assert len(set(picked)) == len(picked)
  for k in range(3):
    top = max((n for s, n in picked[:end] if s == k), default=-1)
    assert set(range(top + 1)) <= {n for s, n in picked if s == k}
  assert [x["weight"] for x in m.stats([1, 1, 1])] == list(np.divide(w3, sum(w3)))


def test_new_weights_on_3_hosts_reach_every_host_from_its_next_batch():
  sources = [lm_jobs.rows(k, 600) for k in range(3)]

  def mixture(weights):
    return gjs.elastic_mixture(sources, weights, lambda ds: ds.batch(10), seed=0)

  head, states = lm_jobs.play(mixture([1, 1, 1]), 3, 5)
  new = (0.9, 0.05, 0.05)
  rest, after = lm_jobs.play(mixture(list(new)), 3, 40, states)
  m = mixture(list(new)).mixture
  m = m.restored(state_lib.runs_from_json(after[0]["source"]["mixture_runs"]))
  for got in rest:  # Every host, over its next 40 batches.
    share = np.bincount([int(s) for b in got for s in b["s"]], minlength=3) / 400
    assert np.all(np.abs(share - new) < 0.02)
  seen = reread(m, head, states, [0] * 3) + reread(m, rest, after, [0] * 3)
  assert len({(s, e, i) for _, s, e, i in seen}) == len(seen) == 1350


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hosts_given_other_weights_or_seed_raise_the_same_value_error_naming_the_source():
  from helpers import run_cases

  head = "processes 0 and 1 were given different settings (elastic_source: '30 records, seed=0"
  cases = {
    "same": (lm_jobs.mixed_by_process, ([[1, 2], [1.0, 2.0]], [0, 0]), {}),
    "weights": (lm_jobs.mixed_by_process, ([[1, 2], [2, 1]], [0, 0]), {}),
    "seed": (lm_jobs.mixed_by_process, ([[1, 2], [1, 2]], [0, 1]), {}),
  }
  out = run_cases(2, 1, cases, timeout_s=120)
  assert out[0] == out[1]  # Every host the same.
  assert out[0]["same"] == "2 batches"
  assert out[0]["weights"].startswith(head)
  assert "proportions [100, 200] of sources of [10, 20] records" in out[0]["weights"]
  assert "proportions [200, 100]" in out[0]["weights"]
  assert out[0]["seed"].startswith(head) and "vs '30 records, seed=1" in out[0]["seed"]
