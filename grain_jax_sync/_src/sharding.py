"""The host/device dtype policy, row digests, and NumPy -> global jax.Array.

The only module that creates `jax.Array`s: `to_global_leaves` builds a
batch's global arrays where a `placement.BatchPlacement` says.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from grain_jax_sync._src import placement as placement_lib

logger = logging.getLogger(__name__)


# -- identical rows where processes share a data shard ----------------------------

# Leaves up to this size are hashed whole. blake2b measured 1.4 to 3.7 ms per
# MiB on the shared 2-core machine, so a leaf costs at most about 1 ms.
DIGEST_FULL_BYTES = 256 << 10
# Larger leaves: at most this many rows, evenly spaced (first and last kept), and
# at most this many bytes of each (evenly strided elements).
DIGEST_SAMPLE_ROWS = 64
DIGEST_ROW_BYTES = 1024


def rows_digest(leaves: Sequence[np.ndarray]) -> str:
  """A cheap digest of a batch's rows, to compare across processes.

  Hashes each leaf's dtype and shape, and its bytes: whole up to
  `DIGEST_FULL_BYTES`, else a strided sample of rows and of each row's
  elements. Equal rows give equal digests; rows loaded from another shard
  or another shuffle differ in the sample with near certainty.

  Args:
    leaves: The batch's leaves, rows first.

  Returns:
    16 hex digits.
  """
  h = hashlib.blake2b(digest_size=8)
  for leaf in leaves:
    a = np.asarray(leaf)
    h.update(f"{a.dtype.str}{a.shape};".encode())
    if a.nbytes <= DIGEST_FULL_BYTES or a.ndim == 0:
      h.update(np.ascontiguousarray(a).tobytes())
      continue
    rows = a.shape[0]
    picks = np.unique(np.linspace(0, rows - 1, min(rows, DIGEST_SAMPLE_ROWS)).astype(np.int64))
    per_row = max(1, a[0].size)
    stride = max(1, -(-per_row * a.itemsize // DIGEST_ROW_BYTES))
    for r in picks:
      h.update(np.ascontiguousarray(a[r].reshape(-1)[::stride]).tobytes())
  return h.hexdigest()


def shared_rows_error(
  digests: Sequence[str | None], groups: Sequence[Sequence[int]], batch_index: int
) -> str | None:
  """The error when processes that share a data shard fed different rows.

  Args:
    digests: Per process index, `rows_digest` of the rows it fed at this
      batch, or None where it fed none (a dummy batch).
    groups: `BatchPlacement.groups`: per input shard, the processes feeding it.
    batch_index: The output batch, for the message.

  Returns:
    The message for every host to raise as ValueError, or None if they agree.
  """
  for shard, procs in enumerate(groups):
    fed = {p: digests[p] for p in procs if digests[p] is not None}
    ended = [p for p in procs if digests[p] is None]
    head = (
      f"batch {batch_index}: processes {list(procs)} hold the same data shards"
      f" (input shard {shard}) and must feed identical rows, but"
    )
    if fed and ended:
      # A dummy batch on one replica and real rows on another would make a
      # global array whose copies differ from process to process.
      return (
        f"{head} {_processes(ended)} had no batch {batch_index} (its source ended) while"
        f" {_processes(list(fed))} had one. Processes that share data shards must"
        f" feed the same number of batches: load {_LOAD_SHARD}"
      )
    if len(set(fed.values())) > 1:
      detail = ", ".join(f"process {p}: {d}" for p, d in fed.items())
      return f"{head} their rows differ (row digests {detail}). Load {_LOAD_SHARD}"
  return None


_LOAD_SHARD = (
  "the data with grain_jax_sync.data_shard_info(mesh) as the shard"
  " (tfds_pipeline(mesh=...) does) and the same seed on every process"
)


def _processes(ps: Sequence[int]) -> str:
  return f"process {ps[0]}" if len(ps) == 1 else f"processes {list(ps)}"


def split_casts(
  src: Sequence[np.dtype], want: Sequence[Any]
) -> tuple[list[np.dtype], list[np.dtype | None]]:
  """The dtype policy: shrink on the host, grow on the device.

  A cast to a dtype of fewer or equal bytes (float32 -> bfloat16, int64 ->
  int32) runs on the host before the transfer, so fewer bytes cross the link.
  A cast to a wider dtype (uint8 -> float32) runs on the device after it.

  Args:
    src: Each leaf's dtype as read.
    want: Each leaf's requested dtype, or None to keep it.

  Returns:
    (host_dtypes, device_dtypes): the dtype each leaf is transferred in, and
    the dtype to cast to on the device afterwards (None for no device cast).
  """
  host: list[np.dtype] = []
  device: list[np.dtype | None] = []
  for s, w in zip(src, want):
    if w is None:
      host.append(s)
      device.append(None)
      continue
    w = np.dtype(w) if not isinstance(w, np.dtype) else w
    w = np.dtype(jax.dtypes.canonicalize_dtype(w))
    if w.itemsize <= s.itemsize:
      host.append(w)
      device.append(None)
    else:
      host.append(s)
      device.append(w)
  return host, device


Targets = tuple[list[jax.sharding.Sharding], list[tuple[int, ...]]]


def global_targets(
  local_shapes: Sequence[Sequence[int]], placement: placement_lib.BatchPlacement
) -> Targets:
  """Per leaf, its sharding and global shape, given its local shape."""
  return (
    [placement.sharding_for(len(s)) for s in local_shapes],
    [placement.global_shape(s) for s in local_shapes],
  )


def to_global_leaves(
  leaves: Sequence[np.ndarray],
  placement: placement_lib.BatchPlacement,
  device_dtypes: Sequence[np.dtype | None] | None = None,
  *,
  targets: Targets | None = None,
) -> list[jax.Array]:
  """Makes the global arrays of one batch from this process's leaves.

  With several processes, one `jax.make_array_from_process_local_data` call
  over the list of leaves: JAX builds each leaf from its local slices. A
  leaf's global shape is `placement.global_shape` of its local shape: rows
  per data shard times data shards. In a single process that call checks
  that each global shape is the local one and then makes one batched
  `jax.device_put` of the whole batch; where the shapes agree this makes
  that `device_put` itself, without the call's per-leaf pytree work (about
  12 us per leaf, measured in `docs/performance.md`). No copy is made here;
  widening casts (`device_dtypes`) run on the device afterwards.

  Args:
    leaves: Process-local arrays, rows first.
    placement: Where the rows go (`resolve_sharding`).
    device_dtypes: Per leaf, the dtype to cast to on the device, or None.
    targets: `global_targets` of the leaves' shapes, if the caller keeps it
      (a batch of the same shapes as an earlier one).

  Returns:
    The global arrays, in leaf order.
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
