"""Source adapters: anything that yields per-host batches -> `SourceIterator`.

Grain, TensorFlow and `datasets` are imported only when such a source is passed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from grain_jax_sync._src.sources.base import SourceIterator
from grain_jax_sync._src.sources.elastic import source as elastic_source
from grain_jax_sync._src.sources.elastic import stream as elastic_stream
from grain_jax_sync._src.sources.iterable import next_only, open_iterable


def open_source(source: Any) -> SourceIterator:
  """A `SourceIterator` at the start of `source` (any source `iter_jax_batches` takes)."""
  if isinstance(source, SourceIterator):
    return source
  if isinstance(source, elastic_source.ElasticSource):
    return elastic_stream.open_stream(source)
  module = type(source).__module__ or ""
  adapted = None
  if module.startswith("datasets") or module == f"{__name__}.hugging_face":
    from grain_jax_sync._src.sources import hugging_face  # pylint: disable=g-import-not-at-top

    adapted = hugging_face.open_hf(source)
  elif module.startswith("grain"):
    from grain_jax_sync._src.sources import grain as grain_source  # pylint: disable=g-import-not-at-top

    adapted = grain_source.open_grain(source)
  elif module.startswith(("tensorflow", "tf_keras", "keras")):
    from grain_jax_sync._src.sources import tf_data  # pylint: disable=g-import-not-at-top

    adapted = tf_data.open_tf_data(source)
  return open_iterable(source) if adapted is None else adapted


def reopen(source: Any, current: SourceIterator, initial: Any) -> SourceIterator:
  """A source iterator at the start of `source` again (for `reset()`).

  A fresh one over a re-iterable `source` (`current` closed), else `current`
  restored to `initial`, its state before its first read (None: none).
  """
  if not isinstance(source, (SourceIterator, Iterator)) and not next_only(source):
    current.close()
    return open_source(source)
  if current.supports_state and initial is not None:
    current.set_state(initial)
    return current
  raise RuntimeError(
    f"`reset()` cannot restart {current.description}: it can be read only once"
    " and cannot restore its start (no get_state()/set_state()); pass a"
    " re-iterable source (a list, a Grain dataset or DataLoader, a"
    " tf.data.Dataset) or an iterator with get_state()/set_state()"
  )


__all__ = ["open_source", "reopen"]
