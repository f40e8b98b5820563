"""NumPy -> global jax.Array: the only module that creates `jax.Array`s.

`to_global_leaves` builds a batch's global arrays where a
`placement.BatchPlacement` says.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grain_jax_sync._src import placement as placement_lib

Targets = tuple[list[jax.sharding.Sharding], list[tuple[int, ...]]]

# A leaf bound for one device crosses the link as up to `PIECES` puts of
# rows (views: no host memory added), joined on the device: one put fills only
# part of a host-to-device link, a few fill it. Each is at least `PIECE_BYTES`,
# so its fixed cost stays small beside its bytes on any host. One put where
# there is no link (CPU devices), or where NumPy does not own the memory
# (Grain's shared memory, a memory-mapped file: several puts faulting one
# mapping at once cost far more CPU). Why, with figures: docs/performance.md.
PIECES = 4
PIECE_BYTES = 4 << 20
NO_LINK = frozenset({"cpu"})


def global_targets(
  local_shapes: Sequence[Sequence[int]], placement: placement_lib.BatchPlacement
) -> Targets:
  """Per leaf, its sharding and global shape, given its local shape."""
  return (
    [placement_lib.cut(placement.sharding, len(s)) for s in local_shapes],
    [placement_lib.local_to_global_shape(s, placement.sharding) for s in local_shapes],
  )


def pieces(leaf: np.ndarray, sharding: jax.sharding.Sharding) -> int:
  """How many puts of rows `leaf` crosses as (1: one put) to `sharding`'s devices."""
  if leaf.ndim == 0 or len(sharding.device_set) != 1:
    return 1
  device: Any = next(iter(sharding.device_set))
  if device.platform in NO_LINK or not _numpy_owned(leaf):
    return 1
  return max(1, min(PIECES, leaf.nbytes // PIECE_BYTES, leaf.shape[0]))


def _numpy_owned(leaf: np.ndarray) -> bool:
  """Whether `leaf`'s memory is an array's own allocation (not a buffer NumPy wraps)."""
  base: Any = leaf
  while isinstance(base, np.ndarray) and base.base is not None:
    base = base.base
  return isinstance(base, np.ndarray)


@functools.lru_cache(maxsize=64)
def _joined(sharding: jax.sharding.Sharding, dtype: Any) -> Any:
  """Joins pieces along the rows on the device (and casts to `dtype`, unless None).

  One jitted function per target: `jit` traces it once per count and shape of pieces.
  """

  def join(*parts: jax.Array) -> jax.Array:
    out = jnp.concatenate(parts, axis=0)
    return out if dtype is None else out.astype(dtype)

  return jax.jit(join, out_shardings=sharding)


def _put(
  leaves: Sequence[np.ndarray],
  shardings: Sequence[jax.sharding.Sharding],
  device_dtypes: Sequence[np.dtype | None],
) -> list[jax.Array]:
  """One batched `jax.device_put` of every leaf, as `pieces` of rows where it is large."""
  counts = [pieces(x, s) for x, s in zip(leaves, shardings, strict=True)]
  parts: list[np.ndarray] = []
  targets: list[jax.sharding.Sharding] = []
  for x, s, k in zip(leaves, shardings, counts, strict=True):
    parts += np.array_split(x, k) if k > 1 else [x]  # Views: no copy.
    targets += [s] * k
  put = jax.device_put(parts, targets)
  out: list[jax.Array] = []
  at = 0
  for k, s, dtype in zip(counts, shardings, device_dtypes, strict=True):
    if k == 1:
      out.append(put[at] if dtype is None else put[at].astype(dtype))
    else:
      out.append(_joined(s, dtype)(*put[at : at + k]))
    at += k
  return out


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
  call's per-leaf pytree work (`docs/performance.md`), a large leaf bound for
  one device as several puts (`PIECES`). No copy is made on the host;
  widening casts (`device_dtypes`: per leaf from the first, a dtype or None)
  run on the device afterwards. `targets` is `global_targets` of the leaves'
  shapes, where the caller keeps it.
  """
  shardings, shapes = targets or global_targets([x.shape for x in leaves], placement)
  dtypes = list(device_dtypes or []) + [None] * (len(leaves) - len(device_dtypes or []))
  if placement.single_process and all(x.shape == s for x, s in zip(leaves, shapes)):
    return _put(leaves, shardings, dtypes)
  out = list(jax.make_array_from_process_local_data(shardings, list(leaves), shapes))
  for k, dtype in enumerate(dtypes):
    if dtype is not None:
      out[k] = out[k].astype(dtype)
  return out
