"""`iter_jax_batches`: the public constructor of `JaxBatchIterator` (options in `options.py`)."""

from __future__ import annotations

from typing import Any, Unpack

import jax

from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src.iterator import JaxBatchIterator


def iter_jax_batches(
  source: Any,
  *,
  mesh: jax.sharding.Mesh | None = None,
  data_axes: str | tuple[str, ...] | None = None,
  sharding: jax.sharding.Sharding | jax.sharding.PartitionSpec | None = None,
  **options: Unpack[options_lib.Keywords],
) -> JaxBatchIterator:
  """Iterates global `jax.Array` batches that every process agrees on.

  Each process passes its own shard of the data. For every batch, all
  processes agree (about `decide_ahead_s` ahead of the consumer) on whether
  there is one and how many rows it has, then each yields the same structure
  of global arrays, rows split over the data axes of the mesh (by default
  the 1-D ``"data"`` mesh over every device) and replicated over its other
  axes. The leading dimension is ``rows * shard_count``: processes that hold
  the same data shards (a model axis across processes) feed identical rows
  (see `data_shard_info`); otherwise it is ``rows * jax.process_count()``.

  Rules, identical on every process:
    * all sources ended: every process stops;
    * some ended: stop if `drop_last`; else the ended ones yield dummy batches
      of `paddings` values (all-False mask) if `paddings` is given; else
      every process raises ValueError;
    * row counts differ: pad to `batch_size` with `paddings`; with
      `drop_last` a position whose short batches are all their processes'
      last batches is dropped on every process, and a short batch that is
      not its process's last raises ValueError naming both sizes; otherwise
      ValueError with the range of sizes;
    * batch structure (tree, dtypes, trailing shapes) or settings differ:
      ValueError naming the processes and columns;
    * a source raises: that process re-raises its exception, the others raise
      RuntimeError naming it.

  Args:
    source: Per-process batches: a sequence or iterable of NumPy arrays or
      pytrees of them (dicts, lists, tuples), a Grain `DataLoader`,
      `IterDataset` or `MapDataset`, or a `tf.data.Dataset`.
    mesh: The mesh the batch lands on, over every device of the job; rows
      are split over `data_axes` and replicated over its other axes. Default:
      the mesh set by `jax.set_mesh`, else `default_mesh()`.
    data_axes: With a mesh: the axis (or tuple of axes) the rows are split
      over; default ``"data"`` if the mesh has it, else every axis.
    sharding: Instead of `mesh`: the sharding of every leaf (a spec longer
      than a leaf's rank is cut), or a `PartitionSpec` applied to `mesh` (or
      to the context or default mesh).
    **options: The options, by name, each documented once, with its
      default, under `Options` in the API reference (docs/api.md).

  Returns:
    A `JaxBatchIterator`.

  Raises:
    ValueError: For bad arguments (checked here) and bad data (on iteration,
      on every process).

  Example:

    >>> batches = [{"x": np.arange(8.0)}, {"x": np.arange(4.0)}]
    >>> with iter_jax_batches(batches, batch_size=8, paddings=0, mask_key="mask") as it:
    ...   for batch in it:
    ...     loss = step(batch["x"], batch["mask"])
  """
  checked = options_lib.make("iter_jax_batches", options, process_count=jax.process_count())
  placement = placement_lib.resolve_placement(mesh=mesh, data_axes=data_axes, sharding=sharding)
  return JaxBatchIterator(source, options=checked, placement=placement)
