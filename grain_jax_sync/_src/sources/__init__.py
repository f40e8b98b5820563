"""Source adapters: anything that yields per-host batches -> `SourceIterator`.

Grain, TensorFlow and Hugging Face `datasets` are imported only when such a
source is passed, so the core works without them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from grain_jax_sync._src.sources import elastic
from grain_jax_sync._src.sources.base import SourceIterator
from grain_jax_sync._src.sources.iterable import next_only, open_iterable


def open_source(source: Any) -> SourceIterator:
  """Returns a `SourceIterator` over `source`.

  Args:
    source: A Grain `DataLoader`, `IterDataset` or `MapDataset`, a
      `tf.data.Dataset`, a Hugging Face `datasets.Dataset` or
      `IterableDataset` or `hf_pipeline`'s source, an `elastic_source`, or
      any sequence or iterable of batches.

  Returns:
    A fresh iterator positioned at the source's start.
  """
  if isinstance(source, SourceIterator):
    return source
  if isinstance(source, elastic.ElasticSource):
    return elastic.open_stream(source)
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

  Args:
    source: What the iterator was built from.
    current: Its source iterator now (closed if a fresh one is opened).
    initial: `current`'s state before its first read (None if it has none).

  Returns:
    A fresh iterator over a re-iterable `source` (a sequence, a Grain
    dataset or loader, a `tf.data.Dataset`, any iterable that is not itself
    an iterator), else `current` restored to `initial` (an iterator, with
    `__iter__` or `__next__` alone).

  Raises:
    RuntimeError: If `source` can be read only once and cannot restore its
      start (a generator, an iterator without get_state()/set_state()).
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


__all__ = ["SourceIterator", "open_source", "reopen"]
