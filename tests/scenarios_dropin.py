"""Scenario functions for the drop-ins (run inside simulated hosts; importable).

Each runs several cases in one set of processes (processes are expensive on a
shared machine) and returns, per case, plain values that pickle back.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
from scenarios import consume, gather, make_batches


class ThreadRecordingSource:
  """A list of batches that records the thread of every read (not thread-safe on purpose)."""

  def __init__(self, batches: list[Any]):
    self._batches = batches
    self.reads: list[int] = []

  def __iter__(self):
    for b in self._batches:
      self.reads.append(threading.get_ident())
      yield b


def _compat(data: Any, **kwargs: Any) -> dict[str, Any]:
  import grain_jax_sync as gjs

  return consume(gjs.jax_sync_generator(data, **kwargs))


def run_compat_cases(sizes_by_case: dict[str, list[list[int]]]) -> dict[str, Any]:
  """Ray-style calls of `jax_sync_generator` on this process's shard."""
  import jax

  from grain_jax_sync import jax_sync_generator as gjs_compat

  p = jax.process_index()
  out: dict[str, Any] = {}

  def data(case: str) -> list[Any]:
    return make_batches(p, sizes_by_case[case][p])

  for sync in (False, True):
    for drop_last in (False, True):
      out[f"defaults/sync={sync}/drop_last={drop_last}"] = _compat(
        data("equal"), drop_last=drop_last, synchronize_batches=sync
      )
  out["uneven_sizes"] = _compat(data("uneven_sizes"), drop_last=False, synchronize_batches=True)
  out["uneven_count"] = _compat(data("uneven_count"), drop_last=False, synchronize_batches=True)
  out["not_divisible"] = _compat(data("not_divisible"), drop_last=False, synchronize_batches=True)
  out["larger"] = _compat(
    data("larger"), drop_last=False, batch_size=8, paddings=0, synchronize_batches=True
  )
  out["batch_size_none"] = _compat(
    data("larger"), drop_last=False, batch_size=None, synchronize_batches=True
  )
  src = ThreadRecordingSource(data("equal"))
  result = _compat(src, drop_last=True, synchronize_batches=True)
  result["read_threads"] = sorted(set(src.reads))
  result["caller_thread"] = threading.get_ident()
  out["lazy_sync"] = result
  src = ThreadRecordingSource(data("equal"))
  gen = gjs_compat(src, drop_last=False)
  reads_per_yield = []
  for _ in gen:  # No collective: each host reads alone.
    reads_per_yield.append(len(src.reads))
  out["lazy_unsync"] = {"reads": reads_per_yield, "threads": sorted(set(src.reads))}
  return out


def _grain_batches(p: int, n: int, batch: int) -> Any:
  import grain

  base = 1000 * p
  return (
    grain.MapDataset.range(base, base + n)
    .map(lambda i: {"x": np.int32(i)})
    .batch(batch)
    .to_iter_dataset()
  )


def run_device_put_cases(n: int, batch: int, k: int) -> dict[str, Any]:
  """Grain's device_put state restored after the swap; unbatched elements refused."""
  import grain
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  out: dict[str, Any] = {}
  local = jax.local_devices()[0]
  theirs = iter(grain.experimental.device_put(_grain_batches(p, n, batch), local))
  head = [np.asarray(next(theirs)["x"]).tolist() for _ in range(k)]
  grain_state = json.loads(json.dumps(theirs.get_state()))
  theirs.close()
  out["grain_state"] = grain_state
  out["grain_head"] = head

  sharding = gjs.default_sharding()
  full_it = iter(gjs.device_put(_grain_batches(p, n, batch), sharding))
  out["full"] = [gather(b)["x"].tolist() for b in full_it]
  full_it.close()
  ours = iter(gjs.device_put(_grain_batches(p, n, batch), sharding))
  ours.set_state(grain_state)
  out["resumed"] = [gather(b)["x"].tolist() for b in ours]
  out["state_after"] = ours.get_state()["source"]
  ours.close()
  # None on several processes: global batches on the default mesh, as unset.
  none_it = iter(gjs.device_put(_grain_batches(p, n, batch), None))
  out["none"] = [gather(b)["x"].tolist() for b in none_it]
  out["none_default"] = none_it.sharding.is_equivalent_to(gjs.default_sharding(), 2)
  none_it.close()
  try:  # A None leaf beside the default sharding: one placement, no error.
    gjs.device_put(_grain_batches(p, n, batch), {"x": sharding, "y": None})
    out["none_leaf"] = None
  except ValueError as e:
    out["none_leaf"] = str(e)

  # Grain's, given a sharding over every host, needs the same element on each
  # (jax.device_put checks): the global array is that element. Ours takes each
  # host's element as its own rows, so the same element appears once per host.
  # No buffers: Grain's check is a collective, made by each next() in turn.
  # JAX before 0.10 checks on one host only: the other host's collective can
  # hang for 30 s and break the next ones, so that part runs from 0.10.
  unbuffered = {"cpu_buffer_size": 0, "device_buffer_size": 0}
  out["grain_own_rows"] = None
  if jax.__version_info__ >= (0, 10):
    own = iter(grain.experimental.device_put(_grain_batches(p, n, batch), sharding, **unbuffered))
    try:
      next(own)
    except AssertionError as e:
      out["grain_own_rows"] = str(e)
    own.close()
  for name, put in (("grain_same", grain.experimental.device_put), ("ours_same", gjs.device_put)):
    same_it = iter(put(_grain_batches(0, n, batch), sharding, **unbuffered))
    out[name] = gather(next(same_it))["x"].tolist()
    same_it.close()

  unbatched = grain.MapDataset.range(8).map(lambda i: {"x": np.int32(i)}).to_iter_dataset()
  out["unbatched"] = consume(iter(gjs.device_put(unbatched, sharding)))
  try:
    gjs.device_put(unbatched, {"x": sharding, "y": gjs.default_sharding("other")})
    out["pytree_error"] = None
  except (ValueError, TypeError) as e:
    out["pytree_error"] = f"{type(e).__name__}: {e}"
  return out


