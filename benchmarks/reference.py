"""BASELINE MODEL of the reference implementation (not grain_jax_sync code).

A faithful minimal re-implementation of the behaviour of Ray Data's
`jax_sync_generator` (ray-project/ray, python/ray/data/util/jax_util.py), written
for the benchmark's "reference" column because Ray itself is not installed:

* reads a window of `synchronize_lookahead` batches on demand, in the
  consumer's thread (no prefetch, no overlap with the step);
* exchanges ``[has_batch, rows]`` per batch with
  ``multihost_utils.process_allgather(jnp.array(infos))``, a device
  computation;
* pads with ``np.concatenate``;
* converts with ``jax.make_array_from_process_local_data`` and then applies
  `dtypes` with ``.astype(dtype)`` on the device, after the transfer.

Only the paths the benchmark uses are modelled (dict batches of NumPy arrays).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np


def _sharding() -> Any:
  import jax

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def _pad(batch: dict[str, np.ndarray], target: int, paddings: Any) -> dict[str, np.ndarray]:
  out = {}
  for k, v in batch.items():
    missing = target - v.shape[0]
    if missing > 0:
      fill = np.full((missing, *v.shape[1:]), paddings, v.dtype)
      v = np.concatenate([v, fill], axis=0)
    out[k] = v
  return out


def _read_window(it: Iterator[dict[str, np.ndarray]], n: int) -> list[dict[str, np.ndarray]]:
  """Up to `n` batches read on demand, in the consumer's thread."""
  window: list[dict[str, np.ndarray]] = []
  for _ in range(n):
    try:
      window.append(next(it))
    except StopIteration:
      break
  return window


def _gather_infos(window: list[dict[str, np.ndarray]], lookahead: int, pc: int) -> np.ndarray:
  """Every host's ``[has_batch, rows]`` per window slot, by a device all-gather."""
  import jax.numpy as jnp
  from jax.experimental import multihost_utils

  infos = [[1, next(iter(b.values())).shape[0]] for b in window]
  infos += [[0, 0]] * (lookahead - len(window))
  gathered = np.asarray(multihost_utils.process_allgather(jnp.array(infos)))
  return gathered.reshape(pc, lookahead, 2)


def _synced_end(slot: np.ndarray, drop_last: bool, paddings: Any, batch_size: int) -> bool:
  """True when the gathered ``[has_batch, rows]`` of one slot ends the synchronized stream."""
  has = slot[:, 0]
  if not has.any():
    return True
  if not has.all() and (drop_last or paddings is None):
    return True
  rows = slot[:, 1]
  return bool(drop_last and rows[has == 1].min() < batch_size)


def _local_batch(
  window: list[dict[str, np.ndarray]],
  i: int,
  template: dict[str, np.ndarray] | None,
  *,
  drop_last: bool,
  batch_size: int,
  paddings: Any,
  synchronize_batches: bool,
) -> dict[str, np.ndarray] | None:
  """Window batch `i` (or a dummy for a host that ran out), padded; None to end the stream."""
  if i < len(window):
    batch = window[i]
  else:  # A dummy batch for a host that ran out.
    assert template is not None
    batch = {k: np.full((0, *v.shape[1:]), paddings, v.dtype) for k, v in template.items()}
  rows_here = next(iter(batch.values())).shape[0]
  if drop_last and rows_here < batch_size and not synchronize_batches:
    return None
  if paddings is not None:
    batch = _pad(batch, batch_size, paddings)
  return batch


def _to_global(batch: dict[str, np.ndarray], sharding: Any, pc: int, dtypes: Any) -> dict[str, Any]:
  """`make_array_from_process_local_data` per leaf, then `dtypes` on the device."""
  import jax

  out = {}
  for k, v in batch.items():
    arr = jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * pc, *v.shape[1:]))
    want = dtypes.get(k) if isinstance(dtypes, dict) else dtypes
    if want is not None:
      arr = arr.astype(want)
    out[k] = arr
  return out


def reference_sync_generator(
  batch_iterable: Iterable[dict[str, np.ndarray]],
  drop_last: bool,
  batch_size: int = 256,
  paddings: Any = None,
  dtypes: Any = None,
  synchronize_batches: bool = False,
  synchronize_lookahead: int = 10,
) -> Iterator[dict[str, Any]]:
  """Baseline model of the reference's generator (see the module docstring)."""
  import jax

  sharding = _sharding()
  pc = jax.process_count()
  it = iter(batch_iterable)
  template: dict[str, np.ndarray] | None = None
  while True:
    window = _read_window(it, synchronize_lookahead)
    if window and template is None:
      template = window[0]
    if synchronize_batches:
      gathered = _gather_infos(window, synchronize_lookahead, pc)
    for i in range(synchronize_lookahead):
      if synchronize_batches:
        if _synced_end(gathered[:, i], drop_last, paddings, batch_size):
          return
      elif i >= len(window):
        return
      batch = _local_batch(
        window,
        i,
        template,
        drop_last=drop_last,
        batch_size=batch_size,
        paddings=paddings,
        synchronize_batches=synchronize_batches,
      )
      if batch is None:
        return
      yield _to_global(batch, sharding, pc, dtypes)
    if not synchronize_batches and len(window) < synchronize_lookahead:
      return
