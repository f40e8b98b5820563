"""Source adapters: anything that yields per-host batches -> `SourceIterator`.

Grain and TensorFlow are imported only when such a source is passed, so the
core works without either installed.
"""

from __future__ import annotations

from typing import Any

from grain_jax_sync._src.sources.base import SourceIterator
from grain_jax_sync._src.sources.iterable import open_iterable


def open_source(source: Any) -> SourceIterator:
  """Returns a `SourceIterator` over `source`.

  Args:
    source: A Grain `DataLoader`, `IterDataset` or `MapDataset`, a
      `tf.data.Dataset`, a sequence of batches, or any iterable of batches.

  Returns:
    A fresh iterator positioned at the source's start.
  """
  if isinstance(source, SourceIterator):
    return source
  module = type(source).__module__ or ""
  if module.startswith("grain"):
    from grain_jax_sync._src.sources import grain as grain_source  # pylint: disable=g-import-not-at-top

    adapted = grain_source.open_grain(source)
    if adapted is not None:
      return adapted
  if module.startswith(("tensorflow", "tf_keras", "keras")):
    from grain_jax_sync._src.sources import tf_data  # pylint: disable=g-import-not-at-top

    adapted = tf_data.open_tf_data(source)
    if adapted is not None:
      return adapted
  return open_iterable(source)


__all__ = ["SourceIterator", "open_source"]
