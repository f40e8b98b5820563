"""Every ending on the simulated cluster: real cores, an in-memory store, virtual time.

The bounds of docs/guarantees.md, checked in virtual seconds at any step time
and host count, with a request at every batch from the first. No process, no
thread, no real second: each run takes milliseconds.
"""

from __future__ import annotations

import gc
import os
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grain_jax_sync import testing
from grain_jax_sync._src import periods
from grain_jax_sync._src.agreement import common

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The documented bound at the library's defaults (docs/guarantees.md section 10): T in seconds,
# and 2R in batches past the asker's batch k (k <= B <= k + 2R).
from benchmarks.timed_endings import bound  # noqa: E402 - the repository root, from any directory.

STEPS_S = (0.005, 0.05, 0.5, 2.0, 5.0, 10.0)


def _run(n, prefetch, plans, store_s=0.0, collective=False):
  # Steps on their own, as the real-process tests these replaced did (no collective, so
  # that a host that closed or died cannot hold a peer in its step); stops: collective.
  cluster = testing.SimulatedCluster(
    processes=n, prefetch_batches=prefetch, store_s=store_s, collective_steps=collective
  )
  return cluster.run(plans)


def _check_stop(n, prefetch, step_s, at, offset, store_s=0.0):
  plans = [testing.HostPlan(batches=40, step_s=step_s)] * n
  asker = n - 1
  plans[asker] = testing.HostPlan(batches=40, step_s=step_s, stop=(at, offset * step_s))
  out = _run(n, prefetch, plans, store_s, collective=True)
  asked_at = out[asker].received[at - 1] + offset * step_s
  assert {o.ending for o in out} == {"end"}, [(o.ending, o.message) for o in out]
  assert {o.stopped_by for o in out} == {asker}
  assert len({o.batches for o in out}) == 1  # One batch everywhere: one checkpoint.
  most = bound(prefetch, step_s)
  assert at <= out[0].batches <= at + most.batches, (out[0].batches, most)
  latency = max(o.ended_at for o in out) - asked_at
  assert latency <= most.seconds, (latency, most)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("step_s", STEPS_S)
@pytest.mark.parametrize("n", [2, 8])
def test_a_stop_asked_at_any_batch_ends_every_host_at_one_batch_within_the_bound(
  n, step_s, prefetch
):
  for at in range(1, 7):
    for offset in (0.0, 0.3, 0.9):  # Into the step after batch `at`.
      _check_stop(n, prefetch, step_s, at, offset)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("step_s", [0.05, 2.0])
def test_a_stop_with_5_ms_store_round_trips_ends_every_host_within_the_bound(step_s, prefetch):
  # Every store call's result reaches its core 5 ms late (a loaded coordinator).
  for at in range(1, 7):
    _check_stop(8, prefetch, step_s, at, 0.3, store_s=0.005)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("step_s", [0.05, 2.0, 10.0])
def test_a_stop_at_64_hosts_ends_every_host_at_one_batch_within_the_bound(step_s, prefetch):
  for at in (1, 2, 5):
    _check_stop(64, prefetch, step_s, at, 0.3)


def test_a_stop_in_the_start_up_burst_is_not_taken_for_the_consumers_pace():
  # A 5 s step, the stop 1.5 s into the step after batch 1: the prefetch
  # queue's fill once counted as pace, and every host ended 18.5 s after the
  # request against a bound of 17 s.
  _check_stop(2, 2, 5.0, 1, 0.3)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("step_s", [0.02, 2.0])
