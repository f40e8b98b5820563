"""Where `device_put` puts elements: its `device` argument resolved once, to a `Placement`.

`device` (or `mesh`/`data_axes`/`sharding`) is resolved in the caller's
thread, so that the mesh set by `jax.set_mesh` around `device_put` is the
one used: one sharding for every leaf of a global batch, or, on one process,
what `jax.device_put` gets for an element placed as it is. `grain_dataset`
resolves it; the dataset's iterator (`synced_dataset`) applies it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src import placement as placement_lib

_ONE_PLACEMENT = (jax.sharding.Sharding, jax.sharding.Mesh, jax.sharding.PartitionSpec, jax.Device)


def _resolve(device: Any, mesh: Any, data_axes: Any, sharding: Any) -> jax.sharding.Sharding:
  """`device_put`'s `device` (or `mesh`/`data_axes`/`sharding`) as one sharding.

  Resolved once, in the caller's thread, so that the mesh set by
  `jax.set_mesh` around `device_put` is the one used.
  """
  if isinstance(device, jax.Device):
    if jax.process_count() > 1:
      raise ValueError(
        f"`device` is the single device {device}, but there are"
        f" {jax.process_count()} processes; pass a sharding (or mesh) that"
        " spans every process's devices, e.g. grain_jax_sync.default_mesh()"
      )
    device = jax.sharding.SingleDeviceSharding(device)
  if device is not None:
    if mesh is not None or sharding is not None:
      raise ValueError("pass `device`, or `mesh`/`sharding`, not both")
    if isinstance(device, jax.sharding.Mesh):
      mesh = device  # Rows over the data axes, replicated over the rest.
    elif isinstance(device, (jax.sharding.Sharding, jax.sharding.PartitionSpec)):
      sharding = device
    else:
      raise _usage_error(device)
  placement = placement_lib.resolve_sharding(mesh=mesh, data_axes=data_axes, sharding=sharding)
  return placement.sharding


def _usage_error(device: Any) -> ValueError:
  return ValueError(
    "`device` must be a jax.sharding.Sharding, a jax.sharding.Mesh, a"
    " PartitionSpec, a jax.Device, a pytree of shardings or devices, or None,"
    f" got {type(device).__qualname__}: {device!r:.200}"
  )


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where `device_put` puts elements.

  Attributes:
    sharding: The one sharding of every leaf of a global batch, or None if
      `device` is a pytree of different placements (one process only).
    per_leaf: True if `device` is such a pytree.
    element: What `jax.device_put` gets for an element placed as it is (an
      unbatched element, or any element under a per-leaf pytree).
  """

  sharding: jax.sharding.Sharding | None
  per_leaf: bool
  element: Any


def resolve(device: Any, mesh: Any, data_axes: Any, sharding: Any) -> Placement:
  """Resolves `device` (or `mesh`/`data_axes`/`sharding`) once, in the caller's thread.

  `device` left unset means `mesh`/`sharding`, else the `jax.set_mesh` mesh,
  else `default_mesh()`. None, or None inside a pytree, means what it means
  to `jax.device_put` (the default device) on one process, so that Grain's
  calls place as Grain does; on several processes, where a global batch
  spans every host's devices, it is taken as unset.
  """
  multi = jax.process_count() > 1
  if device is None and not multi:
    if mesh is not None or sharding is not None or data_axes is not None:
      raise ValueError("pass `device`, or `mesh`/`sharding`/`data_axes`, not both")
    return Placement(None, True, None)  # As `jax.device_put(element, None)`.
  if device is options_lib.UNSET or device is None:
    device = None
  elif not multi and any(x is None for x in _leaves_and_nones(device)):
    # A pytree with the default device for some leaves: placed as it is.
    return Placement(None, True, device)
  if device is None or isinstance(device, _ONE_PLACEMENT):
    one = _resolve(device, mesh, data_axes, sharding)
    if isinstance(device, jax.sharding.Mesh):
      # An unbatched element has no row dimension to split: replicate it.
      element: Any = jax.sharding.NamedSharding(device, jax.sharding.PartitionSpec())
    else:
      # As `jax.device_put(element, device)` places it (None: the default device).
      element = device if device is None or isinstance(device, jax.Device) else one
    return Placement(one, False, element)
  leaves = _leaves_and_nones(device)
  if not leaves or not all(x is None or isinstance(x, _ONE_PLACEMENT) for x in leaves):
    raise _usage_error(device)
  shardings = [_resolve(x, mesh, data_axes, sharding) for x in leaves]
  if all(x == shardings[0] for x in shardings):
    return Placement(shardings[0], False, device)
  if jax.process_count() > 1:
    raise ValueError(
      f"`device` is a pytree of {len(set(shardings))} different shardings, but"
      f" there are {jax.process_count()} processes; global batches need one"
      " sharding for every leaf (rows split over every process's devices):"
      " pass one jax.sharding.Sharding or a jax.sharding.Mesh"
    )
  return Placement(None, True, device)


def _leaves_and_nones(tree: Any) -> list[Any]:
  """`tree`'s leaves, None included (`jax.tree_util` drops None as an empty node)."""
  return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)
