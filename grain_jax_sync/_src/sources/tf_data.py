"""tf.data sources. Imported only when a TensorFlow object is passed."""

from __future__ import annotations

from typing import Any

from grain_jax_sync._src.sources import base


def open_tf_data(source: Any) -> base.SourceIterator | None:
  """Adapts a tf.data.Dataset, or returns None to use the generic path."""
  del source
  return None
