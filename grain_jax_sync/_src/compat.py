"""`jax_sync_generator`: a drop-in for Ray Data's ``ray.data.util.jax_util.jax_sync_generator``.

Of the version with `batch_size`, `paddings` and `dtypes`; docs/sources.md lists
every difference and its reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from grain_jax_sync._src import placement
from grain_jax_sync._src.iterator import iter_jax_batches


class _DefaultBatchSize(int):
  """The reference's default `batch_size` (256), told apart from a passed 256."""

  def __repr__(self) -> str:
    return repr(int(self))


_DEFAULT_BATCH_SIZE = _DefaultBatchSize(256)


def jax_sync_generator(
  batch_iterable: Iterable[Any],
  drop_last: bool,
  batch_size: int | None = _DEFAULT_BATCH_SIZE,
  paddings: Any = None,
  dtypes: Any = None,
  synchronize_batches: bool = False,
  synchronize_lookahead: int = 10,
  *,
  prefetch_batches: int = 0,
  pad_shapes: Any = None,
  shape_buckets: Any = None,
  shape_mask_keys: Any = None,
) -> Iterator[Any]:
  """Yields global `jax.Array` batches; Ray Data's signature and defaults.

  A thin wrapper over `iter_jax_batches` (no mask, synchronization off by
  default, the source read lazily in the caller's thread, batches on the 1-D
  default mesh even inside `jax.set_mesh`, as in the reference). Unlike the
  reference it drops a short last batch under `drop_last`, pads to the
  first batch's size when `batch_size` is not passed, compares batch
  structure across hosts and raises a source failure on every host;
  docs/sources.md lists every difference.

  Every argument but `batch_iterable` is the option of its name, documented
  under `Options` in the API reference, with the reference's default
  where it has one. `pad_shapes`, `shape_buckets` and `shape_mask_keys` (the
  one mask this wrapper adds) are not in the reference; on several hosts
  `pad_shapes` needs `synchronize_batches=True`.

  Args:
    batch_iterable: Per-host batches: NumPy arrays or dicts of them.
    batch_size: Not passed (the reference's 256), or None: the largest host
      batch of the first batch, agreed across hosts; batches of equal size
      keep it.

  Yields:
    Batches of global `jax.Array` values with the input's structure.

  Raises:
    ValueError: With the reference's opening phrases ("Uneven batch sizes
      detected across JAX workers", "Uneven number of batches detected
      across JAX workers", "... must be evenly divisible by the number of
      local JAX devices") followed by the processes, batch and sizes.

  Example:

    >>> for batch in jax_sync_generator(ds.iter_batches(batch_size=32), drop_last=True):
    ...   state = train_step(state, batch)
  """
  if (type(batch_iterable).__module__ or "").startswith("tensorflow"):
    # A generator has no get_state(): take no tf.data resume snapshots.
    from grain_jax_sync._src.sources import tf_data  # pylint: disable=g-import-not-at-top

    batch_iterable = tf_data.open_tf_data(batch_iterable, state_every=None) or batch_iterable
  # Not passed: the largest first host batch, not the reference's 256 (docs/sources.md).
  full = None if batch_size is None or batch_size is _DEFAULT_BATCH_SIZE else batch_size
  it = iter_jax_batches(
    batch_iterable,
    batch_size=full,
    drop_last=drop_last,
    paddings=paddings,
    mask_key=None,  # The reference has no mask; `iter_jax_batches` has one.
    dtypes=dtypes,
    synchronize_batches=synchronize_batches,
    synchronize_lookahead=synchronize_lookahead,
    sharding=placement.default_sharding(),
    prefetch_batches=prefetch_batches,
    pad_shapes=pad_shapes,
    shape_buckets=shape_buckets,
    shape_mask_keys=shape_mask_keys,
  )
  with it:
    yield from it
