"""`device_put`: the drop-in for `grain.experimental.device_put`, with agreement.

`grain.experimental.device_put(ds, device)` prefetches on the CPU, then calls
`jax.device_put` on each element. On several hosts that neither builds global
arrays nor makes hosts agree on the number or shape of batches. This version
returns a `grain.IterDataset` whose iterator runs `iter_jax_batches` over the
per-host batches: same first arguments, global `jax.Array`s out, and the
iterator is a `grain.DatasetIterator` whose JSON `get_state`/`set_state` are
the `JaxBatchIterator`'s, so Grain's checkpoint handlers save and restore it.

Grain is imported when `device_put` is first called, never by
``import grain_jax_sync``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from grain_jax_sync._src import extras
from grain_jax_sync._src import iterator as iterator_lib
from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src import settings as settings_lib

if TYPE_CHECKING:
  import grain


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
class _Placement:
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


def _placement(device: Any, mesh: Any, data_axes: Any, sharding: Any) -> _Placement:
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
    return _Placement(None, True, None)  # As `jax.device_put(element, None)`.
  if device is iterator_lib.UNSET or device is None:
    device = None
  elif not multi and any(x is None for x in _leaves_and_nones(device)):
    # A pytree with the default device for some leaves: placed as it is.
    return _Placement(None, True, device)
  if device is None or isinstance(device, _ONE_PLACEMENT):
    one = _resolve(device, mesh, data_axes, sharding)
    if isinstance(device, jax.sharding.Mesh):
      # An unbatched element has no row dimension to split: replicate it.
      element: Any = jax.sharding.NamedSharding(device, jax.sharding.PartitionSpec())
    else:
      # As `jax.device_put(element, device)` places it (None: the default device).
      element = device if device is None or isinstance(device, jax.Device) else one
    return _Placement(one, False, element)
  leaves = _leaves_and_nones(device)
  if not leaves or not all(x is None or isinstance(x, _ONE_PLACEMENT) for x in leaves):
    raise _usage_error(device)
  shardings = [_resolve(x, mesh, data_axes, sharding) for x in leaves]
  if all(x == shardings[0] for x in shardings):
    return _Placement(shardings[0], False, device)
  if jax.process_count() > 1:
    raise ValueError(
      f"`device` is a pytree of {len(set(shardings))} different shardings, but"
      f" there are {jax.process_count()} processes; global batches need one"
      " sharding for every leaf (rows split over every process's devices):"
      " pass one jax.sharding.Sharding or a jax.sharding.Mesh"
    )
  return _Placement(None, True, device)


def _why_plain(device: Any) -> str:
  if device is None:
    return "`device` is None (the default device, as for jax.device_put)"
  return "`device` is a pytree of different placements"


def _leaves_and_nones(tree: Any) -> list[Any]:
  """`tree`'s leaves, None included (`jax.tree_util` drops None as an empty node)."""
  return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)


def _unbatched(element: Any) -> str | None:
  """Why `element` is not a batch (a scalar leaf, unequal leading sizes), or None."""
  leaves = jax.tree_util.tree_leaves(element)
  if any(np.ndim(x) == 0 for x in leaves):
    return "it has a scalar (0-d) leaf"
  firsts = {np.shape(x)[0] for x in leaves}
  if len(firsts) > 1:
    return f"its leaves have different leading sizes {sorted(firsts)}"
  return None


def _normalize_state(state: Any) -> dict[str, Any]:
  """Our state, or the state Grain's `device_put` iterator saved, as our state.

  Grain's iterator saves its parent's state (e.g. ``{"next_index": 32}``):
  the same dict as the source state inside ours, since both wrap the same
  dataset iterator.
  """
  if isinstance(state, Mapping) and "version" in state and "source" in state:
    return dict(state)
  # Version 1: a state that carries no settings digest to compare.
  return {
    "version": 1,
    "batches": 0,
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "source": state,
  }


