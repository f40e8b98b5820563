"""Endings that need real processes: real sources, threads, the garbage collector, gloo.

Which host ends how and when (stops, closes, source errors, stalls, pauses,
timeouts, kills, diverged states, the order of the first next()) is checked
on the simulated cluster, at 2 to 64 hosts (tests/test_sim_cluster.py). Here:
the iterator's own errors (conversion, values, names, states), a close by the
finalizer or from a watchdog thread, a SIGKILL before the first beat, the
collective fallback, restarts, key hygiene. The last process is the faulty
one ("victim"); one run of processes executes every error and state case in
turn (`scenarios_endings.run_endings`). Each host checks the rows of its own
shards (no collective in the test, so that a host that closed or died cannot
hang a peer in a gather).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import scenarios
import scenarios_endings
import scenarios_faults

from grain_jax_sync import testing

TOPOLOGIES = [pytest.param(2, 4, id="2x4")]  # More hosts: tests/test_sim_cluster.py.
TIMEOUT = 180
BOUND_S = 15.0  # Every case ends on every host within this, with default settings.
KINDS = [
  "type_error",
  "get_state_oserror",
  "keyboard_interrupt",
  "system_exit",
  "unprintable",
  "open_fails",
  "int64",
  "float64",
  "float16",
  "same_name",
  "close_drop",
  "state_settings",
  "state_missing_field",
  "state_bad_type",
  "state_unknown_version",
  "state_bad_source",
]
_RUNS: dict = {}


def _endings(n, d):
  if (n, d) not in _RUNS:
    try:
      outs = testing.values(
        testing.run_processes(
          scenarios_endings.run_endings,
          num_processes=n,
          devices_per_process=d,
          args=(KINDS,),
          timeout_s=TIMEOUT,
        )
      )
      _RUNS[(n, d)] = {k: [outs[p][i] for p in range(n)] for i, k in enumerate(KINDS)}
    except Exception as e:  # noqa: BLE001 - re-raised by every reader.
      _RUNS[(n, d)] = e
  if isinstance(_RUNS[(n, d)], Exception):
    raise _RUNS[(n, d)]
  return _RUNS[(n, d)]


def _check_rows(p, out, first=0):
  for b, rows in enumerate(out["rows"]):
    assert rows == scenarios.rows_for(p, first + b, 8).tolist(), (p, b)


def _case(n, d, kind):
  outs = _endings(n, d)[kind]
  for p, out in enumerate(outs):
    assert out["elapsed_s"] < BOUND_S, (kind, p, out["elapsed_s"])
    _check_rows(p, out, first=3 if kind.startswith(("resume", "state")) else 0)
  return outs


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
@pytest.mark.parametrize(
  ("kind", "at", "victim_type", "cause"),
  [
    ("type_error", 1, "TypeError", "failed while converting batch 1: TypeError: can't convert"),
    (
      "get_state_oserror",
      2,
      "OSError",
      "failed while taking the source state after batch 2: OSError: state file vanished",
    ),
    (
      "keyboard_interrupt",
      1,
      "KeyboardInterrupt",
      "failed while reading batch 1 from its source: KeyboardInterrupt: interrupted",
    ),
    (
      "system_exit",
      1,
      "SystemExit",
      "failed while reading batch 1 from its source: SystemExit: the source gave up",
    ),
    (
      "open_fails",
      0,
      "OSError",
      "failed while opening its source: OSError: cannot open the shard",
    ),
    (
      "unprintable",
      1,
      "Unprintable",
      "failed while reading batch 1 from its source: Unprintable: <str() of the exception"
      " raised RuntimeError>",
    ),
  ],
)
def test_any_error_type_on_one_host_ends_every_host(n, d, kind, at, victim_type, cause):
  outs = _case(n, d, kind)
  v = n - 1
  assert outs[v]["error_type"] == victim_type  # Its own exception, re-raised.
  peer_messages = {out["error"] for out in outs[:v]}
  assert len(peer_messages) == 1  # Word for word the same on every peer.
  for out in outs:
    assert out["n"] == at  # The batches before the failure, on every host.
  for out in outs[:v]:
    assert out["error_type"] == "RuntimeError"
    assert f"process {v} {cause}" in out["error"]
    assert f"process {v} raised {victim_type}" in out["error"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_int64_out_of_int32_range_raises_on_every_host_naming_the_value(n, d):
  outs = _case(n, d, "int64")
  assert len({out["error"] for out in outs}) == 1
  for out in outs:
    assert out["error_type"] == "ValueError" and out["n"] == 1
    assert (
      f"process {n - 1}, batch 1, column 'x': value {2**40 + 1000 * (n - 1) + 17}" in (out["error"])
    )
    assert "does not fit int32" in out["error"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
@pytest.mark.parametrize(
  ("kind", "column", "value", "into", "why"),
  [
    ("float64", "x", "1e+300", "float32", "JAX holds float64 values in while x64 is off"),
    ("float16", "y", "100000.0", "float16", "`dtypes` casts it to on the host"),
  ],
)
def test_a_float_beyond_its_narrowed_dtype_raises_on_every_host_naming_the_value(
  n, d, kind, column, value, into, why
):
  # It became inf in the global array, silently.
  outs = _case(n, d, kind)
  assert len({out["error"] for out in outs}) == 1
  for out in outs:
    assert out["error_type"] == "ValueError" and out["n"] == 1
    assert out["error"].startswith(
      f"process {n - 1}, batch 1, column {column!r}: value {value} does not fit {into},"
      f" the dtype {why} (it would become inf silently)"
    ), out["error"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_leaves_of_the_same_name_raise_on_every_host_before_any_batch(n, d):
  # {"y": {"b": ...}, "y/b": ...}: both leaves were named "y/b" in `paddings`,
  # `dtypes`, `pad_shapes` and messages, silently.
  outs = _case(n, d, "same_name")
  assert len({out["error"] for out in outs}) == 1
  for out in outs:
    assert out["error_type"] == "ValueError" and out["n"] == 0
    assert out["error"].startswith(
      "process 0, batch 0: leaves batch['y']['b'] and batch['y/b'] have the same name 'y/b'"
    ), out["error"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_a_host_whose_iterator_is_collected_ends_every_peer_naming_it(n, d):
  # Closed by the garbage collector's finalizer. A close before any batch or
  # mid-stream: tests/test_sim_cluster.py.
  kind, at = "close_drop", 2
  outs = _case(n, d, kind)
  v = n - 1
  assert outs[v]["error"] is None and outs[v]["n"] == at
  assert len({out["error"] for out in outs[:v]}) == 1
  for out in outs[:v]:
    assert out["error_type"] == "RuntimeError"
    assert out["error"] == f"process {v} closed its iterator at batch {at}"
    # Peers yield what was decided before the close reached process 0.
    assert at <= out["n"] < scenarios_endings.CLOSE_LENGTH


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
@pytest.mark.parametrize(
  ("kind", "needle"),
  [
    ("state_settings", "`state` was saved by an iterator with other settings (batch_size: 4 vs 8"),
    ("state_missing_field", "`state` has no 'batches' field"),
    ("state_bad_type", "`state['batches']` must be an int >= 0, got 'three'"),
    ("state_unknown_version", "`state['version']` is 99"),
    ("state_bad_source", "`state['source']` is not a state of"),
  ],
)
def test_bad_state_on_one_host_raises_the_same_value_error_on_every_host(n, d, kind, needle):
  outs = _case(n, d, kind)
  v = n - 1
  assert outs[v].get("local")  # Raised by set_state itself, before any source call.
  assert len({out["error"] for out in outs}) == 1
  for out in outs:
    assert out["error_type"] == "ValueError" and out["n"] == 0
    assert out["error"].startswith(f"process {v}: {needle}")


# -- threads, kills, the collective fallback, restarts ------------------------------


def _run(fn, *args, n=2, d=4, **kwargs):
  return testing.run_processes(
    fn, num_processes=n, devices_per_process=d, args=args, timeout_s=TIMEOUT, **kwargs
  )


CLOSE_CASES = [(prefetch, stall) for prefetch in (0, 2) for stall in (True, False)]


@pytest.mark.multiprocess
def test_close_from_another_thread_ends_that_next_and_the_peer_counts_exactly():
  # A watchdog thread closes process 1's iterator: while its consumer waits
  # for a decision (process 0 stuck in its source; with `prefetch_batches=0`
  # the wait is the consumer's own and raised an internal `Cancelled`), or
  # mid-stream (a batch on its way to the consumer was delivered after the
  # close posted its count: the peer's message said one batch fewer). The
  # counting at more hosts and schedules: tests/test_sim_cluster.py.
  cases = [(prefetch, stall, 1.0 if stall else 100) for prefetch, stall in CLOSE_CASES]
  per_process = testing.values(_run(scenarios_endings.run_closes_from_thread, cases, d=2))
  for i, (_, stall, _) in enumerate(cases):
    _check_close_from_thread(stall, [per_process[p][i] for p in range(2)])


def _check_close_from_thread(stall, outs):
  closer, peer = outs[1], outs[0]
  if stall:
    assert closer["error"] is None, closer  # The waiting next() ended with StopIteration.
  else:  # Inside a next() (StopIteration), or between two calls ("closed").
    assert closer["error"] in (None, "the iterator is closed"), closer
  n = closer["n"]
  assert closer["state_batches"] == n
  # Stalled: positions 0 and 1 are decided before the hang, or not.
  assert n in (0, 1, 2) if stall else 100 <= n < 4000, n
  if stall:  # The close 1 s in ends the waiting next() at once (mid-stream: 100 batches first).
    assert closer["elapsed_s"] < 1.0 + 3.0
  assert peer["error_type"] == "RuntimeError", peer
  assert f"process 1 closed its iterator at batch {n}" in peer["error"], (n, peer["error"])
  assert peer["n"] >= n  # The batches already decided.
  for p, out in enumerate(outs):
    _check_rows(p, out)
    assert out["threads"] == []


def run_kill_default(victim: int, kill_at: int = 2) -> dict[str, Any]:
  """Process `victim` SIGKILLs itself at its batch `kill_at`; default settings everywhere."""
  import jax
  from jax._src import distributed

  import grain_jax_sync as gjs

  p = jax.process_index()
  jax.devices()
  distributed.global_state.client.wait_at_barrier("killdef/start", 60_000)
  src = scenarios_faults.batch_source(p, [8] * 6, kill_at=kill_at if p == victim else None)
  it = gjs.iter_jax_batches(src, batch_size=8, name="killdef")
  out = scenarios_endings.drain(it)
  start = time.monotonic()
  it.close()
  out["close_s"] = time.monotonic() - start
  if p == 0:
    time.sleep(3.0)  # Process 0 hosts the store: let the others finish first.
  return out


@pytest.mark.multiprocess
def test_host_killed_at_its_first_read_with_default_settings_is_named_within_15_s():
  # Before its beat thread's first turn, so it is named only because the first
  # beat is written when the iterator is built. Killed later, at more hosts:
  # tests/test_sim_cluster.py.
  n, d, kill_at, victim = 2, 4, 0, 1
  outcomes = _run(run_kill_default, victim, kill_at, n=n, d=d, exit_barrier_timeout_s=0)
  assert outcomes[victim].exit_code == -9
  for o in outcomes:
    if o.process_index == victim:
      continue
    assert o.exit_code == 0, o.log
    out = o.value
    assert out["error_type"] == "PeerLostError", out
    assert out["error"].startswith(f"process {victim} is lost: its liveness beat stopped for 8s")
    assert out["elapsed_s"] < 15.0, out["elapsed_s"]
    assert out["close_s"] < 5
    _check_rows(o.process_index, out)


FREEZE_BATCHES = 200


def run_freeze_process_0(freeze_s: float) -> dict[str, Any]:
  """Process 0 (which holds the store) is frozen whole (SIGSTOP) after its batch 3; a 20 ms step."""
  import subprocess

  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  src = scenarios_faults.batch_source(p, [8] * FREEZE_BATCHES)

  def step(n: int) -> None:
    time.sleep(0.02)
    if p == 0 and n == 3:
      pid = os.getpid()
      subprocess.Popen(["sh", "-c", f"kill -STOP {pid}; sleep {freeze_s}; kill -CONT {pid}"])
      time.sleep(1.0)  # Frozen within it.

  with gjs.iter_jax_batches(src, batch_size=8) as it:
    return scenarios_endings.drain(it, on_batch=step)


@pytest.mark.multiprocess
def test_process_0_frozen_beyond_the_dead_threshold_is_slow_not_lost():
  # Process 0 frozen 10 s (> DEAD_AFTER_S = 8 s) freezes the store with it: the follower's read
  # of its beat returns when it comes back, with the beat from before. Before, the follower
  # raised PeerLostError then, while process 0 yielded the batches already decided and raised
  # "process 1 closed its iterator": two endings.
  outs = testing.values(_run(run_freeze_process_0, 10.0, d=1))
  for p, out in enumerate(outs):
    assert out["error"] is None and out["n"] == FREEZE_BATCHES, (p, out["error"], out["n"])
    _check_rows(p, out)


@pytest.mark.multiprocess
def test_sixty_iterators_broken_off_early_leave_no_key_on_any_host():
  outs = testing.values(_run(scenarios_endings.run_many, 60))
  for out in outs:
    assert out["keys"] == []
    assert out["threads"] == []
    assert sum(out["ended"].values()) == 60


def run_collective_fallback() -> dict[str, Any]:
  """Iterates with no key-value client: the collective fallback, in the caller's thread."""
  import jax
  from jax._src import distributed

  import grain_jax_sync as gjs

  p = jax.process_index()
  client = distributed.global_state.client
  distributed.global_state.client = None  # As without jax.distributed's store.
  try:
    data = scenarios.make_batches(p, [[8, 8, 4], [8, 8]][p])
    it = gjs.iter_jax_batches(data, batch_size=8, paddings=0, mask_key="mask")
    first = next(it)
    threads = [t.name for t in threading.enumerate() if t.name.startswith("grain_jax")]
    out = scenarios.consume(it)
    out["batches"].insert(0, scenarios.gather(first))
    it.close()
  finally:
    distributed.global_state.client = client
  out["threads_while_iterating"] = threads
  return out


