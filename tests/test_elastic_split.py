"""The elastic split (pure, no JAX): every record of every epoch exactly once across resizes."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_jax_sync._src.sources.elastic import split as es
from grain_jax_sync._src.sources.elastic import state as state_lib

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None)


def job_shares(n, epochs, first, splits, count):
  return [es.EpochShares(n, epochs, first, splits, count, i) for i in range(count)]


def record_of(epoch_shares, j, *, shuffle, seed):
  epoch, pos = epoch_shares.locate(j)
  order = es.epoch_order(epoch_shares.num_records, shuffle=shuffle, seed=seed, epoch=epoch)
  return epoch, int(pos if order is None else order[pos])


def run_job(draw_cursor, n, epochs, counts, *, shuffle, seed, keep):
  """Plays a job that resizes through `counts`; returns (epoch, record) pairs yielded."""
  seen = []
  first, splits = 0, ()
  for k, count in enumerate(counts):
    job = job_shares(n, epochs, first, splits, count)
    last = k == len(counts) - 1
    consumed = [j.length if last else draw_cursor(j.length) for j in job]
    for epoch_shares, c in zip(job, consumed, strict=True):
      for j in range(c):
        epoch, record = record_of(epoch_shares, j, shuffle=shuffle, seed=seed)
        if keep(record):
          seen.append((epoch, record))
    if not last:
      positions = [(c,) for c in consumed]
      first, splits = es.resume(job, positions)
      # The state is JSON: what a resumed job reads back.
      splits = state_lib.splits_from_json(json.loads(json.dumps(state_lib.splits_to_json(splits))))
  return seen


@PROPERTY_SETTINGS
@given(
  n=st.integers(0, 60),
  epochs=st.integers(1, 3),
  counts=st.lists(st.integers(1, 9), min_size=1, max_size=4),
  shuffle=st.booleans(),
  modulus=st.integers(1, 4),
  data=st.data(),
)
def test_every_record_of_every_epoch_exactly_once_across_resizes(
  n, epochs, counts, shuffle, modulus, data
):
  def draw_cursor(length):
    return data.draw(st.integers(0, length))

  def keep(record):
    return record % modulus != 0 or modulus == 1

  seen = run_job(draw_cursor, n, epochs, counts, shuffle=shuffle, seed=7, keep=keep)
  expected = Counter((e, r) for e in range(epochs) for r in range(n) if keep(r))
  assert Counter(seen) == expected


@PROPERTY_SETTINGS
@given(n=st.integers(0, 200), history=st.data(), count=st.integers(1, 12))
def test_a_resize_shares_exactly_what_the_cursors_left(n, history, count):
  old_count = history.draw(st.integers(1, 12))
  old = es.shares(n, (), old_count)
  cursors = [history.draw(st.integers(0, es.total(s))) for s in old]
  new = es.shares(n, [(old_count, tuple(cursors))], count)
  left = [p for s, c in zip(old, cursors, strict=True) for p in expand(s)[c:]]
  assert [p for s in new for p in expand(s)] == left
  sizes = [es.total(s) for s in new]
  assert max(sizes) - min(sizes) <= 1


def expand(ranges):
  return [p for a, b in ranges for p in range(a, b)]


def test_even_split_is_contiguous_and_balanced():
  assert es.even_split([(0, 10)], 3) == [[(0, 4)], [(4, 7)], [(7, 10)]]
  assert es.even_split([(0, 2), (5, 7)], 3) == [[(0, 2)], [(5, 6)], [(6, 7)]]
  assert es.even_split([], 2) == [[], []]


def test_shuffled_order_is_deterministic_given_seed_and_epoch():
  a = es.epoch_order(50, shuffle=True, seed=3, epoch=1)
  assert np.array_equal(a, es.epoch_order(50, shuffle=True, seed=3, epoch=1))
  assert sorted(a.tolist()) == list(range(50))
  assert not np.array_equal(a, es.epoch_order(50, shuffle=True, seed=3, epoch=0))
  assert not np.array_equal(a, es.epoch_order(50, shuffle=True, seed=4, epoch=1))
  assert es.epoch_order(50, shuffle=False, seed=3, epoch=1) is None


def test_a_later_epoch_uses_the_new_split():
  job = job_shares(12, 2, 0, (), 2)
  first, splits = es.resume(job, [(3,), (6,)])  # Process 1 finished epoch 0 (6 records).
  assert first == 0
  new = job_shares(12, 2, first, splits, 3)
  # Epoch 0: the 3 records process 0 left, over 3 processes; epoch 1 fresh, 3-way.
  assert [es.total(n.epochs[0][1]) for n in new] == [1, 1, 1]
  assert [n.epochs[1][1] for n in new] == [[(0, 4)], [(4, 8)], [(8, 12)]]


def test_resize_at_an_epoch_boundary_keeps_both_epochs():
  job = job_shares(8, 3, 0, (), 2)
  # Process 0 is in epoch 1 (2 of 4 read); process 1 still in epoch 0 (1 of 4).
  first, splits = es.resume(job, [(4 + 2,), (1,)])  # Stream positions: 4 per epoch.
  (new,) = job_shares(8, 3, first, splits, 1)
  got = [new.locate(j) for j in range(new.length)]
  epoch0 = [p for e, p in got if e == 0]
  epoch1 = [p for e, p in got if e == 1]
  assert epoch0 == [5, 6, 7]
  assert sorted(epoch1) == [2, 3, 4, 5, 6, 7]  # Process 0 read 0 and 1 of epoch 1.
  assert [p for e, p in got if e == 2] == list(range(8))


def test_cursor_at_the_end_and_at_epoch_boundaries():
  (epoch_shares,) = job_shares(4, 2, 0, (), 1)
  assert [epoch_shares.cursor(j) for j in range(9)] == [
    (0, 0),
    (0, 1),
    (0, 2),
    (0, 3),
    (1, 0),
    (1, 1),
    (1, 2),
    (1, 3),
    (1, 4),
  ]
  with pytest.raises(IndexError):
    epoch_shares.locate(8)


@pytest.mark.parametrize("resizes", [1, 2])
def test_state_stays_under_10_kb_at_1024_processes(resizes):
  rng = np.random.default_rng(0)
  n, first, splits = 10_000_000, 0, ()
  for _ in range(resizes):
    job = job_shares(n, 1, first, splits, 1024)
    share = job[0].length
    positions = [(int(c),) for c in rng.integers(share // 2, share, size=1024)]
    first, splits = es.resume(job, positions)
  size = len(json.dumps(state_lib.splits_to_json(splits)))
  assert size < 10_000, size


def test_a_resize_of_1024_processes_with_2_mp_prefetch_workers_each_stays_under_10_kb():
  rng = np.random.default_rng(0)
  n = 10_000_000
  job = job_shares(n, 1, 0, (), 1024)
  share = job[0].length
  thresholds = []
  for k in rng.integers(share // 4, share // 2, size=1024):
    drift = int(rng.integers(-50, 50))  # The workers drift apart by a few records.
    thresholds.append((2 * int(k), 1 + 2 * (int(k) + drift)))
  first, splits = es.resume(job, thresholds)
  text = json.dumps(state_lib.splits_to_json(splits))
  assert len(text) < 10_000, len(text)
  assert state_lib.splits_from_json(json.loads(text)) == splits


def test_pack_ints_round_trips():
  for values in ([], [3, 1], list(range(100)), [2**40, 0, 5] * 20):
    assert state_lib.unpack_ints(json.loads(json.dumps(state_lib.pack_ints(values)))) == tuple(
      values
    )
  with pytest.raises(ValueError, match="list of ints"):
    state_lib.unpack_ints("nope")


def test_a_cursor_past_its_share_is_refused():
  with pytest.raises(ValueError, match="process 1's cursor 9 is outside its share of 5"):
    es.shares(10, [(2, (0, 9))], 1)


@PROPERTY_SETTINGS
@given(
  n=st.integers(0, 60),
  epochs=st.integers(1, 3),
  counts=st.lists(st.integers(1, 6), min_size=2, max_size=4),
  data=st.data(),
)
def test_strided_cursors_of_mp_prefetch_workers_resplit_exactly_the_rest(n, epochs, counts, data):
  """Each old process's W workers read every W-th stream index: consumed iff j < T[j % W]."""
  seen, first, splits = [], 0, ()
  for k, count in enumerate(counts):
    job = job_shares(n, epochs, first, splits, count)
    if k == len(counts) - 1:
      for epoch_shares in job:
        seen += [
          record_of(epoch_shares, j, shuffle=True, seed=3) for j in range(epoch_shares.length)
        ]
      break
    thresholds = []
    for epoch_shares in job:
      width = data.draw(st.integers(1, 4))
      reads = [len(range(w, epoch_shares.length, width)) for w in range(width)]
      t = tuple(w + data.draw(st.integers(0, r)) * width for w, r in zip(range(width), reads))
      thresholds.append(t)
      for j in range(epoch_shares.length):
        if j < t[j % width]:
          seen.append(record_of(epoch_shares, j, shuffle=True, seed=3))
    first, splits = es.resume(job, thresholds)
    splits = state_lib.splits_from_json(json.loads(json.dumps(state_lib.splits_to_json(splits))))
  assert Counter(seen) == Counter((e, r) for e in range(epochs) for r in range(n))


