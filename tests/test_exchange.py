"""The key-value exchange.

Exchange tests run real processes joined by jax.distributed, whose
coordination service holds the key-value store; the ledger's own tests are in
test_ledger.py.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import scenarios
import scenarios_faults
import scenarios_perf
from helpers import check_cases, run_cases

from grain_jax_sync import testing
from grain_jax_sync._src import exchange
from grain_jax_sync._src.exchange import key_value
from grain_jax_sync._src.exchange import streams as exchange_streams

TIMEOUT = 180


def run(fn, *args, n=2, d=4, **kwargs):
  return testing.values(
    testing.run_processes(
      fn, num_processes=n, devices_per_process=d, args=args, kwargs=kwargs, timeout_s=TIMEOUT
    )
  )


# -- one process ---------------------------------------------------------------------


def test_make_exchange_single_process_is_local():
  ex = exchange.make_exchange(synchronize=True, namespace=None)
  assert isinstance(ex, exchange.LocalExchange)
  assert ex.all_gather(0, "a") == ["a"]


# -- key-value store across processes --------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_chunks_up_decisions_down_release_and_end_round_trip(n):
  # One full group of chunks and decisions: released with one delete each.
  k = key_value.GROUP
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


def keys_after_iteration(
  sizes: list[list[int]], kwargs: dict[str, Any], tag: str = ""
) -> dict[str, Any]:
  """Drains an iterator, then lists what is left in the key-value store (`tag`: its barrier's)."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  it = gjs.iter_jax_batches(scenarios.make_batches(p, sizes[p]), **kwargs)
  n, error = 0, None
  try:
    for _ in it:
      n += 1
  except ValueError as e:
    error = type(e).__name__
  it.close()
  # Listed before any process starts the next case's iterator (whose first
  # keys a slower peer would otherwise list as left over).
  left = scenarios_faults.keys_left(f"keys_after_iteration{tag}")
  return {"batches": n, "error": error, "left": left}


FULL_ITERATIONS = {
  "error_at_end": ({}, 27, "ValueError"),
  "drop_last": ({"drop_last": True}, 27, None),
  "padded": ({"paddings": 0}, 30, None),
  "lookahead1": ({"paddings": 0, "synchronize_lookahead": 1, "prefetch_batches": 0}, 30, None),
}
FULL_SIZES = [[8] * 30, [8] * 27 + [4]]


def check_no_keys_left_after_a_full_iteration(outs, batches, error):
  for o in outs:
    assert o["batches"] == batches
    assert o["error"] == error
    assert o["left"] == []


def peer_never_comes(timeout_s: float) -> dict[str, Any]:
  """Process 0 iterates; process 1 never builds its iterator."""
  import jax

  import grain_jax_sync as gjs

  if jax.process_index() != 0:
    return {"type": None, "threads": scenarios_perf.library_threads()}
  it = gjs.iter_jax_batches(
    scenarios.make_batches(0, [8] * 4), batch_size=8, sync_timeout_s=timeout_s
  )
  out: dict[str, Any] = {"type": None}
  try:
    next(it)
  except Exception as e:  # noqa: BLE001 - returned to the test.
    out = {"type": type(e).__qualname__, "message": str(e), "missing": getattr(e, "missing", None)}
  it.close()
  out["threads"] = scenarios_perf.library_threads()
  return out


def check_missing_peer_times_out_naming_it(outs):
  o = outs[0]
  assert o["type"] == "PeerTimeoutError"
  assert "process 1 did not report" in o["message"]
  assert "sync_timeout_s" in o["message"]
  assert o["missing"] == (1,)
  assert o["threads"] == []


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_no_keys_left_after_full_iterations_and_a_missing_peer_named():
  # One launch: the full iterations, then the peer that never comes (last:
  # process 1 leaves it at once).
  cases = {
    name: (keys_after_iteration, (FULL_SIZES, {"batch_size": 8, **kw}, f"/{name}"), {})
    for name, (kw, _, _) in FULL_ITERATIONS.items()
  }
  cases["missing_peer"] = (peer_never_comes, (2.0,), {})
  checks = {
    name: functools.partial(check_no_keys_left_after_a_full_iteration, batches=b, error=e)
    for name, (_, b, e) in FULL_ITERATIONS.items()
  }
  checks["missing_peer"] = check_missing_peer_times_out_naming_it
  check_cases(run_cases(2, 4, cases), checks)


def test_a_closed_iterators_streams_are_forgotten():
  # The registry of this process's streams (the crosswise-wait detection's)
  # keeps nothing of an iterator once it closed, however its streams ended.
  a, b = exchange_streams.new_namespace("forget-a"), exchange_streams.new_namespace("forget-b")
  exchange_streams.stream_started(f"{a}/1")
  exchange_streams.waiting_first(f"{a}/2", True)
  exchange_streams.pre_end(f"{a}/3", "process 0 closed its iterator at batch 0")
  exchange_streams.stream_started(f"{b}/1")
  assert {a, f"{a}/1", f"{a}/2", f"{a}/3", b, f"{b}/1"} <= set(exchange_streams.recorded())
  exchange_streams.forget(a)
  left = exchange_streams.recorded()
  assert not [s for s in left if s == a or s.startswith(f"{a}/")], left
  assert {b, f"{b}/1"} <= set(left)  # Another iterator's record stays.
  assert exchange_streams.pre_ended(f"{a}/3") is None
  assert not exchange_streams.made_not_started(f"{a}/2")  # Made here, never started: forgotten.
  exchange_streams.forget(b)
  assert not [s for s in exchange_streams.recorded() if s.startswith((a, b))]
