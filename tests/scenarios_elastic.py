"""Scenarios for the elastic source, run inside simulated hosts (one job per call).

A test chains jobs of different process counts: each job restores what the
previous one saved (JSON files or an Orbax checkpoint in `directory`), reads
some global batches, and saves its own state. Records carry an id; the
transform drops ids with ``id % 3 == 1`` and batches by `BATCH`.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from typing import Any

import numpy as np

BATCH = 4
PAD = -1


def keep(i: int) -> bool:
  return i % 3 != 1


def records(n: int) -> list[dict[str, Any]]:
  return [{"id": np.int64(i)} for i in range(n)]


def tokens(i: int) -> int:
  return 1 + i % 3


def packed(ds: Any, batch: int) -> Any:
  """Records as `tokens(id)` tokens of value ``id + 1`` (0 pads), packed `batch` bins at a time."""
  import grain

  ds = ds.filter(lambda r: keep(int(r["id"])))
  ds = ds.map(lambda r: {"tok": np.full(tokens(int(r["id"])), r["id"] + 1, np.int64)})
  # As many bins as rows per batch: every batch ends a packed batch (the cursor is exact).
  ds = grain.experimental.FirstFitPackIterDataset(
    ds, length_struct={"tok": 8}, num_packing_bins=batch
  )
  return ds.batch(batch)


def transform(ds: Any, batch: int = BATCH, workers: int = 0, pack: bool = False) -> Any:
  if pack:
    return packed(ds, batch)
  ds = ds.map(lambda r: {"id": r["id"], "x": np.float32(2 * r["id"])})
  ds = ds.filter(lambda r: keep(int(r["id"]))).batch(batch)
  if workers:  # Grain's multiprocess prefetch: each worker reads every `workers`-th record.
    import grain
    from absl import flags

    if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return ds


def make_iterator(
  n: int,
  *,
  shuffle: bool,
  seed: int = 5,
  num_epochs: int = 1,
  batch: int = BATCH,
  workers: int = 0,
  pack: bool = False,
) -> Any:
  import grain_jax_sync as gjs

  shaped = functools.partial(transform, batch=batch, workers=workers, pack=pack)
  src = gjs.elastic_source(records(n), shaped, shuffle=shuffle, seed=seed, num_epochs=num_epochs)
  return gjs.iter_jax_batches(src, batch_size=batch, paddings=PAD, mask_key="mask")


def gather(tree: Any) -> Any:
  import jax
  from jax.experimental import multihost_utils

  return jax.tree_util.tree_map(
    lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree
  )


def _json_states(directory: str, job: int) -> list[Any]:
  folder = os.path.join(directory, f"job{job}")
  names = sorted(os.listdir(folder), key=lambda s: int(s.split("_")[1].split(".")[0]))
  return [json.load(open(os.path.join(folder, name))) for name in names]


def elastic_job(
  job: int,
  n: int,
  steps: int | None,
  directory: str,
  mode: str,
  shuffle: bool = False,
  num_epochs: int = 1,
  workers: int = 0,
  pack: bool = False,
  stop_at: int | None = None,
) -> dict[str, Any]:
  """One job: restore the previous job's state, read `steps` global batches (None: all), save.

  With `stop_at`, the last process sends itself SIGTERM once it has read
  that many batches; its handler calls `request_stop()` (docs/multihost.md's
  recipe), and every host reads on until its stream ends.

  Returns:
    The global batches read ({"id", "x", "mask"} lists), the batch count
    the iterator resumed at, and the process whose request stopped it.
  """
  import jax
  import orbax.checkpoint as ocp

  import grain_jax_sync as gjs

  p = jax.process_index()
  it = make_iterator(n, shuffle=shuffle, num_epochs=num_epochs, workers=workers, pack=pack)
  mngr = ocp.CheckpointManager(os.path.join(directory, "ckpt")) if mode == "orbax" else None
  if job:
    if mngr is None:
      it.set_state(_json_states(directory, job - 1))
    else:
      mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data=gjs.checkpoint_restore(it)))
  resumed_at = it.get_state()["batches"]
  asker = stop_at is not None and p == jax.process_count() - 1
  if asker:
    signal.signal(signal.SIGTERM, lambda *_: it.request_stop())
  out = []
  for b in it:
    g = gather(b)
    out.append({k: np.asarray(v).tolist() for k, v in g.items()})
    if asker and len(out) == stop_at:
      os.kill(os.getpid(), signal.SIGTERM)
    if steps is not None and len(out) == steps:
      break
  if mngr is not None:
    mngr.save(job + 1, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))
    mngr.wait_until_finished()
    mngr.close()
  else:
    folder = os.path.join(directory, f"job{job}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"state_{p}.json"), "w") as f:
      json.dump(it.get_state(), f)
  it.close()
  return {"batches": out, "resumed_at": resumed_at, "stopped_by": it.stop_requested_by}


def refusals(n: int, directory: str) -> dict[str, str]:
  """The errors of states that do not fit, from a 1-process job's states, on 2 processes."""
  import grain_jax_sync as gjs

  states = _json_states(directory, 0)
  out = {}
  for name, kwargs in (("seed", {"seed": 6}), ("num_records", {"n": n + 1})):
    args = {"n": n, "shuffle": True, **kwargs}
    it = make_iterator(args.pop("n"), **args)
    try:
      it.set_state(states)
    except ValueError as e:
      out[name] = str(e)
    it.close()
  it = make_iterator(n, shuffle=True, num_epochs=1)
  mid_epoch = dict(states[0], source=dict(states[0]["source"], epoch=1))
  try:
    it.set_state([mid_epoch])
  except ValueError as e:
    out["epoch"] = str(e)
  it.close()
  # Not elastic: a Grain MapDataset split by hand.
  import grain
  import jax

  ds = grain.MapDataset.source(records(n))[jax.process_index() :: jax.process_count()]
  it = gjs.iter_jax_batches(
    transform(ds.to_iter_dataset()), batch_size=BATCH, paddings=PAD, mask_key="mask"
  )
  try:
    it.set_state(states)
  except ValueError as e:
    out["not_elastic"] = str(e)
  it.close()
  return out
