"""`elastic_mixture`: a weighted mixture of sources, read as one elastic source (`MixedRecords`).

Row ``n`` of source ``k`` is in its epoch ``n // len(k)``, in the order of a seeded bijection.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src.sources.elastic import split
from grain_jax_sync._src.sources.elastic.source import ElasticSource, elastic_source, sized

_SCALE = 100  # Grain's mix scales the least weight to this integer proportion.


Range = split.Range


@dataclasses.dataclass(frozen=True)
class Mixture:
  """The mixture's arithmetic: integer proportions (as Grain's) and each source's size.

  Runs of weights: run 0 selects global row ``g`` by Grain's `mix` of its
  proportions at ``g``. A resume with new weights starts a run that keeps
  the rows the old job consumed (`kept`, global row ranges) and re-chooses
  every other row: row ``g`` is its rank among the rows not kept, selected by
  the new proportions, and a source's ``m``-th selection takes its ``m``-th
  row that no kept row holds. So no source row is skipped or taken twice.
  """

  proportions: tuple[int, ...]
  sizes: tuple[int, ...]
  shuffle: bool
  # (kept global row ranges, proportions) of each run, when a resume changed the weights.
  history: tuple[tuple[tuple[Range, ...], tuple[int, ...]], ...] = ()

  @property
  def epoch_length(self) -> int:
    """Global rows per epoch of the mixture: as many as the sources hold together."""
    return sum(self.sizes)

  @property
  def key(self) -> list[Any]:
    """What a state must match: the proportions, the sizes and the sources' shuffling."""
    return [list(self.proportions), list(self.sizes), self.shuffle]

  @functools.cached_property
  def _runs(self) -> list[_Run]:
    """Each run with the source rows it may take (`_Run.free`), from the runs before it."""
    out: list[_Run] = []
    for kept, p in self.history or (((), self.proportions),):  # Run 0 keeps none.
      used: list[list[Range]] = [[] for _ in self.sizes]
      for a, b in kept:
        for k, rows in enumerate(_source_rows(out, a, b)):
          used[k] += rows
      out.append(_Run(kept, p, [_complement(u) for u in used]))
    return out

  def counts(self, g: int) -> list[int]:
    """Rows of each source among global rows ``0 .. g - 1``."""
    return [split.total(rows) for rows in _source_rows(self._runs, 0, int(g))]

  def switched(self, kept: Sequence[Range], proportions: tuple[int, ...]) -> Mixture:
    """This mixture with `proportions` for every global row but those in `kept` (sorted ranges)."""
    runs = (*(self.history or (((), self.proportions),)), (tuple(kept), proportions))
    return dataclasses.replace(self, proportions=proportions, history=runs)

  def restored(self, history: Sequence[tuple[Sequence[Range], Sequence[int]]] | None) -> Mixture:
    """This mixture with a state's runs of weights (`state.runs_from_json`; None: none)."""
    if history is None:
      return dataclasses.replace(self, history=())
    runs = tuple((tuple(kept), tuple(p)) for kept, p in history)
    if len(runs) < 2 or runs[0][0] or runs[-1][1] != self.proportions:
      raise ValueError(
        f"`state['source']['mixture_runs']` {history!r:.100} does not end in this mixture's weights"
      )
    return dataclasses.replace(self, history=runs)

  def consumed(self, shares: split.EpochShares, position: int, holes: Sequence[int]) -> list[int]:
    """Rows of each source a process consumed: stream ``0 .. position - 1`` but `holes`."""
    out = np.zeros(len(self.sizes), np.int64)
    last, cursor = shares.cursor(position)
    for epoch in range(shares.first_epoch, last + 1):
      share, _ = shares.entry(epoch)
      base = epoch * self.epoch_length
      for start, stop in split.take(share, 0, cursor if epoch == last else split.total(share)):
        out += np.subtract(self.counts(base + stop), self.counts(base + start))
    rows = [epoch * self.epoch_length + pos for epoch, pos in map(shares.locate, holes)]
    np.subtract.at(out, self.select(rows)[0], 1)
    return [int(n) for n in out]

  def stats(self, rows: Sequence[int]) -> list[dict[str, float]]:
    """Per source: ``rows`` read, their ``share`` of all rows, and the ``weight``."""
    total = max(sum(rows), 1)
    weights = [p / sum(self.proportions) for p in self.proportions]
    return [
      {"rows": int(n), "share": n / total, "weight": w} for n, w in zip(rows, weights, strict=True)
    ]

  def select(self, rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source, its row) of each global row in `rows`."""
    g = np.asarray(rows, dtype=np.int64).reshape(-1)
    owner = np.zeros(len(g), np.int64)
    for j, run in enumerate(self._runs[1:], start=1):
      owner[~_contains(run.kept, g)] = j
    source, row = np.zeros(len(g), np.int64), np.zeros(len(g), np.int64)
    for j, run in enumerate(self._runs):
      mine = owner == j
      if mine.any():
        source[mine], row[mine] = run.select(g[mine] - _below(run.kept, g[mine]))
    return source, row


@dataclasses.dataclass(frozen=True)
class _Run:
  """A run of weights: its kept rows, its proportions, and per source the rows it may take
  (finite ranges, then every row from the tail on)."""

  kept: tuple[Range, ...]
  p: tuple[int, ...]
  free: list[tuple[tuple[Range, ...], int]]

  def select(self, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, its row) of each rank among the rows this run selects."""
    top = sum(self.p)
    big = int(rank.max(initial=0)) + 1 >= 2**62 // top  # Python ints past int64.
    r: Any = rank.astype(object) if big else rank
    before = np.stack(_counts(self.p, r))
    source = np.argmax(np.stack(_counts(self.p, r + 1)) - before, axis=0).astype(np.int64)
    m = before[source, np.arange(len(r))].astype(np.int64)
    row = np.zeros(len(m), np.int64)
    for k, (ranges, tail) in enumerate(self.free):
      mine = source == k
      row[mine] = _nth(ranges, tail, m[mine])
    return source, row


