"""`JaxBatchIterator.stats()`: exact counts across 2 real processes and in one.

Counts are checked against the counts the agreement rules give for known
per-process sizes (uneven hosts, padding, dummy batches, drops); times by
what must hold whatever the machine's speed (a slow source's sleeps are in
`source_s`; without prefetching every stage's time nests in `wait_s`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import pytest
import scenarios
from helpers import check_cases, check_each, run_cases

from grain_jax_sync import testing
from grain_jax_sync._src import stats

COUNTS = ("batches", "real_rows", "padded_rows", "dummy_batches", "dropped_batches")
# Per case, per process: batches, real rows, padded rows, dummy batches, dropped batches.
TWO_PROCESSES = {
  # Positions: (8, 8) -> 8; (8, 3 last) -> padded to 8; (5 last, none) -> padded, dummy.
  "padded": [(3, 21, 3, 0, 0), (3, 11, 13, 1, 0)],
  "padded_no_prefetch": [(3, 21, 3, 0, 0), (3, 11, 13, 1, 0)],
  "padded_window_1": [(3, 21, 3, 0, 0), (3, 11, 13, 1, 0)],
  # (8, 8), (8, 8), (5 last, 8) -> dropped, then process 0 has none -> stop.
  "dropped": [(2, 16, 0, 0, 1), (2, 16, 0, 0, 1)],
  "even": [(2, 16, 0, 0, 0), (2, 16, 0, 0, 0)],
}
ONE_PROCESS = {
  "padded": (3, 21, 3, 0, 0),
  "padded_no_prefetch": (3, 21, 3, 0, 0),
  "padded_window_1": (3, 21, 3, 0, 0),
  "dropped": (2, 16, 0, 0, 1),
  "even": (2, 16, 0, 0, 0),
}

# The scenarios, run in every process (and in this one): each case iterates
# `scenarios.make_batches` with given per-process sizes and returns the stats,
# so the tests compare them with the counts the rules give. The same cases in
# every topology: (per-process sizes, iter_jax_batches options).
PADDED = {"batch_size": 8, "paddings": 0, "mask_key": "mask"}
CASES: dict[str, tuple[list[list[int]], dict[str, Any]]] = {
  # Process 0: 3 batches, the last short; process 1: 2, the last short, then dummies.
  "padded": ([[8, 8, 5], [8, 3]], PADDED),
  "padded_no_prefetch": ([[8, 8, 5], [8, 3]], {**PADDED, "prefetch_batches": 0}),
  "padded_window_1": ([[8, 8, 5], [8, 3]], {**PADDED, "synchronize_lookahead": 1}),
  # drop_last: the short position is dropped on every host, then every host stops.
  "dropped": ([[8, 8, 5], [8, 8, 8, 8]], {"batch_size": 8, "drop_last": True}),
  "even": ([[8, 8], [8, 8]], {"batch_size": 8}),
}
SLOW_READ_S = 0.02  # Per batch of the slow source.


class SlowSource:
  """Sleeps `delay_s` before each batch (time that `source_s` must count)."""

  def __init__(self, batches: list[Any], delay_s: float = SLOW_READ_S):
    self._batches = batches
    self._delay_s = delay_s

  def __iter__(self):
    for b in self._batches:
      time.sleep(self._delay_s)
      yield b


def _case(p: int, sizes: list[list[int]], kwargs: dict[str, Any]) -> dict[str, Any]:
  import grain_jax_sync as gjs

  mine = sizes[p] if p < len(sizes) else []
  with gjs.iter_jax_batches(scenarios.make_batches(p, mine), **kwargs) as it:
    n = sum(1 for _ in it)
    return {"yielded": n, "stats": it.stats()}


def _mid_stream(p: int) -> dict[str, Any]:
  """Stats after 1 of 6 batches, with the pipeline prefetching ahead."""
  import grain_jax_sync as gjs

  data = scenarios.make_batches(p, [8, 8, 8, 8, 8, 6])
  with gjs.iter_jax_batches(data, **PADDED, prefetch_batches=4) as it:
    next(it)
    time.sleep(0.5)  # Let the stages run ahead.
    first = it.stats()
    rest = sum(1 for _ in it)
    return {"first": first, "rest": rest, "end": it.stats()}


def _slow(p: int) -> dict[str, Any]:
  """A slow source read in the consumer's thread: every stage's time nests in wait_s."""
  import grain_jax_sync as gjs

  data = SlowSource(scenarios.make_batches(p, [8, 8, 8, 8]))
  with gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=0) as it:
    t0 = time.monotonic()
    n = sum(1 for _ in it)
    return {"yielded": n, "stats": it.stats(), "loop_s": time.monotonic() - t0}


def _resumed(p: int) -> dict[str, Any]:
  """stats() after set_state: counts of this iterator's batches only, then more."""
  import grain_jax_sync as gjs

  data = scenarios.make_batches(p, [8, 8, 8, 5])
  with gjs.iter_jax_batches(data, **PADDED) as it:
    next(it)
    state = it.get_state()
  with gjs.iter_jax_batches(data, **PADDED) as it:
    it.set_state(state)
    before = it.stats()
    next(it)
    it.set_state(state)  # Restart: the prefetched batches are not counted.
    n = 1 + sum(1 for _ in it)
    return {"before": before, "yielded": n, "stats": it.stats()}