def test_a_strided_cursor_leaves_the_positions_above_each_worker_s_threshold():
  share = [(0, 5), (10, 15)]  # Share positions 0..9 name 0..4, 10..14.
  # Even positions below 6 and odd ones below 3 are consumed: 3, 5 and 6.. are left.
  assert es.remaining([share], [(6, 3)]) == [(3, 4), (10, 15)]
  assert es.remaining([share], [(2, 5)]) == [(2, 3), (4, 5), (10, 15)]
  assert es.remaining([share], [(4, 4)]) == es.remaining([share], [4]) == [(4, 5), (10, 15)]
  with pytest.raises(ValueError, match="outside its share of 10 records"):
    es.remaining([share], [(0, 11)])


def test_forever_a_resize_in_a_later_epoch_then_fresh_epochs_every_record_once_each():
  n, seed = 11, 4
  old = job_shares(n, None, 0, (), 2)
  assert old[0].length == es.FOREVER and old[0].locate(6 * 3 + 2) == (3, 2)  # Share 0: 0..5.
  # Process 0 is in epoch 2, process 1 already in epoch 3.
  consumed = [6 * 2 + 4, 5 * 3 + 1]
  seen = [record_of(a, j, shuffle=True, seed=seed) for a, c in zip(old, consumed) for j in range(c)]
  cursors = [a.cursor(c) for a, c in zip(old, consumed, strict=True)]
  assert cursors == [(2, 4), (3, 1)]
  first, splits = es.resume(old, [(c,) for c in consumed])
  splits = state_lib.splits_from_json(json.loads(json.dumps(state_lib.splits_to_json(splits))))
  assert first == 2 and [e for e, _ in splits] == [2, 3]
  for epoch_shares in job_shares(n, None, first, splits, 3):
    # The re-split rest of epochs 2 and 3, then 2 fresh epochs of 11 over 3 (4, 4, 3).
    listed = sum(es.total(s) for _, s, _ in epoch_shares.epochs)
    assert epoch_shares.length == listed + es.FOREVER
    per_epoch = es.total(es.shares(n, (), 3)[epoch_shares.index])
    assert epoch_shares.cursor(listed + per_epoch + 1) == (5, 1)
    seen += [
      record_of(epoch_shares, j, shuffle=True, seed=seed) for j in range(listed + 2 * per_epoch)
    ]
  assert Counter(seen) == Counter((e, r) for e in range(6) for r in range(n))


@PROPERTY_SETTINGS
@given(n=st.integers(1, 80), count=st.integers(1, 5), new=st.integers(1, 5), data=st.data())
def test_holes_a_packer_holds_are_resplit_with_the_records_not_read(n, count, new, data):
  job = job_shares(n, 1, 0, (), count)
  stops, holes = [], []
  for j in job:
    stop = data.draw(st.integers(0, j.length))
    stops.append((stop,))
    holes.append(
      tuple(sorted(data.draw(st.sets(st.integers(0, max(stop - 1, 0)))) if stop else ()))
    )
  first, splits = es.resume(job, stops, holes)
  splits = state_lib.splits_from_json(json.loads(json.dumps(state_lib.splits_to_json(splits))))
  consumed = [
    job[p].locate(j)[1] for p in range(count) for j in range(stops[p][0]) if j not in holes[p]
  ]
  after = job_shares(n, 1, first, splits, new)
  rest = [a.locate(j)[1] for a in after for j in range(a.length)]
  assert sorted(consumed + rest) == list(range(n))
