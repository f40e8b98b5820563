"""The elastic split: which records of an epoch each process reads, and re-splitting them.

An epoch's positions ``0 .. num_records - 1`` each name a record (the
identity, or a seeded permutation when shuffling). A split cuts the positions
not yet read, ranges ``[start, stop)``, into `count` contiguous shares in
process order, the first ``num_records % count`` one longer. Each process
keeps a cursor over its share: a `Cursor`. A resize appends ``(old_count,
cursors)`` to the epoch's split history, which replays to the current split,
so a state never lists records. Pure Python and NumPy.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Mapping, Sequence

import numpy as np

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Holes:
  """A consumed prefix ``stop`` of a share but for `holes`: positions read, not yet delivered."""

  stop: int
  holes: tuple[int, ...]
  offsets: tuple[int, ...] = ()  # Per hole, its tokens already delivered (empty: none).


# A consumed cursor over a share: how many of its positions are consumed; or strided, a tuple
# ``(t_0, .., t_{W-1})``: position ``i`` is consumed when ``i < t_{i % W}`` (`W` `mp_prefetch`
# workers, each reading every `W`-th); or `Holes`, a packer's records in flight.
Cursor = int | tuple[int, ...] | Holes
# (old process count, each old process's cursor over its share of that split).
Resize = tuple[int, tuple[Cursor, ...]]


def total(ranges: Sequence[Range]) -> int:
  """The number of positions in `ranges`."""
  return sum(stop - start for start, stop in ranges)


def _extend(out: list[Range], ranges: Sequence[Range]) -> None:
  """Appends `ranges` to `out`, an adjacent one joined to the last, an empty one dropped."""
  for start, stop in ranges:
    if start >= stop:
      continue
    if out and out[-1][1] == start:
      out[-1] = (out[-1][0], stop)
    else:
      out.append((start, stop))


def take(ranges: Sequence[Range], begin: int, end: int) -> list[Range]:
  """The positions ``begin .. end - 1`` of the concatenation of `ranges`."""
  out: list[Range] = []
  offset = 0
  for start, stop in ranges:
    n = stop - start
    lo, hi = max(begin - offset, 0), min(end - offset, n)
    _extend(out, [(start + lo, start + hi)])
    offset += n
    if offset >= end:
      break
  return out


def even_split(ranges: Sequence[Range], count: int) -> list[list[Range]]:
  """`ranges` cut into `count` contiguous shares, sizes differing by at most one."""
  if count < 1:
    raise ValueError(f"`count` must be >= 1, got {count}")
  n = total(ranges)
  size, extra = divmod(n, count)
  shares, begin = [], 0
  for i in range(count):
    end = begin + size + (1 if i < extra else 0)
    shares.append(take(ranges, begin, end))
    begin = end
  return shares


def _unconsumed(share: Sequence[Range], cursor: Cursor) -> list[Range]:
  """The share positions a cursor leaves (strided: the positions ``i >= t_{i % W}``)."""
  n = total(share)
  if isinstance(cursor, int):
    return take(share, cursor, n)
  out: list[Range] = []
  if isinstance(cursor, Holes):
    for i in (*cursor.holes, cursor.stop):
      _extend(out, take(share, i, i + 1 if i < cursor.stop else n))
    return out
  lo, hi, width = min(cursor), max(cursor), len(cursor)
  for i in range(lo, hi):  # Between the thresholds: position by position.
    if i >= cursor[i % width]:
      _extend(out, take(share, i, i + 1))
  _extend(out, take(share, hi, n))
  return out


def remaining(shares: Sequence[Sequence[Range]], cursors: Sequence[Cursor]) -> list[Range]:
  """What `shares` leave once each has consumed its cursor, in process order."""
  out: list[Range] = []
  for i, (share, cursor) in enumerate(zip(shares, cursors, strict=True)):
    n = total(share)
    values: tuple[int, ...]
    if isinstance(cursor, Holes):
      values = (cursor.stop,)
      if [*cursor.holes, cursor.stop] != sorted({*cursor.holes, cursor.stop}):
        raise ValueError(f"process {i}'s holes {cursor.holes[:8]} are not sorted share positions")
    else:
      values = (cursor,) if isinstance(cursor, int) else tuple(cursor)
    if not values or not all(0 <= c <= n for c in values):
      raise ValueError(f"process {i}'s cursor {cursor} is outside its share of {n} records")
    _extend(out, _unconsumed(share, cursor))
  return out


def shares(num_records: int, history: Sequence[Resize], count: int) -> list[list[Range]]:
  """Each process's share of an epoch after `history`, split `count` ways (cached: read only)."""
  key = tuple((int(n), tuple(c)) for n, c in history)  # Cursors: ints or tuples of ints.
  return _shares(int(num_records), key, int(count))


