"""`pack_sequences`: token sequences packed into rows of a context length, resumable anywhere.

A row is emitted when it is full or a record fits in no open row (the
fullest one goes), and at the end the open rows go in order.

The state names the records in flight (in the open rows): the parent's
state before the first of them, which of the records read since are in
which open row, and, over an elastic stream, their stream indices (the
cursor's holes, `cursor.PACKED`). So a resume on the same count rebuilds
the open rows exactly, and a re-split over another count re-reads exactly
the records in flight with those not read. Grain is imported when it is used.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_jax_sync._src import extras, leaves
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src.sources.elastic import cursor as cursor_lib


@dataclasses.dataclass
class _Record:
  read: int  # Its place among the records read.
  value: dict[str, np.ndarray]
  before: Any  # The parent's state before it was read.
  after: Any  # ... and after.


def _used(row: list[_Record]) -> dict[str, int]:
  return {k: sum(len(r.value[k]) for r in row) for k in row[0].value}


def _fits(row: list[_Record], record: _Record, length: int) -> bool:
  used = _used(row)
  return all(used.get(k, 0) + len(v) <= length for k, v in record.value.items())


def packed_row(row: list[_Record], length: int) -> dict[str, np.ndarray]:
  """One emitted row: per feature its tokens, segment ids and positions."""
  out = {}
  for k in row[0].value:
    parts = [r.value[k] for r in row]
    tokens = np.zeros(length, parts[0].dtype)
    segments, positions = np.zeros(length, np.int32), np.zeros(length, np.int32)
    at = 0
    for s, x in enumerate(parts, start=1):
      tokens[at : at + len(x)] = x
      segments[at : at + len(x)] = s
      positions[at : at + len(x)] = np.arange(len(x))
      at += len(x)
    out.update({k: tokens, f"{k}_segment_ids": segments, f"{k}_positions": positions})
  return out


def checked_record(value: Any, dtypes: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
  """A record as 1-D arrays of tokens, each of its feature's dtype in `dtypes` (the first record's).

  One rule whatever the order the records come in: a feature of another
  dtype than the first record's is refused, never cast.

  Raises:
    DataError: Naming the feature, its shape or dtype, and what was expected.
  """
  if not isinstance(value, Mapping) or not value:
    raise leaves.DataError(
      f"pack_sequences packs dicts of 1-D token arrays, got {type(value).__name__} {value!r:.80}"
    )
  out = {}
  for k, v in value.items():
    if not isinstance(k, str):
      raise leaves.DataError(f"pack_sequences: feature names must be str, got {k!r:.40}")
    where = f"pack_sequences: feature {k!r}"
    try:
      x = leaves.to_array(v, context=where)
    except ValueError as e:
      raise leaves.DataError(str(e)) from e
    if x.ndim != 1:
      raise leaves.DataError(
        f"{where}: a {x.ndim}-d array of shape {x.shape}; expected a 1-D sequence of"
        " tokens per record (one record per element: unbatch or flatten it first)"
      )
    out[k] = x
  if dtypes and (set(out) != set(dtypes) or any(out[k].dtype != d for k, d in dtypes.items())):
    raise leaves.DataError(_mismatch(out, dtypes))
  return out


def _mismatch(record: Mapping[str, np.ndarray], dtypes: Mapping[str, np.dtype]) -> str:
  """Why `record` does not pack beside the first record (its features `dtypes`)."""
  if set(record) != set(dtypes):
    return (
      f"pack_sequences: a record has the features {sorted(record)}, the first record"
      f" {sorted(dtypes)}; every record must have the same features"
    )
  k = next(k for k, d in dtypes.items() if record[k].dtype != d)
  empty = ": an empty list becomes float64" if not record[k].size else ""
  return (
    f"pack_sequences: feature {k!r} is {record[k].dtype} in a record"
    f" ({record[k]!r:.60}{empty}), {dtypes[k]} in the first record; every record's"
    f" feature must have one dtype (cast it in the map before pack_sequences)"
  )


def _stream_index(state: Any) -> tuple[int | None, str | None]:
  """(stream index past the last record read, why not exact) of a parent state."""
  found = cursor_lib.find_position(state)
  if found is None:
    return None, None
  thresholds, why, holes = found
  if len(thresholds) > 1 or holes:
    return None, why or "pack_sequences reads a stream whose cursor is not a prefix (mp_prefetch)"
  return thresholds[0], why


class PackIterator:
  """Packs its parent's records (see the module); a `grain.DatasetIterator` by `_classes`."""

  _parent: Any  # Set by `grain.DatasetIterator.__init__`.

  def _start(self, length: int, num_bins: int) -> None:
    self._length, self._num_bins = length, num_bins
    self._rows: list[list[_Record]] = []
    self._read = 0
    self._ended = False
    self._dtypes: dict[str, np.dtype] = {}  # The first record's: every record's (`checked_record`).
    self._last = self._parent.get_state()

  def _take(self) -> _Record | None:
    try:
      value = next(self._parent)
    except StopIteration:
      self._ended = True
      return None
    value = checked_record(value, self._dtypes)
    self._dtypes = self._dtypes or {k: v.dtype for k, v in value.items()}
    value = {k: v[: self._length] for k, v in value.items()}
    before, self._last = self._last, self._parent.get_state()
    self._read += 1
    return _Record(self._read - 1, value, before, self._last)

  def __next__(self) -> dict[str, np.ndarray]:
    while not self._ended and (record := self._take()) is not None:
      row = next((r for r in self._rows if _fits(r, record, self._length)), None)
      if row is not None:
        row.append(record)
        if max(_used(row).values()) == self._length:  # Full.
          return self._emit(row)
      elif len(self._rows) < self._num_bins:
        self._rows.append([record])
      else:
        fullest = max(self._rows, key=lambda r: max(_used(r).values()))
        self._rows[self._rows.index(fullest)] = [record]
        return packed_row(fullest, self._length)
    if not self._rows:
      raise StopIteration
    return self._emit(self._rows[0])

  def _emit(self, row: list[_Record]) -> dict[str, np.ndarray]:
    self._rows.remove(row)
    return packed_row(row, self._length)

  def get_state(self) -> dict[str, Any]:
    held = sorted((r for row in self._rows for r in row), key=lambda r: r.read)
    first = held[0].read if held else self._read
    state = {
      "parent": held[0].before if held else self._last,
      "rows": [[r.read - first for r in row] for row in self._rows],
      "read": self._read - first,
    }
    stop, why = _stream_index(self._last)
    if stop is None and why is None:
      return state  # Not over an elastic stream.
    holes = [_stream_index(r.after)[0] for r in held]
    tag = {cursor_lib.TAG: {"next_index": stop or 0}, "holes": [j - 1 for j in holes if j]}
    if why is not None or None in holes:
      tag["why"] = why or "pack_sequences could not name a record's stream index"
    return {**state, cursor_lib.PACKED: tag}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._start(self._length, self._num_bins)
    where = {i: k for k, row in enumerate(state["rows"]) for i in row}
    self._rows = [[] for _ in state["rows"]]
    for _ in range(state["read"]):  # The records since the first in flight, read again.
      record = self._take()
      if record is None:
        raise ValueError("`state` names records in flight past the end of the stream")
      if record.read in where:
        self._rows[where[record.read]].append(record)


