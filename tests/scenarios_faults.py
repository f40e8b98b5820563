"""Scenario functions for the fault, hostile-input, conservation and hygiene tests.

They run inside simulated hosts (`grain_jax_sync.testing.run_processes`), so
they are module-level and return plain values that pickle. Rows encode where
they came from (see `scenarios.rows_for`).

A scenario runs several *cases* in one set of processes where it can, because
starting N JAX processes costs seconds: each case builds its own iterator
(`name=` keeps their exchange keys apart), drains it, and records what
happened.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import scenarios


def batch_source(
  process: int,
  sizes: list[int],
  *,
  raise_at: int | None = None,
  kill_at: int | None = None,
  mutate: Any = None,
) -> Iterator[Any]:
  """Yields `scenarios.make_batches` batches, with optional faults.

  Args:
    process: This process.
    sizes: Row count of each batch.
    raise_at: Raise `OSError("disk on fire")` instead of yielding this batch.
    kill_at: SIGKILL this process instead of yielding this batch.
    mutate: ``(batch_index, fn)``: yield ``fn(batch)`` from that batch on.
  """
  for b, batch in enumerate(scenarios.make_batches(process, sizes)):
    if raise_at is not None and b == raise_at:
      raise OSError(f"disk on fire at batch {b}")
    if kill_at is not None and b == kill_at:
      os.kill(os.getpid(), signal.SIGKILL)
    if mutate is not None and b >= mutate[0]:
      batch = mutate[1](batch)
    yield batch


def _outcome(it: Any, *, limit: int | None = None) -> dict[str, Any]:
  out = scenarios.consume(it, limit)
  return {
    "n": len(out["batches"]),
    "batches": out["batches"],
    "error": out["error"],
    "error_type": out["error_type"],
    "elapsed_s": out["elapsed_s"],
  }


def drain_local(it: Any) -> dict[str, Any]:
  """Drains `it` without any collective (safe when a peer may be dead).

  Records the global shape of each batch's `x` instead of gathering values.
  """
  out: dict[str, Any] = {"n": 0, "shapes": [], "error": None, "error_type": None}
  start = time.monotonic()
  try:
    for batch in it:
      out["n"] += 1
      out["shapes"].append(tuple(batch["x"].shape))
  except Exception as e:  # noqa: BLE001 - returned to the test.
    out["error"] = str(e)
    out["error_type"] = type(e).__name__
  out["elapsed_s"] = time.monotonic() - start
  return out


def run_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Runs several iterator cases in sequence in this process.

  Each case is a dict with ``sizes`` (per-process lists of batch sizes),
  ``kwargs`` (for `iter_jax_batches`; may be a per-process list) and optional
  per-process fault lists ``raise_at``/``kill_at``/``mutate`` (one entry per
  process, None for no fault), and ``keep_batches`` (default True).

  Returns:
    One outcome per case: batch count, gathered batches, error and elapsed.
  """
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  results = []
  for c, case in enumerate(cases):
    kwargs = case["kwargs"]
    if isinstance(kwargs, list):
      kwargs = kwargs[p]
    kwargs = {"name": f"case{c}", **kwargs}
    src = batch_source(
      p,
      case["sizes"][p],
      raise_at=(case.get("raise_at") or [None] * (p + 1))[p],
      kill_at=(case.get("kill_at") or [None] * (p + 1))[p],
      mutate=_mutation(case.get("mutate"), p),
    )
    it = gjs.iter_jax_batches(src, **kwargs)
    out = _outcome(it)
    it.close()
    if not case.get("keep_batches", True):
      out["batches"] = []
    results.append(out)
  return results


_MUTATIONS = {
  "drop_y": lambda b: {"x": b["x"]},
  "rename_y": lambda b: {"x": b["x"], "z": b["y"]},
  "nest_y": lambda b: {"x": b["x"], "y": {"inner": b["y"]}},
  "y_float64": lambda b: {"x": b["x"], "y": b["y"].astype(np.float64)},
  "y_trailing_3": lambda b: {"x": b["x"], "y": np.concatenate([b["y"], b["y"][:, :1]], axis=1)},
}


def _mutation(spec: Any, p: int) -> Any:
  if spec is None or spec[p] is None:
    return None
  index, name = spec[p]
  return (index, _MUTATIONS[name])


