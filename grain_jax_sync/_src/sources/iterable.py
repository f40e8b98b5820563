"""Plain Python sources: sequences (resumable by index) and any iterable."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from grain_jax_sync._src.sources import base


class SequenceSource(base.SourceIterator):
  """A sequence of batches, read in order; the state is the next index."""

  supports_state = True

  def __init__(self, seq: Sequence[Any]):
    self._seq = seq
    self._i = 0
    self.description = f"a {type(seq).__name__} of {len(seq)} batches"

  def __next__(self) -> Any:
    if self._i >= len(self._seq):
      raise StopIteration
    item = self._seq[self._i]
    self._i += 1
    return item

  def get_state(self) -> Any:
    return {"index": self._i}

  def set_state(self, state: Any) -> None:
    index = int(state["index"])
    if not 0 <= index <= len(self._seq):
      raise ValueError(f"state index {index} is outside the sequence of {len(self._seq)} batches")
    self._i = index


class IteratorSource(base.WrappedIterator):
  """Any iterable. Resumable when its iterator has get_state/set_state."""

  def __init__(self, iterable: Iterable[Any]):
    if next_only(iterable):
      self._it: Any = iterable  # `__next__` alone, as MaxText-style iterators are written.
    else:
      self._it = iter(iterable)  # May have get_state/set_state.
    self.supports_state = all(
      callable(getattr(self._it, m, None)) for m in ("get_state", "set_state")
    )
    self.description = f"an iterator of type {type(self._it).__qualname__}"


def next_only(source: Any) -> bool:
  """Whether `source` has `__next__` and no `__iter__` (missing, or None: Python's "not iterable")."""
  return getattr(source, "__iter__", None) is None and callable(getattr(source, "__next__", None))


def open_iterable(source: Any) -> base.SourceIterator:
  if isinstance(source, Sequence) and not isinstance(source, (str, bytes, np.ndarray)):
    return SequenceSource(source)
  if isinstance(source, (str, bytes)):
    raise ValueError(f"`source` must be an iterable of batches, got a {type(source).__name__}")
  try:
    return IteratorSource(source)
  except TypeError as e:
    raise ValueError(
      f"`source` must be an iterable of batches, got {type(source).__qualname__}"
    ) from e
