"""The agreement protocol: this host's reads + the exchange -> decided runs.

Two forms, one decision (`plan.decide`):

* `lockstep`: every process reads a window, the reports are all-gathered and
  every process decides the same plan. One process (no exchange) and the
  collective fallback (which runs in the caller's thread) use it.
* Streamed (`streamed.Decider` on process 0, `follower.Follower` on the
  others): the key-value store. Every process other than 0 posts its rows
  (and its ending) in chunks as it reads; process 0, the decider, reads every
  chunk, decides each position as soon as every process's row (or ending) for
  it is known and posts the decision; every process, process 0 included, acts
  on the same decisions, so every host yields the same batches and ends the
  same way, with the same message.

Endings. Every ending is a report with a position: exhausted and failed
(from the reader, at the position of the failed read) are decided in order
with the rows; closed (posted by `Streamed.close`), timed out and lost (found
by the decider while it waits) end the stream at once. A process posts its
ending before it raises or stops, and yields only decided positions.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import build as build_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import ledger as ledger_lib
from grain_jax_sync._src import liveness
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import prefetch as prefetch_lib
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src import sharding as sharding_lib

logger = logging.getLogger(__name__)

ErrorKind = plan_lib.ErrorKind

# Undecided batches a process holds: max(2, min(READ_AHEAD_WINDOWS * lookahead,
# READ_AHEAD_BYTES // bytes of the first batch)); see docs/performance.md. 32
# windows, so that a quick source is posted (and decided) in chunks of up to
# 16 windows: a store call costs about 0.3 ms of CPU at the client and as much
# at the service, and each return from one waits for the GIL (up to the 5 ms
# switch interval beside a busy consumer). 2 x 4 synchronized throughput went
# from 0.46-0.79 to 0.78-0.95 of unsynchronized with 4 windows -> 16, and from
# 0.86-0.89 to 0.89-0.91 with 16 -> 32 (12 rotated trials, 64-row batches of
# 0.1 ms; 64 and 128 windows: the same as 32, both capped by the 64 MiB).
READ_AHEAD_BYTES = 64 << 20
READ_AHEAD_WINDOWS = 32
# A batch that took this long to read is posted at once (a slow source). Rows
# read faster are posted once a window (`synchronize_lookahead` rows) is held and
# its oldest row has waited this long (the first window at once), or half the
# read-ahead is held, or the process has nothing else to do.
FLUSH_AFTER_S = 0.01
# A process asks the store for news at most this often while it still has
# batches to read (or twice the last store call's time, if longer); a process
# other than 0 only while a position it posted is undecided (else its next post
# comes first: 0.024 instead of 0.038 decision reads per batch at 2 x 4).
POLL_MIN_S = 0.002
# The source moves to its own thread once most of the last READ_THREAD_READS
# reads (the median) took this long: a slow source then overlaps with the
# exchange, and a fast one is not charged a thread hand-off per batch
# (measured on 2 cores: agreement throughput 0.5-0.6 of unsynchronized with
# the thread from the start, 0.6-0.9 without it). The median, not a mean: a
# garbage collection inside one read (40 ms of CPU, 2 x 4 with 0.1 ms batches)
# moved a quick source to the thread for good in about one iterator in three.
READ_THREAD_AFTER_S = 0.002
READ_THREAD_READS = 5
READ_THREAD = "grain_jax_sync-read"
# A process other than 0 waits this much longer than `sync_timeout_s` for a
# decision before it gives up on its own, so that process 0, which waits on the
# slow peer itself, names it first (the same message on every host).
FOLLOWER_GRACE_S = liveness.DEAD_AFTER_S + 2.0


def to_exception(
  error: plan_lib.ReportedError, process: int, own: reader_lib.End | None
) -> BaseException:
  """The exception this host raises for an agreed error."""
  if own is not None and own.exception is not None and own.error == error:
    return own.exception  # This host's own failure: its own exception.
  if error.kind == ErrorKind.VALUE:
    return ValueError(error.message)
  if error.kind == ErrorKind.TIMEOUT:
    return exchange_lib.PeerTimeoutError(error.message, error.missing)
  if error.kind == ErrorKind.LOST:
    return exchange_lib.PeerLostError(error.message, error.missing)
  if error.kind == ErrorKind.CLOSED:
    return RuntimeError(error.message)
  return RuntimeError(
    f"{error.message} (process {error.process_index} raised"
    f" {error.type_name}; every other process stops too, so that no host"
    " waits forever)"
  )


def closed_peer_message(note: str, namespace: str) -> str:
  """The error for a peer found closed (`exchange.register_close`) while waited for here.

  A peer that closed in this stream could not post its ending (a stage
  thread of its was still blocked); one that closed in an earlier stream
  never started this one, which other processes restarted.
  """
  try:
    stream, message = json.loads(note)
  except (TypeError, ValueError):
    stream, message = None, str(note)
  if stream == namespace:
    return str(message)
  return (
    f"{message}, without starting the stream that other processes restarted"
    " (reset(), set_state()): every process must restart it at the same point"
  )


def read_ahead_limit(read: reader_lib.Read, lookahead: int, cap: int | None = None) -> int:
  """Undecided batches a process may hold: a few windows, capped by bytes and by `cap`.

  At least 2: a short batch is decided only once its host's next batch (or
  end) is known (`plan.Options.wait_for_last`).
  """
  limit = min(READ_AHEAD_WINDOWS * lookahead, READ_AHEAD_BYTES // max(1, read.batch.nbytes))
  if cap is not None:
    limit = min(limit, cap)
  return max(2, limit)


class Identity:
  """What a process says about itself in its first report.

  `groups` (the same on every process) is `BatchPlacement.groups` where
  processes share rows, else empty: then each report carries its rows'
  digests and `decide` compares them.
  """

  def __init__(
    self,
    *,
    process: int,
    devices: int,
    config: Any,
    resume: int,
    groups: tuple[tuple[int, ...], ...] = (),
  ):
    self.process = process
    self.devices = devices
    self.config = config
    self.resume = resume
    self.groups = groups


def make_report(
  who: Identity,
  rows: tuple[int, ...],
  end: reader_lib.End | None,
  sig: Any,
  first: bool,
  digests: tuple[str | None, ...] = (),
  sizes: tuple[tuple[int, ...], ...] = (),
) -> plan_lib.Report:
  return plan_lib.Report(
    process_index=who.process,
    rows=rows,
    exhausted=end is not None and end.exhausted,
    error=None if end is None else end.error,
    signature=sig,
    local_devices=who.devices,
    config=who.config if first else None,
    resume=who.resume if first else None,
    digests=digests,
    sizes=sizes,
  )


def sizes_of(reads: Any, options: plan_lib.Options) -> tuple[tuple[int, ...], ...]:
  """The reads' sizes of the varying dims for a report (`pad_shapes`); () without."""
  return () if options.shapes is None else tuple(r.batch.sizes for r in reads)