def _plain_first(parent: Any, settings: Any, placement: _Placement) -> list[Any] | None:
  """Reads the first element to choose the mode: [it] where elements are placed
  one by one (as `jax.device_put` does), None for global batches (then
  `parent` is back where it was).

  Raises:
    ValueError: If options that need global batches are given.
  """
  if jax.process_count() > 1:  # Unbatched elements fail validation everywhere.
    return None
  before = parent.get_state()
  try:
    first = next(parent)
  except StopIteration:
    first = None
  why = None if first is None else _unbatched(first)
  if first is None or not (why or placement.per_leaf):
    parent.set_state(before)  # The engine reads it again.
    return None
  options = [k for k in ("paddings", "dtypes") if getattr(settings, k) is not None]
  options += [k for k in ("mask_key", "drop_last") if getattr(settings, k)]
  options += ["pad_shapes"] if settings.shapes is not None else []
  if options:
    why = f"the first element is unbatched ({why})" if why else None
    raise ValueError(
      f"`{'`, `'.join(options)}` need global batches, but"
      f" {why or _why_plain(placement.element)}, so"
      " elements are placed one by one as jax.device_put places them."
      " Batch the dataset first (e.g. `ds.batch(n)`) and pass one sharding"
    )
  return [first]


def _plain_state(count: int, settings: Any, source: Any) -> dict[str, Any]:
  """The state of an iterator that places elements one by one (or has not chosen yet)."""
  return {
    "version": iterator_lib.STATE_VERSION,
    "batches": count,
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "settings": settings.digest(),
    "source": source,
  }


class _SyncedIterator:  # The bases come with Grain (`_classes`).
  """Global `jax.Array` batches that every host agrees on.

  `get_state`/`set_state` are those of `JaxBatchIterator` (JSON dicts), so
  `grain.checkpoint.CheckpointSave` / `CheckpointRestore` work unchanged;
  `set_state` also takes the state Grain's own `device_put` iterator saved.
  On one process, unbatched elements (and every element, when `device` is
  a pytree of different shardings) are placed as `jax.device_put` places
  them.
  """

  _MUTATES_ELEMENT_SPEC = True
  # Grain's DatasetIterator (the other base) sets and defines these.
  _closed: bool
  _parent: Any
  _assert_not_closed: Any

  def __init__(self, parent: Any, settings: Any, placement: _Placement, batches: Any):
    super().__init__(parent)  # type: ignore[call-arg]  # Grain's base.
    self._settings = settings
    self._placement = placement
    self._batches = batches  # The resolved `placement.BatchPlacement` of global batches.
    self._jax: iterator_lib.JaxBatchIterator | None = None
    self._plain = False  # Elements placed one by one, as jax.device_put does.
    self._first: list[Any] = []  # The element read to choose the mode.
    self._restored: dict[str, Any] | None = None
    self._count = 0

  def _choose(self) -> None:
    """Reads the first element to choose: global batches or plain placement."""
    first = _plain_first(self._parent, self._settings, self._placement)
    if first is None:
      self._start_batches()
      return
    self._plain = True
    self._first.append(first[0])

  def _start_batches(self) -> None:
    self._jax = iterator_lib.JaxBatchIterator(
      self._parent, settings=self._settings, placement=self._batches
    )
    if self._restored is not None:
      self._jax.set_state(self._restored)

  def __next__(self) -> Any:
    self._assert_not_closed()
    if self._jax is None and not self._plain:
      self._choose()
    if self._jax is not None:
      return next(self._jax)
    element = self._first.pop() if self._first else next(self._parent)
    self._count += 1
    return jax.device_put(element, self._placement.element)

  def get_state(self) -> dict[str, Any]:
    if self._jax is not None:
      return self._jax.get_state()
    if self._first:  # Read to choose the mode, not yet returned.
      raise RuntimeError("internal: state asked between choosing and returning")
    return _plain_state(self._count, self._settings, self._parent.get_state())

  def set_state(self, state: Any) -> None:
    state = _normalize_state(state)
    if self._jax is not None:
      self._jax.set_state(state)
      return
    self._first.clear()
    self._parent.set_state(state["source"])
    self._count = int(state["batches"])
    self._restored = state

  def close(self) -> None:
    if self._closed:
      return
    if self._jax is not None:
      self._jax.close()  # Stops the pipeline thread, then closes `parent`.
    else:
      self._parent.close()
    self._closed = True

  @property
  def sharding(self) -> jax.sharding.Sharding | None:
    return self._jax.sharding if self._jax is not None else self._placement.sharding

  def __str__(self) -> str:
    return "SyncedDatasetIterator"