def _read_only(base: np.ndarray) -> np.ndarray:
  """A copy of `base` that cannot be written to."""
  a = base.copy()
  a.flags.writeable = False
  return a


# Each kind of `y` column: a function of the float32 (n, 2) `base` and of `n`.
_HOSTILE_LEAVES: dict[str, Callable[[np.ndarray, int], Any]] = {
  "string": lambda base, n: np.array([f"r{i}" for i in range(n)]),
  "bytes": lambda base, n: np.array([b"r"] * n),
  "object": lambda base, n: np.array([{"a": i} for i in range(n)], dtype=object),
  "structured": lambda base, n: np.zeros(n, dtype=[("a", np.int32), ("b", np.float32)]),
  "ragged": lambda base, n: base[: n - 1],
  "zero_d": lambda base, n: np.float32(1.0),
  "none": lambda base, n: None,
  "ragged_list": lambda base, n: [[1.0, 2.0], [3.0]] + [[0.0, 0.0]] * (n - 2),
  "python_scalar": lambda base, n: 3.5,
  "list_of_lists": lambda base, n: base.tolist(),
  "bool": lambda base, n: base > 5,
  "non_contiguous": lambda base, n: np.arange(n * 4, dtype=np.float32).reshape(n, 4)[:, ::2],
  "negative_stride": lambda base, n: base[::-1],
  "read_only": lambda base, n: _read_only(base),
  "big_endian": lambda base, n: base.astype(">f4"),
  "fortran": lambda base, n: np.asfortranarray(base),
  # Would fail at the transfer, on this host alone.
  "masked": lambda base, n: np.ma.masked_array(base, mask=base > 3),
  "longdouble": lambda base, n: base.astype(np.longdouble),
  # An ndarray subclass: taken as a plain view.
  "subclass": lambda base, n: base.view(_Subclass),
}


def hostile_leaf(kind: str, n: int) -> Any:
  """A bad (or unusual but valid) `y` column with `n` rows."""
  base = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
  if kind not in _HOSTILE_LEAVES:
    raise ValueError(kind)
  return _HOSTILE_LEAVES[kind](base, n)


class _Subclass(np.ndarray):
  """An ndarray subclass with nothing of its own (as np.memmap views are)."""


EVERY_HOST_KINDS = frozenset({"bool", "list_of_lists"})

# A bad record for `pack_sequences` among int32 records of 2 tokens (`packed_source`).
PACK_RECORDS: dict[str, Any] = {
  "pack_zero_d": np.int32(5),
  "pack_2d": np.ones((2, 2), np.int32),
  "pack_strings": np.array(["a", "b"]),
  "pack_float_joins": np.array([1.5, 2.5]),  # Into the row that an int32 record opened.
  "pack_float_opens": np.array([1.5, 2.5]),  # Opens its own row.
}


def packed_source(kind: str, process: int, bad_process: int) -> Any:
  """32 records ``{"tok": [10 r + 1, 10 r + 2]}`` (int32) packed 2 to a row of 4, 8 rows a batch.

  On `bad_process`, record 17 (`PACK_RECORDS[kind]`) joins the row that
  record 16 opened; record 16 for ``"pack_float_opens"``. Either is read for batch 1.
  """
  import grain

  import grain_jax_sync as gjs

  records = [{"tok": np.array([10 * r + 1, 10 * r + 2], np.int32)} for r in range(32)]
  if process == bad_process:
    records[16 if kind == "pack_float_opens" else 17] = {"tok": PACK_RECORDS[kind]}
  ds = grain.MapDataset.source(records).to_iter_dataset()
  return gjs.pack_sequences(ds, length=4, num_bins=1).batch(8)


