"""The build stage's policy (`pace.Pace`): who fetches and builds, from what it timed."""

from __future__ import annotations

import time

import pytest

from grain_jax_sync._src import pace


def _settled(p: pace.Pace, *, build_s: float, fetch_s: float = 0.0, away_s: float = 0.0) -> None:
  """Feeds `p` the same timings until its averages are within 1% of them."""
  for _ in range(40):
    p.built(build_s)
    now = time.perf_counter()
    p.fetched(now, time.thread_time() - fetch_s, 1)
    p.left_at = time.perf_counter() - away_s
    p.came_back()


def test_the_consumer_fetches_its_first_run_then_only_quick_ones_with_no_step():
  p = pace.Pace(inline_fetch=True)
  assert p.fetches_inline()  # The first fetch, before anything is timed.
  p.count_fetch()
  _settled(p, build_s=0.0002)
  assert p.fetches_inline()
  _settled(p, build_s=0.0002, fetch_s=2 * pace.INLINE_FETCH_S)
  assert not p.fetches_inline()  # A slow source: read in the thread.
  _settled(p, build_s=0.0002, away_s=2 * pace.AWAY_FETCH_S)
  assert not p.fetches_inline()  # A step to hide the reads behind.


def test_the_consumer_never_fetches_where_an_exchange_is_waited_on():
  p = pace.Pace(inline_fetch=False)
  assert not p.fetches_inline()
  _settled(p, build_s=0.0002)
  assert not p.fetches_inline()


@pytest.mark.parametrize(("bytes_", "inline"), [(4096, True), (8 << 20, False)])
def test_a_long_build_keeps_the_consumer_fetching_only_where_it_moves_few_bytes(bytes_, inline):
  p = pace.Pace(inline_fetch=True)
  p.count_fetch()
  p.bytes = bytes_
  _settled(p, build_s=2 * pace.INLINE_BUILD_S)
  assert p.fetches_inline() is inline
  assert not p.builds_direct()


def test_stepping_is_time_away_beyond_the_grace_of_builds():
  p = pace.Pace(inline_fetch=False)
  _settled(p, build_s=0.001, away_s=0.0)
  assert p.grace() == pytest.approx(pace.AWAY_BUILDS * 0.001, rel=0.01)
  assert not p.stepping()
  _settled(p, build_s=0.001, away_s=0.02)
  assert p.stepping()


def test_one_fetch_in_inline_fetch_sample_is_timed():
  p = pace.Pace(inline_fetch=True)
  timed = [p.count_fetch() for _ in range(3 * pace.INLINE_FETCH_SAMPLE)]
  assert timed.count(True) == 3 and timed[0]
