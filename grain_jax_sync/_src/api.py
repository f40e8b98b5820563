"""`iter_jax_batches`: the public constructor of `JaxBatchIterator`, its options documented.

The options are made and checked by `settings.make`, which `device_put` and
`jax_sync_generator` share; the iterator itself lives in `iterator.py`.
"""

from __future__ import annotations

from typing import Any

import jax

from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src import settings as settings_lib
from grain_jax_sync._src.iterator import UNSET, JaxBatchIterator


def iter_jax_batches(
  source: Any,
  *,
  batch_size: int | None = None,
  drop_last: bool = False,
  paddings: Any = None,
  mask_key: str | None = UNSET,
  dtypes: Any = None,
  synchronize_batches: bool = True,
  synchronize_lookahead: int = 10,
  prefetch_batches: int = 2,
  mesh: jax.sharding.Mesh | None = None,
  data_axes: str | tuple[str, ...] | None = None,
  sharding: jax.sharding.Sharding | jax.sharding.PartitionSpec | None = None,
  sync_timeout_s: float = 600.0,
  name: str | None = None,
  pad_shapes: Any = None,
  shape_buckets: Any = None,
  shape_mask_keys: Any = None,
) -> JaxBatchIterator:
  """Iterates global `jax.Array` batches that every process agrees on.

  Each process passes its own shard of the data. For every batch, all
  processes agree (in windows of `synchronize_lookahead` batches) on whether
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
    batch_size: Rows per process per batch that padding fills to and
      `drop_last` compares with; batches larger than it pass through when
      every process has one of the same size. None (the default): the
      largest host batch of the first position, agreed across processes
      (and saved with the state); a short batch that is not its host's last
      then raises naming both sizes. Without `paddings` and `drop_last`
      every batch keeps its size (host batches must be equal).
    drop_last: Stop when any process runs out; drop a short last batch on
      every process (a short batch mid-stream raises, naming both sizes).
    paddings: Fill value for padded rows and dummy batches: a scalar or a dict
      of column name (or prefix) to scalar. None disables padding. A value
      must be one of its column's output dtype (as it lands on the device:
      int64 is int32 with x64 off): -1 for uint8, 0.5 for an integer or
      1e6 for float16 raise a `ValueError` naming the column.
    mask_key: If set, dict batches get a boolean ``(rows,)`` column of that
      name: True for real rows, False for padding and dummy batches. Left
      unset with `paddings`, one warning is logged that padded rows look
      real; pass None to silence it.
    dtypes: Output dtype: one dtype or a dict of column name to dtype.
      Narrowing casts run on the host before the transfer, widening casts on
      the device after it; either way the values are `jax.Array.astype`'s
      (float to integer saturates, NaN becomes 0; integer to integer wraps).
    synchronize_batches: Agree across processes (a single process never
      exchanges anything).
    synchronize_lookahead: The agreement's read-ahead: a process holds at
      most this many batches (and at most 64 MiB) read but not yet agreed
      on, and posts its rows every half of it. With `prefetch_batches`, no
      host is more than about R = `synchronize_lookahead + prefetch_batches`
      agreed batches ahead of another, so an ending (a close, an error,
      `request_stop()`) reaches every host within about R batches
      (docs/performance.md, Memory).
    prefetch_batches: Batches prepared ahead in a background thread (0: none).
    mesh: The mesh the batch lands on, over every device of the job; rows
      are split over `data_axes` and replicated over its other axes. Default:
      the mesh set by `jax.set_mesh`, else `default_mesh()`.
    data_axes: With a mesh: the axis (or tuple of axes) the rows are split
      over; default ``"data"`` if the mesh has it, else every axis.
    sharding: Instead of `mesh`: the sharding of every leaf (a spec longer
      than a leaf's rank is cut), or a `PartitionSpec` applied to `mesh` (or
      to the context or default mesh).
    sync_timeout_s: How long to wait for a live peer (one whose liveness
      beat goes on: a slow source, a long checkpoint save or compile) before
      every process raises `PeerTimeoutError` naming it. A dead peer (no beat
      for 8 s) is named within about 10 s whatever this is.
    name: Names the exchange keys; needed only when processes do not create
      their iterators in the same order. Iterators of one name are counted
      (a new one each epoch is fine): every process creates as many.
    pad_shapes: The dims (>= 1) whose sizes may differ across hosts and
      batches: a dict of column name (or prefix) to a dim or a tuple of dims
      (``{"tokens": 1}``), or a dim (tuple) for a bare-array batch. At each
      batch every host pads them with `paddings` (required) to the largest
      size on any host. Everything else still must match. See docs/shapes.md.
    shape_buckets: Per column of `pad_shapes`, ascending sizes
      (``{"tokens": [128, 256, 512]}``): the agreed size is rounded up to the
      next one (so a jitted step sees at most that many shapes); a size above
      the last raises the same ValueError on every host.
    shape_mask_keys: Per column of `pad_shapes`, the key of a boolean element
      mask added to dict batches (``{"tokens": "tokens_mask"}``), shaped like
      the padded leaf up to its last named dim: True for real elements, False
      for padded elements and for padded and dummy rows.

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
  settings = settings_lib.make(
    batch_size=batch_size,
    drop_last=drop_last,
    paddings=paddings,
    mask_key=mask_key,
    dtypes=dtypes,
    synchronize_batches=synchronize_batches,
    synchronize_lookahead=synchronize_lookahead,
    prefetch_batches=prefetch_batches,
    sync_timeout_s=sync_timeout_s,
    name=name,
    pad_shapes=pad_shapes,
    shape_buckets=shape_buckets,
    shape_mask_keys=shape_mask_keys,
    process_count=jax.process_count(),
  )
  placement = placement_lib.resolve_placement(mesh=mesh, data_axes=data_axes, sharding=sharding)
  return JaxBatchIterator(source, settings=settings, placement=placement)
