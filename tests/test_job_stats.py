"""The cross-host view's pieces: the codec additions, the decided counts, the straggler rule."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from grain_jax_sync._src import batches, job_stats, messages, trees
from grain_jax_sync._src.agreement import ledger

Y, D = messages.Action.YIELD, messages.Action.DROP
SIGNATURE = batches.Signature.of(*trees.flatten({"x": np.zeros((8, 2), np.int32)})).to_json()


def test_chunk_carries_times_only_when_given():
  report = messages.Report(process_index=3, rows=(8, 5), exhausted=True, signature=SIGNATURE)
  plain = messages.Chunk(start=4, ack=2, report=report)
  timed = messages.Chunk(start=4, ack=2, report=report, times=(0.5, 1.25, 0.0, 2.0))
  assert '"t"' not in plain.to_json()
  assert messages.Chunk.from_json(plain.to_json()) == plain
  assert messages.Chunk.from_json(timed.to_json()) == timed


def test_decision_carries_the_table_only_when_given():
  steps = (messages.Step(Y, 8, ()),) * 3
  table = ((0, 3, 24, 0, 0, 0, 0.1, 0.2, 0.3, 0.4), (2, 3, 20, 4, 0, 1, 0.0, 9.5, 0.0, 0.0))
  plain = messages.Decision(7, steps, messages.Outcome.CONTINUE, batch_size=8)
  with_table = messages.Decision(7, steps, messages.Outcome.STOP, batch_size=8, table=table)
  assert '"t"' not in plain.to_json()
  assert messages.Decision.from_json(plain.to_json()) == plain
  assert messages.Decision.from_json(with_table.to_json()) == with_table


def _no_clock() -> float:
  raise AssertionError("the table read the host's clock for the core")


def test_decided_counts_rows_per_host_and_the_table_goes_to_followers(monkeypatch):
  decider = job_stats.JobTable(lambda: _own(0.0))
  # What the agreement's core calls reads no clock: it is handed the core's `now`.
  monkeypatch.setattr(job_stats.time, "monotonic", _no_clock)
  decider.attach(0, 3)
  full = messages.Step(Y, 8, (8, 8, 8))
  decider.decided((full, full, messages.Step(Y, 8, (8, 5, 0)), messages.Step(D, 0, (8, 8, 3))))
  decider.add_times([(2, (0.0, 7.0, 0.0, 0.0))])
  rows = decider.rows_to_send(final=True, now=0.0)
  assert rows is not None and [r[0] for r in rows] == [0, 1, 2]
  assert decider.rows_to_send(final=True, now=0.0) is None  # Nothing changed since.
  # Between decisions the table is due on the core's clock (`now`), not the host's.
  decider.add_times([(1, (0.0, 1.0, 0.0, 0.0))])
  assert decider.rows_to_send(final=False, now=job_stats.TABLE_EVERY_S / 2) is None
  later = decider.rows_to_send(final=False, now=job_stats.TABLE_EVERY_S)
  assert later is not None and [r[0] for r in later] == [0, 1]
  decider.check_stragglers(job_stats.TABLE_EVERY_S)
  monkeypatch.undo()  # A table is made outside the core (`session.Streams`), on the host's clock.
  follower = job_stats.JobTable(lambda: _own(0.0))
  follower.attach(1, 3)
  follower.merge(rows)
  view = follower.view()
  assert view["slowest"] == 2
  host0, _, host2 = view["hosts"]
  assert (host0["batches"], host0["real_rows"], host0["padded_rows"]) == (3, 24, 0)
  assert (host2["batches"], host2["real_rows"], host2["padded_rows"]) == (3, 16, 8)
  assert (host2["dummy_batches"], host2["dropped_batches"], host2["source_s"]) == (1, 1, 7.0)
  assert host2["padding_fraction"] == 8 / 24


@pytest.mark.parametrize(
  ("sources", "slowest"),
  [
    ([0.0, 0.00004, 0.0], None),  # Every one 0.0000 as printed: nothing tells them apart.
    ([0.5, 0.50004, 0.1], None),  # A tie at the top, at 0.1 ms.
    ([0.5, 0.5002, 0.1], 1),
    ([0.00004], 0),  # One host: itself.
  ],
)
def test_slowest_is_none_where_the_most_source_time_ties_at_the_printed_precision(sources, slowest):
  hosts = [{"process_index": p, "source_s": s} for p, s in enumerate(sources)]
  assert job_stats.slowest(hosts) == slowest


def _own(source_s: float) -> dict:
  return {
    "batches": 0,
    "real_rows": 0,
    "padded_rows": 0,
    "dummy_batches": 0,
    "dropped_batches": 0,
    "wait_s": 0.0,
    "source_s": source_s,
    "exchange_s": 0.0,
    "transfer_s": 0.0,
  }


@pytest.mark.parametrize(
  ("sources", "warned"),
  [
    ([0.1, 0.1, 1.0, 0.1], 2),  # 10x the median and all of the wall time.
    ([0.6, 0.6, 1.0, 0.6], None),  # Less than twice the median.
    ([0.001, 0.001, 0.01, 0.001], None),  # 10x, but a quick source: 1% of the wall time.
  ],
)
def test_straggler_rule_is_ratios_over_windows_and_warns_once(caplog, sources, warned):
  s = job_stats.Stragglers(100.0)
  with caplog.at_level(logging.WARNING, logger=job_stats.__name__):
    for w in range(1, 2 * job_stats.STRAGGLER_WINDOWS + 1):
      s.seen(2)
      s.check(0, [x * w for x in sources], 100.0 + w)
      if w < job_stats.STRAGGLER_WINDOWS:
        assert s.warned is None  # Not before the windows in a row.
  assert s.warned == warned
  assert len(caplog.records) == (warned is not None)
  if warned is not None:
    assert "process 2's source is the straggler" in caplog.records[0].getMessage()


def test_straggler_streak_needs_fresh_figures_in_a_row():
  s = job_stats.Stragglers(0.0)
  for w in range(2 * job_stats.STRAGGLER_WINDOWS):
    s.check(0, [0.0, 1e9], float(w))  # Host 1's figure never refreshed: no window of its ends.
  assert s.warned is None


@pytest.mark.parametrize(
  "report",
  [
    messages.Report(process_index=1, rows=(8, 8, 5)),
    messages.Report(process_index=1, rows=(8, 3), exhausted=True, signature=SIGNATURE),
    messages.Report(process_index=1, rows=(8,), config={"b": 8}, resume=0, more=True),
  ],
)
def test_ledger_add_json_records_what_add_records(report):
  chunk = messages.Chunk(start=0, ack=3, report=report, times=(0.0, 1.5, 0.0, 0.25))
  a, b = ledger.Ledger(2), ledger.Ledger(2)
  for led in (a, b):
    led.add_rows(0, 8)
  a.add(chunk)
  assert b.add_json(chunk.to_json()) == (1, (0.0, 1.5, 0.0, 0.25))
  assert (a.count(1), a.ack(1), a.ended(1)) == (b.count(1), b.ack(1), b.ended(1))
  assert a.window_reports(0, 3, with_config=True) == b.window_reports(0, 3, with_config=True)
  with pytest.raises(messages.ProtocolError):
    b.add_json('{"v": 2, "s": 0, "a": 0, "R": {"p": 1}}')
