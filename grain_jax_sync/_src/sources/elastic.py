"""The elastic source: records the library splits over processes, resumable on any count.

`elastic_source(records, transform)` is opened on each process as a Grain
pipeline over that process's share of each epoch (`elastic_split.Layout`):
``_Stream`` (a `MapDataset` of its records, in order) -> ``to_iter_dataset()``
-> ``_Cursor`` (tags the stream index in the state) -> the user's transform.
Grain nests a parent's state in its iterators' states (map, filter and batch
pass it up as it was after the last element they took), so the tag inside the
state kept after each delivered batch is the exact consumed cursor as of that
batch. Under `mp_prefetch`, each worker slices ``_Cursor`` (`set_slice`) and its
tag says which stride of the stream it reads; Grain keeps each worker's state
as of its last delivered element, so the host's cursor is one threshold per
worker (`elastic_cursor.find_position`). Packing's state holds its parent's at the start of
the packed batch it is emitting: exact once that batch is all delivered.
`get_state()` copies Grain's state (as a Grain source does); the cursor is
looked up only when a state is exported.

A process's exported state holds the job's split (the process count, this
process's index, the epochs' resize histories) and its stream index, plus
Grain's own state for a resume on the same count (exactly today's stream).
`for_this_process` turns the list of every old process's state into this
process's state on a job of another size.

Grain is imported when the source is opened.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from grain_jax_sync._src import elastic_codec, extras
from grain_jax_sync._src import elastic_split as es
from grain_jax_sync._src.sources import base, elastic_cursor

FORMAT = "grain_jax_sync.elastic/1"
_TAG = elastic_cursor.TAG
_SLICE = elastic_cursor.SLICE


@dataclasses.dataclass(frozen=True, eq=False)  # `records` may be unhashable.
class ElasticSource:
  """What `elastic_source` returns: opened on each process by `iter_jax_batches`."""

  records: Any
  transform: Callable[[Any], Any] | None
  shuffle: bool
  seed: int
  num_epochs: int | None

  def open(self) -> ElasticIterator:
    import jax  # pylint: disable=g-import-not-at-top

    return ElasticIterator(self, index=jax.process_index(), count=jax.process_count())


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
  if num_epochs is not None and (
    isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1
  ):
    raise ValueError(f"`num_epochs` must be an int >= 1 or None (forever), got {num_epochs!r}")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"`seed` must be an int >= 0, got {seed!r}")
  if transform is not None and not callable(transform):
    raise ValueError(f"`transform` must be callable or None, got {type(transform).__name__}")
  try:
    len(records)
  except TypeError as e:
    raise ValueError(
      f"`records` must be a grain.MapDataset or a random-access sequence, got"
      f" {type(records).__name__} (no len())"
    ) from e
  return ElasticSource(records, transform, bool(shuffle), seed, num_epochs)


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


@functools.cache
def _classes() -> tuple[type, type]:
  """(_Stream, _Cursor), built on first use (Grain loads lazily)."""
  grain: Any = extras.require("grain", needed_by="grain_jax_sync.elastic_source")

  class Stream(grain.MapDataset):
    """This process's records, in stream order: `records[order[position]]`."""

    def __init__(self, records: Any, layout: es.Layout, shuffle: bool, seed: int):
      super().__init__(records)
      self._layout = layout
      self._shuffle = shuffle
      self._seed = seed

    def __len__(self) -> int:
      return self._layout.length

    def __getitem__(self, j):
      if isinstance(j, slice):
        return self.slice(j)
      epoch, pos = self._layout.locate(j)
      order = es.epoch_order(
        self._layout.num_records, shuffle=self._shuffle, seed=self._seed, epoch=epoch
      )
      return self._parent[pos if order is None else int(order[pos])]

    def __str__(self) -> str:
      return f"ElasticStream(process {self._layout.index} of {self._layout.count})"

  return Stream, _cursor_class(grain)


def _cursor_class(grain: Any) -> type:
  """The `Cursor` dataset (see `_classes`)."""

  class CursorIterator(grain.DatasetIterator):
    def __init__(self, parent, sliced):
      super().__init__(parent)
      self._sliced = sliced

    def __next__(self):
      return next(self._parent)

    def get_state(self):
      state = {_TAG: self._parent.get_state()}
      if self._sliced is not None:
        state[_SLICE] = list(self._sliced)
      return state

    def set_state(self, state):
      self._parent.set_state(state[_TAG])

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
  layout: es.Layout
  grain: Any


