"""`elastic_mixture`: a weighted mixture of sources, read as one elastic source (`MixedRecords`).

Row ``n`` of source ``k`` is in its epoch ``n // len(k)``, in the order of a seeded bijection.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src.sources.elastic import split
from grain_jax_sync._src.sources.elastic.source import ElasticSource, elastic_source

_SCALE = 100  # Grain's mix scales the least weight to this integer proportion.


@dataclasses.dataclass(frozen=True)
class Mixture:
  """The mixture's arithmetic: integer proportions (as Grain's) and each source's size."""

  proportions: tuple[int, ...]
  sizes: tuple[int, ...]
  shuffle: bool
  # (first global row, proportions) of each run of weights, when a resume changed them.
  history: tuple[tuple[int, tuple[int, ...]], ...] = ()

  @property
  def epoch_length(self) -> int:
    """Global rows per epoch of the mixture: as many as the sources hold together."""
    return sum(self.sizes)

  @property
  def key(self) -> list[Any]:
    """What a state must match: the proportions, the sizes and the sources' shuffling."""
    return [list(self.proportions), list(self.sizes), self.shuffle]

  @functools.cached_property
  def _runs(self) -> list[tuple[int, tuple[int, ...], list[int]]]:
    """(first global row, proportions, each source's rows before it) of each run of weights."""
    out: list[tuple[int, tuple[int, ...], list[int]]] = []
    for start, p in self.history or ((0, self.proportions),):
      base = [0] * len(self.sizes)
      if out:
        was, q, before = out[-1]
        base = [b + n for b, n in zip(before, _counts(q, start - was), strict=True)]
      out.append((start, p, base))
    return out

  def counts(self, g: Any) -> list[Any]:
    """Rows of each source among global rows ``0 .. g - 1`` (Grain's `mix` selection, per run)."""
    out = _counts(self._runs[0][1], g)
    for start, p, base in self._runs[1:]:
      later = np.asarray(g) >= start
      out = [np.where(later, b + n, o) for o, b, n in zip(out, base, _counts(p, g - start))]
    return out

  def switched(self, g: int, proportions: tuple[int, ...]) -> Mixture:
    """This mixture with `proportions` from global row `g` on (at least its last run's start)."""
    g = max(g, self._runs[-1][0])
    runs = (*((s, p) for s, p, _ in self._runs if s < g), (g, proportions))
    return dataclasses.replace(self, proportions=proportions, history=runs if g else ())

  def restored(self, runs: Any) -> Mixture:
    """This mixture with a state's ``mixture_runs`` (None: its weights from row 0)."""
    if runs is None:
      return dataclasses.replace(self, history=())
    try:
      history = tuple((int(g), tuple(int(x) for x in p)) for g, p in runs)
    except (TypeError, ValueError) as e:
      raise ValueError(
        f"`state['source']['mixture_runs']` is not [[row, proportions], ..] ({e})"
      ) from e
    starts = [g for g, _ in history]
    if (
      len(history) < 2
      or starts[0]
      or starts != sorted(set(starts))
      or history[-1][1] != self.proportions
    ):
      raise ValueError(
        f"`state['source']['mixture_runs']` {runs!r:.100} does not end in this mixture's weights"
      )
    return dataclasses.replace(self, history=history)

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
    """(source, its row) of each global row in `rows`, as Grain's `mix` selects them."""
    top = max(sum(p) for _, p, _ in self._runs)
    big = max(rows, default=0) >= 2**62 // top  # Python ints past int64.
    g: Any = np.asarray(rows, dtype=object if big else np.int64)
    before = np.stack(self.counts(g))
    source = np.argmax(np.stack(self.counts(g + 1)) - before, axis=0)
    return source, before[source, np.arange(len(g))]


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
      if np.max(g) - first >= _BLOCK:
        start, (sources, at) = first, self._find(g)
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
  try:
    size = len(source)
  except TypeError as e:
    raise ValueError(
      f"`sources[{i}]` must be a grain.MapDataset or a random-access sequence, got"
      f" {type(source).__name__} (no len())"
    ) from e
  if not size:
    raise ValueError(f"`sources[{i}]` is empty")
  return source


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
    ValueError: If a source is empty or not random-access, or a weight is not > 0.

  Example:

    >>> src = elastic_mixture([list(range(10)), list(range(100))], [1, 3], lambda ds: ds.batch(4))
    >>> it = iter_jax_batches(src, batch_size=4, paddings=0, mask_key="mask")
  """
  if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
    raise ValueError(f"`sources` must be a non-empty list of sources, got {sources!r:.100}")
  records = [_records(s, i) for i, s in enumerate(sources)]
  weights, count = list(weights), len(records)
  if len(weights) != count or not all(
    isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights
  ):
    raise ValueError(f"`weights` must be {count} numbers > 0, one per source, got {weights!r:.100}")
  proportions = tuple(int(w * _SCALE / min(weights)) for w in weights)
  seed = options_lib.checked_int("seed", seed, minimum=0)
  mixture = Mixture(proportions, tuple(len(r) for r in records), bool(shuffle))
  mixed = MixedRecords(records, mixture, seed)
  checked = elastic_source(mixed, transform, shuffle=False, seed=seed, num_epochs=num_epochs)
  return dataclasses.replace(checked, mixture=mixture)
