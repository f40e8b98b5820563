"""The fault matrix on real processes: every host ends the same way.

A source error, an empty shard and diverged settings at more hosts, and every
schedule of them, run on the simulated cluster (tests/test_sim_cluster.py);
here, the iterator's own checks (structure, settings digests, padding) and
the kills.

Each case either raises the same clear error on every host or yields the same
batches on every host, within a bound. To keep CI cheap, one run of N
processes per topology executes every data and settings case in sequence (each
with its own iterator and exchange keys, see `scenarios_faults.run_cases`),
and one test checks every case of that run, naming each case that fails.
Killed processes need a run of their own.
"""

from __future__ import annotations

import functools
import re
import time

import numpy as np
import pytest
import scenarios
import scenarios_faults
from helpers import check_each

from grain_jax_sync import testing

TOPOLOGIES = [pytest.param(2, 4, id="2x4")]  # More hosts: tests/test_sim_cluster.py.
TIMEOUT = 150
BOUND_S = 30.0  # Every faulty case ends on every host well within this.
SIX = [8] * 6


def _sizes(n, victim_sizes, others=SIX):
  return [list(others)] * (n - 1) + [list(victim_sizes)]


def _on_victim(n, value):
  return [None] * (n - 1) + [value]


def _cases(n):
  """Every data and settings case; the last process is the faulty one."""
  base = {"batch_size": 8, "synchronize_lookahead": 4}
  pad = {**base, "paddings": 0, "mask_key": "mask"}
  cases = {}
  # Structure disagreements (from the first batch) and a mid-stream change.
  for label, mutation, at in (
    ("keys", "drop_y", 0),
    ("renamed", "rename_y", 0),
    ("nesting", "nest_y", 0),
    ("dtype", "y_float64", 0),
    ("trailing_shape", "y_trailing_3", 0),
    ("mid_stream", "drop_y", 3),
  ):
    cases[f"structure_{label}"] = {
      "sizes": _sizes(n, SIX),
      "kwargs": base,
      "mutate": _on_victim(n, (at, mutation)),
    }
  # Settings disagreements: the last process was given something else.
  for label, good, bad in (
    ("batch_size", base, {**base, "batch_size": 16}),
    ("drop_last", base, {**base, "drop_last": True}),
    ("paddings", pad, {**pad, "paddings": -1}),
    (
      "paddings_numpy_scalar",
      {**pad, "paddings": np.float32(0)},
      {**pad, "paddings": np.float32(1)},
    ),
    ("mask_key", pad, {**pad, "mask_key": "valid"}),
  ):
    cases[f"config_{label}"] = {"sizes": _sizes(n, SIX), "kwargs": [good] * (n - 1) + [bad]}
  # Empty shards.
  for label, kwargs in (
    ("plain", base),
    ("padded", pad),
    ("drop_last", {**base, "drop_last": True}),
  ):
    cases[f"one_empty_{label}"] = {"sizes": _sizes(n, [], others=[8, 8]), "kwargs": kwargs}
  return cases


def _run_matrix(n, d):
  """Every case of `_cases(n)` in one set of n processes: {label: every process's value}, outcomes."""
  cases = _cases(n)
  outcomes = testing.run_processes(
    scenarios_faults.run_cases,
    num_processes=n,
    devices_per_process=d,
    args=(list(cases.values()),),
    timeout_s=TIMEOUT,
  )
  per_process = testing.values(outcomes)
  return {label: [per_process[p][i] for p in range(n)] for i, label in enumerate(cases)}, outcomes