@pytest.mark.multiprocess
def test_collective_fallback_runs_in_the_callers_thread_and_agrees():
  for out in testing.values(_run(run_collective_fallback)):
    assert out["threads_while_iterating"] == []  # No collective from a background thread.
    assert out["error"] is None and len(out["batches"]) == 3
    for b, batch in enumerate(out["batches"]):
      real = [8, 8, 4][b], [8, 8, 0][b]
      want = np.concatenate(
        [np.r_[scenarios.rows_for(p, b, real[p]), np.zeros(8 - real[p])] for p in range(2)]
      )
      np.testing.assert_array_equal(batch["x"], want)
      np.testing.assert_array_equal(
        batch["mask"], np.r_[np.arange(8) < real[0], np.arange(8) < real[1]]
      )


@pytest.mark.multiprocess
@pytest.mark.parametrize("resetter", [0, 1])
def test_collective_fallback_reset_on_one_host_raises_the_same_error_on_both(resetter):
  # Nothing carries the resetter's ending to its peer here: its first window
  # of the new stream meets the peer's second window. Without the check both
  # went on, pairing batch 0 of one process with batch 2 of the other.
  outs = testing.values(_run(scenarios_endings.run_collective_reset_peer, resetter))
  assert len({o["error"] for o in outs}) == 1, outs
  where = ", ".join(
    f"process {p} at batch {b}" for p, b in sorted([(resetter, 0), (1 - resetter, 2)])
  )
  for o in outs:
    assert o["error_type"] == "RuntimeError"
    assert f"different batches of the stream ({where})" in o["error"]
    assert f"process {resetter} restarted the stream (reset()" in o["error"]
  assert outs[resetter]["batches"] == 0  # Nothing from the new stream.
  assert outs[1 - resetter]["batches"] == 2  # Its first window: batches 0 and 1.


