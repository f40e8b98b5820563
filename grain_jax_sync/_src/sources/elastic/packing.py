"""`pack_sequences`: token sequences packed into rows of a context length, resumable anywhere.

A record is read from its first token not yet delivered (0, or where a resize
left it). A row is emitted when it is full or a piece fits in no open row
(the fullest one goes); at the end the open rows go in order. The state names
the records in flight (the open rows' pieces, and a record whose full rows
are still going out): the parent's state before the first of them, where each
record read since is and from which token, and, over an elastic stream, their
stream indices and tokens delivered (the cursor's holes, `cursor.PACKED`). So
a resume on the same count rebuilds the open rows exactly, and a re-split
re-reads exactly the records in flight. Grain is imported when it is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_jax_sync._src import extras, leaves
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src.sources import grain as grain_source
from grain_jax_sync._src.sources.elastic import cursor as cursor_lib

TOKENS = "grain_jax_sync_packed_tokens"  # [packed, padded, trimmed] in a packer's state.


@dataclasses.dataclass
class _Record:
  read: int  # Its place among the records read.
  value: dict[str, np.ndarray]
  before: Any  # The parent's state before it was read.
  after: Any  # ... and after.
  trimmed: int  # Tokens trimming cut off.

  @property
  def size(self) -> int:
    return max((len(v) for v in self.value.values()), default=0)


@dataclasses.dataclass
class _Piece:
  """Tokens ``start .. stop - 1`` of a record (of each feature, where it has them)."""

  record: _Record
  start: int
  stop: int

  def tokens(self, key: str) -> np.ndarray:
    return self.record.value[key][self.start : self.stop]


def _used(row: list[_Piece]) -> dict[str, int]:
  return {k: sum(len(p.tokens(k)) for p in row) for k in row[0].record.value}


def _fits(row: list[_Piece], piece: _Piece, length: int) -> bool:
  used = _used(row)
  return all(used.get(k, 0) + len(piece.tokens(k)) <= length for k in piece.record.value)


def packed_row(row: list[_Piece], length: int, restart_positions: bool) -> dict[str, np.ndarray]:
  """One emitted row: per feature its tokens, segment ids and positions."""
  out = {}
  for k in row[0].record.value:
    tokens = np.zeros(length, row[0].record.value[k].dtype)
    segments, positions = np.zeros(length, np.int32), np.zeros(length, np.int32)
    at = 0
    for s, piece in enumerate(row, start=1):
      x = piece.tokens(k)
      tokens[at : at + len(x)] = x
      segments[at : at + len(x)] = s
      first = 0 if restart_positions else piece.start
      positions[at : at + len(x)] = np.arange(first, first + len(x))
      at += len(x)
    out.update({k: tokens, f"{k}_segment_ids": segments, f"{k}_positions": positions})
  return out


def checked_record(value: Any, dtypes: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
  """A record as 1-D arrays of tokens of the dtypes in `dtypes` (the first record's), never cast;
  a DataError names the feature, its shape or dtype, and what was expected."""
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
  if len(found.thresholds) > 1 or found.holes:
    why = "pack_sequences reads a stream whose cursor is not a prefix (mp_prefetch)"
    return None, found.why or why
  return found.thresholds[0], found.why


def _counts(x: Any) -> list[list[int]]:
  """Every packer's [packed, padded, trimmed] in a Grain state."""
  if isinstance(x, Mapping):
    return ([x[TOKENS]] if TOKENS in x else []) + _counts(list(x.values()))
  if isinstance(x, (list, tuple)):
    return [c for v in x for c in _counts(v)]
  return []


def counters(state: Any) -> dict[str, int] | None:
  """The tokens the packers in a Grain state emitted: packed, padded, trimmed (None: no packer)."""
  found = _counts(state)
  if not found:
    return None
  totals = np.sum(np.asarray(found, np.int64), axis=0)
  return {f"tokens_{k}": int(n) for k, n in zip(("packed", "padded", "trimmed"), totals)}


class PackIterator:
  """Packs its parent's records (see the module); a `grain.DatasetIterator` by `grain_class`."""

  _parent: Any  # Set by `grain.DatasetIterator.__init__`.

  def __init__(self, parent: Any, options: tuple[int, int, bool, bool]):
    super().__init__(parent)  # type: ignore[call-arg]  # Grain's base.
    self._start(options)

  def _start(self, options: tuple[int, int, bool, bool]) -> None:
    self._options = options
    self._length, self._num_bins, self._trim, _ = options
    self._rows: list[list[_Piece]] = []
    self._pending: _Piece | None = None  # A record's tokens from `start` on, not placed yet.
    self._read = 0
    self._ended = False
    self._tokens = [0, 0, 0]  # Packed, padded, trimmed, in the rows emitted.
    self._dtypes: dict[str, np.dtype] = {}  # The first record's: every record's (`checked_record`).
    self._last = self._parent.get_state()

  def _take(self) -> _Piece | None:
    """The next record from its first token not delivered (the stream's skip), or None."""
    try:
      value = next(self._parent)
    except StopIteration:
      self._ended = True
      return None
    value = checked_record(value, self._dtypes)
    self._dtypes = self._dtypes or {k: v.dtype for k, v in value.items()}
    trimmed = 0
    if self._trim:
      trimmed = sum(max(len(v) - self._length, 0) for v in value.values())
      value = {k: v[: self._length] for k, v in value.items()}
    before, self._last = self._last, self._parent.get_state()
    self._read += 1
    record = _Record(self._read - 1, value, before, self._last, trimmed)
    return _Piece(record, cursor_lib.find_skip(self._last), record.size)

  def __next__(self) -> dict[str, np.ndarray]:
    while True:
      if self._pending is None and not self._ended:
        self._pending = self._take()
      if self._pending is None:
        break
      piece, self._pending = self._pending, None
      if piece.stop - piece.start >= self._length:  # A full row of one record.
        head = _Piece(piece.record, piece.start, piece.start + self._length)
        if head.stop < piece.stop:
          self._pending = _Piece(piece.record, head.stop, piece.stop)
        return self._emit([head])
      if piece.start < piece.stop and (row := self._place(piece)) is not None:
        return self._emit(row)
    if not self._rows:
      raise StopIteration
    return self._emit(self._rows.pop(0))

  def _place(self, piece: _Piece) -> list[_Piece] | None:
    """Puts `piece` first-fit in an open row; returns a row to emit (full, or the fullest)."""
    row = next((r for r in self._rows if _fits(r, piece, self._length)), None)
    if row is not None:
      row.append(piece)
      if max(_used(row).values()) == self._length:  # Full.
        self._rows.remove(row)
        return row
      return None
    if len(self._rows) < self._num_bins:
      self._rows.append([piece])
      return None
    fullest = max(self._rows, key=lambda r: max(_used(r).values()))
    self._rows[self._rows.index(fullest)] = [piece]
    return fullest

  def _emit(self, row: list[_Piece]) -> dict[str, np.ndarray]:
    used = sum(_used(row).values())
    self._tokens[0] += used
    self._tokens[1] += self._length * len(row[0].record.value) - used
    self._tokens[2] += sum(p.record.trimmed for p in row if p.stop == p.record.size)
    return packed_row(row, self._length, self._options[3])

  def _held(self) -> list[_Piece]:
    """The pieces in flight, each the rest of its record, in read order."""
    pieces = [p for row in self._rows for p in row]
    if self._pending is not None:
      pieces.append(self._pending)
    return sorted(pieces, key=lambda p: p.record.read)

  def get_state(self) -> dict[str, Any]:
    held = self._held()
    first = held[0].record.read if held else self._read
    state: dict[str, Any] = {
      "parent": held[0].record.before if held else self._last,
      "rows": [[[p.record.read - first, p.start] for p in row] for row in self._rows],
      "read": self._read - first,
      TOKENS: list(self._tokens),
    }
    if self._pending is not None:
      state["pending"] = [self._pending.record.read - first, self._pending.start]
    stop, why = _stream_index(self._last)
    if stop is None and why is None:
      return state  # Not over an elastic stream.
    holes = [(_stream_index(p.record.after)[0], p.start) for p in held]
    tag: dict[str, Any] = {
      cursor_lib.TAG: {"next_index": stop or 0},
      "holes": [j - 1 for j, _ in holes if j],
      "partial": [[j - 1, start] for j, start in holes if j and start],
    }
    if why is not None or any(j is None for j, _ in holes):
      tag["why"] = why or "pack_sequences could not name a record's stream index"
    return {**state, cursor_lib.PACKED: tag}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["parent"])
    self._start(self._options)
    self._tokens = [int(n) for n in state.get(TOKENS, (0, 0, 0))]
    where = {}  # Read index -> (open row, first token), or (-1, ..): the pending record.
    for k, row in enumerate(state["rows"]):
      for entry in row:
        where[entry[0]] = (k, entry[1])
    if "pending" in state:
      where[state["pending"][0]] = (-1, state["pending"][1])
    self._rows = [[] for _ in state["rows"]]
    for _ in range(state["read"]):  # The records since the first in flight, read again.
      piece = self._take()
      if piece is None:
        raise ValueError("`state` names records in flight past the end of the stream")
      if piece.record.read in where:
        k, start = where[piece.record.read]
        piece.start = start
        if k < 0:
          self._pending = piece
        else:
          self._rows[k].append(piece)