def decide(
  reports: list[plan_lib.Report],
  options: plan_lib.Options,
  *,
  groups: tuple[tuple[int, ...], ...],
  position: int,
) -> plan_lib.Plan:
  """`plan.decide`, then, where processes share rows, the digest check.

  The first yielded position whose rows differ within a group of processes
  that share a data shard ends the plan: the steps before it stand, and every
  host raises the same ValueError (`sharding.shared_rows_error`).
  """
  plan = plan_lib.decide(reports, options, position=position)
  if not groups:
    return plan
  index = position
  for i, step in enumerate(plan.steps):
    if step.action != plan_lib.Action.YIELD:
      continue
    digests = [r.digests[i] if i < len(r.digests) else None for r in reports]
    message = sharding_lib.shared_rows_error(digests, groups, index)
    if message is not None:
      error = plan_lib.ReportedError(ErrorKind.VALUE, message, -1, index)
      return dataclasses.replace(plan, steps=plan.steps[:i], end=plan_lib.End.RAISE, error=error)
    index += 1
  return plan


# -- lockstep ----------------------------------------------------------------------


def lockstep(  # noqa: C901 - one window per pass, in order; the one-process fast path first
  reader: Iterator[reader_lib.Read | reader_lib.End],
  exchange: exchange_lib.LocalExchange | exchange_lib.CollectiveExchange,
  options: plan_lib.Options,
  who: Identity,
  *,
  window: int,
  position: int,
) -> Iterator[build_lib.Run]:
  """Reads a window, all-gathers the reports, decides; in the calling thread.

  On `End.WAIT` the undecided reads are kept and every process reads at least
  one more batch (or its end) before the next decision, which starts at the
  first undecided position.
  """
  signature: batches_lib.Signature | None = None
  end: reader_lib.End | None = None
  reads: list[reader_lib.Read] = []  # Undecided reads kept after a WAIT.
  alone = exchange.process_count == 1 and not who.groups
  memo: dict[tuple[tuple[int, ...], plan_lib.Options], tuple[plan_lib.Plan, int]] = {}
  # One process, one batch per window, mid-stream: the decided step and its
  # yield count per row count, for the current `options` (cleared when they
  # change). A batch of a known size is yielded without building a window
  # (about 4 of the 8 us the window costs per batch).
  quick: dict[int, tuple[plan_lib.Step, int]] | None = None
  if alone and window == 1 and options.shapes is None:  # `pad_shapes`: sizes decide too.
    quick = {}
  for w in range(1 << 62):
    need = max(window, len(reads) + 1)  # Counted before a quick read, which it includes.
    if quick and not reads and end is None:
      end = _read(reader, reads, 1)
      hit = quick.get(reads[0].batch.rows) if end is None else None
      if hit is not None:
        position += hit[1]
        yield build_lib.Run(((reads.pop(), hit[0]),), signature, options.batch_size)
        continue
    if end is None:
      end = _read(reader, reads, need)
    if signature is None and reads:
      signature = reads[0].batch.signature
    rows = tuple(r.batch.rows for r in reads)
    # One process, mid-stream: a window of the same sizes gets the same plan
    # (an error-free plan does not depend on the position).
    # Not with `pad_shapes`: the plan depends on the sizes too (and they take many values).
    memoize = alone and w and end is None and options.shapes is None
    key = (rows, options) if memoize else None
    known = memo.get(key) if key is not None else None
    if known is not None:
      decision, yields = known
    else:
      decision, signature = _decide_window(
        reads, rows, end, signature, who, exchange, options, w=w, position=position
      )
      yields = sum(1 for s in decision.steps if s.action == plan_lib.Action.YIELD)
      if key is not None and decision.error is None:
        memo[key] = (decision, yields)
    pinned = plan_lib.pin(options, decision)
    if quick is not None and pinned is not options:
      quick.clear()
    elif quick is not None and key is not None and _repeatable(decision):
      quick[rows[0]] = (decision.steps[0], yields)
    options = pinned
    n = len(decision.steps)
    steps = tuple(
      (reads[i] if i < len(reads) else None, step) for i, step in enumerate(decision.steps)
    )
    position += yields
    reads = reads[n:] if decision.end == plan_lib.End.WAIT else []
    if steps:
      yield build_lib.Run(steps, signature, options.batch_size)
    steps = ()
    if decision.end == plan_lib.End.STOP:
      return
    if decision.end == plan_lib.End.RAISE:
      assert decision.error is not None
      raise to_exception(decision.error, who.process, end)