def run_all() -> dict[str, Any]:
  """Every case on this process, in the same order on every process."""
  import jax

  p = jax.process_index()
  out: dict[str, Any] = {k: _case(p, sizes, kwargs) for k, (sizes, kwargs) in CASES.items()}
  out["mid_stream"] = _mid_stream(p)
  out["slow"] = _slow(p)
  out["resumed"] = _resumed(p)
  return out


_RUNS: dict[str, list[dict]] = {}


def _one():
  if "one" not in _RUNS:
    _RUNS["one"] = [run_all()]
  return _RUNS["one"]


def _counts(s: dict) -> tuple[int, ...]:
  return tuple(s[k] for k in COUNTS)


def _check_times(s: dict) -> None:
  assert list(s) == list(stats.FIELDS)
  for k in ("wait_s", "source_s", "exchange_s", "transfer_s"):
    assert isinstance(s[k], float) and s[k] >= 0.0, (k, s)
  assert s["transfer_s"] > 0.0


def check_stats_counts_are_exact_across_two_processes(outs, case):
  for p, out in enumerate(outs):
    r = out[case]
    assert _counts(r["stats"]) == TWO_PROCESSES[case][p], (p, r)
    assert r["yielded"] == r["stats"]["batches"]
    _check_times(r["stats"])
    assert r["stats"]["exchange_s"] > 0.0  # Two processes exchange through the store.


@pytest.mark.parametrize("case", sorted(ONE_PROCESS))
def test_stats_counts_are_exact_in_one_process(case):
  r = _one()[0][case]
  assert _counts(r["stats"]) == ONE_PROCESS[case]
  assert r["yielded"] == r["stats"]["batches"]
  _check_times(r["stats"])
  assert r["stats"]["exchange_s"] == 0.0  # Nothing to exchange.


def _check_mid_stream(r: dict, last_rows: int) -> None:
  # Prefetching ran ahead, but only the batch received is counted.
  assert _counts(r["first"]) == (1, 8, 0, 0, 0)
  assert r["rest"] == 5
  assert _counts(r["end"]) == (6, 40 + last_rows, 8 - last_rows, 0, 0)


def _check_slow(r: dict) -> None:
  s = r["stats"]
  assert r["yielded"] == 4
  assert s["source_s"] >= 4 * SLOW_READ_S  # The sleeps, at least.
  # Without prefetching the consumer's thread reads and builds: both nest in wait_s.
  assert s["wait_s"] >= s["source_s"] + s["transfer_s"]
  assert s["wait_s"] <= r["loop_s"]