def _below(ranges: Sequence[Range], g: np.ndarray) -> np.ndarray:
  """How many rows of `ranges` (sorted) are below each `g`."""
  if not ranges:
    return np.zeros(len(g), np.int64)
  starts, stops = (np.asarray(x, np.int64) for x in zip(*ranges, strict=True))
  before = np.concatenate([[0], np.cumsum(stops - starts)])
  i = np.searchsorted(starts, g, side="right") - 1
  inside = np.where(i >= 0, np.minimum(g - starts[i], (stops - starts)[i]), 0)
  return np.where(i >= 0, before[np.maximum(i, 0)] + inside, 0)


def _contains(ranges: Sequence[Range], g: np.ndarray) -> np.ndarray:
  """Whether `ranges` (sorted) hold each `g`."""
  return _below(ranges, g + 1) > _below(ranges, g)


def _nth(ranges: Sequence[Range], tail: int, m: np.ndarray) -> np.ndarray:
  """The `m`-th row of `ranges` then of ``tail, tail + 1, ..``."""
  if not ranges:
    return tail + m
  starts, stops = (np.asarray(x, np.int64) for x in zip(*ranges, strict=True))
  before = np.cumsum(stops - starts)
  i = np.searchsorted(before, m, side="right")
  first = np.concatenate([[0], before])[i]
  at = np.concatenate([starts, [tail]])[i]
  return at + m - first


def _pieces(runs: Sequence[_Run], a: int, b: int) -> list[tuple[_Run, int, int]]:
  """Global rows ``a .. b - 1`` as (owning run, first rank, past the last) of runs of one owner."""
  cuts = sorted({a, b, *(x for run in runs for r in run.kept for x in r if a < x < b)})
  out = []
  for x, y in itertools.pairwise(cuts):
    g = np.asarray([x], np.int64)
    j = max(i for i, run in enumerate(runs) if i == 0 or not _contains(run.kept, g)[0])
    r = x - int(_below(runs[j].kept, g)[0])
    out.append((runs[j], r, r + y - x))
  return out


def _source_rows(runs: Sequence[_Run], a: int, b: int) -> list[list[Range]]:
  """Per source, the rows that global rows ``a .. b - 1`` take (as ranges)."""
  out: list[list[Range]] = [[] for _ in runs[0].free]
  for run, r0, r1 in _pieces(runs, a, b):
    for k, (m0, m1) in enumerate(zip(_counts(run.p, r0), _counts(run.p, r1), strict=True)):
      ranges, tail = run.free[k]
      lo, hi = int(m0), int(m1)
      finite = split.total(ranges)
      out[k] += split.take(ranges, lo, min(hi, finite))
      if hi > finite:
        out[k].append((tail + max(lo - finite, 0), tail + hi - finite))
  return out