def test_a_close_at_batch_5_reaches_every_peer_within_the_bound(step_s, prefetch):
  n = 4
  plans = [testing.HostPlan(batches=40, step_s=step_s)] * n
  plans[2] = testing.HostPlan(batches=40, step_s=step_s, close_at=5)
  out = _run(n, prefetch, plans)
  closed_at = out[2].ended_at
  assert out[2].ending == "closed"
  for o in out[:2] + out[3:]:
    assert o.ending == "RuntimeError", o
    assert "process 2 closed its iterator at batch 5" in o.message
    assert o.ended_at - closed_at <= bound(prefetch, step_s).seconds
  # The peers get the batches decided before the close reached process 0, the same ones.
  assert len({o.batches for o in out if o.process_index != 2}) == 1 and out[0].batches >= 5


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_a_source_error_at_batch_5_raises_the_same_error_on_every_host(n, prefetch):
  plans = [testing.HostPlan(batches=40, step_s=0.05)] * n
  plans[1] = testing.HostPlan(batches=40, step_s=0.05, error_at=5)
  out = _run(n, prefetch, plans)
  assert {o.batches for o in out} == {5}  # The batches before the failed read.
  messages = {o.message for o in out if o.process_index != 1}
  assert len(messages) == 1 and "process 1" in messages.pop()
  assert "source failed at batch 5" in out[1].message
  assert (
    max(o.ended_at for o in out) - min(o.ended_at for o in out) <= bound(prefetch, 0.05).seconds
  )


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_killed_peer_is_named_on_every_host_within_its_bound(prefetch):
  n = 8
  plans = [testing.HostPlan(batches=400, step_s=0.05)] * n
  plans[3] = testing.HostPlan(batches=400, step_s=0.05, kill_at=2.0)
  out = _run(n, prefetch, plans)
  assert out[3].ending == "killed"
  for o in out[:3] + out[4:]:
    assert o.ending == "PeerLostError", o
    assert "process 3" in o.message
    # Dead after its beat is still for `DEAD_AFTER_S`; looked at once per slice.
    assert o.ended_at - 2.0 <= periods.DEAD_AFTER_S + 2 * periods.LIVENESS_PERIOD_S + 1.0


@pytest.mark.parametrize("prefetch", [2])
def test_a_stop_during_a_peers_20_s_stall_ends_every_host_within_the_bound(prefetch):
  n, step_s = 4, 0.05
  plans = [testing.HostPlan(batches=40, step_s=step_s)] * n
  plans[1] = testing.HostPlan(batches=40, step_s=step_s, stall=(8, 20.0))
  plans[0] = testing.HostPlan(batches=40, step_s=step_s, stop=(6, 0.0))
  out = _run(n, prefetch, plans)
  asked_at = out[0].received[5]
  assert {o.ending for o in out} == {"end"}
  assert len({o.batches for o in out}) == 1
  assert max(o.ended_at for o in out) - asked_at <= bound(prefetch, step_s).seconds


def test_a_stop_beside_a_stalled_peer_lands_at_its_look_after_process_0s_store_wait():
  # The twin's stall_stop_2: process 0's stop waits out its store wait for the stalled peer, whose
  # look for a decision (once a liveness period) times out at that instant. The service answers
  # a timed-out store wait a round trip late, so that look finds nothing; the next one, a period
  # later, finds the stop, as in most real runs (a race: benchmarks/twin.py).
  plans = [H(batches=400, step_s=0.05, stop=(6, 0.0)), H(batches=400, step_s=0.05, stall=(8, 5.0))]
  out = _run(2, 2, plans, collective=True)
  assert {(o.ending, o.stopped_by, o.batches) for o in out} == {("end", 0, 8)}
  asked_at = out[0].received[5]
  assert [round(o.ended_at - asked_at, 6) for o in out] == [1.95, 1.95]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  n=st.integers(2, 9),
  prefetch=st.sampled_from([0, 1, 2, 4]),
  lengths=st.lists(st.integers(1, 12), min_size=9, max_size=9),
  step_s=st.sampled_from([0.005, 0.1, 1.0]),
  ending=st.sampled_from(["none", "stop", "close", "error"]),
  who=st.integers(0, 8),
  at=st.integers(1, 12),
)
def test_every_host_ends_the_same_way_on_any_schedule(
  n, prefetch, lengths, step_s, ending, who, at
):
  who = who % n
  plans = [testing.HostPlan(batches=lengths[p], step_s=step_s) for p in range(n)]
  base, last = plans[who], max(lengths[:n])  # A plan past the job's last batch is refused.
  if ending == "stop":
    plans[who] = testing.HostPlan(batches=base.batches, step_s=step_s, stop=(min(at, last), 0.0))
  elif ending == "close":
    plans[who] = testing.HostPlan(batches=base.batches, step_s=step_s, close_at=min(at, last))
  elif ending == "error" and at < base.batches:
    plans[who] = testing.HostPlan(batches=base.batches, step_s=step_s, error_at=at)
  elif ending == "error":
    ending = "none"
  out = _run(n, prefetch, plans)
  # The host that closed, or whose source failed (it raises its own error), apart.
  others = [o for o in out if o.process_index != who or o.ending in ("end", "PeerTimeoutError")]
  assert len({o.ending for o in others}) == 1, [(o.ending, o.message) for o in out]
  assert len({o.batches for o in others}) == 1
  assert len({o.message for o in others if o.process_index != who}) <= 1
  if out[who].ending == "OSError":
    assert all(out[who].message in o.message for o in others)
  if ending == "none":
    assert out[0].ending == "end" and out[0].batches == max(lengths[:n])  # Padded to the longest.


