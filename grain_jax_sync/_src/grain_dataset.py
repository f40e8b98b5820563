"""`device_put`: the drop-in for `grain.experimental.device_put`, with agreement.

Grain's calls `jax.device_put` per element: on several hosts, no global arrays
and no agreement. Grain is imported at the first call, not by ``import grain_jax_sync``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Unpack

import jax

from grain_jax_sync._src import extras, sources, synced_dataset
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src.sources import grain as grain_source

if TYPE_CHECKING:
  import grain


def device_put(
  ds: Any,
  device: Any = options_lib.UNSET,
  *,
  cpu_buffer_size: int = 4,
  device_buffer_size: int = 2,
  mesh: jax.sharding.Mesh | None = None,
  data_axes: str | tuple[str, ...] | None = None,
  sharding: jax.sharding.Sharding | jax.sharding.PartitionSpec | None = None,
  **options: Unpack[options_lib.CommonKeywords],
) -> grain.IterDataset:
  """Moves per-host batches to global `jax.Array` batches that every host agrees on.

  A drop-in for `grain.experimental.device_put` (same first arguments) that
  makes hosts agree. Elements of `ds` should be this process's batches; the
  returned dataset's elements are global arrays of rows x input shards,
  built and agreed as by `iter_jax_batches`. (Grain's, given a sharding over
  every host, needs the same global batch on every host: here each host's
  `ds` yields its own share, or every row appears once per host.) Its iterators are
  `grain.DatasetIterator`s with JSON `get_state`/`set_state` (which also
  takes the state Grain's own `device_put` iterator saved), so Grain's
  checkpointing and Orbax's resume them exactly, and they have
  `JaxBatchIterator`'s `request_stop()` and `stop_requested_by`.

  On one process it accepts everything Grain's does: unbatched elements (a
  0-d leaf, or leaves of different leading sizes), and every element under a
  pytree of different shardings, are placed as `jax.device_put(element,
  device)` places them (no padding, mask or agreement).

  Args:
    ds: A `grain.IterDataset` (or `MapDataset`, read in order) of batches,
      or a Hugging Face `datasets.Dataset`, `IterableDataset` or
      `hf_pipeline` source (see docs/sources.md).
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
    cpu_buffer_size: Batches read ahead on the host beside the built ones,
      as Grain's: its buffer, and one more in its thread's hand.
    device_buffer_size: Global batches built ahead on the devices (a
      thread), as Grain's: its buffer, and one more in its thread's hand
      (`iter_jax_batches`'s ``prefetch_batches=device_buffer_size + 1``). 0
      builds in the caller's thread (with Grain's host prefetch thread of
      `cpu_buffer_size`, as Grain's `device_put`).
    mesh: As in `iter_jax_batches`, instead of `device`.
    data_axes: As in `iter_jax_batches`: the mesh axes the rows are split
      over; default ``"data"`` if the mesh has it, else every axis.
    sharding: As in `iter_jax_batches`, instead of `device`.
    **options: The options of `iter_jax_batches` but `prefetch_batches`
      (here `device_buffer_size`), each documented with its default under
      `Options` in the API reference; `batch_size`'s default is the largest
      host batch of the first position, agreed across hosts, and
      `pad_shapes` pads Grain's batches per batch to the size agreed for it.

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
    >>> signal.signal(signal.SIGTERM, lambda *_: it.request_stop())
    >>> batch = next(it); state = it.get_state()
  """
  grain = extras.require("grain", needed_by="grain_jax_sync.device_put")
  prefetch = extras.require("grain.experimental", needed_by="grain_jax_sync.device_put")

  if isinstance(ds, grain.MapDataset):
    ds = ds.to_iter_dataset()
  if type(ds).__module__.startswith(("datasets", "grain_jax_sync._src.sources.hugging_face")):
    ds = grain_source.grain_class(SourceDataset, "IterDataset")(ds)  # Or `hf_pipeline`'s.
  if not isinstance(ds, grain.IterDataset):
    raise ValueError(
      "`ds` must be a grain.IterDataset or grain.MapDataset, or a Hugging Face source,"
      f" got {type(ds).__qualname__}"
    )
  cpu_buffer_size = options_lib.checked_int("cpu_buffer_size", cpu_buffer_size, minimum=0)
  device_buffer_size = options_lib.checked_int("device_buffer_size", device_buffer_size, minimum=0)
  placement = placement_lib.resolve_device_put(device, mesh, data_axes, sharding)
  # As Grain's two `ThreadPrefetchIterDataset` stages hold: each its buffer and, with a
  # thread (a size above 0), one element in its hand. Ours reads `read_ahead` ahead of
  # the built batches (the one being built included) and builds the rest ahead.
  held = cpu_buffer_size + device_buffer_size + (cpu_buffer_size > 0) + (device_buffer_size > 0)
  read_ahead = cpu_buffer_size + 1 if device_buffer_size > 0 else None
  # Checked now rather than at the first `iter()`; no store, no thread.
  checked = options_lib.make(
    "device_put",
    options,
    process_count=jax.process_count(),
    prefetch_batches=0 if read_ahead is None else held - read_ahead,
    read_ahead=read_ahead,
  )
  batches = placement.batches
  batches.check_divisible(checked)
  if cpu_buffer_size > 0 and device_buffer_size == 0:
    # Built in the consumer's thread: the host read-ahead is Grain's thread.
    ds = prefetch.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cpu_buffer_size)
  synced = grain_source.grain_class(synced_dataset.SyncedIterDataset, "IterDataset")
  return synced(ds, checked, placement)


class SourceDatasetIterator:
  """A source of another kind, read and resumed through its `SourceIterator` (`grain_class`)."""

  def __init__(self, source: Any):
    super().__init__()
    self._source = sources.open_source(source)

  def __next__(self) -> Any:
    return next(self._source)

  def get_state(self) -> Any:
    return self._source.export_state(self._source.get_state())

  def set_state(self, state: Any) -> None:
    self._source.set_state(state)


class SourceDataset:
  """A `grain.IterDataset` over a source of another kind (`grain_class`)."""

  def __init__(self, source: Any):
    super().__init__()
    self._source = source

  def __iter__(self) -> Any:
    return grain_source.grain_class(SourceDatasetIterator, "DatasetIterator")(self._source)