def _read(
  reader: Iterator[reader_lib.Read | reader_lib.End], reads: list[reader_lib.Read], need: int
) -> reader_lib.End | None:
  """Reads into `reads` until it holds `need` batches; the stream's end if reached first."""
  while len(reads) < need:
    item = next(reader)
    if isinstance(item, reader_lib.End):
      return item
    reads.append(item)
  return None


def _decide_window(
  reads: list[reader_lib.Read],
  rows: tuple[int, ...],
  end: reader_lib.End | None,
  signature: batches_lib.Signature | None,
  who: Identity,
  exchange: exchange_lib.LocalExchange | exchange_lib.CollectiveExchange,
  options: plan_lib.Options,
  *,
  w: int,
  position: int,
) -> tuple[plan_lib.Plan, batches_lib.Signature | None]:
  """Reports a window (all-gathered with several processes) and decides it.

  Returns:
    The decision, and the agreed signature (learnt from a peer's report
    where this process has read no batch yet).
  """
  sig = None if signature is None else signature.to_json()
  digests = tuple(r.digest for r in reads) if who.groups else ()
  report = make_report(who, rows, end, sig, w == 0, digests, sizes_of(reads, options))
  if exchange.process_count == 1:
    reports = [report]  # Nothing to exchange: skip the JSON round trip.
  else:
    chunk = ledger_lib.Chunk(start=position, ack=w, report=report)
    chunks = _parse_all(exchange.all_gather(w, chunk.to_json()))
    _check_in_step(chunks)
    reports = [c.report for c in chunks]
    if signature is None and (found := ledger_lib.signature_of(reports)) is not None:
      signature = batches_lib.Signature.from_json(found)
  return decide(reports, options, groups=who.groups, position=position), signature


def _repeatable(decision: plan_lib.Plan) -> bool:
  """Whether a one-batch window's decision holds for any later batch of its size."""
  return (
    decision.error is None and len(decision.steps) == 1 and decision.end == plan_lib.End.CONTINUE
  )


