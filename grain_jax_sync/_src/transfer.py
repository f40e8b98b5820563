"""NumPy -> global jax.Array: the only module that creates `jax.Array`s.

`to_global_leaves` builds a batch's global arrays where a
`placement.BatchPlacement` says.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grain_jax_sync._src import placement as placement_lib

Targets = tuple[list[jax.sharding.Sharding], list[tuple[int, ...]]]

# A leaf bound for one accelerator device goes as row pieces put at once: a
# host-to-device link moves more with more transfers under way, and a batch
# held is one batch however many pieces it travels in. A piece is at least
# `PIECE_BYTES`, so that a put's fixed host cost stays small beside its copy
# on any host, and a leaf is at most `PIECES` pieces, so that the batches
# built ahead keep a few tens of transfers under way, not hundreds.
PIECE_BYTES = 4 << 20
PIECES = 8


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
  call's per-leaf pytree work (`docs/performance.md`), in pieces where one
  accelerator device takes a leaf (`put_in_pieces`). No host copy is made here;
  widening casts (`device_dtypes`: per leaf from the first, a dtype or None)
  run on the device afterwards. `targets` is `global_targets` of the leaves'
  shapes, where the caller keeps it.
  """
  shardings, shapes = targets or global_targets([x.shape for x in leaves], placement)
  if placement.single_process and all(x.shape == s for x, s in zip(leaves, shapes)):
    out = put_in_pieces(leaves, shardings)
  else:
    out = list(jax.make_array_from_process_local_data(shardings, list(leaves), shapes))
  if device_dtypes is not None:
    for k, dtype in enumerate(device_dtypes):
      if dtype is not None:
        out[k] = out[k].astype(dtype)
  return out


def put_in_pieces(
  leaves: Sequence[np.ndarray], shardings: Sequence[jax.sharding.Sharding]
) -> list[jax.Array]:
  """One `jax.device_put` of the leaves, each bound for one accelerator device as row pieces.

  The pieces (views, no copy) travel at once and are joined on the device;
  a leaf spread over several devices already travels as one transfer per
  device, and a CPU device takes a leaf without a link to fill.
  """
  pieces = [_pieces(x, s) for x, s in zip(leaves, shardings, strict=True)]
  if all(k == 1 for k in pieces):
    return list(jax.device_put(list(leaves), list(shardings)))
  flat = [p for x, k in zip(leaves, pieces) for p in np.array_split(x, k)]
  put = iter(jax.device_put(flat, [s for s, k in zip(shardings, pieces) for _ in range(k)]))
  parts = [[next(put) for _ in range(k)] for k in pieces]
  return [p[0] if len(p) == 1 else _join(s)(p) for s, p in zip(shardings, parts)]


def _pieces(leaf: np.ndarray, sharding: jax.sharding.Sharding) -> int:
  """How many row pieces `leaf` travels in to `sharding` (`PIECE_BYTES`, `PIECES`)."""
  devices = sharding.device_set
  if leaf.ndim == 0 or len(devices) != 1 or next(iter(devices)).platform == "cpu":
    return 1
  return max(1, min(PIECES, leaf.shape[0], leaf.nbytes // PIECE_BYTES))


@functools.cache
def _join(sharding: jax.sharding.Sharding) -> jax.stages.Wrapped:
  """Joins row pieces on the device, into an array placed by `sharding`."""
  return jax.jit(jnp.concatenate, out_shardings=sharding)
