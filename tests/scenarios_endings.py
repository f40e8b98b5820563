"""Scenarios for the endings tests (run inside simulated hosts).

Every case runs without collectives in the test itself (a host that closes or
dies must not leave a peer inside a gather): each host records the rows of its
own shards of each batch (`local_x`), which the test compares with what it fed.
The last process is the faulty one ("victim").
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import scenarios
import scenarios_faults

KW = {"batch_size": 8, "synchronize_lookahead": 2}
# A host reads ahead and holds decided at most about 4 R + 2 batches (R =
# `agreement.READ_AHEAD_WINDOWS` x lookahead = 64 here: its undecided reads, a
# run held by the agreement thread and one queued, the build stage's decided
# positions, its ready items; see docs/performance.md, Memory). Longer than
# that, so that a close lands mid-stream.
CLOSE_LENGTH = 400
SIBLING_LENGTH = 2000  # Beyond the read-ahead: process 1 needs process 0's `b` to go on.


def local_x(batch: Any) -> list[int]:
  """This host's rows of column `x`, in global row order."""
  shards = sorted(batch["x"].addressable_shards, key=lambda s: s.index[0].start or 0)
  seen, out = set(), []
  for s in shards:
    if s.index[0].start in seen:
      continue
    seen.add(s.index[0].start)
    out.extend(np.asarray(s.data).tolist())
  return out


def drain(
  it: Any,
  *,
  limit: int | None = None,
  pause: tuple[int, float] | None = None,
  on_batch: Any = None,
) -> dict:
  """Drains `it` locally; any exception type (BaseException too) is recorded.

  `on_batch(n)` is called after the n-th batch.
  """
  out: dict[str, Any] = {"n": 0, "rows": [], "error": None, "error_type": None}
  start = time.monotonic()
  try:
    for batch in it:
      out["n"] += 1
      out["rows"].append(local_x(batch))
      if pause is not None and out["n"] == pause[0]:
        time.sleep(pause[1])
      if on_batch is not None:
        on_batch(out["n"])
      if limit is not None and out["n"] >= limit:
        break
  except BaseException as e:  # noqa: BLE001 - returned to the test.
    out["error"] = "<unprintable>" if isinstance(e, Unprintable) else str(e)
    out["error_type"] = type(e).__name__
  out["elapsed_s"] = time.monotonic() - start
  return out


class _Unopenable:
  """A source whose `iter()` fails: the iterator fails while it is built."""

  def __iter__(self) -> Iterator[Any]:
    raise OSError("cannot open the shard")


class Unprintable(Exception):  # noqa: N818 - named for what it does.
  """A source exception whose `__str__` itself raises."""

  def __str__(self) -> str:
    raise RuntimeError("__str__ exploded")


class _CudaLike:
  """A leaf whose `__array__` raises TypeError, like a CUDA tensor."""

  shape = (8,)

  def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
    raise TypeError("can't convert cuda:0 device type tensor to numpy")


class StatefulSource:
  """Batches with get_state/set_state; get_state raises OSError after batch `fail_at`."""

  def __init__(self, batches: list[Any], fail_at: int | None = None):
    self._batches = batches
    self._i = 0
    self._fail_at = fail_at

  def __iter__(self) -> StatefulSource:
    return self

  def __next__(self) -> Any:
    if self._i >= len(self._batches):
      raise StopIteration
    self._i += 1
    return self._batches[self._i - 1]

  def get_state(self) -> dict[str, int]:
    if self._fail_at is not None and self._i == self._fail_at + 1:
      raise OSError("state file vanished")
    return {"i": self._i}

  def set_state(self, state: dict[str, int]) -> None:
    self._i = int(state["i"])


def _raising(batches: list[Any], at: int, exc: BaseException) -> Iterator[Any]:
  for b, batch in enumerate(batches):
    if b == at:
      raise exc
    yield batch


def _data(kind: str, p: int, victim: bool) -> list[Any]:
  """The batches of case `kind` on process `p` (values out of range on the victim)."""
  # A close must land mid-stream: longer than the read-ahead (`CLOSE_LENGTH`).
  batches = scenarios.make_batches(p, [8] * (CLOSE_LENGTH if kind.startswith("close") else 6))
  if kind == "int64":  # Every host has int64 ids; the victim's batch 1 does not fit int32.
    batches = [{"x": b["x"].astype(np.int64), "y": b["y"]} for b in batches]
    if victim:
      batches[1]["x"] = batches[1]["x"] + 2**40
  if kind == "float64":  # float64 x everywhere (float32 with x64 off); the victim's 1e300.
    batches = [{"x": b["x"].astype(np.float64), "y": b["y"]} for b in batches]
    if victim:
      batches[1]["x"][7] = 1e300
  if kind == "float16" and victim:  # `dtypes` casts y to float16 on the host.
    batches[1]["y"][2, 1] = 1e5
  if kind == "same_name":  # Every host: two leaves named "y/b".
    batches = [{"x": b["x"], "y": {"b": b["y"]}, "y/b": b["y"]} for b in batches]
  return batches


