"""The key-value exchange and the pipelined agreement's ledger.

Ledger tests are pure; exchange tests run real processes joined by
jax.distributed, whose coordination service holds the key-value store.
"""

from __future__ import annotations

import pytest
import scenarios_perf

from grain_jax_sync import testing
from grain_jax_sync._src import exchange
from grain_jax_sync._src import ledger as ledger_lib
from grain_jax_sync._src import plan as plan_lib

TIMEOUT = 180


def run(fn, *args, n=2, d=4, **kwargs):
  return testing.values(
    testing.run_processes(
      fn, num_processes=n, devices_per_process=d, args=args, kwargs=kwargs, timeout_s=TIMEOUT
    )
  )


def chunk(p, start, rows, *, exhausted=False, error=None, ack=0, sig=None):
  return ledger_lib.Chunk(
    start=start,
    ack=ack,
    report=plan_lib.Report(
      process_index=p, rows=tuple(rows), exhausted=exhausted, error=error, signature=sig
    ),
  )


# -- ledger (pure) ------------------------------------------------------------------


def test_chunk_json_round_trip():
  err = plan_lib.ReportedError(plan_lib.ErrorKind.SOURCE, "boom", 1, 3, "KeyError")
  c = chunk(1, 3, [8, 4], error=err, ack=2, sig={"spec": "x", "leaves": []})
  assert ledger_lib.Chunk.from_json(c.to_json()) == c


def test_window_is_what_every_process_has_reported():
  led = ledger_lib.Ledger(3)
  led.add(chunk(0, 0, [8, 8, 8]))
  led.add(chunk(1, 0, [8]))
  assert led.window(0) == 0
  assert led.missing(0) == [2]
  led.add(chunk(2, 0, [8, 8]))
  assert led.window(0) == 1
  assert led.missing(1) == [1]
  assert led.furthest() == 3  # Process 0's three rows.
  led.add(chunk(1, 1, [8, 8, 8]))
  assert led.window(0) == 2
  assert led.window(2) == 0
  assert led.furthest() == 4  # Process 1's rows at positions 0 to 3.


def test_window_reports_end_of_stream_inside_window():
  led = ledger_lib.Ledger(2)
  led.add(chunk(0, 0, [8, 8, 8]))
  led.add(chunk(1, 0, [8], exhausted=True))
  # Process 1 ended: positions are limited by process 0 only.
  assert led.window(0) == 3
  reports = led.window_reports(0, 3, with_config=False)
  assert reports[0].rows == (8, 8, 8) and not reports[0].exhausted
  assert reports[1].rows == (8,) and reports[1].exhausted
  plan = plan_lib.decide(reports, plan_lib.Options(batch_size=8, drop_last=True, pad=False))
  assert [s.action for s in plan.steps] == [plan_lib.Action.YIELD]
  assert plan.end == plan_lib.End.STOP


def test_window_when_every_stream_ended_includes_the_end():
  led = ledger_lib.Ledger(2)
  led.add(chunk(0, 0, [8, 8], exhausted=True))
  led.add(chunk(1, 0, [8, 8], exhausted=True))
  assert led.window(0) == 3
  plan = plan_lib.decide(
    led.window_reports(0, 3, with_config=False),
    plan_lib.Options(batch_size=8, drop_last=False, pad=False),
  )
  assert len(plan.steps) == 2 and plan.end == plan_lib.End.STOP


def test_window_reports_match_a_windowed_exchange():
  # The same rows decided position by position and as one window agree.
  rows = {0: [8, 4, 8, 8], 1: [8, 8, 8]}
  led = ledger_lib.Ledger(2)
  led.add(chunk(0, 0, rows[0], exhausted=True))
  led.add(chunk(1, 0, rows[1], exhausted=True))
  opts = plan_lib.Options(batch_size=8, drop_last=False, pad=True)
  whole = plan_lib.decide(led.window_reports(0, led.window(0), with_config=False), opts)
  windowed = plan_lib.decide(
    [plan_lib.Report(process_index=p, rows=tuple(r), exhausted=True) for p, r in rows.items()],
    opts,
  )
  assert whole == windowed


def test_forget_keeps_positions_after():
  led = ledger_lib.Ledger(2)
  led.add(chunk(0, 0, [1, 2, 3]))
  led.add(chunk(1, 0, [4, 5, 6]))
  led.forget(2)
  reports = led.window_reports(2, led.window(2), with_config=False)
  assert [r.rows for r in reports] == [(3,), (6,)]
  assert led.count(0) == 3


def test_out_of_order_chunk_raises():
  led = ledger_lib.Ledger(2)
  with pytest.raises(RuntimeError, match="expected 0"):
    led.add(chunk(1, 2, [8]))


def test_ack_is_the_largest_seen():
  led = ledger_lib.Ledger(2)
  led.add(chunk(1, 0, [8], ack=3))
  led.add(chunk(1, 1, [8], ack=1))
  assert led.ack(1) == 3


def test_make_exchange_single_process_is_local():
  ex = exchange.make_exchange(synchronize=True, namespace=None)
  assert isinstance(ex, exchange.LocalExchange)
  assert ex.all_gather(0, "a") == ["a"]


# -- key-value store across processes --------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_chunks_up_decisions_down_release_and_end_round_trip(n):
  # One full group of chunks and decisions: released with one delete each.
  k = exchange.GROUP
  outs = run(scenarios_perf.exchange_roundtrip, k, n=n, d=1)
  for p, o in enumerate(outs):
    if p == 0:  # The decider reads every chunk, in order per process.
      for q in range(1, n):
        assert [v for r, v in o["got"] if r == q] == [f"{q}:{c}" for c in range(k)]
      assert len(o["got"]) == k * (n - 1)
    else:  # Every other process reads every decision.
      assert o["got"] == [(0, f"d{c}") for c in range(k)]
    assert o["left_after_release"] == []
    assert o["left_after_end"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize(
  ("kw", "batches", "error"),
  [
    pytest.param({}, 27, "ValueError", id="error_at_end"),
    pytest.param({"drop_last": True}, 27, None, id="drop_last"),
    pytest.param({"paddings": 0}, 30, None, id="padded"),
    pytest.param(
      {"paddings": 0, "synchronize_lookahead": 1, "prefetch_batches": 0}, 30, None, id="lookahead1"
    ),
  ],
)
def test_no_keys_left_after_a_full_iteration(kw, batches, error):
  sizes = [[8] * 30, [8] * 27 + [4]]
  outs = run(scenarios_perf.keys_after_iteration, sizes, {"batch_size": 8, **kw})
  for o in outs:
    assert o["batches"] == batches
    assert o["error"] == error
    assert o["left"] == []


@pytest.mark.multiprocess
def test_missing_peer_times_out_naming_it():
  outs = run(scenarios_perf.peer_never_comes, 2.0)
  o = outs[0]
  assert o["type"] == "PeerTimeoutError"
  assert "process 1 did not report" in o["message"]
  assert "sync_timeout_s" in o["message"]
  assert o["missing"] == (1,)
  assert o["threads"] == []