class ElasticIterator(base.SourceIterator):
  """One process's iterator over an `ElasticSource`."""

  supports_state = True
  elastic = True

  def __init__(self, spec: ElasticSource, *, index: int, count: int):
    self._spec = spec
    self._num_records = len(spec.records)
    self.description = f"an elastic source of {self._num_records} records"
    self._it: Any = None
    self._open(es.Layout(self._num_records, spec.num_epochs, 0, (), count, index))

  def _open(self, layout: es.Layout) -> None:
    grain: Any = extras.require("grain", needed_by="grain_jax_sync.elastic_source")
    stream_cls, cursor_cls = _classes()
    records = self._spec.records
    if not isinstance(records, grain.MapDataset):
      records = grain.MapDataset.source(records)
    ds = cursor_cls(
      stream_cls(records, layout, self._spec.shuffle, self._spec.seed).to_iter_dataset(),
      layout.length,
    )
    if self._spec.transform is not None:
      ds = self._spec.transform(ds)
      if not isinstance(ds, grain.IterDataset):
        raise ValueError(f"`transform` must return a grain.IterDataset, got {type(ds).__name__}")
    self.close()
    self._layout = layout
    self._it = iter(ds)

  def __next__(self) -> Any:
    return next(self._it)

  def get_state(self) -> Any:
    return _Snapshot(self._layout, self._kept(self._it.get_state()))

  def export_state(self, state: Any) -> Any:
    if not isinstance(state, _Snapshot):
      return super().export_state(state)  # Already exported (restored by set_state).
    found = elastic_cursor.find_position(state.grain)
    if found is None:
      raise RuntimeError(
        f"the state of {self.description} does not hold its stream's position:"
        " `transform` must build on the IterDataset it is given with Grain"
        " transformations that nest their parent's state (map, filter, batch)"
      )
    return export(state.layout, found[0], state.grain, self._spec, why_not=found[1])

  def set_state(self, state: Any) -> None:
    layout, position, grain_state = check_source_state(state, self._spec, self._num_records)
    if layout.count != self._layout.count or layout.index != self._layout.index:
      raise ValueError(
        f"`state['source']` is process {layout.index} of {layout.count}'s, but this is"
        f" process {self._layout.index} of {self._layout.count}"
      )
    self._open(layout)
    if grain_state is not None:
      self._it.set_state(base.decode_state(grain_state))
    elif position:
      raise ValueError("`state['source']['position']` must be 0 without a Grain state")

  def close(self) -> None:
    close = getattr(self._it, "close", None)
    if callable(close):
      close()


def export(
  layout: es.Layout,
  consumed: int | tuple[int, ...],
  grain_state: Any,
  spec: ElasticSource,
  *,
  why_not: str | None = None,
) -> dict:
  """A process's JSON source state, with stream thresholds (or a position) `consumed`.

  `why_not`: why the cursor cannot be re-split (None: it can; see
  `elastic_cursor.find_position`). ``position`` is the consumed prefix; ``strided`` the
  thresholds of `mp_prefetch` workers, when there are several.
  """
  thresholds = (consumed,) if isinstance(consumed, int) else tuple(consumed)
  position = min(min(thresholds), layout.length)
  epoch, cursor = layout.cursor(position)
  out = {
    "format": FORMAT,
    "num_records": layout.num_records,
    "shuffle": spec.shuffle,
    "seed": spec.seed,
    "num_epochs": layout.num_epochs,
    "process_count": layout.count,
    "process_index": layout.index,
    "first_epoch": layout.first_epoch,
    "splits": elastic_codec.splits_to_json(layout.splits),
    "position": position,
    "epoch": epoch,
    "cursor": cursor,
    "resplittable": why_not is None,
    "grain": grain_state,
  }
  if len(thresholds) > 1:
    out["strided"] = [int(t) for t in thresholds]
  if why_not is not None:
    out["why_not_resplittable"] = why_not
  return out


def _field(state: Mapping[str, Any], key: str, kind: type = int) -> Any:
  if key not in state:
    raise ValueError(f"`state['source']` has no {key!r} field; expected an elastic source's state")
  value = state[key]
  if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
    raise ValueError(f"`state['source'][{key!r}]` must be an int >= 0, got {value!r:.100}")
  if kind is bool and not isinstance(value, bool):
    raise ValueError(f"`state['source'][{key!r}]` must be a bool, got {value!r:.100}")
  return value


def check_source_state(
  state: Any, spec: ElasticSource, num_records: int
) -> tuple[es.Layout, int, Any]:
  """(layout, stream index, Grain state or None) of an exported state, checked against `spec`.

  Raises:
    ValueError: Naming the field that is missing, ill-typed or differs from
      the source's (record count, shuffle, seed, an epoch past `num_epochs`).
  """
  if not isinstance(state, Mapping) or state.get("format") != FORMAT:
    raise ValueError(
      f"`state['source']` is not an elastic source's state (no 'format': {FORMAT!r});"
      " was it saved from another source?"
    )
  for key, now in (("num_records", num_records), ("shuffle", spec.shuffle), ("seed", spec.seed)):
    saved = _field(state, key, bool if key == "shuffle" else int)
    if saved != now:
      raise ValueError(
        f"`state['source'][{key!r}]` is {saved!r}, but this elastic source has {key}={now!r};"
        " restore with the records and options the state was saved with"
      )
  epoch = _field(state, "epoch")
  if spec.num_epochs is not None and epoch >= spec.num_epochs:
    raise ValueError(
      f"`state['source']['epoch']` is {epoch}, but this elastic source has"
      f" num_epochs={spec.num_epochs}"
    )
  count = _field(state, "process_count")
  index = _field(state, "process_index")
  if count < 1 or index >= count:
    raise ValueError(f"`state['source']` names process {index} of {count}")
  layout = es.Layout(
    num_records,
    spec.num_epochs,
    _field(state, "first_epoch"),
    elastic_codec.splits_from_json(state.get("splits", [])),
    count,
    index,
  )
  position = _field(state, "position")
  if position > layout.length:
    raise ValueError(
      f"`state['source']['position']` is {position}, past this process's {layout.length} records"
    )
  return layout, position, state.get("grain")