def _complement(used: list[Range]) -> tuple[tuple[Range, ...], int]:
  """(finite ranges, tail) of the rows from 0 on that `used` does not hold."""
  out, at = [], 0
  for a, b in sorted(used):
    if a > at:
      out.append((at, a))
    at = max(at, b)
  return tuple(out), at


def _counts(proportions: Sequence[int], g: Any) -> list[Any]:
  """Rows of each source among rows ``0 .. g - 1`` of Grain's `mix` with `proportions`."""
  out, left, k = [], sum(proportions), g
  for p in proportions:
    rest = k * (left - p) // left
    out.append(k - rest)
    left, k = left - p, rest
  return out


@functools.lru_cache(maxsize=256)
def _keys(seed: int, source: int, epoch: int) -> np.ndarray:
  return np.random.SeedSequence([seed, source, epoch]).generate_state(4, np.uint64)


def _shuffled(i: np.ndarray, n: np.ndarray, keys: np.ndarray) -> np.ndarray:
  """Each ``i[m]`` through a bijection of ``0 .. n[m] - 1`` keyed by ``keys[m]`` (4 keys):
  a Feistel network over the bits of ``n - 1``, cycle-walked until below ``n``."""
  bits = np.maximum(2, np.ceil(np.log2(np.maximum(n, 2)))).astype(np.uint64)
  out, n = i.astype(np.uint64), n.astype(np.uint64)
  todo = np.ones(len(i), bool)
  while todo.any():
    x, key, left = out[todo], keys[todo], bits[todo] // np.uint64(2)
    right = bits[todo] - left
    for r in range(keys.shape[1]):
      low = x & ((np.uint64(1) << right) - np.uint64(1))
      mixed = (low ^ key[:, r]) * np.uint64(0x9E3779B97F4A7C15)  # Wraps: a hash.
      x = (low << left) | ((x >> right) ^ (mixed >> (np.uint64(64) - left)))
      left, right = right, left
    out[todo] = x
    todo = out >= n
  return out.astype(np.int64)


_BLOCK = 4096  # Global rows whose source and row are found at once (16 bytes each).


class MixedRecords:
  """The mixture's endless global rows; each `_BLOCK` rows' sources are found at once."""

  def __init__(self, records: Sequence[Any], mixture: Mixture, seed: int):
    self._records, self._mixture, self._seed = list(records), mixture, seed
    self._block: tuple[int, np.ndarray, np.ndarray] = (0, np.zeros(0, int), np.zeros(0, int))

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, g: int) -> Any:
    return self._getitems([g])[0]

  def _getitems(self, rows: Sequence[int]) -> list[Any]:
    g = np.asarray(rows, np.int64)
    start, sources, at = self._block
    if len(g) and not (start <= np.min(g) and np.max(g) < start + len(sources)):
      first = int(np.min(g))
      if np.max(g) - first >= _BLOCK:  # Too far apart for a block (an epoch's end, a resize).
        start, (sources, at), g = 0, self._find(g), np.arange(len(g))
      else:
        self._block = start, sources, at = (first, *self._find(np.arange(first, first + _BLOCK)))
    sources, at = sources[g - start].tolist(), at[g - start].tolist()
    return [self._records[k][j] for k, j in zip(sources, at, strict=True)]

  def remixed(self, mixture: Mixture) -> MixedRecords:
    """The same sources, mixed by `mixture`."""
    return MixedRecords(self._records, mixture, self._seed)

  def _find(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, the record in it) of each global row in `g`."""
    sources, keys = self._mixture.select(g.tolist())
    sizes = np.asarray(self._mixture.sizes, np.int64)[sources]
    epochs, at = np.divmod(keys.astype(np.int64), sizes)
    if self._mixture.shuffle:
      count = len(self._mixture.sizes)
      pairs, which = np.unique(epochs * count + sources, return_inverse=True)
      table = np.stack([_keys(self._seed, int(p % count), int(p // count)) for p in pairs])
      at = _shuffled(at, sizes, table[which])
    return sources, at


def _records(source: Any, i: int) -> Any:
  """A source's random-access records (an `elastic_source` gives its own)."""
  if isinstance(source, ElasticSource):
    if source.transform is not None or source.mixture is not None:
      raise ValueError(
        f"`sources[{i}]` is an elastic source with a transform or a mixture; give its"
        " records: the mixture's `transform` reads every source"
      )
    source = source.records
  if not sized(f"sources[{i}]", source):
    raise ValueError(f"`sources[{i}]` is empty")
  return source


