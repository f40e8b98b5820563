"""Every ending on the simulated cluster: real cores, an in-memory store, virtual time.

The bounds of docs/guarantees.md, checked in virtual seconds at any step time
and host count, with a request at every batch from the first. No process, no
thread, no real second: each run takes milliseconds.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grain_jax_sync import testing
from grain_jax_sync._src import liveness

STEPS_S = (0.005, 0.05, 0.5, 2.0, 5.0, 10.0)
DECIDE_AHEAD_S = 1.0


def bound_s(prefetch: int, step_s: float) -> float:
  """`decide_ahead_s + (prefetch_batches + 1) x step + 1 s` (docs/guarantees.md)."""
  return DECIDE_AHEAD_S + (prefetch + 1) * step_s + 1.0


def _run(n, prefetch, plans):
  cluster = testing.SimulatedCluster(processes=n, prefetch_batches=prefetch)
  return cluster.run(plans)


def _check_stop(n, prefetch, step_s, at, offset):
  plans = [testing.HostPlan(batches=40, step_s=step_s)] * n
  asker = n - 1
  plans[asker] = testing.HostPlan(batches=40, step_s=step_s, stop=(at, offset * step_s))
  out = _run(n, prefetch, plans)
  asked_at = out[asker].received[at - 1] + offset * step_s
  assert {o.ending for o in out} == {"end"}, [(o.ending, o.message) for o in out]
  assert {o.stopped_by for o in out} == {asker}
  assert len({o.batches for o in out}) == 1  # One batch everywhere: one checkpoint.
  assert out[0].batches >= at
  latency = max(o.ended_at for o in out) - asked_at
  assert latency <= bound_s(prefetch, step_s), (latency, bound_s(prefetch, step_s))


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
    assert o.ended_at - closed_at <= bound_s(prefetch, step_s)
  # The peers get the batches decided before the close reached process 0, the same ones.
  assert len({o.batches for o in out if o.process != 2}) == 1 and out[0].batches >= 5


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_a_source_error_at_batch_5_raises_the_same_error_on_every_host(n, prefetch):
  plans = [testing.HostPlan(batches=40, step_s=0.05)] * n
  plans[1] = testing.HostPlan(batches=40, step_s=0.05, error_at=5)
  out = _run(n, prefetch, plans)
  assert {o.batches for o in out} == {5}  # The batches before the failed read.
  messages = {o.message for o in out if o.process != 1}
  assert len(messages) == 1 and "process 1" in messages.pop()
  assert "source failed at batch 5" in out[1].message
  assert max(o.ended_at for o in out) - min(o.ended_at for o in out) <= bound_s(prefetch, 0.05)


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
    assert o.ended_at - 2.0 <= liveness.DEAD_AFTER_S + 2 * liveness.BEAT_S + 1.0


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
  assert max(o.ended_at for o in out) - asked_at <= bound_s(prefetch, step_s)


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
  base = plans[who]
  if ending == "stop":
    plans[who] = testing.HostPlan(batches=base.batches, step_s=step_s, stop=(at, 0.0))
  elif ending == "close":
    plans[who] = testing.HostPlan(batches=base.batches, step_s=step_s, close_at=at)
  elif ending == "error":
    plans[who] = testing.HostPlan(batches=base.batches, step_s=step_s, error_at=at)
  out = _run(n, prefetch, plans)
  # The host that closed, or whose source failed (it raises its own error), apart.
  others = [o for o in out if o.process != who or o.ending in ("end", "PeerTimeoutError")]
  assert len({o.ending for o in others}) == 1, [(o.ending, o.message) for o in out]
  assert len({o.batches for o in others}) == 1
  assert len({o.message for o in others if o.process != who}) <= 1
  if out[who].ending == "OSError":
    assert all(out[who].message in o.message for o in others)
  if ending == "none":
    assert out[0].ending == "end" and out[0].batches == max(lengths[:n])  # Padded to the longest.


def test_the_same_schedule_gives_the_same_run():
  plans = [testing.HostPlan(batches=20 + p, step_s=0.1, read_s=0.01 * p) for p in range(8)]
  plans[5] = testing.HostPlan(batches=30, step_s=0.1, stop=(4, 0.05))
  a, b = _run(8, 2, plans), _run(8, 2, plans)
  assert a == b