@functools.cache
def _classes() -> type:
  grain: Any = extras.require("grain", needed_by="grain_jax_sync.pack_sequences")

  class Iterator(PackIterator, grain.DatasetIterator):
    def __init__(self, parent: Any, length: int, num_bins: int):
      grain.DatasetIterator.__init__(self, parent)
      self._start(length, num_bins)

  class Packed(grain.IterDataset):
    def __init__(self, parent: Any, length: int, num_bins: int):
      super().__init__(parent)
      self._length, self._num_bins = length, num_bins

    def __iter__(self):
      return Iterator(self._parent.__iter__(), self._length, self._num_bins)

    def __str__(self) -> str:
      return f"PackSequences(length={self._length}, num_bins={self._num_bins})"

  return Packed


def pack_sequences(ds: Any, *, length: int, num_bins: int = 8) -> Any:
  """Packs `ds`'s records of token sequences into rows of `length` tokens.

  Each record, a dict of 1-D arrays (longer ones trimmed to `length`), goes
  first-fit into one of `num_bins` open rows. Each row holds, per feature
  ``k``: ``k`` (0 pads), ``k_segment_ids`` (which record of the row each
  token is of, from 1; 0 pads, so ``k_segment_ids > 0`` is the mask) and
  ``k_positions`` (each token's position in its record), as MaxText and T5
  pack. Its state names the records in flight, so in an `elastic_source` or
  `elastic_mixture` transform a state taken at any batch resumes exactly on
  the same process count and re-splits on another: every token of every
  record once.

  Args:
    ds: A `grain.IterDataset` of records (in an elastic transform: the
      elastic stream through `map` and `filter`).
    length: Tokens per row (the context length).
    num_bins: Rows open at once: more pack fuller, and hold more in flight.

  Returns:
    A `grain.IterDataset` of packed rows (batch them with `.batch`).

  Raises:
    ValueError: If `length` or `num_bins` is not an int >= 1 (NumPy ints too); while reading,
      naming the feature, if a record is not a dict of 1-D numeric arrays
      with the first record's features and dtypes (raised on every host).

  Example:

    >>> def transform(ds):
    ...   return pack_sequences(ds.map(tokenize), length=64).batch(8)
    >>> src = elastic_mixture([web, code, books], [1, 2, 5], transform)
  """
  length = options_lib.checked_int("length", length)
  return _classes()(ds, length, options_lib.checked_int("num_bins", num_bins))