def _parse_all(payloads: list[str]) -> list[ledger_lib.Chunk]:
  """Every process's chunk, or the same ValueError on every host."""
  versions: dict[int, Any] = {}
  chunks = []
  for p, text in enumerate(payloads):
    try:
      chunks.append(ledger_lib.Chunk.from_json(text))
    except ledger_lib.ProtocolError as e:
      versions[p] = e.version
  if versions:
    shown = ", ".join(
      f"process {p}: {versions.get(p, ledger_lib.PROTOCOL_VERSION)!r}" for p in range(len(payloads))
    )
    raise ValueError(
      "the processes run different versions of the grain_jax_sync agreement"
      f" protocol ({shown}); every process must run the same version of the library"
    )
  return chunks


def _check_in_step(chunks: list[ledger_lib.Chunk]) -> None:
  """Under the collective exchange, every window must start at the same batch.

  A process that restarted its stream (`reset()`, `set_state()` or a new
  iterator) while its peers kept iterating has nothing to post its ending
  to: its next all-gather meets the peers' next window, and without this
  check the processes would pair different batches into one global array.
  Raises the same RuntimeError on every host. Different starts in every
  process's first window are `plan.decide`'s resume error.
  """
  starts = {c.report.process_index: c.start for c in chunks}
  if len(set(starts.values())) < 2:
    return
  fresh = [c.report.process_index for c in chunks if c.report.config is not None]
  if len(fresh) == len(chunks):
    return
  where = ", ".join(f"process {p} at batch {b}" for p, b in sorted(starts.items()))
  restarted = f"processes {fresh} restarted" if len(fresh) > 1 else f"process {fresh[0]} restarted"
  raise RuntimeError(
    f"the processes are at different batches of the stream ({where}):"
    f" {restarted} the stream (reset(), set_state() or a new iterator) while"
    " the others kept iterating. Without the key-value store (the collective"
    " exchange) every process must reset or restore at the same point"
    if fresh
    else f"the processes are at different batches of the stream ({where})"
  )


# -- this host's reads, for the streamed form --------------------------------------


class OwnReads:
  """This host's undecided reads, read inline while quick, in a thread once slow."""

  def __init__(
    self,
    reader: Iterator[reader_lib.Read | reader_lib.End],
    *,
    lookahead: int,
    threads: bool,
    read_ahead: int | None = None,
  ):
    self._reader = reader
    self._cap = read_ahead
    self._threads = threads
    self._thread: prefetch_lib.Prefetcher[Any] | None = None
    self._recent: collections.deque[float] = collections.deque(maxlen=READ_THREAD_READS)
    self.lookahead = lookahead
    self.limit = lookahead if read_ahead is None else max(2, min(lookahead, read_ahead))
    self.pending: collections.deque[reader_lib.Read] = collections.deque()
    self.count = 0  # Positions read.
    self.end: reader_lib.End | None = None
    self.signature: batches_lib.Signature | None = None
    self.last_read_s = 0.0

  def room(self) -> bool:
    return self.end is None and len(self.pending) < self.limit

  def read(self) -> reader_lib.Read | reader_lib.End:
    t0 = time.monotonic()
    item = next(self._reader)
    self.last_read_s = time.monotonic() - t0
    if self._thread is None and self._threads:
      self._recent.append(self.last_read_s)
      if (
        len(self._recent) == READ_THREAD_READS
        and sorted(self._recent)[READ_THREAD_READS // 2] >= READ_THREAD_AFTER_S
        and not isinstance(item, reader_lib.End)
      ):
        # A slow source: read it in its own thread from now on, so that it
        # overlaps with the exchange.
        self._thread = prefetch_lib.Prefetcher(self._reader, buffer_size=1, name=READ_THREAD)
        self._reader = self._thread
    if isinstance(item, reader_lib.End):
      self.end = item
      return item
    if self.count == 0:
      self.limit = read_ahead_limit(item, self.lookahead, self._cap)
      self.signature = item.batch.signature
    self.pending.append(item)
    self.count += 1
    return item

  def take(self, start: int, n: int) -> list[reader_lib.Read | None]:
    """This host's reads for positions ``[start, start + n)`` (None past its end)."""
    return [self.pending.popleft() if start + i < self.count else None for i in range(n)]

  def close(self) -> None:
    if self._thread is not None:
      self._thread.close()
