"""One process's stream of an elastic source: a Grain pipeline over its share of each epoch.

`open_stream` opens an `ElasticSource` as ``Stream`` (this process's records
in stream order, `split.EpochShares`), read by ``Reader`` (a chunk of
positions at a time; its state, the positions delivered, tagged with the
stream index) -> the user's transform. Grain nests a parent's state in its
iterators' states as it was after the last element they took, so the tag
inside the state kept after each delivered batch is the consumed cursor as of
that batch; under `mp_prefetch` each worker slices ``Reader`` and the host's
cursor is one threshold per worker (`cursor.find_position`). Grain is
imported when the source is opened.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import zlib
from typing import Any

from grain_jax_sync._src import extras
from grain_jax_sync._src.sources import base
from grain_jax_sync._src.sources import grain as grain_source
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
    self._records, self.shares, self._spec = records, shares, spec
    self._endless = spec.mixture is not None  # Epoch e starts at row e * num_records.

  def read(self, positions: range) -> list[Any]:
    """The records at stream `positions`, in one batched read where the records have one."""
    rows = []
    for j in positions:
      epoch, pos = self.shares.locate(j)
      order = epoch_order(
        self.shares.num_records, shuffle=self._spec.shuffle, seed=self._spec.seed, epoch=epoch
      )
      pos = pos if order is None else int(order[pos])
      rows.append(pos + epoch * self.shares.num_records if self._endless else pos)
    getitems = getattr(self._records, "_getitems", None)  # Grain's and `MixedRecords`' batch read.
    return list(getitems(rows)) if getitems else [self._records[r] for r in rows]


class Chunks:
  """`stream` at `positions`, read in chunks, its state (the positions delivered) tagged for the
  cursor to be found (`cursor.TAG`, `cursor.SLICE`); a `grain.DatasetIterator` by `grain_class`."""

  def __init__(self, stream: Stream, positions: range, sliced: tuple[int, int, bool] | None):
    super().__init__()  # Grain's `DatasetIterator`, the other base.
    self._stream, self._positions, self._sliced = stream, positions, sliced
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

  def get_state(self) -> dict[str, Any]:
    state = {"next_index": self._delivered}
    last = self._positions[self._delivered - 1] if self._delivered else None
    if last is not None and (skip := self._stream.shares.skip(last)):
      state["skip"] = skip  # Its last record's tokens a resize left delivered.
    tagged: dict[str, Any] = {cursor_lib.TAG: state}
    if self._sliced is not None:
      tagged[cursor_lib.SLICE] = list(self._sliced)
    return tagged

  def set_state(self, state: dict[str, Any]) -> None:
    self._delivered = int(state[cursor_lib.TAG]["next_index"])
    self._buffer.clear()


class Reader:
  """The stream as a dataset, a `grain.IterDataset` by `grain_class`; `mp_prefetch` slices it in
  each worker (`set_slice`)."""

  def __init__(self, stream: Stream):
    super().__init__()
    self._stream, self._positions = stream, range(stream.shares.length)
    self._sliced: tuple[int, int, bool] | None = None

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    if self._sliced is not None:
      raise ValueError(f"an elastic source's stream cannot be sliced twice ({sl})")
    mine, self._sliced = _worker_slice(sl, sequential_slice, self._stream.shares.length)
    self._positions = self._positions[mine]

  def __iter__(self) -> Any:
    chunks = grain_source.grain_class(Chunks, "DatasetIterator")
    return chunks(self._stream, self._positions, self._sliced)

  def __str__(self) -> str:
    return f"ElasticStream(process {self._stream.shares.index} of {self._stream.shares.count})"


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
    stream = Stream(self.spec.records, shares, self.spec)
    ds = grain_source.grain_class(Reader, "IterDataset")(stream)
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

  def fingerprint(self) -> dict[str, str]:
    """The split's settings and a mixture's weights (their runs too): another on one host would
    read records another host reads, or none."""
    spec, mixture = self.spec, self.spec.mixture
    what = f"{self.num_records} records, seed={spec.seed}, num_epochs={spec.num_epochs}"
    if mixture is None:
      return {"elastic_source": f"{what}, shuffle={spec.shuffle}"}
    what += f", proportions {list(mixture.proportions)} of sources of {list(mixture.sizes)}"
    what += f" records, shuffle={mixture.shuffle}"
    if mixture.history:  # Runs of weights (resumes that changed them): a digest.
      runs = json.dumps(state_lib.mixture_fields(mixture)["mixture_runs"]).encode()
      what += f", {len(mixture.history)} runs of weights (digest {zlib.crc32(runs):08x})"
    return {"elastic_source": what}

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