def _check_resumed(r: dict) -> None:
  assert _counts(r["before"]) == (0, 0, 0, 0, 0)
  # Batch 1 twice (received, then restored from before it), then 2 and 3 (5 rows).
  assert r["yielded"] == 4
  assert _counts(r["stats"]) == (4, 29, 3, 0, 0)


def check_stats_count_received_batches_not_prefetched_ones_across_two_processes(outs):
  for out in outs:
    _check_mid_stream(out["mid_stream"], 6)
    _check_slow(out["slow"])
    assert out["slow"]["stats"]["exchange_s"] > 0.0
    _check_resumed(out["resumed"])


def test_stats_count_received_batches_not_prefetched_ones_in_one_process():
  out = _one()[0]
  _check_mid_stream(out["mid_stream"], 6)
  _check_slow(out["slow"])
  _check_resumed(out["resumed"])


def test_delivered_counts_padding_and_dummies():
  d = stats.Delivered().added(8, 8, 0, 0.0).added(5, 8, 0, 0.0).added(0, 8, 2, 0.0)
  got = stats.snapshot(d, stats.Times(1.0, 2.0, 3.0))
  assert got == {
    "batches": 3,
    "real_rows": 13,
    "padded_rows": 11,
    "dummy_batches": 1,
    "dropped_batches": 2,
    "wait_s": 0.0,
    "source_s": 1.0,
    "exchange_s": 2.0,
    "transfer_s": 3.0,
  }


@pytest.mark.parametrize("step_s", [0.005, 0.02, 0.3, 0.5, 2.0])
def test_pace_never_counts_more_than_a_steady_consumer_takes_in_the_window(step_s):
  # The first window is extrapolated from the intervals seen so far; a
  # steady consumer is never counted faster than it is, at any instant.
  pace = stats.Pace(1.0, fill=2)
  for t in (0.0, 0.0):  # The queue's fill, at once.
    pace.done(t)
  for k in range(int(3.0 / step_s)):
    t = 0.1 + k * step_s
    pace.done(t)
    for now in (t, t + step_s / 2):
      assert pace.count(now) <= 1.0 / step_s + 1, (k, now)
  assert pace.count(t) == pytest.approx(1.0 / step_s, abs=1)  # The window is full.


@pytest.mark.parametrize("store_ms", [20.0 + 0.05 * i for i in range(41)])
def test_pace_counts_a_position_on_the_window_edge_out_however_virtual_time_rounds(store_ms):
  # A consumer taking one every half window, its times summed as a simulated
  # host's clock sums them (three store calls, then half-second steps): one
  # position lands on the window's edge, rounded to either side of it. It is
  # out (2 a window, not 3): at 21.1 ms it was counted, and a simulated stop
  # landed a batch later than at 21.05 or 21.15.
  pace, t = stats.Pace(1.0, fill=0), 0.0
  for _ in range(3):
    t += store_ms / 1e3
  for k in range(10):
    pace.done(t)
    if k >= 3:
      assert pace.count(t) == 2, (k, t)
    t += 0.5


def test_pace_grows_with_a_starved_consumer_before_the_window_fills():
  # Positions come in rounds of 0.1 s, each as large as the count says (a
  # horizon that follows the pace). The plain count of the window's
  # positions would double a round (16 after 5); extrapolated, it grows about
  # threefold, and never counts more than twice the positions done.
  pace, now, counts, done = stats.Pace(1.0, fill=0), 0.0, [], []
  for _ in range(5):
    now += 0.1
    for i in range(max(1, pace.count(now))):
      pace.done(now + i * 1e-4)  # A round's positions, as the build hands them on.
    done.append(done[-1] + i + 1 if done else i + 1)
    counts.append(pace.count(now + 0.01))
  assert counts[-1] >= 50
  assert all(c <= 2 * d for c, d in zip(counts, done, strict=True))