def _proportions(weights: Any, count: int) -> tuple[int, ...]:
  """Grain's integer proportions of `weights`: `count` finite numbers > 0 (NumPy numbers too)."""
  if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, (Sequence, np.ndarray)):
    raise TypeError(f"`weights` must be a list of {count} numbers, got {weights!r:.100}")
  given = [options_lib.finite_number(w) for w in weights]
  bad = [w for w, f in zip(weights, given) if f is None or f <= 0]
  if len(given) != count or bad:
    why = f" ({bad[0]!r:.40} is not)" if bad else f" ({len(given)} given)"
    raise ValueError(
      f"`weights` must be {count} finite numbers > 0, one per source, got {weights!r:.100}{why}"
    )
  numbers = [f for f in given if f is not None]
  ratios = [f * _SCALE / min(numbers) for f in numbers]
  if not all(map(math.isfinite, ratios)):
    raise ValueError(f"`weights` {weights!r:.100} span too wide a range: their ratio overflows")
  return tuple(int(r) for r in ratios)


def elastic_mixture(
  sources: Sequence[Any],
  weights: Sequence[float],
  transform: Callable[[Any], Any] | None = None,
  *,
  shuffle: bool = True,
  seed: int = 0,
  num_epochs: int | None = None,
) -> ElasticSource:
  """A weighted mixture of sources, split over processes and resumable on any count.

  Global row ``g`` comes from Grain's `MapDataset.mix` selection for ``g`` and
  the weights, on any process count; every prefix of rows is within one row of
  the weights. Each source repeats, reshuffled (by `seed`, the source and its
  epoch) each epoch, so no row appears twice in one of its epochs. The rows are
  read as an `elastic_source` through ``transform``, one pipeline for the whole
  mixture: a state resumes exactly on the same count and, as the list of every
  old process's state, on any other. `stats()` gives each source's rows against
  its weight. New weights at a resume (from every old process's state) apply
  from the first global row past every old cursor.

  Args:
    sources: Each a `grain.MapDataset` or a random-access sequence of records
      (a Hugging Face `Dataset`, a TFDS data source, a list), or an
      `elastic_source` without a transform (its records).
    weights: One number > 0 per source (normalised).
    transform: Maps this process's `grain.IterDataset` of rows to batches, as
      for `elastic_source` (`pack_sequences` included).
    shuffle: Whether each source is reshuffled each of its epochs.
    seed: The shuffles' seed.
    num_epochs: Epochs of the mixture to read, each as many rows as the
      sources hold together (None: forever).

  Returns:
    A source for `iter_jax_batches`.

  Raises:
    ValueError: If a source is empty or not random-access, or a weight is not
      a finite number > 0 (NumPy numbers are numbers; bools are not).
    TypeError: If `weights` is not a list (or 1-D array) of numbers.

  Example:

    >>> src = elastic_mixture([list(range(10)), list(range(100))], [1, 3], lambda ds: ds.batch(4))
    >>> it = iter_jax_batches(src, batch_size=4, paddings=0, mask_key="mask")
  """
  if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
    raise ValueError(f"`sources` must be a non-empty list of sources, got {sources!r:.100}")
  records = [_records(s, i) for i, s in enumerate(sources)]
  proportions = _proportions(weights, len(records))
  seed = options_lib.checked_int("seed", seed, minimum=0)
  shuffle = options_lib.checked_bool("shuffle", shuffle)
  mixture = Mixture(proportions, tuple(len(r) for r in records), shuffle)
  mixed = MixedRecords(records, mixture, seed)
  checked = elastic_source(mixed, transform, shuffle=False, seed=seed, num_epochs=num_epochs)
  return dataclasses.replace(checked, mixture=mixture)