def run_hostile(
  bad_process: int, kinds: list[str], *, batch_size: int = 8, bad_batch: int = 1
) -> list[dict[str, Any]]:
  """For each kind, `bad_process` yields column `y` of that kind at `bad_batch`.

  Every other batch (and every other process) is the normal
  ``{"x": int32 (n,), "y": float32 (n, 2)}``; kinds in `EVERY_HOST_KINDS`
  replace `y` in every batch on every host instead (a dtype all hosts share).
  ``"too_big"`` and ``"too_big_padded"`` make the batch twice `batch_size`
  (the latter with `paddings`); kinds in `PACK_RECORDS` read `packed_source`
  (its `tok` is gathered). Returns one outcome per kind with the gathered
  `y` of each yielded batch.
  """
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  results = []
  for k, kind in enumerate(kinds):
    data = scenarios.make_batches(p, [batch_size] * 3)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "name": f"hostile{k}"}
    if kind in PACK_RECORDS:
      data = packed_source(kind, p, bad_process)
    elif kind in EVERY_HOST_KINDS:
      for b in data:
        b["y"] = hostile_leaf(kind, batch_size)
    elif kind.startswith("too_big"):
      if p == bad_process:
        data[bad_batch] = scenarios.make_batches(p, [batch_size * 2])[0]
      if kind == "too_big_padded":
        kwargs.update(paddings=0, mask_key="mask")
    elif p == bad_process:
      data[bad_batch] = {**data[bad_batch], "y": hostile_leaf(kind, batch_size)}
    it = gjs.iter_jax_batches(data, **kwargs)
    out = _outcome(it)
    it.close()
    out["batches"] = [b["tok" if kind in PACK_RECORDS else "y"] for b in out["batches"]]
    results.append(out)
  return results


def run_kill(
  victim: int,
  sizes: list[list[int]],
  kill_at: int,
  sync_timeout_s: float,
  *,
  linger_s: float = 0.0,
) -> dict[str, Any]:
  """Process `victim` SIGKILLs itself when its source reaches `kill_at`.

  Process 0 (when it survives) lingers `linger_s` before returning: it hosts
  the coordination service, and a real job would not exit that fast, so the
  other survivors get to report their own error first. Every process starts
  its backend and meets the others first, so that the kill lands mid-run and
  not in a peer's start-up.
  """
  import jax
  from jax._src import distributed

  import grain_jax_sync as gjs

  p = jax.process_index()
  jax.devices()
  distributed.global_state.client.wait_at_barrier("kill/start", 60_000)
  src = batch_source(p, sizes[p], kill_at=kill_at if p == victim else None)
  it = gjs.iter_jax_batches(
    src, batch_size=8, sync_timeout_s=sync_timeout_s, synchronize_lookahead=2, name="kill"
  )
  out = drain_local(it)
  start = time.monotonic()
  it.close()
  out["close_s"] = time.monotonic() - start
  out["threads"] = sorted(t.name for t in threading.enumerate())
  if p == 0 and p != victim:
    time.sleep(linger_s)
  return out


# -- conservation over real Grain pipelines ----------------------------------------


def grain_shard(
  kind: str, process: int, count: int, num_records: int, batch: int, worker_count: int = 0
) -> Any:
  """This process's shard of records ``0..num_records-1`` as a Grain pipeline.

  ``"map_slices"``: uneven contiguous `MapDataset` slices (process p gets a
  share proportional to p + 1). ``"loader"``: a `DataLoader` over a
  `RangeDataSource` with `ShardOptions` (Grain's own near-even split), with
  `worker_count` worker processes. Records become ``{"id": int32, "v":
  float32 (2,)}``; batches keep the remainder.
  """
  import grain

  def record(i: Any) -> dict[str, np.ndarray]:
    return {"id": np.int32(i), "v": np.array([i, -i], np.float32)}

  if kind == "map_slices":
    weights = np.arange(1, count + 1)
    bounds = np.concatenate([[0], np.cumsum(weights)]) * num_records // weights.sum()
    start, stop = int(bounds[process]), int(bounds[process + 1])
    return grain.MapDataset.range(num_records)[start:stop].map(record).batch(batch)

  class ToRecord(grain.transforms.Map):
    def map(self, element: Any) -> dict[str, np.ndarray]:
      return record(element)

  shard = grain.sharding.ShardOptions(process, count, drop_remainder=False)
  sampler = grain.samplers.IndexSampler(
    num_records=num_records, shard_options=shard, shuffle=False, num_epochs=1
  )
  return grain.DataLoader(
    data_source=grain.sources.RangeDataSource(0, num_records, 1),
    sampler=sampler,
    operations=[ToRecord(), grain.transforms.Batch(batch)],
    worker_count=worker_count,
  )