def _assert_same_error_everywhere(outs, error_type, *needles):
  messages = {out["error"] for out in outs}
  assert len(messages) == 1, messages  # Word for word the same on every host.
  for out in outs:
    assert out["error_type"] == error_type, out
    for needle in needles:
      assert needle in out["error"], (needle, out["error"])


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_every_fault_case_ends_every_host_the_same_way_within_the_bound(n, d):
  # One launch; each case's checks run, and a failure names every failed case.
  results, outcomes = _run_matrix(n, d)
  assert [o.exit_code for o in outcomes] == [0] * n  # Every process exits cleanly after it all.
  assert all(o.elapsed_s < TIMEOUT for o in outcomes)
  for label, outs in results.items():
    for out in outs:
      assert out["elapsed_s"] < BOUND_S, (label, out["elapsed_s"])
  checks = {
    f"structure_{label}": functools.partial(check_structure_disagreement, n, needles)
    for label, needles in STRUCTURE_NEEDLES.items()
  }
  checks["structure_mid_stream"] = functools.partial(check_structure_change_mid_stream, n)
  checks.update(
    {
      f"config_{label}": functools.partial(check_settings_disagreement, n, needle)
      for label, needle in SETTINGS_NEEDLES.items()
    }
  )
  checks["one_empty_plain"] = functools.partial(check_one_empty_shard_without_options, n)
  checks["one_empty_padded"] = functools.partial(check_one_empty_shard_with_paddings, n)
  checks["one_empty_drop_last"] = check_one_empty_shard_with_drop_last
  assert sorted(checks) == sorted(results), "every case has its checks"
  check_each({label: functools.partial(check, results[label]) for label, check in checks.items()})


# -- structure disagreements -------------------------------------------------------

STRUCTURE_NEEDLES = {
  "keys": ["columns only in the first: ['y']"],
  "renamed": ["columns only in the first: ['y']", "columns only in the second: ['z']"],
  "nesting": ["columns only in the first: ['y']", "columns only in the second: ['y/inner']"],
  "dtype": ["column 'y': dtype float32 vs float64"],
  "trailing_shape": ["column 'y': trailing shape (2,) vs (3,)"],
}


def check_structure_disagreement(n, needles, outs):
  _assert_same_error_everywhere(
    outs, "ValueError", f"processes 0 and {n - 1} yield batches of different structure", *needles
  )
  assert all(out["n"] == 0 for out in outs)


def check_structure_change_mid_stream(n, outs):
  _assert_same_error_everywhere(
    outs,
    "ValueError",
    f"process {n - 1}, batch 3: the batch structure changed mid-stream",
    "columns only in the first: ['y']",
  )
  assert all(out["n"] == 3 for out in outs)


# -- settings disagreements --------------------------------------------------------

SETTINGS_NEEDLES = {
  "batch_size": "batch_size: 8 vs 16",
  "drop_last": "drop_last: False vs True",
  "paddings": "paddings: '0' vs '-1'",
  "paddings_numpy_scalar": "paddings: '0.0' vs '1.0'",
  "mask_key": "mask_key: 'mask' vs 'valid'",
}


def check_settings_disagreement(n, needle, outs):
  _assert_same_error_everywhere(
    outs, "ValueError", f"processes 0 and {n - 1} were given different settings", needle
  )
  assert all(out["n"] == 0 for out in outs)
  assert not any("the same devices in the same order" in out["error"] for out in outs)


# -- empty shards ------------------------------------------------------------------


def check_one_empty_shard_without_options(n, outs):
  _assert_same_error_everywhere(
    outs,
    "ValueError",
    f"Uneven number of batches detected across JAX workers: process {n - 1} ran out of data"
    " at batch 0",
  )


def check_one_empty_shard_with_paddings(n, outs):
  for out in outs:
    assert out["error"] is None and out["n"] == 2
    for b, batch in enumerate(out["batches"]):
      want = np.concatenate([scenarios.rows_for(q, b, 8) for q in range(n - 1)] + [np.zeros(8)])
      np.testing.assert_array_equal(batch["x"], want)
      np.testing.assert_array_equal(batch["mask"], np.arange(8 * n) < 8 * (n - 1))


def check_one_empty_shard_with_drop_last(outs):
  for out in outs:
    assert out["error"] is None and out["n"] == 0


# -- a process is killed -----------------------------------------------------------

KILL_SYNC_TIMEOUT_S = 4.0
HEARTBEAT_S = 30  # Longer than the sync timeout: the library speaks first.


