"""Stop together: an agreed stop, and a host that leaves is known within a few batches.

Real processes joined by `jax.distributed` (gloo, forced CPU devices). Each
host checks the rows of its own shards of every batch (no collective in the
test, so that a host that closed cannot hang a peer in a gather). Host p
feeds rows ``1000 p + i`` at batch i.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from grain_jax_sync import testing

TOPOLOGIES = [pytest.param(2, 4, id="2x4"), pytest.param(4, 2, id="4x2")]
TIMEOUT = 240
LOOKAHEAD = 10  # The default `synchronize_lookahead`.


def _data(p: int, length: int) -> list[dict[str, np.ndarray]]:
  return [{"x": np.full(8, 1000 * p + i, np.int32)} for i in range(length)]


def _first_row(batch: Any) -> int:
  """This host's first row of column `x` (its rows are all the same value)."""
  shard = min(batch["x"].addressable_shards, key=lambda s: s.index[0].start or 0)
  return int(np.asarray(shard.data)[0])


def _iterator(data: Any, prefetch: int, **kw: Any) -> Any:
  import grain_jax_sync as gjs

  kw.setdefault("sync_timeout_s", 60.0)
  return gjs.iter_jax_batches(data, batch_size=8, prefetch_batches=prefetch, **kw)


def _stop_on_sigterm(prefetch: int, asker: int, after: int, length: int, step_s: float) -> dict:
  """`asker`'s SIGTERM handler calls request_stop() after its batch `after`; then a resume."""
  import jax

  p = jax.process_index()
  it = _iterator(_data(p, length), prefetch)
  previous = signal.signal(signal.SIGTERM, lambda *_: it.request_stop())
  rows = []
  try:
    for batch in it:
      rows.append(_first_row(batch))
      if p == asker and len(rows) == after:
        os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(step_s)
  finally:
    signal.signal(signal.SIGTERM, previous)
  state, by = it.get_state(), it.stop_requested_by
  again = next(it, None)  # The stream stays ended.
  it.close()
  # The restarted job: a fresh iterator from the saved state, to the end.
  fresh = _iterator(_data(p, length), prefetch)
  fresh.set_state(state)
  resumed = [_first_row(b) for b in fresh]
  fresh.close()
  return {"rows": rows, "batches": state["batches"], "by": by, "again": again, "resumed": resumed}


def _stop_by_two_at_once(prefetch: int, length: int) -> dict:
  """Hosts 0 and the last ask for a stop after the same batch."""
  import jax

  p, n = jax.process_index(), jax.process_count()
  it = _iterator(_data(p, length), prefetch)
  rows = []
  for batch in it:
    rows.append(_first_row(batch))
    if len(rows) == 3 and p in (0, n - 1):
      it.request_stop()
      it.request_stop()  # A second request changes nothing.
    time.sleep(0.005)
  out = {"rows": rows, "batches": it.get_state()["batches"], "by": it.stop_requested_by}
  it.close()
  return out


def _stop_after_the_end(prefetch: int, length: int) -> dict:
  import jax

  p = jax.process_index()
  it = _iterator(_data(p, length), prefetch)
  rows = [_first_row(b) for b in it]
  it.request_stop()  # After the end: nothing changes.
  out = {
    "rows": rows,
    "by": it.stop_requested_by,
    "batches": it.get_state()["batches"],
    "again": next(it, None),
  }
  it.close()
  return out