def test_the_same_schedule_gives_the_same_run():
  plans = [testing.HostPlan(batches=20 + p, step_s=0.1, read_s=0.01 * p) for p in range(8)]
  plans[5] = testing.HostPlan(batches=30, step_s=0.1, stop=(4, 0.05))
  a, b = _run(8, 2, plans), _run(8, 2, plans)
  assert a == b


# -- the twins of the real-process ending tests ---------------------------------------
#
# Each names the real-process test it replaced (tests/test_endings.py,
# tests/test_faults.py, tests/test_stop.py); the closing note of issue 48 lists them.

H = testing.HostPlan


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("at", [0, 1, 2, 5])
@pytest.mark.parametrize(
  "error",
  [OSError("disk on fire"), KeyboardInterrupt("interrupted"), SystemExit("the source gave up")],
  ids=lambda e: type(e).__name__,
)
def test_a_source_error_of_any_type_ends_every_host_naming_it(error, at, n, prefetch):
  # Was test_endings.test_any_error_type_on_one_host_ends_every_host (source kinds)
  # and test_faults.test_source_raise_on_one_host_raises_on_every_host, at 4 x 2.
  v, kind = n - 1, type(error).__name__
  plans = [H(batches=6)] * (n - 1) + [H(batches=6, error_at=at, error=error)]
  out = _run(n, prefetch, plans)
  assert (out[v].ending, out[v].message) == (kind, str(error))  # Its own exception.
  assert {o.batches for o in out} == {at}  # The batches before the failure, everywhere.
  assert len({o.message for o in out[:v]}) == 1  # Word for word the same on every peer.
  for o in out[:v]:
    assert o.ending == "RuntimeError"
    assert f"process {v} failed while reading batch {at} from its source: {kind}: {error}" in (
      o.message
    )
    assert f"process {v} raised {kind}" in o.message


def _same_value_error(out, text):
  assert {(o.ending, len(o.received)) for o in out} == {("ValueError", 0)}, out
  assert len({o.message for o in out}) == 1
  assert out[0].message.startswith(text), out[0].message


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_diverged_resume_positions_raise_the_same_value_error_on_every_host(n, prefetch):
  # Was test_endings.test_different_resume_positions_raise_on_every_host_before_any_batch.
  out = _run(n, prefetch, [H(resume=3)] * (n - 1) + [H(resume=5)])
  where = ", ".join(f"process {p} at batch {5 if p == n - 1 else 3}" for p in range(n))
  _same_value_error(out, f"the processes resume from different positions ({where})")


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_diverged_settings_raise_the_same_value_error_on_every_host(n, prefetch):
  # Was test_faults' settings cases (`config_*`), at 4 x 2.
  good, bad = {"batch_size": 8, "drop_last": False}, {"batch_size": 16, "drop_last": False}
  out = _run(n, prefetch, [H(config=good)] * (n - 1) + [H(config=bad)])
  _same_value_error(out, f"processes 0 and {n - 1} were given different settings (batch_size: 8")


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 4])
def test_a_refused_state_on_one_host_raises_the_same_value_error_on_every_host(n, prefetch):
  # Was test_endings.test_bad_state_on_one_host_raises_the_same_value_error_on_every_host,
  # at 4 x 2, and the peer's side of ..._refused_state_on_a_host_that_keeps_its_iterator_open.
  message = f"process {n - 1}: `state['batches']` must be an int >= 0, got 'three'"
  out = _run(n, prefetch, [H()] * (n - 1) + [H(refused=message)])
  _same_value_error(out, message)
  assert max(o.ended_at for o in out) < 1.0  # At once, not `sync_timeout_s` later.


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("length", [40, 400])
@pytest.mark.parametrize("at", [0, 2, 5])
def test_a_host_that_closes_at_any_batch_ends_every_peer_naming_it(at, length, n, prefetch):
  # Was test_endings.test_closing_host_ends_every_peer_naming_it (close_before, close_mid)
  # and test_stop.test_a_host_that_closes_is_known_within_a_few_batches_and_never_ends_a_peer_normally.
  v, step_s = n - 1, 0.05
  out = _run(n, prefetch, [H(batches=length, step_s=step_s)] * v + [H(batches=length, close_at=at)])
  assert (out[v].ending, out[v].batches) == ("closed", at)
  assert len({(o.message, o.batches) for o in out[:v]}) == 1
  for o in out[:v]:
    assert (o.ending, o.message) == (
      "RuntimeError",
      f"process {v} closed its iterator at batch {at}",
    )
    # Never ended normally: within 2R batches of the close (docs/guarantees.md section 10;
    # the 40-batch stream is shorter than that at this step).
    assert at <= o.batches <= min(at + bound(prefetch, step_s).batches, length)
    assert o.ended_at - out[v].ended_at <= bound(prefetch, step_s).seconds


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("stall", [True, False])
def test_a_close_from_another_thread_ends_the_peer_naming_the_batches_it_received(stall, prefetch):
  # Was test_endings.test_close_from_another_thread_ends_that_next_and_the_peer_counts_exactly:
  # process 1 closes 1 s into process 0's 6 s stall (its consumer waits for a
  # decision), or mid-stream.
  plans = [H(batches=4000, stall=(2, 6.0) if stall else None), H(batches=4000, close_s=1.0)]
  out = _run(2, prefetch, plans)
  closer, peer = out[1], out[0]
  n = closer.batches
  assert (closer.ending, closer.ended_at) == ("closed", 1.0)
  assert n in (0, 1, 2) if stall else 10 <= n < 4000, n
  assert (peer.ending, peer.message) == (
    "RuntimeError",
    f"process 1 closed its iterator at batch {n}",
  )
  assert peer.batches >= n  # The batches already decided.
  # With prefetch, the peer's agreement thread sees the close while its source stalls.
  assert peer.ended_at - 1.0 <= (6.0 if stall and prefetch == 0 else bound(prefetch, 0.05).seconds)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("closer", [0, 1])