class _SyncedDataset:  # The bases come with Grain (`_classes`).
  """The dataset `device_put` returns; each `iter()` starts a fresh run."""

  _parent: Any  # Set by Grain's IterDataset (the other base).

  def __init__(self, parent: Any, settings: Any, placement: _Placement, batches: Any):
    super().__init__(parent)  # type: ignore[call-arg]  # Grain's base.
    self._args = (settings, placement, batches)

  def __iter__(self) -> Any:
    return _classes()[1](self._parent.__iter__(), *self._args)

  def __str__(self) -> str:
    return "grain_jax_sync.device_put"


@functools.cache
def _classes() -> tuple[type, type]:
  """The Grain subclasses, made on first use so that Grain loads lazily."""
  # Any: Grain's classes are bases here, and Grain ships no type information.
  grain: Any = extras.require("grain", needed_by="grain_jax_sync.device_put")
  iterator = type(
    "SyncedDatasetIterator",
    (_SyncedIterator, grain.DatasetIterator),
    {"_MUTATES_ELEMENT_SPEC": True, "__doc__": _SyncedIterator.__doc__},
  )
  dataset = type(
    "SyncedIterDataset", (_SyncedDataset, grain.IterDataset), {"__doc__": _SyncedDataset.__doc__}
  )
  return dataset, iterator


