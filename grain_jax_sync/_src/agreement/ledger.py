"""Process 0's record of what every process reported, per batch position.

In the streamed agreement each process posts the row counts of the batches it
has read as soon as it reads them (a `messages.Chunk`: one or more
consecutive positions), and process 0 (`decider.Decider`) decides position
``j`` with `plan.decide` once it knows, for every process, either the rows of
its batch ``j`` or that its stream ended (or failed) before ``j``. `Ledger`
keeps that knowledge and turns each known run of positions into the window
reports that `plan.decide` takes.

Pure Python: no JAX, no I/O.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from grain_jax_sync._src import messages


class Ledger:
  """Per-process knowledge of rows per position, stream ends, structure.

  Args:
    process_count: How many processes report.
    digests: Keep each position's row digest (processes share rows), for
      the window reports.
    sizes: Keep each position's sizes of the varying dims (`pad_shapes`).
  """

  def __init__(self, process_count: int, *, digests: bool = False, sizes: bool = False):
    self._process_count = process_count
    self._rows: list[collections.deque[int]] = [collections.deque() for _ in range(process_count)]
    # Parallel to `_rows` where digests are kept (None: a process sent none).
    self._digests: list[collections.deque[str | None]] | None = None
    if digests:
      self._digests = [collections.deque() for _ in range(process_count)]
    # Parallel to `_rows` with `pad_shapes` (None: a process sent none).
    self._sizes: list[collections.deque[tuple[int, ...] | None]] | None = None
    if sizes:
      self._sizes = [collections.deque() for _ in range(process_count)]
    self._base = [0] * process_count  # Position of _rows[p][0].
    self._end: list[messages.Report | None] = [None] * process_count
    self._signature: list[dict[str, Any] | None] = [None] * process_count
    self._devices = [1] * process_count
    self._config: list[dict[str, Any] | None] = [None] * process_count
    self._resume: list[int | None] = [None] * process_count
    self._ack = [0] * process_count
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
    """Records one chunk; chunks of a process must arrive in order.

    Raises:
      RuntimeError: If the chunk does not continue the process's stream.
    """
    r = chunk.report
    p = r.process_index
    if r.error is not None and r.error.kind in messages.ABORTS:
      self.abort = self.abort or r.error
      return
    self._extend(p, chunk.start, r.rows, r.digests, chunk.ack, r.local_devices, r.sizes)
    if r.exhausted or r.error is not None:
      self._end[p] = r
    if r.signature is not None:
      self._signature[p] = r.signature
    if r.config is not None:
      self._config[p] = r.config
    if r.resume is not None:
      self._resume[p] = r.resume

  def add_json(self, text: str) -> tuple[int, tuple[float, ...] | None]:
    """`messages.Chunk.from_json` (raises its ProtocolError), then `add`.

    Returns:
      The chunk's process and its times.
    """
    chunk = messages.Chunk.from_json(text)
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
    if start != self.count(p) or self._end[p] is not None:
      raise RuntimeError(
        f"internal: process {p} posted positions from {start}, expected"
        f" {self.count(p)} (ended: {self._end[p] is not None})"
      )
    self._rows[p].extend(rows)
    if self._digests is not None:
      got = digests[: len(rows)]
      self._digests[p].extend((*got, *[None] * (len(rows) - len(got))))
    if self._sizes is not None:
      have = sizes[: len(rows)]
      self._sizes[p].extend((*have, *[None] * (len(rows) - len(have))))
    self._devices[p] = devices
    self._ack[p] = max(self._ack[p], ack)

  def add_rows(
    self, p: int, rows: int, digest: str | None = None, sizes: tuple[int, ...] = ()
  ) -> None:
    """Records one more batch of process `p` (its own reads, no chunk)."""
    self._rows[p].append(rows)
    if self._digests is not None:
      self._digests[p].append(digest)
    if self._sizes is not None:
      self._sizes[p].append(sizes)

  def end(self, report: messages.Report) -> None:
    """Records that process `report.process_index` ended (own stream)."""
    p = report.process_index
    self._end[p] = report
    if report.signature is not None:
      self._signature[p] = report.signature

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
    if signature is not None:
      self._signature[p] = signature
    self._devices[p] = devices
    self._config[p] = config
    if resume is not None:
      self._resume[p] = resume

  def furthest(self) -> int:
    """Positions the furthest-reported process has reported rows for."""
    return max(b + len(r) for b, r in zip(self._base, self._rows, strict=True))

  def window(self, position: int) -> int:
    """How many positions from `position` on are known for every process.

    Positions after every stream ended count as one more (the end itself).
    """
    live = [
      b + len(r) - position
      for b, r, e in zip(self._base, self._rows, self._end, strict=True)
      if e is None
    ]
    if live:
      return max(0, min(live))
    return self.furthest() - position + 1

  def window_reports(self, position: int, size: int, *, with_config: bool) -> list[messages.Report]:
    """Window reports for `plan.decide` over positions ``[position, position + size)``.

    A process whose stream ends inside the window reports its remaining rows
    and its end (exhausted or error), exactly like a windowed exchange; one
    that has reported rows past the window says so (`Report.more`).
    """
    out = []
    last = position + size
    islice = itertools.islice
    for p in range(self._process_count):
      base = self._base[p]
      count = base + len(self._rows[p])
      stop = min(count, last)
      # Slices of the deques (O(size) from their left end, where `position` is).
      rows = tuple(islice(self._rows[p], position - base, stop - base)) if stop > position else ()
      digests: tuple[str | None, ...] = ()
      if self._digests is not None and stop > position:
        digests = tuple(islice(self._digests[p], position - base, stop - base))
      sizes: tuple[Any, ...] = ()
      if self._sizes is not None and stop > position:
        sizes = tuple(islice(self._sizes[p], position - base, stop - base))
      # An end right after the window's last row counts too: that row is then
      # known to be the process's last (`plan.Rules.wait_for_last`).
      end = self._end[p] if count <= last else None
      out.append(
        messages.Report(
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
      )
    return out

  def missing(self, position: int) -> list[int]:
    """Processes whose batch (or end) at `position` is not known yet."""
    return [
      p for p in range(self._process_count) if position >= self.count(p) and self._end[p] is None
    ]

  def forget(self, position: int) -> None:
    """Drops what is known about positions before `position`."""
    for p in range(self._process_count):
      rows = self._rows[p]
      drop = min(position - self._base[p], len(rows))
      if drop <= 0:
        continue
      self._base[p] += drop
      held: list[collections.deque[Any]] = [rows]
      if self._digests is not None:
        held.append(self._digests[p])
      if self._sizes is not None:
        held.append(self._sizes[p])
      for q in held:
        if drop == len(q):
          q.clear()  # Every row decided: the common case, one call.
        else:
          for _ in range(drop):
            q.popleft()