@pytest.mark.parametrize(
  "close", [{"close_at": 38}, {"close_at": 40}, {"close_s": 1.87}], ids=["38", "40", "1.87s"]
)
def test_a_close_once_every_batch_is_decided_ends_the_peer_at_the_end_naming_it(
  close, closer, prefetch
):
  # Every position of the 40 is decided before the close: the peer receives
  # them all, and at the agreed end it raises the close (the real job's ending,
  # `python -m benchmarks.twin --rows close_end_2`), one wait there after it
  # got there, not `PeerTimeoutError` `sync_timeout_s` later.
  plans = [H(batches=40, step_s=0.05)] * 2
  plans[closer] = H(batches=40, step_s=0.05, **close)
  out = _run(2, prefetch, plans)
  n, peer = out[closer].batches, out[1 - closer]
  assert out[closer].ending == "closed" and n == close.get("close_at", 38)
  assert (peer.ending, peer.message, peer.batches) == (
    "RuntimeError",
    f"process {closer} closed its iterator at batch {n}",
    40,
  )
  at_end = peer.received[-1] + 0.05
  assert peer.ended_at - at_end <= periods.LIVENESS_PERIOD_S + 1e-9
  assert peer.ended_at - out[closer].ended_at < 2 * periods.LIVENESS_PERIOD_S  # Of 60 s.


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_close_while_waiting_at_the_end_lets_the_peers_end_normally(prefetch):
  # Host 0 got to the end and waits there for host 2 (paused 5 s) when it
  # closes: it did not leave before the end, so the peers end normally once
  # host 2 gets there, as in the real job (3 processes), and not at the next
  # wait of host 1 with host 0's close.
  plans = [H(batches=40, step_s=0.05, close_s=2.5), H(batches=40, step_s=0.05)]
  out = _run(3, prefetch, plans + [H(batches=40, step_s=0.05, pause=(39, 5.0))])
  assert (out[0].ending, out[0].ended_at) == ("closed", 2.5)
  assert [(o.ending, o.batches) for o in out[1:]] == [("end", 40)] * 2
  assert [o.ended_at for o in out[1:]] == [pytest.approx(out[2].received[-1] + 0.05)] * 2


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("closer", [0, 1])
def test_a_close_while_a_store_call_is_on_its_way_back_ends_the_peer_naming_it(closer, prefetch):
  # Store calls take 3 ms: a close lands while a post's result is on its way
  # back to the core at some of these 160 times. Its ending goes after what
  # the core posted (it is told the result first), never over it: the peer raises the
  # close, not "closed ... without starting the stream", and reads it with the
  # next decision or chunk, not a liveness period later from the close note.
  cluster = testing.SimulatedCluster(
    processes=2, prefetch_batches=prefetch, store_s=0.003, collective_steps=False
  )
  for k in range(160):
    plans = [H(batches=400, step_s=0.02)] * 2
    plans[closer] = H(batches=400, step_s=0.02, close_s=0.05 + k * 0.00125)
    out = cluster.run(plans)
    n, peer = out[closer].batches, out[1 - closer]
    assert (peer.ending, peer.message) == (
      "RuntimeError",
      f"process {closer} closed its iterator at batch {n}",
    ), k
    assert peer.batches >= n
    assert peer.ended_at - out[closer].ended_at < periods.LIVENESS_PERIOD_S / 2, k


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("late", ["stall", "pause"])
def test_a_host_late_beyond_sync_timeout_ends_every_host_with_the_same_timeout(late, n, prefetch):
  # Was test_endings.test_host_late_beyond_sync_timeout_ends_every_host_with_the_same_timeout
  # (sigstop: a stall in its source; pause: in its loop): 4 s late with
  # `sync_timeout_s`=2, under the liveness period: slow, not lost.
  v = n - 1
  slow = H(batches=400, stall=(2, 4.0)) if late == "stall" else H(batches=400, pause=(1, 4.0))
  cluster = testing.SimulatedCluster(
    processes=n, prefetch_batches=prefetch, sync_timeout_s=2.0, collective_steps=False
  )
  out = cluster.run([H(batches=400)] * v + [slow])
  assert len({(o.ending, o.message, o.batches) for o in out}) == 1, out
  assert out[0].ending == "PeerTimeoutError"
  assert f"process {v} did not report batch {out[0].batches}" in out[0].message
  assert "`sync_timeout_s`=2s" in out[0].message
  assert out[0].ended_at < 2.0 + 2.0 and max(o.ended_at for o in out) < 4.0 + 1.0


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_25_s_pause_in_one_hosts_loop_ends_normally_everywhere(prefetch):
  # Was test_endings.test_a_25_s_pause_in_one_hosts_loop_ends_normally_everywhere.
  out = _run(2, prefetch, [H(batches=400), H(batches=400, pause=(1, 25.0))])
  assert {(o.ending, o.batches) for o in out} == {("end", 400)}
  assert out[1].ended_at >= 25.0 + 399 * 0.05  # Its pause, then every step.


