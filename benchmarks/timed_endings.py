"""Endings timed on real processes: a requested stop, a close, a source error.

Shared by tests/test_stop.py, which asserts the bounds, and
benchmarks/endings.py, which reports them. Host p feeds rows ``1000 p + i``
at batch i. Each case returns, per host, the rows it received (its own
shards: no collective, so that a host that closed cannot hang a peer in a
gather) and `time.time()` at the event and at its loop's end; the processes
share one machine's clock, so the times compare across them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from grain_jax_sync import testing
from grain_jax_sync._src import options as options_lib

SLACK_S = 1.0  # Noticing the request.
STALL_S = 20.0  # The longest a stalled or failing source waits for its consumer.
LENGTH = 400  # Batches per host: the ending, not exhaustion, ends every stream.
LAUNCH_TIMEOUT_S = 300  # Per launch: room for the pre-issue-40 code, whose figures we report.


class Bound(NamedTuple):
  """Where an ending lands (docs/guarantees.md, "Stop together")."""

  seconds: float  # T: from the request (or the leaver's ending) to every host's loop end.
  batches: float  # 2R: batches past the asker's last batch before its request.


def bound(prefetch: int, step_s: float) -> Bound:
  """The documented bound at `prefetch_batches=prefetch`, a `step_s` step, the library's defaults.

  T = `decide_ahead_s` of the slowest consumer's consumption, the
  (prefetch_batches + 1) steps already decided and built, and 1 s to notice
  the request; inline (`prefetch_batches=0`) too: a stop asked for between
  calls is posted at once, one asked for during a call when the call ends.
  In batches R = prefetch_batches + 1 + decide_ahead_s / step, and a stop
  asked after batch k lands at a batch B with k <= B <= k + 2R.
  """
  decide_ahead_s = options_lib.Options.decide_ahead_s  # The default, as the jobs here run.
  seconds = decide_ahead_s + (prefetch + 1) * step_s + SLACK_S
  return Bound(seconds, 2 * (prefetch + 1 + decide_ahead_s / step_s))


def data(p: int, length: int) -> list[dict[str, np.ndarray]]:
  """Host `p`'s batches: 8 rows of ``1000 p + i`` at batch i."""
  return [{"x": np.full(8, 1000 * p + i, np.int32)} for i in range(length)]


def first_row(batch: Any) -> int:
  """This host's first row of column `x` (its rows are all the same value)."""
  shard = min(batch["x"].addressable_shards, key=lambda s: s.index[0].start or 0)
  return int(np.asarray(shard.data)[0])


def iterator(source: Any, prefetch: int, **kw: Any) -> Any:
  """`iter_jax_batches` over `source`, 8 rows a batch; a lost peer fails in 60 s, not 600."""
  import grain_jax_sync as gjs

  kw.setdefault("sync_timeout_s", 60.0)
  return gjs.iter_jax_batches(source, batch_size=8, prefetch_batches=prefetch, **kw)


def launch(fn: Any, n: int, d: int, *args: Any, timeout_s: float = LAUNCH_TIMEOUT_S) -> list[Any]:
  """Every process's value of `fn(*args)` on n processes x d CPU devices."""
  return testing.values(
    testing.run_processes(
      fn, num_processes=n, devices_per_process=d, args=args, timeout_s=timeout_s
    )
  )


def _timed_stop(prefetch: int, step_s: float, after: int, asker: int) -> dict:
  """`asker` calls request_stop() in its loop after its batch `after`; then a resume."""
  import jax

  p = jax.process_index()
  it = iterator(data(p, LENGTH), prefetch)
  rows, asked = [], None
  for batch in it:
    rows.append(first_row(batch))
    if p == asker and len(rows) == after:
      asked = time.time()
      it.request_stop()
    time.sleep(step_s)
  ended = time.time()
  state, by = it.get_state(), it.stop_requested_by
  it.close()
  fresh = iterator(data(p, LENGTH), prefetch)
  fresh.set_state(state)
  resumed = [first_row(b) for b in fresh]
  fresh.close()
  return {"rows": rows, "batches": state["batches"], "by": by, "asked": asked, "ended": ended} | {
    "resumed": resumed
  }


def timed_stops(prefetch: int, cases: list[tuple[float, int, int]]) -> list[dict]:
  """One `_timed_stop` per (step_s, after, asker), in sequence, in one launch."""
  return [_timed_stop(prefetch, *case) for case in cases]


def stop_late(outs: list[dict], case: tuple[float, int, int]) -> tuple[float, int]:
  """Seconds from the request to the last host's loop end, and the batches after the request."""
  _, after, asker = case
  return max(o["ended"] for o in outs) - outs[asker]["asked"], outs[0]["batches"] - after


class SourceFailed(Exception):
  pass


def _failing(p: int, leaver: int, length: int, received: Any, failed: list[Any]) -> Iterator[dict]:
  """Host `leaver`'s source raises at its batch 5 once its consumer holds batches 0-4.

  It records when it raised, and whether the consumer got there while the
  read waited (else the wait timed out: a blocked read held decided batches).
  """
  for i, batch in enumerate(data(p, length)):
    if p == leaver and i == 5:
      opened = received.wait(STALL_S)  # The job is at batch 5, not the read-ahead.
      failed.extend([time.time(), opened])
      raise SourceFailed("the shard vanished")
    yield batch


def leave_at_5(prefetch: int, kind: str, step_s: float, length: int = LENGTH) -> dict:
  """The last host closes after its batch 5 ("close") or its source fails at batch 5 ("error").

  The others go on until the ending reaches them.
  """
  import jax

  p, n = jax.process_index(), jax.process_count()
  received, left = threading.Event(), []
  it = iterator(_failing(p, n - 1 if kind == "error" else -1, length, received, left), prefetch)
  rows, error = [], None
  try:
    for batch in it:
      rows.append(first_row(batch))
      if p == n - 1 and len(rows) == 5:
        received.set()
        if kind == "close":
          left.append(time.time())
          it.close()
          break
      time.sleep(step_s)
  except (RuntimeError, SourceFailed) as e:
    error = f"{type(e).__name__}: {e}"
  ended = time.time()
  it.close()
  return {"rows": rows, "error": error, "ended": ended, "left": left[0] if left else None} | {
    "opened": left[1] if len(left) > 1 else None
  }


def leave_cases(prefetch: int, cases: list[tuple[str, float]]) -> list[dict]:
  """One `leave_at_5` per (kind, step_s), in sequence, in one launch."""
  return [leave_at_5(prefetch, kind, step_s) for kind, step_s in cases]