@functools.lru_cache(maxsize=64)
def _shares(num_records: int, history: tuple[Resize, ...], count: int) -> list[list[Range]]:
  left: list[Range] = [(0, num_records)] if num_records else []
  for old_count, cursors in history:
    if len(cursors) != old_count:
      raise ValueError(f"a resize from {old_count} processes lists {len(cursors)} cursors")
    left = remaining(even_split(left, old_count), cursors)
  return even_split(left, count)


def partial(num_records: int, history: Sequence[Resize]) -> dict[int, int]:
  """The epoch positions whose records a resize left partly delivered: their tokens delivered
  (a later resize's count, from the record's start, replaces an earlier one's)."""
  out: dict[int, int] = {}
  for r, (old_count, cursors) in enumerate(history):
    for share, cursor in zip(shares(num_records, history[:r], old_count), cursors, strict=True):
      if isinstance(cursor, Holes):
        offsets = cursor.offsets or (0,) * len(cursor.holes)
        for i, k in zip(cursor.holes, offsets, strict=True):
          if k:
            out[take(share, i, i + 1)[0][0]] = k
  return out


@functools.lru_cache(maxsize=4)
def epoch_order(num_records: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray | None:
  """The record at each position of `epoch`: a permutation seeded by ``[seed, epoch]``, or None
  (the identity) without `shuffle`."""
  return np.random.default_rng([seed, epoch]).permutation(num_records) if shuffle else None


FOREVER = 2**62  # The stream length of a source that repeats forever (`num_epochs=None`).


@dataclasses.dataclass(frozen=True)
class EpochShares:
  """Process `index` of `count`'s stream: its shares of epochs ``first_epoch .. num_epochs - 1``.

  `splits` holds each epoch's resize history (epochs not listed: no resize).
  With ``num_epochs=None`` the epochs go on forever: those a resize touched
  are listed (`epochs`), and every later one is this process's share of a
  fresh split.
  """

  num_records: int
  num_epochs: int | None
  first_epoch: int
  splits: tuple[tuple[int, tuple[Resize, ...]], ...]
  count: int
  index: int

  @functools.cached_property
  def _fresh(self) -> list[Range]:
    return shares(self.num_records, (), self.count)[self.index]

  @functools.cached_property
  def _end_epoch(self) -> int:
    """The first epoch past `epochs` (the periodic tail's first, when forever)."""
    if self.num_epochs is not None:
      return self.num_epochs
    return max([self.first_epoch, *(e + 1 for e, _ in self.splits)])

  @functools.cached_property
  def _period(self) -> int:
    """Positions per epoch of the periodic tail (0: none, the stream ends)."""
    return 0 if self.num_epochs is not None else total(self._fresh)

  @functools.cached_property
  def epochs(self) -> list[tuple[int, list[Range], int]]:
    """(epoch, this process's share, stream index of its first position) per listed epoch."""
    history = dict(self.splits)
    out, offset = [], 0
    for epoch in range(self.first_epoch, self._end_epoch):
      if epoch in history:
        share = shares(self.num_records, history[epoch], self.count)[self.index]
      else:
        share = self._fresh
      out.append((epoch, share, offset))
      offset += total(share)
    return out

  @functools.cached_property
  def _listed(self) -> int:
    """Positions in the listed epochs."""
    return sum(total(share) for _, share, _ in self.epochs)

  @functools.cached_property
  def length(self) -> int:
    """Positions in the whole stream (`FOREVER` past the listed epochs when forever)."""
    return self._listed + (FOREVER if self._period else 0)

  @functools.cached_property
  def _flat(self) -> tuple[list[int], list[tuple[int, int]]]:
    """Each range's first stream index, and its (epoch, first position)."""
    offsets, heads = [], []
    for epoch, share, offset in self.epochs:
      for start, stop in share:
        offsets.append(offset)
        heads.append((epoch, start))
        offset += stop - start
    return offsets, heads

  def locate(self, j: int) -> tuple[int, int]:
    """(epoch, position in that epoch's order) of stream index `j`."""
    if not 0 <= j < self.length:
      raise IndexError(f"stream index {j} is outside this process's {self.length} positions")
    if j >= self._listed:  # The periodic tail: a fresh share is one range.
      k, r = divmod(j - self._listed, self._period)
      return self._end_epoch + k, self._fresh[0][0] + r
    offsets, heads = self._flat
    k = bisect.bisect_right(offsets, j) - 1
    epoch, start = heads[k]
    return epoch, start + j - offsets[k]

  def cursor(self, j: int) -> tuple[int, int]:
    """(epoch, consumed cursor in that epoch's share) once `j` stream positions are consumed."""
    if j >= self._listed and self._period:
      k, r = divmod(j - self._listed, self._period)
      return self._end_epoch + k, r
    if not self.epochs:
      return self._end_epoch, 0
    for epoch, share, offset in self.epochs:
      if j < offset + total(share):
        return epoch, j - offset
    epoch, share, _ = self.epochs[-1]
    return epoch, total(share)

  @functools.cached_property
  def _partial(self) -> dict[int, dict[int, int]]:
    history = dict(self.splits)
    return {e: partial(self.num_records, history[e]) for e, _, _ in self.epochs if e in history}

  def skip(self, j: int) -> int:
    """Tokens of stream index `j`'s record a resize left delivered (0: none)."""
    if not self._partial:
      return 0
    epoch, pos = self.locate(j)
    return self._partial.get(epoch, {}).get(pos, 0)

  def entry(self, epoch: int) -> tuple[list[Range], int]:
    """(this process's share of `epoch`, its first stream index)."""
    for e, share, offset in self.epochs:
      if e == epoch:
        return share, offset
    if self._period and epoch >= self._end_epoch:
      return self._fresh, self._listed + (epoch - self._end_epoch) * self._period
    raise ValueError(f"epoch {epoch} is not in this stream")

  def epoch_cursor(
    self,
    epoch: int,
    thresholds: Sequence[int],
    holes: Sequence[int] = (),
    partial: Mapping[int, int] | None = None,
  ) -> Cursor:
    """The cursor over `epoch`'s share of stream thresholds (``j`` consumed: ``j < T[j % W]``),
    holes (one threshold only) and their tokens delivered (`partial`)."""
    share, offset = self.entry(epoch)
    n, width = total(share), len(thresholds)
    # Share position i is stream index offset + i: its threshold is T[(offset + i) % W].
    local = tuple(min(max(thresholds[(offset + r) % width] - offset, 0), n) for r in range(width))
    mine = tuple(j for j in holes if 0 <= j - offset < local[0])
    if mine:
      tokens = tuple((partial or {}).get(j, 0) for j in mine)
      return Holes(local[0], tuple(j - offset for j in mine), tokens if any(tokens) else ())
    return local[0] if len(set(local)) == 1 else local


def resume(
  olds: Sequence[EpochShares],
  thresholds: Sequence[Sequence[int]],
  holes: Sequence[Sequence[int]] | None = None,
  partial: Sequence[Mapping[int, int]] | None = None,
) -> tuple[int, tuple[tuple[int, tuple[Resize, ...]], ...]]:
  """The next job's (first epoch, splits) from every old process's shares and stream thresholds.

  Stream index ``j`` of old process ``p`` is consumed when
  ``j < thresholds[p][j % len(thresholds[p])]`` and ``j`` is not in
  ``holes[p]`` (``partial[p]``: the tokens delivered of some holes). Every
  epoch some old process had not finished gets the old job's cursors as a
  resize.
  """
  holes = holes or [()] * len(olds)
  partial = partial or [{}] * len(olds)
  # The first and last epoch some old process left partly read.
  first = min(
    old.cursor(min((*t, *h)))[0] for old, t, h in zip(olds, thresholds, holes, strict=True)
  )
  last = max(old.cursor(max(t))[0] for old, t in zip(olds, thresholds, strict=True))
  base = dict(olds[0].splits)
  splits = []
  end = last if olds[0].num_epochs is None else min(last, olds[0].num_epochs - 1)
  for epoch in range(first, end + 1):
    row = tuple(
      old.epoch_cursor(epoch, t, h, k)
      for old, t, h, k in zip(olds, thresholds, holes, partial, strict=True)
    )
    splits.append((epoch, (*base.get(epoch, ()), (len(olds), row))))
  # Later epochs no process has reached keep their histories (unread: no resize).
  splits.extend((e, h) for e, h in sorted(base.items()) if e > last)
  return first, tuple(splits)