def test_a_decider_stuck_in_its_source_ends_every_host_with_the_followers_timeout():
  # Was test_endings.test_decider_stuck_in_its_source_ends_every_host_with_the_followers_timeout:
  # process 0 alive but stuck 26 s in its source; its agreement thread decides
  # the follower's timed-out ending at once, long before the source returns.
  grace = common.FOLLOWER_GRACE_S
  cluster = testing.SimulatedCluster(
    processes=2, prefetch_batches=2, sync_timeout_s=1.0, collective_steps=False
  )
  out = cluster.run([H(batches=400, stall=(2, 2 * grace + 6)), H(batches=400)])
  assert len({(o.ending, o.message, o.batches) for o in out}) == 1, out
  n = out[0].batches
  assert n in (0, 1, 2) and out[0].ending == "PeerTimeoutError"
  assert f"process 1 got no decision on batch {n} from process 0" in out[0].message
  for o in out:
    assert 1.0 + grace - 1 < o.ended_at < 1.0 + grace + 3.0, o.ended_at


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_stream_started_late_within_sync_timeout_ends_normally(prefetch):
  # The order of the first next(): process 1 starts its stream 5 s after process 0.
  out = _run(2, prefetch, [H(batches=40), H(batches=40, start_s=5.0)])
  assert {(o.ending, o.batches) for o in out} == {("end", 40)}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_stream_process_0_starts_too_late_times_out_naming_the_order_on_the_follower(prefetch):
  # Was test_endings.test_an_iterator_process_0_never_makes_times_out_naming_that_cause_on_the_follower.
  grace = common.FOLLOWER_GRACE_S
  cluster = testing.SimulatedCluster(
    processes=2, prefetch_batches=prefetch, sync_timeout_s=1.0, collective_steps=False
  )
  out = cluster.run([H(batches=40, start_s=100.0), H(batches=40)])
  follower = out[1]
  assert (follower.ending, follower.batches) == ("PeerTimeoutError", 0)
  assert "process 1 got no decision on batch 0 from process 0" in follower.message
  assert "it has posted no decision on this iterator yet" in follower.message
  assert "created or started their iterators in a different order" in follower.message
  assert 1.0 + 2 * grace - 1 < follower.ended_at <= 1.0 + 2 * grace + 1
  assert (out[0].ending, out[0].message) == ("PeerTimeoutError", follower.message)


