"""`jax_sync_generator`: the drop-in with the reference's signature."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from grain_jax_sync._src import iterator as iterator_lib
from grain_jax_sync._src import meshes


def jax_sync_generator(
  batch_iterable: Iterable[Any],
  drop_last: bool,
  batch_size: int = 256,
  paddings: Any = None,
  dtypes: Any = None,
  synchronize_batches: bool = False,
  synchronize_lookahead: int = 10,
) -> Iterator[Any]:
  """Yields global `jax.Array` batches; Ray Data's signature and defaults.

  A thin wrapper over `iter_jax_batches` (no mask, synchronization off by
  default as in the reference). Unlike the reference it drops a short final
  batch under `drop_last` without synchronization, compares batch structure
  across hosts, lets a host with an empty shard build dummy batches from its
  peers' structure, raises a source failure on every host, and checks
  `batch_size` against the local device count before the first batch.
  Batches land on the 1-D default mesh (`default_sharding()`), as in the
  reference, even inside `jax.set_mesh`.

  Args:
    batch_iterable: Per-host batches: NumPy arrays or dicts of them.
    drop_last: Drop short batches and stop at the shortest host.
    batch_size: Per-host rows that padding fills to.
    paddings: Scalar or per-column padding values; None disables padding.
    dtypes: A dtype or per-column dtypes for the output arrays.
    synchronize_batches: Agree on batch counts and shapes across hosts.
    synchronize_lookahead: Batches per agreement window.

  Yields:
    Batches of global `jax.Array` values with the input's structure.
  """
  if (type(batch_iterable).__module__ or "").startswith("tensorflow"):
    # A generator has no get_state(): take no tf.data resume snapshots.
    from grain_jax_sync._src.sources import tf_data  # pylint: disable=g-import-not-at-top

    batch_iterable = tf_data.open_tf_data(batch_iterable, state_every=None) or batch_iterable
  it = iterator_lib.iter_jax_batches(
    batch_iterable,
    batch_size=batch_size,
    drop_last=drop_last,
    paddings=paddings,
    dtypes=dtypes,
    synchronize_batches=synchronize_batches,
    synchronize_lookahead=synchronize_lookahead,
    sharding=meshes.default_sharding(),
  )
  with it:
    yield from it