RESTART_CASES = [
  (1, "set_state", 40),
  (0, "set_state", 40),
  (0, "set_state", 2000),
  (1, "reset", 2000),
]


@pytest.mark.multiprocess
def test_a_host_that_restarts_alone_and_its_peer_end_promptly_naming_it():
  # 40 batches may all be decided before the restart (the peer ends
  # normally, then closes); of 2,000 only the read-ahead can be, so the peer
  # meets the restart.
  # Either way the restarter, waiting in the next stream, ends as soon as
  # the peer closes instead of restarting (not `sync_timeout_s`=60 s later).
  per_process = testing.values(_run(scenarios_endings.run_restarts_alone, RESTART_CASES))
  for i, case in enumerate(RESTART_CASES):
    _check_restart_alone(*case, [per_process[p][i] for p in range(2)])


def _check_restart_alone(restarter, how, length, outs):
  peer, alone = outs[1 - restarter], outs[restarter]
  did = "restored a state (set_state())" if how == "set_state" else "reset its iterator"
  n = len(peer["firsts"])
  assert peer["firsts"] == [8 * b for b in range(n)]  # Batch b: its rows 8b to 8b + 7.
  if peer["error"] is None:
    assert length == 40 and n == 40  # Decided before the restart.
  else:
    assert 3 <= n <= length, n
    assert peer["error_type"] == "RuntimeError"
    assert peer["error"] == f"process {restarter} {did} at batch 3"
  # Its first three batches, then nothing from the new stream.
  assert alone["firsts"] == [0, 8, 16, "restarted"]
  assert alone["error_type"] == "RuntimeError"
  assert alone["error"] == (
    f"process {1 - restarter} closed its iterator at batch {n}, without starting the"
    " stream that other processes restarted (reset(), set_state()): every process"
    " must restart it at the same point"
  )
  for out in outs:
    assert out["elapsed_s"] < BOUND_S, out
    assert out["keys"] == []  # Both streams counted out and deleted.