@pytest.mark.parametrize(
  "plans",
  [
    [H(batches=40, start_s=100.0), H(batches=40)],  # Process 0's stream starts too late.
    [H(batches=400, stall=(2, 26.0)), H(batches=400)],  # Inline: stuck in its own next().
  ],
  ids=["late_start", "inline_stuck"],
)
def test_a_followers_timed_out_ending_ends_process_0_at_the_same_batch(plans):
  cluster = testing.SimulatedCluster(
    processes=2, prefetch_batches=0, sync_timeout_s=1.0, collective_steps=False
  )
  out = cluster.run(plans)
  # The follower gave up, posted its timed-out ending and raised: process 0,
  # late, reads that ending before it decides from the rows posted before it.
  assert out[0].batches == out[1].batches, out
  assert (out[0].ending, out[0].message) == (out[1].ending, out[1].message) != ("end", "")


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_killed_peer_with_a_short_sync_timeout_is_named_by_the_timeout(prefetch):
  # Was test_faults.test_killed_host_survivors_raise_naming_it_within_sync_timeout, at 4 x 2.
  n = 4
  plans = [H(batches=400)] * n
  plans[1] = H(batches=400, kill_at=0.12)
  cluster = testing.SimulatedCluster(
    processes=n, prefetch_batches=prefetch, sync_timeout_s=4.0, collective_steps=False
  )
  out = cluster.run(plans)
  assert out[1].ending == "killed"
  others = [o for o in out if o.process_index != 1]
  assert len({(o.ending, o.message, o.batches) for o in others}) == 1
  for o in others:
    assert o.ending == "PeerTimeoutError"
    assert re.match(r"process 1 did not report batch \d+.* within `sync_timeout_s`=4s", o.message)
    assert "may have died" in o.message
    assert 4.0 <= o.ended_at - 0.12 < 4.0 + 2.0


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 4])
def test_two_hosts_asking_a_stop_at_once_end_every_host_at_one_batch_named_alike(n, prefetch):
  # Was the "two" case of test_stop.test_request_stop_ends_every_host_at_one_batch_and_resumes_exactly.
  plans = [H(batches=200, step_s=0.005)] * n
  plans[0] = plans[n - 1] = H(batches=200, step_s=0.005, stop=(3, 0.0))
  out = _run(n, prefetch, plans)
  assert {o.ending for o in out} == {"end"}
  assert len({(o.batches, o.stopped_by) for o in out}) == 1
  assert out[0].stopped_by in (0, n - 1)
  # Within 2R of batch 3 (docs/guarantees.md section 10); the 200 batches are shorter than
  # that at a 5 ms step.
  assert 3 <= out[0].batches <= min(3 + bound(prefetch, 0.005).batches, 200)


@pytest.mark.parametrize("asker", [0, 1])
@pytest.mark.parametrize("step_s", [0.01, 3.0])
def test_inline_a_stop_asked_during_a_call_reaches_every_host_within_the_bound(step_s, asker):
  # Was the "handler" and "thread" cases of
  # test_stop.test_inline_a_stop_asked_between_or_during_calls_reaches_every_host_within_the_bound:
  # asked inside the next() that reads batch 4. Each read takes half a step: the
  # loop's period, which the bound counts, is 1.5 steps.
  plans = [H(batches=400, step_s=step_s, read_s=step_s / 2)] * 2
  plans[asker] = H(batches=400, step_s=step_s, read_s=step_s / 2, stop=(3, step_s * 1.25))
  out = _run(2, 0, plans)
  asked_at = out[asker].received[2] + step_s * 1.25
  assert {(o.ending, o.stopped_by) for o in out} == {("end", asker)}
  assert len({o.batches for o in out}) == 1 and out[0].batches >= 3
  assert max(o.ended_at for o in out) - asked_at <= bound(0, 1.5 * step_s).seconds