def stop_cases(prefetch: int, asker: int, after: int) -> dict:
  return {
    "signal": _stop_on_sigterm(prefetch, asker, after, length=200, step_s=0.01),
    "two": _stop_by_two_at_once(prefetch, length=200),
    "after_end": _stop_after_the_end(prefetch, length=6),
  }


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_request_stop_ends_every_host_at_one_batch_and_resumes_exactly(n, d, prefetch):
  rng = random.Random(f"{n}x{d}/{prefetch}")
  asker, after = rng.randrange(n), rng.randint(1, 20)
  outs = testing.values(
    testing.run_processes(
      stop_cases,
      num_processes=n,
      devices_per_process=d,
      args=(prefetch, asker, after),
      timeout_s=TIMEOUT,
    )
  )
  bound = 2 * (LOOKAHEAD + prefetch)
  # A SIGTERM handler's request: every host stops at one batch, named alike.
  sig = [o["signal"] for o in outs]
  stopped_at = sig[0]["batches"]
  assert after <= stopped_at <= after + bound, (after, stopped_at)
  for p, o in enumerate(sig):
    assert o["rows"] == [1000 * p + i for i in range(stopped_at)]
    assert o["batches"] == stopped_at
    assert o["by"] == asker
    assert o["again"] is None
    # The restart from the saved state goes on exactly where every host stopped.
    assert o["resumed"] == [1000 * p + i for i in range(stopped_at, 200)]
  # Two hosts ask at once: one stop, one named asker, the same everywhere.
  two = [o["two"] for o in outs]
  assert len({o["batches"] for o in two}) == 1 and len({o["by"] for o in two}) == 1
  assert two[0]["by"] in (0, n - 1)
  assert 3 <= two[0]["batches"] <= 3 + bound
  for p, o in enumerate(two):
    assert o["rows"] == [1000 * p + i for i in range(two[0]["batches"])]
  # A request after the end changes nothing.
  for p, o in enumerate(outs):
    end = o["after_end"]
    assert end == {
      "rows": [1000 * p + i for i in range(6)],
      "by": None,
      "batches": 6,
      "again": None,
    }


def leave_at_batch_5(prefetch: int, length: int, step_s: float) -> dict:
  """The last host closes after its batch 5; the others go on until the error reaches them."""
  import jax

  p, n = jax.process_index(), jax.process_count()
  it = _iterator(_data(p, length), prefetch)
  rows, error = [], None
  try:
    for batch in it:
      rows.append(_first_row(batch))
      if p == n - 1 and len(rows) == 5:
        it.close()
        break
      time.sleep(step_s)
  except RuntimeError as e:
    error = str(e)
  it.close()
  return {"rows": rows, "error": error}


@pytest.mark.multiprocess
@pytest.mark.parametrize("length", [40, 400])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_a_host_that_closes_is_known_within_a_few_batches_and_never_ends_a_peer_normally(
  n, d, prefetch, length
):
  outs = testing.values(
    testing.run_processes(
      leave_at_batch_5,
      num_processes=n,
      devices_per_process=d,
      args=(prefetch, length, 0.05),
      timeout_s=TIMEOUT,
    )
  )
  bound = 5 + 2 * (LOOKAHEAD + prefetch)
  assert outs[n - 1] == {"rows": [1000 * (n - 1) + i for i in range(5)], "error": None}
  for p in range(n - 1):
    rows, error = outs[p]["rows"], outs[p]["error"]
    assert error == f"process {n - 1} closed its iterator at batch 5", (p, error)
    assert 5 <= len(rows) <= bound, (p, len(rows))
    assert rows == [1000 * p + i for i in range(len(rows))]


def test_a_second_threads_next_during_a_next_raises_at_once():
  import grain_jax_sync as gjs

  entered, release = threading.Event(), threading.Event()

  def source():
    for i in range(3):
      if i == 1:
        entered.set()
        release.wait(10)
      yield {"x": np.full(8, i, np.int32)}

  it = gjs.iter_jax_batches(source(), batch_size=8, prefetch_batches=0)
  assert int(np.asarray(next(it)["x"])[0]) == 0
  first: list[Any] = []
  reader = threading.Thread(target=lambda: first.append(next(it)))
  reader.start()
  assert entered.wait(10)
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match=r"next\(\) was called while next\(\) is in progress"):
    next(it)
  with pytest.raises(RuntimeError, match=r"reset\(\) was called while next\(\) is in progress"):
    it.reset()
  assert time.monotonic() - t0 < 1.0  # At once: no queue of turns.
  release.set()
  reader.join(10)
  assert int(np.asarray(first[0]["x"])[0]) == 1
  assert int(np.asarray(next(it)["x"])[0]) == 2
  it.close()