def run_conservation(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per case: the local batch sizes and the global rows every host saw.

  Each case: ``kind`` (see `grain_shard`), ``num_records``, ``batch`` and
  ``kwargs`` for `iter_jax_batches`. Returns per case this host's source batch
  sizes (so the test can apply the documented rule), and per yielded batch the
  gathered ids, values and mask (when `mask_key` is set).
  """
  import jax

  import grain_jax_sync as gjs

  p, n = jax.process_index(), jax.process_count()
  results = []
  for c, case in enumerate(cases):
    local_sizes = [
      len(b["id"]) for b in grain_shard(case["kind"], p, n, case["num_records"], case["batch"])
    ]
    source = grain_shard(case["kind"], p, n, case["num_records"], case["batch"])
    it = gjs.iter_jax_batches(source, name=f"cons{c}", **case["kwargs"])
    out = scenarios.consume(it)
    it.close()
    out["local_sizes"] = local_sizes
    results.append(out)
  return results


# -- hygiene ---------------------------------------------------------------------


# The per-process liveness beat keys (one per process, not per iterator; they
# go at interpreter exit).
BEATS = "grain_jax_sync/beat/"


def iterator_keys(client: Any) -> list[str]:
  """Every key the library holds in the store, less the per-process beats."""
  return sorted(
    k for k, _ in client.key_value_dir_get("grain_jax_sync/") if not k.startswith(BEATS)
  )


def keys_left(tag: str) -> list[str]:
  """The store keys left once every process closed its iterator (beats aside).

  Every process lists between two barriers: none lists before every one
  closed, and none starts its next iterator before every one listed.
  """
  from jax._src import distributed

  client = distributed.global_state.client
  client.wait_at_barrier(f"{tag}/closed", 60_000)
  keys = iterator_keys(client)
  client.wait_at_barrier(f"{tag}/looked", 60_000)
  return keys


def _leftovers(tag: str) -> dict[str, Any]:
  """Threads, child processes and exchange keys left after a case.

  Waits at a barrier first, so that every process has closed its iterator.
  """
  import gc

  import psutil
  from jax._src import distributed

  from grain_jax_sync._src.exchange import streams as exchange_streams

  gc.collect()
  client = distributed.global_state.client
  client.wait_at_barrier(f"hygiene/{tag}/closed", 60_000)
  out = {
    "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync")),
    "children": [c.pid for c in psutil.Process().children(recursive=True)],
    "keys": iterator_keys(client),
    "streams": exchange_streams.recorded(),  # This process's record of its iterators' streams.
  }
  # Nobody starts the next case before every process has looked.
  client.wait_at_barrier(f"hygiene/{tag}/looked", 60_000)
  return out


def run_hygiene() -> dict[str, Any]:
  """Closes iterators in every way a job ends; reports what is left after each."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  long = scenarios.make_batches(p, [8] * 12)
  kw = {"batch_size": 8, "synchronize_lookahead": 2, "prefetch_batches": 2}
  out: dict[str, Any] = {}

  it = gjs.iter_jax_batches(long, name="drained", **kw)
  out["drained_n"] = sum(1 for _ in it)
  it.close()
  out["drained"] = _leftovers("drained")

  it = gjs.iter_jax_batches(long, name="closed_early", **kw)
  next(it)
  next(it)
  it.close()
  out["closed_early"] = _leftovers("closed_early")

  with gjs.iter_jax_batches(long, name="context", **kw) as it:
    next(it)
  out["context"] = _leftovers("context")

  uneven = scenarios.make_batches(p, [8] * (3 + p))
  it = gjs.iter_jax_batches(uneven, name="error", **kw)
  try:
    for _ in it:
      pass
  except ValueError as e:
    out["error_message"] = str(e)
  out["error_no_close"] = _leftovers("error_no_close")
  it.close()

  src = batch_source(p, [8] * 12, raise_at=5 if p == 0 else None)
  it = gjs.iter_jax_batches(src, name="source_error", **kw)
  try:
    for _ in it:
      pass
  except (OSError, RuntimeError) as e:
    out["source_error_type"] = type(e).__name__
  out["source_error_no_close"] = _leftovers("source_error_no_close")

  it = gjs.iter_jax_batches(long, name="collected", **kw)
  next(it)
  del it
  out["collected"] = _leftovers("collected")
  return out