def test_a_close_during_its_own_20_s_source_stall_reaches_the_peer_within_the_bound():
  # Was the close of test_stop.test_a_stop_and_a_close_during_a_peers_20_s_source_stall_end_every_host_within_seconds
  # (its stop is test_a_stop_during_a_peers_20_s_stall_ends_every_host_within_the_bound).
  step_s = 0.05
  out = _run(2, 2, [H(batches=400, step_s=step_s), H(batches=400, stall=(10, 20.0), close_s=2.0)])
  closer, peer = out[1], out[0]
  assert closer.ending == "closed" and 6 <= closer.batches <= 10
  assert peer.message == f"process 1 closed its iterator at batch {closer.batches}"
  assert peer.ended_at - 2.0 <= bound(2, step_s).seconds


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_outcome_keeps_its_ending_once_the_cluster_is_collected(prefetch):
  # The closer's loop is still parked in its stalled read when the run ends:
  # collecting the cluster closes that task, which records and posts nothing.
  plans = [H(batches=40, step_s=0.05), H(batches=40, step_s=0.05, stall=(8, 20.0), close_s=1.0)]
  out = _run(2, prefetch, plans)
  before = [(o.ending, o.message, o.ended_at) for o in out]
  gc.collect()
  assert [(o.ending, o.message, o.ended_at) for o in out] == before
  assert before[1][0] == "closed"


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 4])
def test_an_empty_shard_is_padded_to_the_longest_and_all_empty_yield_nothing(n, prefetch):
  # Was test_faults' `one_empty_padded` case and
  # test_all_shards_empty_yield_zero_batches_without_error, at 4 x 2.
  out = _run(n, prefetch, [H(batches=2)] * (n - 1) + [H(batches=0)])
  assert {(o.ending, o.batches) for o in out} == {("end", 2)}
  out = _run(n, prefetch, [H(batches=0)] * n)
  assert {(o.ending, o.batches) for o in out} == {("end", 0)}


# -- collective steps, and the plans a user writes ---------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_collective_step_holds_the_hosts_together_beside_a_slow_reader(prefetch):
  # Host 1 reads for 1.5 s beside a 1 s step; host 0 asks a stop after batch 3.
  # The step ends on both hosts once both entered it: they receive each batch
  # together (inline too: host 1 waits for the decision on its posted read
  # rather than read its next batch first), and the stop ends both a step
  # later, inline a step and host 1's read of batch 4 (the real job: benchmarks.twin).
  plans = [H(batches=40, step_s=1.0, stop=(3, 0.0)), H(batches=40, step_s=1.0, read_s=1.5)]
  out = _run(2, prefetch, plans, collective=True)
  assert out[0].received == out[1].received
  assert {(o.ending, o.stopped_by, o.batches) for o in out} == {("end", 0, 3)}
  asked_at = out[0].received[2]
  reach = max(o.ended_at for o in out) - asked_at
  assert reach == pytest.approx(1.0 if prefetch else 1.0 + 1.5)
  assert reach <= bound(prefetch, 1.5 + 1.0).seconds


def test_independent_steps_let_the_hosts_drift_apart():
  # With prefetch, host 0 takes the positions decided ahead at its own pace; a
  # collective step would hold it to host 1's.
  plans = [H(batches=10, step_s=0.5), H(batches=10, step_s=1.0)]
  out = _run(2, 2, plans, collective=False)
  assert out[0].received[:4] == pytest.approx([0.0, 0.5, 1.0, 1.5])
  assert out[1].received[:4] == pytest.approx([0.0, 1.0, 2.0, 3.0])
  assert {(o.ending, o.batches) for o in out} == {("end", 10)}


def test_a_killed_peer_holds_the_others_in_a_collective_step():
  plans = [H(batches=400, step_s=0.05), H(batches=400, step_s=0.05, kill_at=2.0)]
  out = _run(2, 2, plans, collective=True)
  assert out[1].ending == "killed"
  # As a real job's collective: the survivor never leaves the step it is in.
  assert (out[0].ending, out[0].ended_at) == (None, float("inf"))
  assert 2.0 - 0.1 <= out[0].received[-1] <= 2.0 + 1e-9