@pytest.mark.multiprocess
def test_an_iterator_dropped_with_the_frame_that_caught_an_ending_ends_its_peer():
  outs = testing.values(_run(scenarios_endings.run_sibling_after_error))
  assert [o["first"] for o in outs] == [0, 0]
  assert outs[0]["a_error"] == "KeyError: 'boom'"
  assert outs[1]["a_error"] == (
    "RuntimeError: process 0 failed while reading batch 1 from its source: KeyError: 'boom'"
    " (process 0 raised KeyError; every other process stops too, so that no host waits"
    " forever)"
  )
  peer = outs[1]
  assert peer["error_type"] == "RuntimeError"
  assert peer["error"] == "process 0 closed its iterator at batch 1"
  # The batches decided before the close, in order, then the error: at once,
  # not `sync_timeout_s`=30 s later.
  assert peer["rows"] == [list(range(8 * i, 8 * i + 8)) for i in range(1, peer["n"] + 1)]
  assert peer["n"] < scenarios_endings.SIBLING_LENGTH - 1
  assert peer["elapsed_s"] < BOUND_S


@pytest.mark.multiprocess
def test_a_refused_state_on_a_host_that_keeps_its_iterator_open_ends_its_peer_at_once():
  # Posted when set_state refuses it, not when the host iterates or closes:
  # a host that lets the error propagate keeps the iterator in its traceback.
  outs = testing.values(_run(scenarios_endings.run_refused_state_kept_open))
  message = "process 1: `state['batches']` must be an int >= 0, got 'three'"
  assert outs[1]["refused"] == message and outs[1]["next_error"] == message
  peer = outs[0]
  assert peer["refused"] is None
  assert peer["error_type"] == "ValueError" and peer["error"] == message
  assert peer["n"] == 0 and peer["elapsed_s"] < BOUND_S


