"""NumPy -> global jax.Array: the only module that creates `jax.Array`s.

`to_global_leaves` builds a batch's global arrays where a
`placement.BatchPlacement` says.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from grain_jax_sync._src import placement as placement_lib

Targets = tuple[list[jax.sharding.Sharding], list[tuple[int, ...]]]


def global_targets(
  local_shapes: Sequence[Sequence[int]], placement: placement_lib.BatchPlacement
) -> Targets:
  """Per leaf, its sharding and global shape, given its local shape."""
  return (
    [placement_lib.cut(placement.sharding, len(s)) for s in local_shapes],
    [placement.global_shape(s) for s in local_shapes],
  )


def to_global_leaves(
  leaves: Sequence[np.ndarray],
  placement: placement_lib.BatchPlacement,
  device_dtypes: Sequence[np.dtype | None] | None = None,
  *,
  targets: Targets | None = None,
) -> list[jax.Array]:
  """Makes the global arrays of one batch, in leaf order, from this process's leaves.

  One `jax.make_array_from_process_local_data` call over the list of leaves.
  In a single process, where every global shape is the local one, that call
  makes one batched `jax.device_put`: this makes it itself, without the
  call's per-leaf pytree work (`docs/performance.md`). No copy is made here;
  widening casts (`device_dtypes`: per leaf from the first, a dtype or None)
  run on the device afterwards. `targets` is `global_targets` of the leaves'
  shapes, where the caller keeps it.
  """
  shardings, shapes = targets or global_targets([x.shape for x in leaves], placement)
  if placement.single_process and all(x.shape == s for x, s in zip(leaves, shapes)):
    out = list(jax.device_put(list(leaves), shardings))
  else:
    out = list(jax.make_array_from_process_local_data(shardings, list(leaves), shapes))
  if device_dtypes is not None:
    for k, dtype in enumerate(device_dtypes):
      if dtype is not None:
        out[k] = out[k].astype(dtype)
  return out
