"""The pipelined agreement's ledger: chunks, windows, acks (pure Python)."""

from __future__ import annotations

import pytest

from grain_jax_sync._src import messages
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.agreement import ledger as ledger_lib


def chunk(p, start, rows, *, exhausted=False, error=None, ack=0, sig=None):
  return messages.Chunk(
    start=start,
    ack=ack,
    report=messages.Report(
      process_index=p, rows=tuple(rows), exhausted=exhausted, error=error, signature=sig
    ),
  )


# -- ledger (pure) ------------------------------------------------------------------


def test_chunk_json_round_trip():
  err = messages.ReportedError(messages.ErrorKind.SOURCE, "boom", 1, 3, "KeyError")
  c = chunk(
    1,
    3,
    [8, 4],
    error=err,
    ack=2,
    sig={"spec": {"d": [["x", "*"]]}, "leaves": [["x", "int32", []]]},
  )
  assert messages.Chunk.from_json(c.to_json()) == c


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
  plan = plan_lib.decide(reports, plan_lib.Rules(batch_size=8, drop_last=True, pad=False))
  assert [s.action for s in plan.steps] == [messages.Action.YIELD]
  assert plan.end == messages.Outcome.STOP


def test_window_when_every_stream_ended_includes_the_end():
  led = ledger_lib.Ledger(2)
  led.add(chunk(0, 0, [8, 8], exhausted=True))
  led.add(chunk(1, 0, [8, 8], exhausted=True))
  assert led.window(0) == 3
  plan = plan_lib.decide(
    led.window_reports(0, 3, with_config=False),
    plan_lib.Rules(batch_size=8, drop_last=False, pad=False),
  )
  assert len(plan.steps) == 2 and plan.end == messages.Outcome.STOP


def test_window_reports_match_a_windowed_exchange():
  # The same rows decided position by position and as one window agree.
  rows = {0: [8, 4, 8, 8], 1: [8, 8, 8]}
  led = ledger_lib.Ledger(2)
  led.add(chunk(0, 0, rows[0], exhausted=True))
  led.add(chunk(1, 0, rows[1], exhausted=True))
  opts = plan_lib.Rules(batch_size=8, drop_last=False, pad=True)
  whole = plan_lib.decide(led.window_reports(0, led.window(0), with_config=False), opts)
  windowed = plan_lib.decide(
    [messages.Report(process_index=p, rows=tuple(r), exhausted=True) for p, r in rows.items()],
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


def test_window_reports_reused_only_while_they_hold():
  """Reports kept across windows (`Ledger._held`) equal a fresh ledger's, JSON path included."""
  led = ledger_lib.Ledger(3)
  sig = {"spec": {"d": [["x", "*"]]}, "leaves": [["x", "int32", []]]}
  led.set_own(0, signature=sig, devices=1, config=None)
  posts = {  # Per window: process 1's and 2's chunks (process 0 adds its own rows).
    0: ([8, 8], [8, 8, 8]),
    2: ([8, 8], [8]),  # Process 2 is one ahead, then not: `more` changes.
    4: ([8, 4], [8, 8]),  # A short row in a held window.
    6: ([8, 8], [8, 8]),
    8: ([8], [8]),  # A shorter window.
  }
  count = [0, 0, 0]
  for j, (a, b) in posts.items():
    for p, rows in ((1, a), (2, b)):
      text = chunk(p, count[p], rows, sig=sig if count[p] == 0 else None).to_json()
      led.add_json(text)
      count[p] += len(rows)
    for _ in range(len(a)):
      led.add_rows(0, 8)
    size = led.window(j)
    fresh = ledger_lib.Ledger(3)
    fresh._base, fresh._rows = list(led._base), [type(q)(q) for q in led._rows]
    fresh._signature, fresh._devices = list(led._signature), list(led._devices)
    assert led.window_reports(j, size, with_config=False) == fresh.window_reports(
      j, size, with_config=False
    )
    led.forget(j + size)
    count[0] += len(a)
  led.add_json(chunk(1, count[1], [], exhausted=True).to_json())
  reports = led.window_reports(9, 0, with_config=False)
  assert reports[1].exhausted and not reports[2].exhausted