# stats(all_hosts=True): process p reads STRAGGLER_BATCHES + p full batches and
# a short one of 5 rows; the slowed host sleeps before each of its batches.
STRAGGLER_BATCHES = 24
STRAGGLER_READ_S = 0.03


class _Captured(logging.Handler):
  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    self.messages.append(record.getMessage())


def straggler(slow: int) -> dict[str, Any]:
  """Iterates with host `slow` slowed; every host's cross-host table and warnings."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  data: Any = scenarios.make_batches(p, [8] * (STRAGGLER_BATCHES + p) + [5])
  if p == slow:
    data = SlowSource(data, STRAGGLER_READ_S)
  captured = _Captured()
  log = logging.getLogger("grain_jax_sync._src.job_stats")
  log.addHandler(captured)
  try:
    with gjs.iter_jax_batches(data, **PADDED, synchronize_lookahead=2) as it:
      n = sum(1 for _ in it)
      return {
        "yielded": n,
        "own": it.stats(),
        "job": it.stats(all_hosts=True),
        "warnings": captured.messages,
      }
  finally:
    log.removeHandler(captured)


def _expected_counts(p: int, n: int) -> tuple[int, int, int, int, int]:
  """Host p's counts in `straggler` with n processes (batch size 8)."""
  b = STRAGGLER_BATCHES
  positions = b + n  # The longest host: b + n - 1 full batches and a short one.
  dummies = n - 1 - p
  return (positions, 8 * (b + p) + 5, 3 + 8 * dummies, dummies, 0)


def _check_job(outs: list[dict], n: int, slowed: tuple[int, ...]) -> None:
  for slow in slowed:
    for p, out in enumerate(outs):
      r = out[slow]
      job = r["job"]
      assert job["slowest"] == slow, (p, slow, job)
      assert [h["process_index"] for h in job["hosts"]] == list(range(n))
      for q, host in enumerate(job["hosts"]):
        assert _counts(host) == _expected_counts(q, n), (p, q, host)
        assert host["padding_fraction"] == host["padded_rows"] / (8 * host["batches"])
      assert job["hosts"][p] == {
        **r["own"],
        "process_index": p,
        "padding_fraction": job["hosts"][p]["padding_fraction"],
      }
      # Every host's view sees the sleeps in the slowed host's source time.
      assert job["hosts"][slow]["source_s"] >= 0.5 * STRAGGLER_READ_S * STRAGGLER_BATCHES
      # One warning, at process 0, naming the slowed host.
      if p == 0:
        assert len(r["warnings"]) == 1, r["warnings"]
        assert r["warnings"][0].startswith(f"grain_jax_sync: process {slow}'s source")
      else:
        assert r["warnings"] == []


def stragglers(slowed: tuple[int, ...]) -> dict[int, dict[str, Any]]:
  """`straggler` once per slowed host, in order (the same on every process)."""
  return {slow: straggler(slow) for slow in slowed}


def check_all_hosts_names_the_slowed_host_with_exact_counts(outs, processes, slowed):
  _check_job(outs, processes, slowed)


def test_all_hosts_in_one_process_is_this_host():
  r = straggler(0)
  assert r["job"] == {
    "hosts": [{"process_index": 0, **r["own"], "padding_fraction": 3 / (8 * r["own"]["batches"])}],
    "slowest": 0,
  }
  assert _counts(r["own"]) == _expected_counts(0, 1)
  assert r["warnings"] == []  # No peers, no straggler.


ENDED_CASES = [(None, 2), (1, 2), (None, 0), (0, 0)]


def ended_figures(cases: list[tuple[int | None, int]]) -> list[dict[str, Any]]:
  """Per (slowed host or None, prefetch_batches): own stats() at the end, then every host's view.

  Host p reads 3 + p batches (the last short); every host asks for the
  cross-host view only once every host has ended (a barrier), so each
  peer's figures at its end are posted.
  """
  import jax
  from jax.experimental import multihost_utils

  import grain_jax_sync as gjs

  p = jax.process_index()
  out = []
  for c, (slow, prefetch) in enumerate(cases):
    data: Any = scenarios.make_batches(p, [8] * (2 + p) + [5])
    if p == slow:
      data = SlowSource(data)
    with gjs.iter_jax_batches(data, **PADDED, prefetch_batches=prefetch) as it:
      n = sum(1 for _ in it)
      own = it.stats()
      multihost_utils.sync_global_devices(f"ended_figures {c}")
      out.append({"yielded": n, "own": own, "job": it.stats(all_hosts=True)})
  return out


