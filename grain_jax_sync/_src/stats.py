"""What the input pipeline did: counts and times, per stage, for `JaxBatchIterator.stats()`.

Each stage is the only thread that writes its figures: the reader its
``source_s``, the exchange its ``exchange_s`` (``busy_s``), the builder its
``transfer_s`` and, per output batch, this host's real and padded rows and
the drops before it, which travel with the batch (`build.Item`) to the
consumer, who adds them up with its ``wait_s`` (`Delivered`). So the counts
are those of the batches received, never of batches still prefetched, and no
lock is taken on the hot path.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple


@dataclasses.dataclass(frozen=True, slots=True)
class Times:
  """Seconds spent by the stages of one or more (re)starts."""

  source_s: float = 0.0
  exchange_s: float = 0.0
  transfer_s: float = 0.0

  def __add__(self, other: Times) -> Times:
    return Times(
      self.source_s + other.source_s,
      self.exchange_s + other.exchange_s,
      self.transfer_s + other.transfer_s,
    )


class Delivered(NamedTuple):
  """What the consumer received, made anew per batch (`session.Mark`): the keys of
  `JaxBatchIterator.stats()` (docs/api.md) but the stage times."""

  batches: int = 0
  real_rows: int = 0
  padded_rows: int = 0
  dummy_batches: int = 0
  dropped_batches: int = 0
  wait_s: float = 0.0

  def added(self, real: int, rows: int, dropped: int, wait_s: float) -> Delivered:
    """These counts and one more batch: `real` of its `rows` local rows were real."""
    return Delivered(
      self.batches + 1,
      self.real_rows + real,
      self.padded_rows + rows - real,
      self.dummy_batches + (real == 0),
      self.dropped_batches + dropped,
      self.wait_s + wait_s,
    )

  def ended(self, wait_s: float, dropped: int) -> Delivered:
    """These counts after a `next()` that ended the stream (drops after the last batch)."""
    return self._replace(
      dropped_batches=self.dropped_batches + dropped, wait_s=self.wait_s + wait_s
    )


# The keys of `JaxBatchIterator.stats()`, in the order `demo` shows them.
FIELDS = (*Delivered._fields, *(f.name for f in dataclasses.fields(Times)))


def snapshot(delivered: Delivered, times: Times) -> dict[str, Any]:
  """The mapping `JaxBatchIterator.stats()` returns (keys in `FIELDS`)."""
  out: dict[str, Any] = delivered._asdict()
  out.update(source_s=times.source_s, exchange_s=times.exchange_s, transfer_s=times.transfer_s)
  return {k: out[k] for k in FIELDS}


TIMES = FIELDS[5:]  # The times of `stats()`, posted in chunks for the cross-host view.


def with_padding_fraction(row: dict[str, Any]) -> dict[str, Any]:
  """`row` plus ``padding_fraction``: padded rows over all rows received (0.0 if none)."""
  rows = row["real_rows"] + row["padded_rows"]
  return {**row, "padding_fraction": row["padded_rows"] / rows if rows else 0.0}


class Pace:
  """The consumer's pace: positions it took in the last `window_s` seconds.

  The first `fill` positions (the burst that fills the prefetch queue) are
  not counted. Until a window has passed since the first one counted, the
  count is the rate of the later half of the positions counted (their
  intervals until now: never more than a steady consumer takes) over the
  whole window, at most twice the positions counted (a refill's burst tells
  little). So a horizon that starts at one position grows about threefold a
  round of decisions, where the plain count would double.
  """

  def __init__(self, window_s: float, fill: int):
    self._window_s = window_s
    self._fill = fill
    self._times: collections.deque[float] = collections.deque()
    self._first: float | None = None  # When the first position counted was done.

  def done(self, now: float) -> None:
    """One more position handed on (or dropped) at `now`."""
    if self._fill > 0:
      self._fill -= 1
      return
    if self._first is None:
      self._first = now
    self._times.append(now)
    self.count(now)

  def count(self, now: float) -> int:
    # The window is (now - window_s, now]: a consumer that takes one every half window takes 2
    # per window, not 3 when one position lands exactly on its edge (virtual time does that,
    # its sums rounded either way: a nanosecond past the edge is on it).
    times, since = self._times, now - self._window_s + 1e-9
    while times and times[0] <= since:
      times.popleft()
    n = len(times)
    if self._first is None or self._first <= since or now <= self._first:
      return n
    middle = n // 2
    if now <= times[middle]:  # A burst: no interval to measure.
      return n
    rate = (n - 1 - middle) * self._window_s / (now - times[middle])
    return max(n, min(2 * n, int(rate)))
