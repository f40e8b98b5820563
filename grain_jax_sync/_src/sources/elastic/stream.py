"""One process's stream of an elastic source: a Grain pipeline over its share of each epoch.

`open_stream` opens an `ElasticSource` as ``Stream`` (this process's records
in stream order, `split.EpochShares`), read by ``Reader`` (a chunk of
positions at a time, one batched read each; its state is the positions
delivered, as Grain's `to_iter_dataset()`'s) -> ``Cursor`` (tags the stream
index in the state) -> the user's transform. Grain nests a parent's state in its iterators' states
as it was after the last element they took, so the tag inside the state kept
after each delivered batch is the consumed cursor as of that batch; under
`mp_prefetch` each worker slices ``Cursor`` and the host's cursor is one
threshold per worker (`cursor.find_position`). The cursor is looked up only
when a state is exported. Grain is imported when the source is opened.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

from grain_jax_sync._src import extras
from grain_jax_sync._src.sources import base
from grain_jax_sync._src.sources.elastic import cursor as cursor_lib
from grain_jax_sync._src.sources.elastic import packing
from grain_jax_sync._src.sources.elastic import state as state_lib
from grain_jax_sync._src.sources.elastic.source import ElasticSource
from grain_jax_sync._src.sources.elastic.split import EpochShares, epoch_order


def open_stream(spec: ElasticSource) -> ElasticIterator:
  """`spec` opened on this process: its share of each epoch, through the transform."""
  import jax  # pylint: disable=g-import-not-at-top

  return ElasticIterator(spec, index=jax.process_index(), count=jax.process_count())


def _worker_slice(sl: slice, sequential: bool, length: int) -> tuple[slice, tuple[int, int, bool]]:
  """(the stream slice, its tag) of an mp_prefetch worker's `sl` over `length` indices."""
  if sl.stop is not None:
    raise ValueError(f"an elastic source's stream takes a worker's slice, got {sl}")
  worker, workers = sl.start or 0, sl.step or 1
  if not sequential:
    return slice(worker, None, workers), (worker, workers, False)
  size, extra = divmod(length, workers)  # A block, as Grain's sequential slices.
  start = worker * size + min(worker, extra)
  return slice(start, start + size + (1 if worker < extra else 0)), (start, 1, True)


_CHUNK = 256  # Stream positions read at once: amortizes each read's fixed cost.


class Stream:
  """This process's records, in stream order: `records[order[position]]`."""

  def __init__(self, records: Any, shares: EpochShares, spec: ElasticSource):
    self._records, self._shares, self._spec = records, shares, spec
    self._endless = spec.mixture is not None  # Epoch e starts at row e * num_records.

  def __len__(self) -> int:
    return self._shares.length

  def read(self, positions: range) -> list[Any]:
    """The records at stream `positions`, in one batched read where the records have one."""
    rows = []
    for j in positions:
      epoch, pos = self._shares.locate(j)
      order = epoch_order(
        self._shares.num_records, shuffle=self._spec.shuffle, seed=self._spec.seed, epoch=epoch
      )
      pos = pos if order is None else int(order[pos])
      rows.append(pos + epoch * self._shares.num_records if self._endless else pos)
    getitems = getattr(self._records, "_getitems", None)  # Grain's and `MixedRecords`' batch read.
    return list(getitems(rows)) if getitems else [self._records[r] for r in rows]

  def skip(self, j: int) -> int:
    """Tokens of stream index `j`'s record a resize left delivered (a packer's split record)."""
    return self._shares.skip(j)


class Chunks:
  """`stream` at `positions`, read in chunks; a `grain.DatasetIterator` by `_reader_class`."""

  def __init__(self, stream: Stream, positions: range):
    self._stream, self._positions = stream, positions
    self._delivered = 0  # Of `positions`.
    self._buffer: collections.deque[Any] = collections.deque()

  def __next__(self) -> Any:
    while True:
      if not self._buffer:
        if self._delivered >= len(self._positions):
          raise StopIteration
        chunk = self._positions[self._delivered : self._delivered + _CHUNK]
        self._buffer.extend(self._stream.read(chunk))
      self._delivered += 1
      value = self._buffer.popleft()
      if value is not None:  # A Grain `filter` on the records leaves None.
        return value

  def get_state(self) -> dict[str, int]:
    state = {"next_index": self._delivered}
    if self._delivered and (skip := self._stream.skip(self._positions[self._delivered - 1])):
      state["skip"] = skip  # Its last record's tokens a resize left delivered.
    return state

  def set_state(self, state: dict[str, Any]) -> None:
    self._delivered = int(state["next_index"])
    self._buffer.clear()


@functools.cache
def _classes() -> tuple[type, type]:
  """(_Reader, _Cursor), built on first use (Grain loads lazily)."""
  grain: Any = extras.require("grain", needed_by="grain_jax_sync.elastic_source")
  return _reader_class(grain), _cursor_class(grain)


def _reader_class(grain: Any) -> type:
  """The `Reader` dataset (see `_classes`)."""

  class ReaderIterator(Chunks, grain.DatasetIterator):
    def __init__(self, stream: Stream, positions: range):
      grain.DatasetIterator.__init__(self)
      Chunks.__init__(self, stream, positions)

  class Reader(grain.IterDataset):
    """The stream read in chunks of positions, its state the positions delivered."""

    def __init__(self, stream: Stream):
      super().__init__()
      self._stream, self._positions = stream, range(len(stream))

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
      del sequential_slice  # `Cursor` gives the slice to read.
      self._positions = self._positions[sl]

    def __iter__(self):
      return ReaderIterator(self._stream, self._positions)

    def __str__(self) -> str:
      return f"ElasticStream(process {self._stream._shares.index} of {self._stream._shares.count})"

  return Reader