def check_all_hosts_shows_each_peers_figures_at_its_end_and_names_no_slowest_on_a_tie(outs):
  # Host 1 saw host 0's wait_s and transfer_s as 0.0000 (as of the final
  # decision, before the last batches were built and received), and named a
  # slowest host when every source time printed as 0.0000.
  for c, (slow, _) in enumerate(ENDED_CASES):
    owns = [outs[p][c]["own"] for p in range(2)]
    for own in owns:
      assert own["wait_s"] > 0 and own["transfer_s"] > 0, own
    sources = [round(own["source_s"], 4) for own in owns]
    if slow is not None:
      assert sources[slow] > sources[1 - slow], sources  # The sleeps, 0.02 s a batch.
    expected = None if sources[0] == sources[1] else sources.index(max(sources))
    for p in range(2):
      job = outs[p][c]["job"]
      assert outs[p][c]["yielded"] == 4
      assert job["slowest"] == expected, (c, p, job, sources)
      peer = job["hosts"][1 - p]
      assert _counts(peer) == _counts(owns[1 - p]), (c, p)
      for k in ("wait_s", "source_s", "exchange_s", "transfer_s"):
        assert peer[k] == round(owns[1 - p][k], 4), (c, p, k, peer, owns[1 - p])


# -- real processes: one launch per topology, each case with its own checks -------------


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_stats_counts_are_exact_across_two_processes():
  outs = testing.values(
    testing.run_processes(run_all, num_processes=2, devices_per_process=2, timeout_s=180)
  )
  calls = {
    case: functools.partial(check_stats_counts_are_exact_across_two_processes, outs, case)
    for case in sorted(TWO_PROCESSES)
  }
  calls["received_not_prefetched"] = functools.partial(
    check_stats_count_received_batches_not_prefetched_ones_across_two_processes, outs
  )
  check_each(calls)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("processes", "devices", "slowed"), [(2, 4, (1, 0)), (4, 2, (2, 0))])
def test_all_hosts_view_names_the_slowed_host_and_each_peers_end(processes, devices, slowed):
  # At 2 x 4 the same launch also takes every host's view once all have ended.
  cases = {"stragglers": (stragglers, (slowed,), {})}
  checks = {
    "stragglers": functools.partial(
      check_all_hosts_names_the_slowed_host_with_exact_counts, processes=processes, slowed=slowed
    )
  }
  if processes == 2:
    cases["ended"] = (ended_figures, (ENDED_CASES,), {})
    checks["ended"] = (
      check_all_hosts_shows_each_peers_figures_at_its_end_and_names_no_slowest_on_a_tie
    )
  check_cases(run_cases(processes, devices, cases, timeout_s=240), checks)


def test_times_sum_and_report_every_field():
  # `Times.__add__` and `snapshot` name the fields by hand (a snapshot is
  # taken in the agreement thread): a field added to `Times` alone would sum
  # as 0 and go unreported.
  names = [f.name for f in dataclasses.fields(stats.Times)]
  a = stats.Times(*(float(i + 1) for i in range(len(names))))
  b = stats.Times(*(10.0 * (i + 1) for i in range(len(names))))
  assert dataclasses.astuple(a + b) == tuple(11.0 * (i + 1) for i in range(len(names)))
  got = stats.snapshot(stats.Delivered(), a)
  assert {k: got[k] for k in names} == dataclasses.asdict(a)
  assert set(stats.TIMES) == {"wait_s", *names}  # Posted to the peers, with the wait.