@pytest.mark.multiprocess
def test_two_threads_sharing_one_iterator_from_its_first_batch_get_every_batch_once():
  # Both threads used to start the stream: two pipelines, two streams for
  # the peer (one taken for a restart), batch counts that differed between
  # hosts with no error, and a build thread left after close(). Now a call
  # during the other thread's raises at once and takes nothing: one stream.
  for out in testing.values(_run(scenarios_endings.run_two_threads, 300)):
    assert out["errors"] == [] and out["threads"] == []
    assert sorted(out["got"][0] + out["got"][1]) == list(range(300))


def run_named_epochs(epochs: int, slow_s: float) -> list[tuple[int, list[int], str | None]]:
  """A new iterator each epoch under one `name=`; process 1's steps are slow.

  Epoch e has 3 + e batches of value 100 * e + b on every host.
  """
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  out = []
  for e in range(epochs):
    data = [{"x": np.full(8, 100 * e + b, np.int32)} for b in range(3 + e)]
    it = gjs.iter_jax_batches(data, batch_size=8, name="train", prefetch_batches=0)
    got: list[int] = []
    error = None
    try:
      for batch in it:
        got.append(int(np.asarray(batch["x"].addressable_shards[0].data)[0]))
        if p == 1:
          time.sleep(slow_s)
    except Exception as ex:  # noqa: BLE001 - returned to the test.
      error = f"{type(ex).__name__}: {ex}"
    it.close()
    out.append((e, got, error))
  return out


@pytest.mark.multiprocess
def test_a_new_iterator_each_epoch_under_one_name_reads_no_stale_keys():
  # Iterators of one `name=` are counted: epoch e's keys are not epoch e-1's,
  # which a slow host may still be ending (before: spurious "ran out of data"
  # errors, ALREADY_EXISTS from the store, or a hang).
  outs = testing.values(
    testing.run_processes(
      run_named_epochs,
      num_processes=2,
      devices_per_process=2,
      args=(4, 0.15),
      timeout_s=TIMEOUT,
    )
  )
  for out in outs:
    assert out == [(e, [100 * e + b for b in range(3 + e)], None) for e in range(4)]