@pytest.mark.multiprocess
def test_killed_host_survivors_raise_naming_it_within_sync_timeout():
  # At 4 hosts and inline: tests/test_sim_cluster.py.
  n, d, victim = 2, 4, 1  # Not the coordinator (process 0 hosts the coordination service).
  outcomes = testing.run_processes(
    scenarios_faults.run_kill,
    num_processes=n,
    devices_per_process=d,
    args=(victim, [[8] * 6] * n, 2, KILL_SYNC_TIMEOUT_S),
    kwargs={"linger_s": 3.0},
    timeout_s=TIMEOUT,
    heartbeat_timeout_s=HEARTBEAT_S,
    exit_barrier_timeout_s=0,
  )
  assert outcomes[victim].exit_code == -9 and outcomes[victim].value is None
  for o in outcomes:
    if o.process_index == victim:
      continue
    assert o.exit_code == 0, o.log
    out = o.value
    # What was agreed before the kill was yielded (how much the victim had
    # posted when it died depends on its read-ahead).
    assert out["n"] <= 2
    assert out["error_type"] == "PeerTimeoutError"
    assert re.match(rf"process {victim} did not report (window|batch) \d+.* within", out["error"])
    assert "`sync_timeout_s`=4s" in out["error"] and "may have died" in out["error"]
    assert KILL_SYNC_TIMEOUT_S <= out["elapsed_s"] < KILL_SYNC_TIMEOUT_S + 10
    assert out["close_s"] < 5
    assert not [t for t in out["threads"] if t.startswith("grain_jax_sync")]


@pytest.mark.multiprocess
def test_killed_host_with_long_sync_timeout_jax_terminates_survivors_at_heartbeat():
  # With `sync_timeout_s` above the heartbeat timeout, JAX's coordination
  # service detects the dead task first and aborts every survivor, naming it.
  heartbeat = 5
  start = time.monotonic()
  outcomes = testing.run_processes(
    scenarios_faults.run_kill,
    num_processes=2,
    devices_per_process=2,
    args=(1, [[8] * 6] * 2, 2, 120.0),
    timeout_s=TIMEOUT,
    heartbeat_timeout_s=heartbeat,
    exit_barrier_timeout_s=0,
  )
  wall_s = time.monotonic() - start
  survivor = outcomes[0]
  assert wall_s < 60  # Start-up plus about one heartbeat timeout.
  assert outcomes[1].exit_code == -9
  assert survivor.exit_code == -6 and survivor.value is None  # SIGABRT, no Python error.
  assert "The following tasks are unhealthy (stopped sending heartbeats):\n1" in survivor.log


@pytest.mark.multiprocess
def test_killed_coordinator_survivors_raise_or_are_terminated_promptly():
  # Process 0 hosts the coordination service. When it dies the survivor either
  # sees the store fail in its next exchange call (a RuntimeError naming
  # process 0), or JAX's error polling aborts it first: a race, both prompt.
  start = time.monotonic()
  outcomes = testing.run_processes(
    scenarios_faults.run_kill,
    num_processes=2,
    devices_per_process=2,
    args=(0, [[8] * 6] * 2, 2, 120.0),
    timeout_s=TIMEOUT,
    heartbeat_timeout_s=HEARTBEAT_S,
    exit_barrier_timeout_s=0,
  )
  wall_s = time.monotonic() - start
  survivor = outcomes[1]
  assert wall_s < 60  # Start-up included; nothing waits for `sync_timeout_s`.
  assert outcomes[0].exit_code == -9
  if survivor.exit_code == -6:  # SIGABRT from JAX, no Python error.
    assert "Failed to send RPC to coordination service" in survivor.log
  else:
    assert survivor.exit_code == 0, survivor.log
    assert survivor.error_type is None, (
      survivor.error_type,
      survivor.error_message,
      survivor.traceback,
    )
    out = survivor.value
    assert out["error_type"] == "RuntimeError", out
    assert "the jax.distributed key-value store failed while" in out["error"]
    assert "if process 0 died" in out["error"].lower()
    assert out["elapsed_s"] < 10
