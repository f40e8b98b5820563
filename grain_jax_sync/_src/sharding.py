"""Meshes, shardings, the host/device dtype policy and NumPy -> global jax.Array.

The only module that creates `jax.Array`s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

DATA_AXIS = "data"


def default_sharding(axis_name: str = DATA_AXIS) -> jax.sharding.NamedSharding:
  """A 1-D mesh over every device, rows split along `axis_name`.

  Devices come in the topology-aware order of
  `jax.experimental.mesh_utils.create_device_mesh`, or in `jax.devices()` order
  where that fails (some CPU and multi-slice set-ups).

  Args:
    axis_name: The mesh axis name.

  Returns:
    ``NamedSharding(Mesh(devices, (axis_name,)), PartitionSpec(axis_name))``.
  """
  try:
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top

    devices = mesh_utils.create_device_mesh((jax.device_count(),))
  except Exception as e:  # noqa: BLE001 - any failure falls back.
    logger.debug("mesh_utils.create_device_mesh failed (%s); using jax.devices()", e)
    devices = np.array(jax.devices())
  mesh = jax.sharding.Mesh(devices, (axis_name,))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))


def local_row_shards(sharding: jax.sharding.Sharding) -> int:
  """How many distinct row blocks this process's devices hold.

  The local batch must divide evenly among them.
  """
  probe = (jax.device_count() * jax.process_count(),)
  try:
    index_map = sharding.addressable_devices_indices_map(probe)
  except Exception:  # noqa: BLE001 - a sharding that needs more dims.
    return jax.local_device_count()
  blocks = {
    (idx[0].start, idx[0].stop) if idx and isinstance(idx[0], slice) else None
    for idx in index_map.values()
  }
  return max(1, len(blocks))


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


def to_global(
  leaf: np.ndarray,
  sharding: jax.sharding.Sharding,
  process_count: int,
  device_dtype: np.dtype | None = None,
) -> jax.Array:
  """Makes the global array whose rows are every process's `leaf` rows."""
  global_shape = (leaf.shape[0] * process_count, *leaf.shape[1:])
  arr = jax.make_array_from_process_local_data(sharding, leaf, global_shape)
  if device_dtype is not None:
    arr = arr.astype(device_dtype)
  return arr


def to_global_leaves(
  leaves: Sequence[np.ndarray],
  sharding: jax.sharding.Sharding,
  process_count: int,
  device_dtypes: Sequence[np.dtype | None] | None = None,
) -> list[jax.Array]:
  """`to_global` for every leaf of a batch in one call.

  One `jax.make_array_from_process_local_data` call over the list of leaves:
  in a single process that is one batched `device_put` for the whole batch;
  with several processes JAX builds each leaf from its local slices. No copy
  is made here; widening casts (`device_dtypes`) run on the device afterwards.

  Args:
    leaves: Process-local arrays, rows first.
    sharding: The sharding of every leaf.
    process_count: ``jax.process_count()``.
    device_dtypes: Per leaf, the dtype to cast to on the device, or None.

  Returns:
    The global arrays, in leaf order.
  """
  shapes = [(x.shape[0] * process_count, *x.shape[1:]) for x in leaves]
  out = list(jax.make_array_from_process_local_data(sharding, list(leaves), shapes))
  if device_dtypes is not None:
    for k, dtype in enumerate(device_dtypes):
      if dtype is not None:
        out[k] = out[k].astype(dtype)
  return out