def run_maxtext_loop(train_n: int, eval_ns: list[int], directory: str) -> dict[str, Any]:
  """MaxText's trainer, shaped: train, eval with reset(), checkpoint local_iterator, resume.

  MaxText builds ``MultiHostDataLoadIterator(dataloader, global_mesh)``, calls
  ``eval_data_iterator.reset()`` before every eval, and saves
  ``data_iterator.local_iterator`` with Grain's checkpoint arguments.
  """
  import grain
  import jax
  import orbax.checkpoint as ocp

  import grain_jax_sync as gjs

  p = jax.process_index()
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "fsdp"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))

  def train_iterator():
    return gjs.iter_jax_batches(_grain_batches(p, train_n, 8), batch_size=8, sharding=sharding)

  full_it = train_iterator()
  full = [gather(b)["x"].tolist() for b in full_it]
  full_it.close()

  train_it = train_iterator()
  eval_it = gjs.iter_jax_batches(
    _grain_batches(p, eval_ns[p], 8), batch_size=8, paddings=0, mask_key="mask", sharding=sharding
  )
  trained, evals = [], []
  for _ in range(2):  # Two rounds of: two train steps, then a full eval.
    for _ in range(2):
      trained.append(gather(next(train_it))["x"].tolist())
    eval_it.reset()
    evals.append([gather(b) for b in eval_it])
  mngr = ocp.CheckpointManager(directory)
  save = grain.checkpoint.CheckpointSave(train_it.local_iterator)
  mngr.save(4, args=ocp.args.Composite(data=save))
  mngr.wait_until_finished()
  mngr.close()
  train_it.close()
  eval_it.close()

  fresh = train_iterator()
  mngr = ocp.CheckpointManager(directory)
  restore = grain.checkpoint.CheckpointRestore(fresh.local_iterator)
  mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data=restore))
  mngr.close()
  rest = [gather(b)["x"].tolist() for b in fresh]
  fresh.close()
  return {
    "full": full,
    "trained": trained,
    "rest": rest,
    "eval_x": [[b["x"].tolist() for b in e] for e in evals],
    "eval_mask": [[b["mask"].tolist() for b in e] for e in evals],
  }


def run_size_cases(prefetch: int) -> dict[str, Any]:
  """The derived full batch size and the exact last batch, synchronized (streamed form)."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  kw = {"prefetch_batches": prefetch, "synchronize_lookahead": 2}
  out: dict[str, Any] = {}
  # Process 0's 16-row batch is not its last: judged only once its next batch is known.
  for q in (0, 1):
    sizes = [[24, 24, 24], [24, 24, 24]]
    sizes[q] = [24, 16, 24]
    early = make_batches(p, sizes[p])
    out[f"short_not_last/{q}"] = consume(
      gjs.iter_jax_batches(early, batch_size=24, drop_last=True, **kw)
    )
  last = make_batches(p, [[24, 24, 16], [24, 24, 24]][p])
  out["derived_pad"] = consume(gjs.iter_jax_batches(last, paddings=-1, mask_key="mask", **kw))
  out["derived_drop"] = consume(gjs.iter_jax_batches(last, drop_last=True, **kw))
  both = make_batches(p, [24, 24, 16])
  with gjs.iter_jax_batches(both, paddings=-1, mask_key="mask", **kw) as it:
    next(it)
    next(it)
    state = it.get_state()
  with gjs.iter_jax_batches(both, paddings=-1, mask_key="mask", **kw) as it:
    it.set_state(state)  # Resumed before the short batch: still judged by 24.
    out["resumed"] = consume(it)
  out["state_batch_size"] = state.get("batch_size")
  return out
