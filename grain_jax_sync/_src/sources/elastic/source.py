"""`elastic_source` and the `ElasticSource` it returns: the records and the options.

Checked when made; opened on each process by `stream.open_stream`. Pure
Python (no JAX, no Grain).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from grain_jax_sync._src import options as options_lib


@dataclasses.dataclass(frozen=True, eq=False)  # `records` may be unhashable.
class ElasticSource:
  """What `elastic_source` returns: opened on each process by `iter_jax_batches`."""

  records: Any
  transform: Callable[[Any], Any] | None
  shuffle: bool
  seed: int
  num_epochs: int | None
  # A `mixture.Mixture`: `records` are its endless global rows, read
  # `mixture.epoch_length` an epoch (epoch e's position i is row e * length + i).
  mixture: Any = None

  @property
  def num_records(self) -> int:
    """Records (positions) per epoch."""
    return len(self.records) if self.mixture is None else self.mixture.epoch_length


def elastic_source(
  records: Any,
  transform: Callable[[Any], Any] | None = None,
  *,
  shuffle: bool = False,
  seed: int = 0,
  num_epochs: int | None = 1,
) -> ElasticSource:
  """A source the library splits over processes, resumable on any process count.

  Each process reads its share of each epoch's record order through
  ``transform``. Its state resumes on the same process count exactly as a
  Grain source does, and, given as the list of every old process's state,
  on any other count: the records not yet consumed are re-split over the new
  processes, so every record of the epoch is yielded once among the unmasked
  rows (see the guide "Preemption and resizing").

  Args:
    records: A `grain.MapDataset` or any random-access sequence of records.
    transform: Maps this process's `grain.IterDataset` of records to an
      `IterDataset` of batches: `map`, `filter`, `batch`, thread prefetch,
      `mp_prefetch`, packing whose packed batches end with the delivered
      batches. A state of a mix, of packing within a packed batch or of a
      sequential `mp_prefetch` resumes on the same process count only (see
      the guide). None: the records are already batches.
    shuffle: Whether each epoch's order is a seeded permutation.
    seed: The permutation's seed (with the epoch).
    num_epochs: Epochs to read (None: repeat forever, each epoch in a new
      order when shuffling).

  Returns:
    A source for `iter_jax_batches`.

  Raises:
    ValueError: If an option is out of range.

  Example:

    >>> src = elastic_source(list(range(64)), lambda ds: ds.batch(4))
    >>> it = iter_jax_batches(src, batch_size=4, paddings=0, mask_key="mask")
  """
  num_epochs = options_lib.checked_int_or_none("num_epochs", num_epochs, none="None (forever)")
  seed = options_lib.checked_int("seed", seed, minimum=0)
  if transform is not None and not callable(transform):
    raise ValueError(f"`transform` must be callable or None, got {type(transform).__name__}")
  sized("records", records)
  shuffle = options_lib.checked_bool("shuffle", shuffle)
  return ElasticSource(records, transform, shuffle, seed, num_epochs)


def sized(arg: str, records: Any) -> int:
  """`len(records)`, or a ValueError naming `arg` if it has none."""
  try:
    return len(records)
  except TypeError as e:
    raise ValueError(
      f"`{arg}` must be a grain.MapDataset or a random-access sequence, got"
      f" {type(records).__name__} (no len())"
    ) from e
