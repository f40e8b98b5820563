"""Process 0's record of what every process reported, per batch position.

Process 0 decides position ``j`` once it knows, for every process, the rows
of its batch ``j`` or that its stream ended before ``j``: `Ledger` keeps that
and turns each known run of positions into reports for `plan.decide`. No I/O.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from grain_jax_sync._src import messages

# A report's keys when it carries rows only (`Ledger.add_json`'s quick path).
_ROWS_ONLY = frozenset(("p", "r", "x", "d"))


class Ledger:
  """Per-process knowledge of rows per position, stream ends, structure; with `digests` and `sizes`,
  each position's row digest (processes share rows) and sizes of the varying dims (`pad_shapes`)."""

  def __init__(self, process_count: int, *, digests: bool = False, sizes: bool = False):
    self._process_count = process_count
    self._rows: list[collections.deque[int]] = [collections.deque() for _ in range(process_count)]
    # Parallel to `_rows` where kept (an entry None: a process sent none).
    self._digests: list[collections.deque[str | None]] | None = (
      [collections.deque() for _ in range(process_count)] if digests else None
    )
    self._sizes: list[collections.deque[tuple[int, ...] | None]] | None = (
      [collections.deque() for _ in range(process_count)] if sizes else None
    )
    self._base = [0] * process_count  # Position of _rows[p][0].
    self._end: list[messages.Report | None] = [None] * process_count
    self._signature: list[dict[str, Any] | None] = [None] * process_count
    self._shared: dict[str, Any] | None = None  # The last structure (`_describe`).
    self._devices = [1] * process_count
    self._config: list[dict[str, Any] | None] = [None] * process_count
    self._resume: list[int | None] = [None] * process_count
    self._ack = [0] * process_count
    # Per process, its last window report, reused while nothing but rows of its count come.
    self._held: list[messages.Report | None] = [None] * process_count
    # The first closed / timed-out ending reported (ends the stream at once).
    self.abort: messages.ReportedError | None = None

  def count(self, p: int) -> int:
    """Positions process `p` has reported rows for."""
    return self._base[p] + len(self._rows[p])

  def ack(self, p: int) -> int:
    return self._ack[p]

  def ended(self, p: int) -> bool:
    """Whether process `p`'s stream ended (exhausted or failed)."""
    return self._end[p] is not None

  def add(self, chunk: messages.Chunk) -> None:
    """Records one chunk; raises RuntimeError unless it continues its process's stream."""
    r = chunk.report
    p = r.process_index
    if r.error is not None and r.error.kind in messages.ABORTS:
      self.abort = self.abort or r.error
      return
    self._extend(p, chunk.start, r.rows, r.digests, chunk.ack, r.local_devices, r.sizes)
    if r.exhausted or r.error is not None:
      self._end[p] = r
    self._describe(p, r.signature, r.config, r.resume)

  def _describe(
    self, p: int, signature: dict[str, Any] | None, config: Any = None, resume: int | None = None
  ) -> None:
    """Records what process `p` told of itself (what is not None); its held report is stale."""
    self._held[p] = None
    if signature is not None:
      if signature != self._shared:  # One object for equal structures: compared by identity first.
        self._shared = signature
      self._signature[p] = self._shared
    if config is not None:
      self._config[p] = config
    if resume is not None:
      self._resume[p] = resume

  def add_json(self, text: str) -> tuple[int, tuple[float, ...] | None]:
    """`messages.Chunk.from_json` (raises its ProtocolError), then `add`: its process and times.
    A chunk of rows only (nearly every one) is recorded without building its report."""
    obj = messages.load(text, "report")
    r = obj.get("R")
    if type(r) is dict and r.keys() == _ROWS_ONLY and r["x"] is False:
      try:
        start, ack, rows = obj["s"], obj["a"], tuple(r["r"])
        times = tuple(map(float, obj["t"])) if "t" in obj else None
      except (KeyError, TypeError, ValueError):
        pass  # `Chunk.from_obj` raises its ProtocolError.
      else:
        self._extend(r["p"], start, rows, (), ack, r["d"], ())
        return r["p"], times
    chunk = messages.Chunk.from_obj(obj)
    self.add(chunk)
    return chunk.report.process_index, chunk.times

  def _extend(
    self,
    p: int,
    start: int,
    rows: tuple[int, ...],
    digests: Any,
    ack: int,
    devices: int,
    sizes: Any,
  ) -> None:
    q = self._rows[p]
    if start != self._base[p] + len(q) or self._end[p] is not None:
      raise RuntimeError(
        f"internal: process {p} posted positions from {start}, expected"
        f" {self.count(p)} (ended: {self._end[p] is not None})"
      )
    held = self._held[p]
    if held is not None and (devices != self._devices[p] or rows.count(held.rows[0]) < len(rows)):
      self._held[p] = None
    q.extend(rows)
    for kept, given in ((self._digests, digests), (self._sizes, sizes)):
      if kept is not None:  # None where a process sent fewer.
        kept[p].extend((*given[: len(rows)], *[None] * (len(rows) - len(given))))
    self._devices[p] = devices
    if ack > self._ack[p]:
      self._ack[p] = ack

  def add_rows(
    self, p: int, rows: int, digest: str | None = None, sizes: tuple[int, ...] = ()
  ) -> None:
    """Records one more batch of process `p` (its own reads, no chunk)."""
    if (held := self._held[p]) is not None and rows != held.rows[0]:
      self._held[p] = None
    self._rows[p].append(rows)
    if self._digests is not None:
      self._digests[p].append(digest)
    if self._sizes is not None:
      self._sizes[p].append(sizes)

  def add_end(self, report: messages.Report) -> None:
    """Records that process `report.process_index` ended (own stream)."""
    self._end[report.process_index] = report
    self._describe(report.process_index, report.signature)

  def set_own(
    self,
    p: int,
    *,
    signature: dict[str, Any] | None,
    devices: int,
    config: Any,
    resume: int | None = None,
  ) -> None:
    """Records a process's structure, device count, settings and resume position."""
    self._devices[p] = devices
    self._describe(p, signature, config, resume)

  def furthest(self) -> int:
    """Positions the furthest-reported process has reported rows for."""
    return max(b + len(r) for b, r in zip(self._base, self._rows, strict=True))

  def window(self, position: int) -> int:
    """How many positions from `position` on are known for every process (the end counts as one)."""
    live = [
      b + len(r) - position
      for b, r, e in zip(self._base, self._rows, self._end, strict=True)
      if e is None
    ]
    if live:
      return max(0, min(live))
    return self.furthest() - position + 1

  def window_reports(self, position: int, size: int, *, with_config: bool) -> list[messages.Report]:
    """Window reports for `plan.decide` over ``[position, position + size)`` (`Report.more`: rows past it)."""
    out = []
    last = position + size
    held = [None] * self._process_count if with_config else self._held
    for p, (base, rows, h) in enumerate(zip(self._base, self._rows, held, strict=True)):
      count = base + len(rows)
      # Reused where it holds (every row it holds is `h.rows[0]`).
      if h is None or len(h.rows) != min(count, last) - position or h.more != (count > last):
        h = self._report(p, position, last, with_config=with_config)
      out.append(h)
    return out

  def _report(self, p: int, position: int, last: int, *, with_config: bool) -> messages.Report:
    """Process `p`'s window report over positions ``[position, last)``."""
    base = self._base[p]
    count = base + len(self._rows[p])
    stop = min(count, last)
    # Slices of the deques (O(size) from their left end, where `position` is).
    a, b = position - base, max(stop, position) - base
    rows = tuple(itertools.islice(self._rows[p], a, b))
    kept: tuple[Any, ...] = (self._digests, self._sizes)  # Parallel to `_rows` where kept.
    digests, sizes = (() if k is None else tuple(itertools.islice(k[p], a, b)) for k in kept)
    # An end right after the window's last row counts too (`plan.Rules.wait_for_last`).
    end = self._end[p] if count <= last else None
    report = messages.Report(
      process_index=p,
      rows=rows,
      exhausted=end.exhausted if end is not None else False,
      error=end.error if end is not None else None,
      signature=self._signature[p],
      local_devices=self._devices[p],
      config=self._config[p] if with_config else None,
      resume=self._resume[p] if with_config else None,
      more=count > stop,
      digests=digests,
      sizes=sizes,
    )
    # Held for the next windows while nothing but rows of the same count come.
    plain = not with_config and self._digests is None and self._sizes is None
    if plain and rows and self._end[p] is None and self._rows[p].count(rows[0]) == count - base:
      self._held[p] = report
    return report

  def missing(self, position: int) -> list[int]:
    """Processes whose batch (or end) at `position` is not known yet."""
    return [
      p for p in range(self._process_count) if position >= self.count(p) and self._end[p] is None
    ]

  def forget(self, position: int) -> None:
    """Drops what is known about positions before `position`."""
    kept = [k for k in (self._digests, self._sizes) if k is not None]  # Parallel to `_rows`.
    for p, (base, rows) in enumerate(zip(self._base, self._rows, strict=True)):
      drop = min(position - base, len(rows))
      if drop <= 0:
        continue
      self._base[p] = base + drop
      if drop == len(rows):  # Every row decided: the common case, one call.
        rows.clear()
        for k in kept:
          k[p].clear()
        continue
      for q in (rows, *[k[p] for k in kept]):
        for _ in range(drop):
          q.popleft()
