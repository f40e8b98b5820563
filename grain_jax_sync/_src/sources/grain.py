"""Grain sources, resumed exactly through Grain's own iterator state. Imported only when used.

Elements must already be batches; the batch validation says how to batch them.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from grain_jax_sync._src import extras
from grain_jax_sync._src.sources import base


class GrainIteratorSource(base.WrappedIterator):
  """A Grain `DatasetIterator` (from an `IterDataset` or `MapDataset`).

  Until the first read, `get_state()` asks `fresh()` (none from `device_put`,
  which reads as Grain's does), another iterator at the start: a Grain
  0.2.18 iterator whose state is taken before its first `next()` starts
  each worker process once the one before has made a batch. `first` is (an
  element already read, the state before it), kept where `set_state` asks
  for that state, since rewinding drops what Grain's threads or workers read ahead.
  """

  supports_state = True

  def __init__(
    self, iterator: Any, *, description: str, fresh: Any = None, first: Any = None
  ) -> None:
    self._it = iterator
    self.description = description
    self._fresh = fresh
    self._first = first

  def __next__(self) -> Any:
    self._fresh = None
    if self._first is not None:
      element, self._first = self._first[0], None
      return element
    return next(self._it)

  def _raw_state(self) -> Any:
    if self._first is not None:
      return self._first[1]
    if self._fresh is None:
      return self._it.get_state()
    return self._fresh().get_state()

  def get_state(self) -> Any:
    return self._kept(self._raw_state())  # A copy, never the live state.

  def set_state(self, state: Any) -> None:
    self._fresh = None
    try:
      due = self._first is not None and bool(base.decode_state(state) == self._first[1])
    except (TypeError, ValueError):  # A state holding arrays: compared by reading again.
      due = False
    if due:
      return  # The element read first is due at this state already.
    self._first = None
    super().set_state(state)

  def local_iterator(self, owner: Any) -> Any:
    return grain_class(LocalIterator, "DatasetIterator")(owner)


class GrainLoaderSource(GrainIteratorSource):
  """A `grain.DataLoader` iterator; its JSON-bytes state is kept as a dict."""

  def get_state(self) -> Any:
    return _from_json_bytes(self._raw_state())

  def set_state(self, state: Any) -> None:
    self._fresh = None
    self._it.set_state(_to_json_bytes(state))

  def close(self) -> None:
    # DataLoaderIterator (Grain 0.2.18) has no close(); its dataset iterator
    # does, and closing it stops the worker processes now rather than at exit.
    close = getattr(self._it, "close", None)
    if not callable(close):
      close = getattr(getattr(self._it, "_iterator", None), "close", None)
    if callable(close):
      close()

  def local_iterator(self, owner: Any) -> Any:
    return LocalLoaderIterator(owner)


def _from_json_bytes(raw: Any) -> Any:
  """A `DataLoaderIterator` state (JSON bytes) as a dict; bytes that are not JSON as base64."""
  try:
    return json.loads(raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw)
  except (ValueError, AttributeError):
    return base.encode_state(raw)


def _to_json_bytes(state: Any) -> bytes:
  """The inverse of `_from_json_bytes`: the JSON bytes a `DataLoaderIterator` takes."""
  state = base.decode_state(state)
  if isinstance(state, (bytes, bytearray)):
    return bytes(state)
  return json.dumps(state, indent=4).encode("utf-8")


class LocalIterator:
  """The source's iterator seen through `owner`, a `JaxBatchIterator`: a checkpoint face for
  Grain's handler (a `grain.DatasetIterator` by `grain_class`).

  `get_state()` is the source state after the last batch the consumer
  received; `set_state()` restarts the stream from a state.
  """

  def __init__(self, owner: Any):
    super().__init__()  # Grain's `DatasetIterator`, where it is the other base.
    self._owner = owner

  def __iter__(self) -> Any:
    return self

  def __next__(self) -> Any:
    raise TypeError(
      "`local_iterator` is for checkpointing (get_state/set_state); iterate the"
      " JaxBatchIterator itself"
    )

  def start_prefetch(self) -> None:
    """Nothing to start: the stream starts on the next batch."""

  def get_state(self) -> Any:
    return self._owner.local_state()

  def set_state(self, state: Any) -> None:
    self._owner.restore_local(state)

  def __str__(self) -> str:
    return "grain_jax_sync.LocalIterator"


class LocalLoaderIterator(LocalIterator):
  """A `grain.DataLoaderIterator`'s checkpoint face (JSON bytes), through the agreed stream.

  Orbax v1 saves it as Grain's: `save`/`load` are `DataLoaderIterator`'s
  (a `StatefulCheckpointable`), run on this iterator's state.
  """

  def get_state(self) -> bytes:
    return _to_json_bytes(super().get_state())

  def set_state(self, state: bytes) -> None:
    super().set_state(_from_json_bytes(state))

  async def save(self, directory: Any) -> Any:
    return await _grain_module().DataLoaderIterator.save(self, directory)

  async def load(self, directory: Any) -> Any:
    return await _grain_module().DataLoaderIterator.load(self, directory)


def _grain_module() -> Any:
  return extras.require("grain", needed_by="a Grain source")


@functools.cache
def grain_class(mixin: type, base: str, needed_by: str = "a Grain source") -> type:
  """`mixin` on Grain's class `base` (``"DatasetIterator"``, ``"IterDataset"``), made on first use
  so that Grain loads lazily; the mixin's name and docstring (Grain ships no type information)."""
  grain: Any = extras.require("grain", needed_by=needed_by)
  namespace = {"__doc__": mixin.__doc__, "__module__": mixin.__module__}
  return type(mixin.__name__, (mixin, getattr(grain, base)), namespace)


def open_grain(source: Any, first: Any = None) -> base.SourceIterator | None:
  """A `SourceIterator` over a Grain object (a loader's or dataset's start), else None."""
  grain = _grain_module()

  name = type(source).__qualname__
  if isinstance(source, grain.DataLoader):
    fresh = functools.partial(iter, source)
    return GrainLoaderSource(fresh(), description=f"a grain DataLoader ({name})", fresh=fresh)
  if isinstance(source, grain.DataLoaderIterator):
    return GrainLoaderSource(source, description=f"a grain DataLoaderIterator ({name})")
  if isinstance(source, (grain.MapDataset, grain.IterDataset)):
    kind = "MapDataset" if isinstance(source, grain.MapDataset) else "IterDataset"
    # In index order; `to_iter_dataset` reads ahead in threads but keeps order
    # and skips the Nones that `filter` leaves.
    ds = source.to_iter_dataset() if kind == "MapDataset" else source
    description = f"a grain {kind} ({source})"
    return GrainIteratorSource(iter(ds), description=description, fresh=functools.partial(iter, ds))
  if isinstance(source, grain.DatasetIterator):
    description = f"a grain DatasetIterator ({name})"
    return GrainIteratorSource(source, description=description, first=first)
  return None
