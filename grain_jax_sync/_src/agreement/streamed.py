"""What the two sides of the streamed agreement share: own reads, runs, the ending.

The streamed agreement runs over the key-value store: process 0 decides
(`decider.Decider`), every other process follows (`follower.Follower`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import job_stats
from grain_jax_sync._src import ledger as ledger_lib
from grain_jax_sync._src import liveness as liveness_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src.agreement import common, cross_wait, endings

ErrorKind = plan_lib.ErrorKind
End = plan_lib.End


class Streamed:
  """What the decider and the followers share: own reads, the runs, the ending.

  Args:
    reader: This host's reader.
    exchange: The key-value exchange of this iterator.
    options: The settings `plan.decide` needs.
    who: This process's identity (devices, settings digest, resume position).
    lookahead: `synchronize_lookahead`.
    timeout_s: `sync_timeout_s`.
    position: Output batches before the first one (the resume position).
    threads: May move a slow source to its own thread.
    live: Tells dead peers from slow ones (default: their beats).
    read_ahead: At most this many undecided batches held (None: the
      default bound, `agreement.read_ahead_limit`).
    job: The iterator's cross-host view (`job_stats.JobTable`), fed from the
      chunks and decisions; None: none kept.
  """

  def __init__(
    self,
    reader: Iterator[reader_lib.Read | reader_lib.End],
    exchange: exchange_lib.KeyValueExchange,
    options: plan_lib.Options,
    who: common.Identity,
    *,
    lookahead: int,
    timeout_s: float,
    position: int,
    threads: bool = True,
    live: liveness_lib.Liveness | None = None,
    read_ahead: int | None = None,
    job: job_stats.JobTable | None = None,
  ):
    self._ex = exchange
    self._options = options
    self._who = who
    self._p = exchange.process_index
    self._n = exchange.process_count
    self._timeout_s = timeout_s
    self._own = common.OwnReads(reader, lookahead=lookahead, threads=threads, read_ahead=read_ahead)
    self._live = live or liveness_lib.Liveness(exchange)
    self._j = 0  # Positions decided.
    self._yielded = position  # Output batches decided (for messages).
    self._seq = 0  # Decisions posted (decider) or consumed (follower).
    self._signature: batches_lib.Signature | None = None
    self._rpc_s = 0.001
    self._last_poll = -1.0
    self._waiting_since: float | None = None
    self._cross = cross_wait.CrossWait(exchange, self._live, timeout_s)
    exchange_lib.stream_started(exchange.namespace)
    self._job = job
    if job is not None:
      job.attach(self._p, self._n)

  def _apply(self, decision: ledger_lib.Decision) -> common.Run | None:
    """This host's reads for a decision, as a run for the builder."""
    if self._signature is None:
      if self._own.signature is not None:
        self._signature = self._own.signature
      elif decision.signature is not None:
        self._signature = batches_lib.Signature.from_json(decision.signature)
    reads = self._own.take(self._j, len(decision.steps))
    self._j += len(decision.steps)
    self._yielded += sum(1 for s in decision.steps if s.action == plan_lib.Action.YIELD)
    self._waiting_since = None
    if not decision.steps:
      return None
    steps = tuple(zip(reads, decision.steps, strict=True))
    return common.Run(steps, self._signature, decision.batch_size)

  def _finish(self, decision: ledger_lib.Decision) -> None:
    """After the final decision's run: stop, or raise the agreed error."""
    if decision.end == End.RAISE:
      assert decision.error is not None
      raise endings.to_exception(decision.error, self._p, self._own.end)

  def _poll_due(self) -> bool:
    return time.monotonic() - self._last_poll >= max(common.POLL_MIN_S, 2 * self._rpc_s)

  def _timed(self, fn: Any, *args: Any) -> Any:
    t0 = time.monotonic()
    out = fn(*args)
    self._last_poll = time.monotonic()
    self._rpc_s = 0.8 * self._rpc_s + 0.2 * (self._last_poll - t0)
    return out

  def _blocking(self, fn: Any, *args: Any) -> Any:
    """A blocking read counts as a poll: the next non-blocking one is due a poll interval later.

    Without this, the first read-ahead after a blocking read that returned
    polled again at once, before anything new could be there (2 x 4, 1,000
    batches: process 1 made 127 non-blocking and 39 blocking decision reads
    for 94 decisions).
    """
    out = fn(*args)
    self._last_poll = time.monotonic()
    return out

  def _waited_s(self) -> float:
    now = time.monotonic()
    if self._waiting_since is None:
      self._waiting_since = now
    return now - self._waiting_since

  def _cross_wait(self, peer: int) -> plan_lib.ReportedError | None:
    """The error once `peer` waits crosswise long enough (`cross_wait.CrossWait.check`)."""
    return self._cross.check(peer, self._yielded)

  def _first_decided(self) -> None:
    """This stream has its first decision: no longer a crosswise wait."""
    self._cross.done()

  def _closed_error(self, at_batch: int) -> plan_lib.ReportedError:
    return endings.closed_error(self._p, at_batch)

  def close_stage(self) -> None:
    """Stops waits and the read thread (from the closing thread)."""
    self._ex.cancel()

  def release(self) -> None:
    self._own.close()
    self._first_decided()

  def close(self, at_batch: int, error: plan_lib.ReportedError | None = None) -> None:
    """Posts this host's ending (`Decider` and `Follower` each post their own)."""
    raise NotImplementedError