def _source(kind: str, p: int, victim: bool) -> Any:
  batches = _data(kind, p, victim)
  if not victim:
    return StatefulSource(batches)
  if kind == "type_error":
    batches[1] = {"x": batches[1]["x"], "y": _CudaLike()}
  elif kind == "keyboard_interrupt":
    return _raising(batches, 1, KeyboardInterrupt("interrupted in the source"))
  elif kind == "system_exit":
    return _raising(batches, 1, SystemExit("the source gave up"))
  elif kind == "unprintable":
    return _raising(batches, 1, Unprintable())
  elif kind == "open_fails":
    return _Unopenable()
  return StatefulSource(batches, fail_at=2 if kind == "get_state_oserror" else None)


def _state(it: Any, kind: str, victim: bool, p: int) -> Any:
  """The state each host restores for the resume cases."""
  state = it.get_state()
  state["batches"], state["source"] = 3, {"i": 3}
  if not victim:
    return state
  if kind == "state_settings":
    state["settings"] = {**state["settings"], "batch_size": 4}
  elif kind == "state_missing_field":
    del state["batches"]
  elif kind == "state_bad_type":
    state["batches"] = "three"
  elif kind == "state_unknown_version":
    state["version"] = 99
  elif kind == "state_bad_source":
    state["source"] = {}
  return state


def run_case(c: int, kind: str) -> dict[str, Any]:
  import jax

  import grain_jax_sync as gjs

  p, n = jax.process_index(), jax.process_count()
  victim = p == n - 1
  start = time.monotonic()
  out: dict[str, Any] = {"n": 0, "rows": [], "error": None, "error_type": None}
  try:
    kw = {**KW, "dtypes": {"y": np.float16}} if kind == "float16" else KW
    it = gjs.iter_jax_batches(_source(kind, p, victim), name=f"end{c}", **kw)
  except OSError as e:  # "open_fails": this host's iterator was never built.
    return {**out, "error": str(e), "error_type": type(e).__name__, "elapsed_s": 0.0}
  if kind.startswith(("resume", "state")):
    try:
      it.set_state(_state(it, kind, victim, p))
    except ValueError as e:
      out.update(error=str(e), error_type="ValueError", local=True)
      it.close()
      out["elapsed_s"] = time.monotonic() - start
      return out
  if victim and kind == "close_drop":
    out = drain(it, limit=2)
    del it
    gc.collect()
    return out
  out = drain(it)
  it.close()
  return out


def run_endings(kinds: list[str]) -> list[dict[str, Any]]:
  """Runs every ending case in turn in this set of processes."""
  return [run_case(c, kind) for c, kind in enumerate(kinds)]


def threads_once_reads_return(timeout_s: float) -> list[str]:
  """The library's threads left, once a read that a close abandoned in the source returned."""
  for t in threading.enumerate():
    if t.name == "grain_jax_sync-read":
      t.join(timeout_s)
  return sorted(t.name for t in threading.enumerate() if t.name.startswith("grain_jax"))


# -- many iterators broken off ------------------------------------------------------