class Packed:
  """`pack_sequences`'s dataset; a `grain.IterDataset` by `grain_class`."""

  _parent: Any  # Set by `grain.IterDataset.__init__`.

  def __init__(self, parent: Any, options: tuple[int, int, bool, bool]):
    super().__init__(parent)  # type: ignore[call-arg]  # Grain's base.
    self._options = options

  def __iter__(self) -> Any:
    iterator = grain_source.grain_class(PackIterator, "DatasetIterator")
    return iterator(self._parent.__iter__(), self._options)

  def __str__(self) -> str:
    length, num_bins, trim, restart = self._options
    return (
      f"PackSequences(length={length}, num_bins={num_bins}, trim={trim},"
      f" restart_positions={restart})"
    )


def pack_sequences(
  ds: Any,
  *,
  length: int,
  num_bins: int = 8,
  trim: bool = False,
  restart_positions: bool = False,
) -> Any:
  """Packs `ds`'s records of token sequences into rows of `length` tokens, dropping none.

  Each record is a dict of 1-D arrays. While at least `length` of its tokens
  remain, they fill a row of their own; the rest goes first-fit into one of
  `num_bins` open rows. So a record longer than `length` is carried over
  several rows as consecutive pieces, in order, and every token is packed
  once. Each row holds, per feature ``k``: ``k`` (0 pads), ``k_segment_ids``
  (which piece of the row each token is of, from 1; 0 pads, so
  ``k_segment_ids > 0`` is the mask) and ``k_positions`` (each token's
  position in its record, going on over a record's pieces), as MaxText and T5
  pack. Its state names the records in flight and the tokens of each already
  delivered, so in an `elastic_source` or `elastic_mixture` transform a state
  taken at any batch, inside a long record too, resumes exactly on the same
  process count and re-splits on another: every token of every record once.
  `stats()` counts the tokens packed, padded and trimmed (``packing``).

  Args:
    ds: A `grain.IterDataset` of records (in an elastic transform: the
      elastic stream through `map` and `filter`).
    length: Tokens per row (the context length).
    num_bins: Rows open at once: more pack fuller, and hold more in flight.
    trim: Cut each record to its first `length` tokens instead (the tokens
      cut are counted, ``tokens_trimmed``).
    restart_positions: Each piece's positions start at 0 (for position
      embeddings of `length` entries) instead of going on over the record.

  Returns:
    A `grain.IterDataset` of packed rows (batch them with `.batch`).

  Raises:
    ValueError: If `ds` is not a Grain dataset, or `length` or `num_bins` is
      not an int >= 1 (NumPy ints too); while reading, naming the feature, if
      a record is not a dict of 1-D numeric arrays with the first record's
      features and dtypes (raised on every host).

  Example:

    >>> def transform(ds):
    ...   return pack_sequences(ds.map(tokenize), length=64).batch(8)
    >>> src = elastic_mixture([web, code, books], [1, 2, 5], transform)
  """
  length = options_lib.checked_int("length", length)
  num_bins = options_lib.checked_int("num_bins", num_bins)
  grain: Any = extras.require("grain", needed_by="grain_jax_sync.pack_sequences")
  if not isinstance(ds, (grain.IterDataset, grain.MapDataset)):
    raise ValueError(
      f"`ds` must be a grain.IterDataset or grain.MapDataset of records, got"
      f" {type(ds).__name__}; wrap a sequence of records as grain.MapDataset.source(records)"
    )
  packed = grain_source.grain_class(Packed, "IterDataset", "grain_jax_sync.pack_sequences")
  return packed(ds, (length, num_bins, bool(trim), bool(restart_positions)))