def _cursor_class(grain: Any) -> type:
  """The `Cursor` dataset (see `_classes`)."""

  class CursorIterator(grain.DatasetIterator):
    def __init__(self, parent, sliced):
      super().__init__(parent)
      self._sliced = sliced

    def __next__(self):
      return next(self._parent)

    def get_state(self):
      state = {cursor_lib.TAG: self._parent.get_state()}
      if self._sliced is not None:
        state[cursor_lib.SLICE] = list(self._sliced)
      return state

    def set_state(self, state):
      self._parent.set_state(state[cursor_lib.TAG])

  class Cursor(grain.IterDataset):
    """Tags the stream's state, so the cursor can be found in the transform's.

    `mp_prefetch` slices it in each worker (`set_slice`): the tag then says
    which stream indices the worker reads (every `step`-th from `start`).
    """

    def __init__(self, parent, length: int):
      super().__init__(parent)
      self._length = length
      self._sliced: tuple[int, int, bool] | None = None

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
      if self._sliced is not None:
        raise ValueError(f"an elastic source's stream cannot be sliced twice ({sl})")
      parent_slice, self._sliced = _worker_slice(sl, sequential_slice, self._length)
      self._parent.set_slice(parent_slice, False)

    def __iter__(self):
      return CursorIterator(self._parent.__iter__(), self._sliced)

  return Cursor


@dataclasses.dataclass(frozen=True)
class _Snapshot:
  shares: EpochShares
  grain: Any


class ElasticIterator(base.WrappedIterator):
  """One process's iterator over an `ElasticSource` (`spec`) of `num_records` records an epoch."""

  supports_state = True

  def __init__(self, spec: ElasticSource, *, index: int, count: int):
    self.spec = spec
    self.num_records = spec.num_records
    self.description = f"an elastic source of {self.num_records} records"
    self._it: Any = None
    self._open(EpochShares(self.num_records, spec.num_epochs, 0, (), count, index))

  def _open(self, shares: EpochShares) -> None:
    grain: Any = extras.require("grain", needed_by="grain_jax_sync.elastic_source")
    reader_cls, cursor_cls = _classes()
    ds = cursor_cls(reader_cls(Stream(self.spec.records, shares, self.spec)), shares.length)
    if self.spec.transform is not None:
      ds = self.spec.transform(ds)
      if not isinstance(ds, grain.IterDataset):
        raise ValueError(f"`transform` must return a grain.IterDataset, got {type(ds).__name__}")
    self.close()
    self._shares = shares
    self._it = iter(ds)

  def get_state(self) -> Any:
    return _Snapshot(self._shares, self._kept(self._it.get_state()))

  def export_state(self, state: Any) -> Any:
    if not isinstance(state, _Snapshot):
      return super().export_state(state)  # Already exported (restored by set_state).
    found = cursor_lib.find_position(state.grain)
    if found is None:
      raise RuntimeError(
        f"the state of {self.description} does not hold its stream's position:"
        " `transform` must build on the IterDataset it is given with Grain"
        " transformations that nest their parent's state (map, filter, batch)"
      )
    return state_lib.export(
      state.shares,
      found.thresholds,
      state.grain,
      self.spec,
      why_not=found.why,
      holes=found.holes,
      partial=found.partial,
    )

  def stats(self, state: Any) -> dict[str, Any]:
    """A mixture's ``sources`` (each one's rows this process consumed, against its weight) and
    ``packing`` (the tokens `pack_sequences` packed, padded and trimmed on this process)."""
    if state is None:
      return {}
    out: dict[str, Any] = {}
    grain_state = state.grain if isinstance(state, _Snapshot) else state.get("grain")
    if (tokens := packing.counters(grain_state)) is not None:
      out["packing"] = tokens
    mixture = self.spec.mixture
    if mixture is None:
      return out
    if isinstance(state, _Snapshot):
      found = cursor_lib.find_position(state.grain)
      if found is None:
        return out
      shares, position, holes = state.shares, min(found.thresholds), tuple(found.holes)
    else:  # Exported (restored by set_state): checked there.
      shares, position, _ = state_lib.check_source_state(state, self.spec, self.num_records)
      holes = state_lib.unpack_ints(state.get("holes", []))
      mixture = state_lib.mixture_spec(state, self.spec).mixture
    return {**out, "sources": mixture.stats(mixture.consumed(shares, position, holes))}

  def set_state(self, state: Any) -> None:
    shares, position, grain_state = state_lib.check_source_state(state, self.spec, self.num_records)
    if shares.count != self._shares.count or shares.index != self._shares.index:
      raise ValueError(
        f"`state['source']` is process {shares.index} of {shares.count}'s, but this is"
        f" process {self._shares.index} of {self._shares.count}"
      )
    self.spec = state_lib.mixture_spec(state, self.spec)  # Its runs of weights.
    self._open(shares)
    if grain_state is not None:
      self._it.set_state(base.decode_state(grain_state))
    elif position:
      raise ValueError("`state['source']['position']` must be 0 without a Grain state")