@pytest.mark.parametrize("n", [2, 8])
def test_a_50_ms_store_keeps_the_pace_of_a_20_ms_step(n):
  # Issue 58: a batch every 1.25 steps or less after batch 10 (the same figure at 1,024 hosts:
  # `python -m benchmarks.sim_scale --pace`); the horizon grows from one position meanwhile.
  cluster = testing.SimulatedCluster(processes=n, prefetch_batches=2, store_s=0.05)
  out = cluster.run([H(batches=120, step_s=0.02)] * n)
  assert {(o.ending, o.batches) for o in out} == {("end", 120)}
  r = out[0].received
  assert (r[-1] - r[10]) / (len(r) - 11) <= 1.25 * 0.02


@pytest.mark.parametrize("at", [20, 30, 41, 49])
def test_a_stop_asked_while_the_agreement_waits_for_the_build_lands_within_a_horizon(at):
  # With a build thread a host reads two horizons ahead. A follower's stop asked while its
  # agreement thread waits for the build to take a run is posted then (the beat's thread), and
  # process 0 reads it before it decides past its own horizon: every host ends within
  # `decide_ahead_s` + (prefetch + 1) steps of the request, not a horizon later.
  step = 0.01
  for offset in (0.0, 0.3 * step, 0.7 * step):
    plans = [H(batches=200, step_s=step), H(batches=200, step_s=step, stop=(at, offset))]
    out = _run(2, 2, plans)
    assert {(o.ending, o.stopped_by) for o in out} == {("end", 1)}
    assert len({o.batches for o in out}) == 1
    asked = out[1].received[at - 1] + offset
    assert max(o.ended_at for o in out) - asked <= 1.0 + 3 * step


def test_an_outcome_names_the_batch_its_checkpoint_would():
  out = _run(2, 2, [H(batches=5, resume=2)] * 2)
  assert {(o.ending, len(o.received), o.batches, o.resume) for o in out} == {("end", 5, 7, 2)}
  assert [o.process_index for o in out] == [0, 1]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_close_after_a_resume_is_posted_at_the_batch_its_checkpoint_names(prefetch):
  # As the real job's close: its count is the resume position plus the batches received.
  plans = [H(batches=40, resume=3)] * 3 + [H(batches=40, resume=3, close_at=2)]
  out = _run(4, prefetch, plans)
  assert (out[3].ending, len(out[3].received), out[3].batches) == ("closed", 2, 5)
  for o in out[:3]:
    assert o.ending == "RuntimeError", o
    assert "process 3 closed its iterator at batch 5" in o.message


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_stop_before_the_first_batch_ends_every_host_at_batch_0_or_just_after(prefetch):
  plans = [H(batches=40), H(batches=40, stop=(0, 0.0))]
  out = _run(2, prefetch, plans, collective=True)
  assert {(o.ending, o.stopped_by) for o in out} == {("end", 1)}
  assert len({o.batches for o in out}) == 1 and out[0].batches <= 1


@pytest.mark.parametrize(
  ("plan", "match"),
  [
    (dict(step_s=-1.0), "`step_s` must be a finite number of seconds >= 0, got -1.0"),
    (dict(read_s=float("nan")), "`read_s` must be a finite number"),
    (dict(stop=(2, -0.5)), r"`stop` must be a finite number of seconds >= 0, got \(2, -0.5\)"),
    (dict(stop=(-1, 0.5)), r"`stop` must be an int >= 0, got \(-1, 0.5\)"),
    (dict(pause=(0, 1.0)), r"`pause` must be an int >= 1, got \(0, 1.0\)"),
    (dict(rows=0), "`rows` must be an int >= 1, got 0"),
    (dict(batches=4, error_at=4), "`error_at` must be below `batches` \\(4\\)"),
    (dict(batches=4, stall=(5, 1.0)), r"`stall` must name a read <= `batches` \(4\)"),
    (dict(kill_at=-2.0), "`kill_at` must be a finite number of seconds >= 0"),
  ],
)
def test_a_plan_that_cannot_happen_is_refused(plan, match):
  with pytest.raises(ValueError, match=match):
    H(**plan)


@pytest.mark.parametrize("field", ["stop", "close_at", "pause"])
def test_a_plan_past_the_jobs_last_batch_is_refused(field):
  value = 9 if field == "close_at" else (9, 0.5)
  plans = [H(batches=8), H(batches=6, **{field: value})]
  with pytest.raises(ValueError, match=f"`{field}` names batch 9, past the job's last \\(8"):
    _run(2, 2, plans)