def run_many(count: int) -> dict[str, Any]:
  """`count` iterators per process, each broken off early in one of five ways."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  ways = ["close", "drop", "before", "with", "error"]
  ended = {w: 0 for w in ways}
  for i in range(count):
    way = ways[i % len(ways)]
    data = scenarios.make_batches(p, [8] * 20)
    if way == "error" and p == 0:
      data[1] = {"x": data[1]["x"], "y": None}  # Bad data: agreed error.
    it = gjs.iter_jax_batches(data, name=f"many{i}", **KW)
    take = 1 + (i + p) % 3  # Hosts break off at different batches.
    if way == "with":
      with it:
        drain(it, limit=take)
    elif way == "drop":
      drain(it, limit=take)
      del it
      gc.collect()
    elif way == "before":
      it.close()
    else:
      drain(it, limit=take if way == "close" else None)
      it.close()
    ended[way] += 1
  gc.collect()
  keys = scenarios_faults.keys_left("many")
  threads = [t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync")]
  return {"keys": keys, "ended": ended, "threads": threads}


def run_collective_reset_peer(resetter: int) -> dict[str, Any]:
  """Collective fallback: `resetter` resets after one batch and iterates on; so does its peer.

  Batches are counted, not gathered: a gather is a collective, and the two
  processes call the exchange's all-gathers at different batches here.
  """
  import jax
  from jax._src import distributed

  import grain_jax_sync as gjs

  p = jax.process_index()
  jax.devices()  # The backend joins the job before the client is hidden.
  client = distributed.global_state.client
  distributed.global_state.client = None
  out: dict[str, Any] = {"batches": 1, "error": None, "error_type": None}
  try:
    data = scenarios.make_batches(p, [8] * 12)
    it = gjs.iter_jax_batches(data, batch_size=8, synchronize_lookahead=2)
    next(it)
    if p == resetter:
      it.reset()
      out["batches"] = 0
    try:
      for _ in it:
        out["batches"] += 1
    except Exception as e:  # noqa: BLE001 - returned to the test.
      out["error"], out["error_type"] = str(e), type(e).__name__
    it.close()
  finally:
    distributed.global_state.client = client
  return out


def run_restart_alone(restarter: int, how: str, length: int, case: int = 0) -> dict[str, Any]:
  """`restarter` alone restarts mid-stream (after batch 3); its peer iterates on, then closes.

  `how`: "set_state" (to the state after batch 1) or "reset". Batch b holds
  rows ``8 * b`` to ``8 * b + 7`` on every host. Each host records the first
  row of its shard of every batch after the restart, its ending, when it
  ended, and (after a barrier) the keys left in the store.
  """
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  data = [{"x": np.arange(8 * b, 8 * b + 8, dtype=np.int32)} for b in range(length)]
  it = gjs.iter_jax_batches(data, batch_size=8, sync_timeout_s=60)
  out: dict[str, Any] = {"firsts": [], "error": None, "error_type": None}
  start = time.monotonic()
  try:
    for n, batch in enumerate(it, 1):
      out["firsts"].append(local_x(batch)[0])
      if p == restarter and n == 1:
        state = it.get_state()
      if p == restarter and n == 3:
        it.set_state(state) if how == "set_state" else it.reset()
        out["firsts"].append("restarted")
  except Exception as e:  # noqa: BLE001 - returned to the test.
    out["error"], out["error_type"] = str(e), type(e).__name__
  out["elapsed_s"] = time.monotonic() - start
  it.close()
  out["keys"] = scenarios_faults.keys_left(f"restart_alone/{case}")
  return out


def run_restarts_alone(cases: list[tuple[int, str, int]]) -> list[dict[str, Any]]:
  """`run_restart_alone` of each ``(restarter, how, length)``, in turn."""
  return [run_restart_alone(*c, case=i) for i, c in enumerate(cases)]


def _fail_at_1_on(p: int, failing: int) -> Iterator[Any]:
  yield {"x": np.arange(8, dtype=np.int32)}
  if p == failing:
    raise KeyError("boom")
  yield {"x": np.arange(8, 16, dtype=np.int32)}


def _round(p: int, *, keep: bool) -> tuple[str, int, Any]:
  """Takes a batch of `b`, then iterates `a` to its agreed error; keeps `b` only if asked."""
  import grain_jax_sync as gjs

  a = gjs.iter_jax_batches(_fail_at_1_on(p, 0), batch_size=8, sync_timeout_s=30)
  data = [{"x": np.arange(8 * i, 8 * i + 8, dtype=np.int32)} for i in range(SIBLING_LENGTH)]
  b = gjs.iter_jax_batches(data, batch_size=8, sync_timeout_s=30)
  first = local_x(next(b))[0]
  try:
    for _ in a:
      pass
    error = "no error"
  except (KeyError, RuntimeError) as e:
    error = f"{type(e).__name__}: {e}"
  return error, first, (b if keep else None)


def run_sibling_after_error() -> dict[str, Any]:
  """Process 0 drops iterator `b` (one batch in) with the frame that caught `a`'s ending.

  `a` ends with process 0's own source error, which process 0 re-raises: its
  reader holds it, and its traceback held the reader's frames.

  Garbage collection is off (as between two of its runs): `b` must close
  when that frame returns, so that process 1, iterating `b` on, ends at once.
  """
  import jax
  from jax._src import distributed

  p = jax.process_index()
  gc.disable()
  try:
    a_error, first, b = _round(p, keep=p == 1)
    out: dict[str, Any] = {"a_error": a_error, "first": first}
    if b is not None:
      out.update(drain(b))
      b.close()
    # Process 0 stays here, collecting nothing, until process 1 is done with `b`.
    distributed.global_state.client.wait_at_barrier("sibling/drained", 120_000)
  finally:
    gc.enable()
  return out


def run_refused_state_kept_open() -> dict[str, Any]:
  """Process 1's `set_state` refuses a state; it keeps the iterator open, neither iterating nor closing.

  Its peer must end at once with the same error, not `sync_timeout_s` later.
  """
  import jax
  from jax._src import distributed

  import grain_jax_sync as gjs

  p = jax.process_index()
  data = scenarios.make_batches(p, [8] * 6)
  with gjs.iter_jax_batches(data, batch_size=8) as first:
    next(first)
    next(first)
    state = first.get_state()
  if p == 1:
    state["batches"] = "three"
  it = gjs.iter_jax_batches(data, batch_size=8, sync_timeout_s=60)
  out: dict[str, Any] = {"refused": None}
  try:
    it.set_state(state)
  except ValueError as e:
    out["refused"] = str(e)
  if p == 1:
    try:
      next(it)  # The refusal is this host's ending: raised again.
    except ValueError as e:
      out["next_error"] = str(e)
  else:
    out.update(drain(it))
  client = distributed.global_state.client
  client.wait_at_barrier("refused/done", 120_000)  # Process 1 holds `it` open till here.
  it.close()
  return out


def run_two_threads(length: int) -> dict[str, Any]:
  """Two threads per process share one iterator from its first `next()`, retrying a call
  made while the other thread's is in progress (it raises at once)."""
  import grain_jax_sync as gjs

  data = [{"x": np.arange(8 * b, 8 * b + 8, dtype=np.int32)} for b in range(length)]
  it = gjs.iter_jax_batches(data, batch_size=8, sync_timeout_s=30)
  got: list[list[int]] = [[], []]
  errors: list[str] = []
  start = threading.Barrier(2)

  def worker(k: int) -> None:
    start.wait()
    while True:
      try:
        batch = next(it)
      except StopIteration:
        return
      except RuntimeError as e:  # A call during the other thread's: retried.
        if "is in progress in another thread" not in str(e):
          errors.append(f"{type(e).__name__}: {e}")
          return
        time.sleep(0)
        continue
      except Exception as e:  # noqa: BLE001 - returned to the test.
        errors.append(f"{type(e).__name__}: {e}")
        return
      got[k].append(local_x(batch)[0] // 8)

  threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  it.close()
  time.sleep(0.5)
  left = [t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync")]
  return {"got": got, "errors": errors, "threads": left}


def hanging(batches: list[Any], at: int, seconds: float) -> Iterator[Any]:
  """`batches`, stuck `seconds` before batch `at` (alive: its liveness beat goes on)."""
  for b, batch in enumerate(batches):
    if b == at:
      time.sleep(seconds)  # Alive (its liveness beat goes on), but stuck in its source.
    yield batch


def run_close_from_thread(
  prefetch: int, stall: bool, after: float, case: int = 0
) -> dict[str, Any]:
  """Process 1 closes its iterator from a watchdog thread.

  With `stall`, process 0's source hangs at its batch 2 and the watchdog
  closes `after` seconds in (process 1's consumer then waits for a
  decision); else it closes once the consumer received `after` batches,
  racing the consumer's next calls.
  """
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  batches = scenarios.make_batches(p, [8] * 4000)
  src = hanging(batches, 2, 6.0) if (stall and p == 0) else batches
  it = gjs.iter_jax_batches(src, name=f"close_thread{case}", prefetch_batches=prefetch, **KW)
  reached = threading.Event()
  if p == 1:

    def watchdog() -> None:
      if not stall:
        reached.wait(60)
      it.close()

    threading.Timer(after if stall else 0.0, watchdog).start()
  out = drain(it, on_batch=lambda n: n == int(after) and not stall and reached.set())
  out["state_batches"] = it.get_state()["batches"] if p == 1 else None
  it.close()
  out["threads"] = threads_once_reads_return(10.0)
  return out


def run_closes_from_thread(cases: list[tuple[int, bool, float]]) -> list[dict[str, Any]]:
  """`run_close_from_thread` of each ``(prefetch, stall, after)``, in turn."""
  return [run_close_from_thread(*c, case=i) for i, c in enumerate(cases)]
