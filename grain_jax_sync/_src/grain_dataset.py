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

import functools
from typing import Any

import jax

from grain_jax_sync._src import extras
from grain_jax_sync._src import iterator as iterator_lib


def _to_sharding(device: Any) -> jax.sharding.Sharding | None:
  """`device_put`'s `device` argument as one sharding for every leaf."""
  if device is None or isinstance(device, jax.sharding.Sharding):
    return device
  if isinstance(device, jax.sharding.Mesh):
    # As MaxText does: rows split over every mesh axis.
    spec = jax.sharding.PartitionSpec(tuple(device.axis_names))
    return jax.sharding.NamedSharding(device, spec)
  if isinstance(device, jax.Device):
    if jax.process_count() > 1:
      raise ValueError(
        f"`device` is the single device {device}, but there are"
        f" {jax.process_count()} processes; pass a sharding (or mesh) that"
        " spans every process's devices, e.g. grain_jax_sync.default_sharding()"
      )
    return jax.sharding.SingleDeviceSharding(device)
  raise ValueError(
    "`device` must be a jax.sharding.Sharding, a jax.sharding.Mesh, a"
    f" jax.Device or None, got {type(device).__qualname__}: {device!r:.200}"
  )


@functools.cache
def _classes() -> tuple[type, type]:
  """Builds the Grain subclasses on first use, so Grain loads lazily."""
  grain = extras.require("grain", needed_by="grain_jax_sync.device_put")

  class SyncedDatasetIterator(grain.DatasetIterator):
    """Global `jax.Array` batches that every host agrees on.

    `get_state`/`set_state` are those of `JaxBatchIterator` (JSON dicts), so
    `grain.checkpoint.CheckpointSave` / `CheckpointRestore` work unchanged.
    """

    _MUTATES_ELEMENT_SPEC = True

    def __init__(self, parent: Any, kwargs: dict[str, Any]):
      super().__init__(parent)
      self._jax = iterator_lib.iter_jax_batches(parent, **kwargs)

    def __next__(self) -> Any:
      self._assert_not_closed()
      return next(self._jax)

    def get_state(self) -> dict[str, Any]:
      return self._jax.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
      self._jax.set_state(state)

    def close(self) -> None:
      if self._closed:
        return
      self._jax.close()  # Stops the pipeline thread, then closes `parent`.
      self._closed = True

    @property
    def sharding(self) -> jax.sharding.Sharding:
      return self._jax.sharding

    def __str__(self) -> str:
      return "SyncedDatasetIterator"

  class SyncedIterDataset(grain.IterDataset):
    """The dataset `device_put` returns; each `iter()` starts a fresh run."""

    def __init__(self, parent: Any, kwargs: dict[str, Any]):
      super().__init__(parent)
      self._kwargs = kwargs

    def __iter__(self) -> Any:
      return SyncedDatasetIterator(self._parent.__iter__(), dict(self._kwargs))

    def __str__(self) -> str:
      return "grain_jax_sync.device_put"

  return SyncedIterDataset, SyncedDatasetIterator


def device_put(
  ds: Any,
  device: Any = None,
  *,
  cpu_buffer_size: int = 4,
  device_buffer_size: int = 2,
  batch_size: int | None = None,
  drop_last: bool = False,
  paddings: Any = None,
  mask_key: str | None = None,
  dtypes: Any = None,
  synchronize_batches: bool = True,
  synchronize_lookahead: int = 10,
  sync_timeout_s: float = 600.0,
  name: str | None = None,
) -> Any:
  """Moves per-host batches to global `jax.Array`s that every host agrees on.

  A drop-in for `grain.experimental.device_put` (same first arguments): swap
  the import and get agreement across hosts. Elements of `ds` must be this
  process's batches; the returned dataset's elements are global arrays whose
  leading dimension is ``rows * jax.process_count()``, built and agreed as by
  `iter_jax_batches` (padding, masks, `drop_last`, the same error on every
  host). Its iterators are `grain.DatasetIterator`s with JSON
  `get_state`/`set_state`, so Grain's checkpointing (and Orbax through
  `grain.checkpoint.CheckpointSave`/`CheckpointRestore`) resumes them
  exactly.

  Args:
    ds: A `grain.IterDataset` (or `MapDataset`, read in order) of batches.
    device: Where the rows go: a `jax.sharding.Sharding` (rows along its
      first dimension), a `jax.sharding.Mesh` (rows split over all of its
      axes), a single `jax.Device` (one process only) or None for
      `default_sharding()`.
    cpu_buffer_size: Batches Grain prefetches on the host (a thread).
    device_buffer_size: Global batches prepared ahead on the devices.
    batch_size: Rows per host batch that `paddings` fill to and `drop_last`
      compares with; required when either is used.
    drop_last: As in `iter_jax_batches`.
    paddings: As in `iter_jax_batches`.
    mask_key: As in `iter_jax_batches`.
    dtypes: As in `iter_jax_batches`.
    synchronize_batches: As in `iter_jax_batches`.
    synchronize_lookahead: As in `iter_jax_batches`.
    sync_timeout_s: As in `iter_jax_batches`.
    name: As in `iter_jax_batches`.

  Returns:
    A `grain.IterDataset` of global `jax.Array` batches.

  Raises:
    ValueError: For bad arguments.

  Example:

    >>> ds = grain.MapDataset.source(src)[lo:hi].shuffle(seed=1).batch(32)
    >>> ds = device_put(ds.to_iter_dataset(), default_sharding(),
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
  if batch_size is None:
    if paddings is not None or drop_last:
      raise ValueError(
        "`batch_size` is required with `paddings` or `drop_last`: the rows per"
        " host batch to pad to or to compare with"
      )
    batch_size = 1  # Unused without padding or drop_last.
  kwargs = {
    "batch_size": batch_size,
    "drop_last": drop_last,
    "paddings": paddings,
    "mask_key": mask_key,
    "dtypes": dtypes,
    "synchronize_batches": synchronize_batches,
    "synchronize_lookahead": synchronize_lookahead,
    "prefetch_batches": device_buffer_size,
    "sharding": _to_sharding(device),
    "sync_timeout_s": sync_timeout_s,
    "name": name,
  }
  # Checks the arguments now rather than at the first `iter()`.
  iterator_lib.iter_jax_batches([], **kwargs).close()
  if cpu_buffer_size > 0:
    ds = prefetch.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cpu_buffer_size)
  synced, _ = _classes()
  return synced(ds, kwargs)
