"""Meshes: the default device order, the context mesh and the data axes.

No `jax.Array` is made here (that is `sharding.py`); this module only picks
devices and axis names, and says why.

The default mesh is 1-D, one ``"data"`` axis over every device of the job:

* devices that report several ``slice_index`` values (multi-slice TPU):
  `mesh_utils.create_hybrid_device_mesh`, data parallelism across the slices
  (the slow network) and within each slice in its topology-aware order;
* one slice: `mesh_utils.create_device_mesh` (topology-aware);
* where those fail: devices ordered by process, then id.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

logger = logging.getLogger(__name__)

DATA_AXIS = "data"

_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(message: str, log: logging.Logger = logger) -> None:
  """Logs `message` at INFO on `log` the first time this process sees it."""
  with _logged_lock:
    if message in _logged:
      return
    _logged.add(message)
  log.info("%s", message)


def _ordered_fallback(devices: Sequence[Any]) -> np.ndarray:
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  out = np.empty(len(ordered), dtype=object)
  out[:] = ordered
  return out


def _slice_indices(devices: Sequence[Any]) -> list[Any]:
  return sorted({s for s in (getattr(d, "slice_index", None) for d in devices) if s is not None})


def default_device_order(devices: Sequence[Any]) -> tuple[np.ndarray, str]:
  """The devices of the default 1-D data mesh, in order, and why that order.

  Args:
    devices: Every device of the job (`jax.devices()`); any objects with
      ``id``, ``process_index`` and the attributes `mesh_utils` reads
      (``slice_index``, ``platform``, ``device_kind``, ``coords``...).

  Returns:
    (order, reason): a 1-D object array of the devices, and a sentence that
    says which rule chose it.
  """
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top

  devices = list(devices)
  n = len(devices)
  slices = _slice_indices(devices)
  if len(slices) > 1:
    per_slice = n // len(slices)
    try:
      order = mesh_utils.create_hybrid_device_mesh((per_slice,), (len(slices),), devices)
      return np.asarray(order, dtype=object).reshape(-1), (
        f"devices report {len(slices)} slice_index values: create_hybrid_device_mesh,"
        f" data parallelism across the {len(slices)} slices of {per_slice} devices"
      )
    except Exception as e:  # noqa: BLE001 - any failure falls back, with the reason.
      return _ordered_fallback(devices), (
        f"devices report {len(slices)} slice_index values but create_hybrid_device_mesh"
        f" failed ({type(e).__name__}: {e}); devices ordered by process, then id"
      )
  try:
    order = mesh_utils.create_device_mesh((n,), devices)
    return np.asarray(order, dtype=object).reshape(-1), (
      "one slice: create_device_mesh (topology-aware order)"
    )
  except Exception as e:  # noqa: BLE001 - any failure falls back, with the reason.
    return _ordered_fallback(devices), (
      f"create_device_mesh failed ({type(e).__name__}: {e}); devices ordered by process, then id"
    )


def default_mesh(axis_name: str = DATA_AXIS) -> jax.sharding.Mesh:
  """The default mesh: 1-D over every device of the job, topology-aware.

  One slice: `mesh_utils.create_device_mesh`; several (devices with
  different ``slice_index``): `mesh_utils.create_hybrid_device_mesh` with data
  parallelism across slices; otherwise devices ordered by process, then id.
  The choice and its reason are logged once at INFO.

  Args:
    axis_name: The mesh axis name.

  Returns:
    A 1-D ``jax.sharding.Mesh`` with axis `axis_name`.

  Example:

    >>> mesh = default_mesh()
    >>> mesh.shape
    OrderedDict([('data', 8)])
  """
  order, reason = default_device_order(jax.devices())
  log_once(
    f"grain_jax_sync: default mesh: 1-D {axis_name!r} axis over {len(order)} devices; {reason}"
  )
  return jax.sharding.Mesh(order, (axis_name,))


def default_sharding(axis_name: str = DATA_AXIS) -> jax.sharding.NamedSharding:
  """Rows split over the default mesh (`default_mesh`): 1-D over every device.

  Args:
    axis_name: The mesh axis name.

  Returns:
    ``NamedSharding(default_mesh(axis_name), PartitionSpec(axis_name))``.

  Example:

    >>> sharding = default_sharding()
    >>> sharding.spec == jax.sharding.PartitionSpec("data")
    True
  """
  mesh = default_mesh(axis_name)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))


def context_mesh() -> jax.sharding.Mesh | None:
  """The concrete mesh set by `jax.set_mesh` (or `jax.sharding.use_mesh`), if any.

  Read in the calling thread: JAX keeps the context per thread.
  """
  get = getattr(jax.sharding, "get_mesh", None)
  if get is None:  # Older JAX: the same value, not yet public.
    from jax._src import mesh as mesh_src  # pylint: disable=g-import-not-at-top

    get = getattr(mesh_src, "get_concrete_mesh", None)
  if get is None:
    return None
  try:
    mesh = get()
  except ValueError:  # Inside a trace: there is no concrete mesh to use.
    return None
  if mesh is None or getattr(mesh, "empty", False) or not getattr(mesh, "axis_names", ()):
    return None
  return mesh


def data_axes_of(mesh: jax.sharding.Mesh, data_axes: str | Sequence[str] | None) -> tuple[str, ...]:
  """The mesh axes the rows are split over, checked against the mesh.

  Args:
    mesh: The mesh.
    data_axes: An axis name, a sequence of them, or None for ``"data"`` where
      the mesh has it and every axis otherwise.

  Returns:
    The axis names, in order (major to minor).

  Raises:
    ValueError: If an axis is not in the mesh, repeated, or none is given.
  """
  names = tuple(mesh.axis_names)
  if data_axes is None:
    return (DATA_AXIS,) if DATA_AXIS in names else names
  axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
  if not axes:
    raise ValueError(
      f"`data_axes` must name at least one axis of the mesh {dict(mesh.shape)}, got {data_axes!r}"
    )
  unknown = [a for a in axes if a not in names]
  if unknown or len(set(axes)) != len(axes):
    raise ValueError(
      f"`data_axes` must be distinct axis names of the mesh {dict(mesh.shape)},"
      f" got {data_axes!r}" + (f" ({unknown!r} not in the mesh)" if unknown else "")
    )
  return axes


def data_spec(mesh: jax.sharding.Mesh, data_axes: Any = None) -> jax.sharding.PartitionSpec:
  """``PartitionSpec`` with rows over `data_axes`, replicated over the rest."""
  axes = data_axes_of(mesh, data_axes)
  return jax.sharding.PartitionSpec(axes[0] if len(axes) == 1 else axes)