def device_put(
  ds: Any,
  device: Any = iterator_lib.UNSET,
  *,
  cpu_buffer_size: int = 4,
  device_buffer_size: int = 2,
  batch_size: int | None = None,
  drop_last: bool = False,
  paddings: Any = None,
  mask_key: str | None = iterator_lib.UNSET,
  dtypes: Any = None,
  synchronize_batches: bool = True,
  synchronize_lookahead: int = 10,
  mesh: jax.sharding.Mesh | None = None,
  data_axes: str | tuple[str, ...] | None = None,
  sharding: jax.sharding.Sharding | jax.sharding.PartitionSpec | None = None,
  sync_timeout_s: float = 600.0,
  name: str | None = None,
  pad_shapes: Any = None,
  shape_buckets: Any = None,
  shape_mask_keys: Any = None,
) -> grain.IterDataset:
  """Moves per-host batches to global `jax.Array` batches that every host agrees on.

  A drop-in for `grain.experimental.device_put` (same first arguments): swap
  the import and get agreement across hosts. Elements of `ds` should be this
  process's batches; the returned dataset's elements are global arrays whose
  leading dimension is rows x input shards (``rows * jax.process_count()``
  unless processes share rows), built and agreed as by
  `iter_jax_batches` (padding, masks, `drop_last`, the same error on every
  host). Its iterators are `grain.DatasetIterator` objects with JSON
  `get_state`/`set_state`, so Grain's checkpointing (and Orbax through
  `grain.checkpoint.CheckpointSave`/`CheckpointRestore`) resumes them
  exactly; `set_state` also takes the state that Grain's own `device_put`
  iterator saved, so a running job can switch.

  On one process it accepts everything Grain's does: unbatched elements
  (scalars, single records: a 0-d leaf, or leaves of different leading
  sizes) and, under a pytree of different shardings, every element are
  placed as `jax.device_put(element, device)` places them (no padding, mask
  or agreement). On several processes elements must be batches.

  Args:
    ds: A `grain.IterDataset` (or `MapDataset`, read in order) of batches.
    device: Where the rows go: a `jax.sharding.Sharding`, a
      `jax.sharding.Mesh` (rows split over its data axes, replicated over the
      others: see `data_axes`; an unbatched element is replicated), a
      `PartitionSpec`, a single `jax.Device` (one process only), a pytree of
      shardings or devices as `jax.device_put` takes (one sharding for every
      leaf on several processes), or None. Left unset: `mesh`/`sharding`,
      else the mesh set by `jax.set_mesh`, else `default_mesh()`. None (or
      None leaves of a pytree) on one process places as Grain's call does,
      `jax.device_put(element, None)`: the default device, element by
      element (no padding, mask or agreement options); on several
      processes None is taken as unset (a global batch spans every host).
    cpu_buffer_size: Batches read ahead on the host, at most, beside the
      built ones (as Grain's host prefetch buffer).
    device_buffer_size: Global batches built ahead on the devices (a thread);
      0 builds in the caller's thread (with Grain's host prefetch thread of
      `cpu_buffer_size`, as Grain's `device_put`).
    batch_size: As in `iter_jax_batches`: rows per host batch that
      `paddings` fill to and `drop_last` compares with; default: the largest
      host batch of the first position, agreed across hosts.
    drop_last: As in `iter_jax_batches`.
    paddings: As in `iter_jax_batches`.
    mask_key: As in `iter_jax_batches`.
    dtypes: As in `iter_jax_batches`.
    synchronize_batches: As in `iter_jax_batches`.
    synchronize_lookahead: As in `iter_jax_batches`.
    mesh: As in `iter_jax_batches` (instead of `device`).
    data_axes: As in `iter_jax_batches`: the mesh axes the rows are split
      over; default ``"data"`` if the mesh has it, else every axis.
    sharding: As in `iter_jax_batches` (instead of `device`).
    sync_timeout_s: As in `iter_jax_batches`.
    name: As in `iter_jax_batches`.
    pad_shapes: As in `iter_jax_batches`: the dims whose sizes may vary
      (Grain batches padded per batch), padded to the size agreed per batch.
    shape_buckets: As in `iter_jax_batches`.
    shape_mask_keys: As in `iter_jax_batches`.

  Returns:
    A `grain.IterDataset` of global `jax.Array` batches.

  Raises:
    ValueError: For bad arguments; on the first element, if it is unbatched
      and `paddings`, `mask_key`, `drop_last` or `dtypes` is given.

  Example:

    >>> ds = grain.MapDataset.source(src)[lo:hi].shuffle(seed=1).batch(32)
    >>> ds = device_put(ds.to_iter_dataset(), default_mesh(),
    ...                 batch_size=32, paddings=0, mask_key="mask")
    >>> it = iter(ds)
    >>> batch = next(it); state = it.get_state()
  """
  grain = extras.require("grain", needed_by="grain_jax_sync.device_put")
  prefetch = extras.require("grain.experimental", needed_by="grain_jax_sync.device_put")

  if isinstance(ds, grain.MapDataset):
    ds = ds.to_iter_dataset()
  if not isinstance(ds, grain.IterDataset):
    raise ValueError(
      f"`ds` must be a grain.IterDataset or grain.MapDataset, got {type(ds).__qualname__}"
    )
  for arg, value in (
    ("cpu_buffer_size", cpu_buffer_size),
    ("device_buffer_size", device_buffer_size),
  ):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"`{arg}` must be an int >= 0, got {value!r}")
  placement = _placement(device, mesh, data_axes, sharding)
  # Checked now rather than at the first `iter()`; no store, no thread.
  settings = settings_lib.make(
    batch_size=batch_size,
    drop_last=drop_last,
    paddings=paddings,
    mask_key=mask_key,
    dtypes=dtypes,
    synchronize_batches=synchronize_batches,
    synchronize_lookahead=synchronize_lookahead,
    prefetch_batches=device_buffer_size,
    sync_timeout_s=sync_timeout_s,
    name=name,
    # As Grain's: at most `cpu_buffer_size` batches read ahead of the built ones.
    read_ahead=max(1, cpu_buffer_size) if device_buffer_size > 0 else None,
    pad_shapes=pad_shapes,
    shape_buckets=shape_buckets,
    shape_mask_keys=shape_mask_keys,
    process_count=jax.process_count(),
  )
  batches = placement_lib.resolve_sharding(mesh=None, data_axes=None, sharding=placement.sharding)
  settings_lib.check_divisible(settings, batches.local_shards, batches.describe_local())
  if cpu_buffer_size > 0 and device_buffer_size == 0:
    # Built in the consumer's thread: the host read-ahead is Grain's thread.
    ds = prefetch.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cpu_buffer_size)
  synced, _ = _classes()
  return synced(ds, settings, placement, batches)
