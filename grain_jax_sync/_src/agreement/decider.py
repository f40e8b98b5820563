"""The streamed agreement over the key-value store: one decider, O(processes).

Process 0 (`Decider`, here) reads every peer's chunks with one directory
read, decides with `plan.decide` and posts each decision once; every other
process (`follower.Follower`) posts its chunks and reads the decisions. See `agreement` for the
endings and `exchange` for the keys.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import build as build_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import job_stats, wire
from grain_jax_sync._src import ledger as ledger_lib
from grain_jax_sync._src import liveness as liveness_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src.agreement import common, endings

logger = logging.getLogger(__name__)

ErrorKind = plan_lib.ErrorKind
End = plan_lib.End

# Two processes that each wait at the start of a stream the other has not
# started (iterators started in a different order: a stream starts at its
# first `next()`) can never go on. Named after this long crosswise, or half
# `sync_timeout_s` if shorter: longer than a live peer takes between the
# first `next()` calls of iterators it starts together (threads), on any host.
CROSS_WAIT_S = 30.0


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
    self._cross_since: float | None = None  # Since when a peer waits crosswise.
    exchange_lib.stream_started(exchange.namespace)
    self._job = job
    if job is not None:
      job.attach(self._p, self._n)

  def _apply(self, decision: ledger_lib.Decision) -> build_lib.Run | None:
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
    return build_lib.Run(steps, self._signature, decision.batch_size)

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
    """The error once `peer` has waited long enough at the start of a stream not started here.

    Called while this process waits for `peer` before anything is decided.
    Process 0 and the peer each find it (the peer from process 0's beat), and
    name the pair the same way: the same message on both.
    """
    exchange_lib.waiting_first(self._ex.namespace, True)
    # Streams of iterators made here but not started: an iterator never made
    # here is the timeout's case (created on some processes only).
    theirs = [
      t
      for t in self._live.waiting(peer)
      if t != self._ex.namespace and exchange_lib.is_created(t) and not exchange_lib.is_started(t)
    ]
    now = time.monotonic()
    if not theirs:
      self._cross_since = None
      return None
    if self._cross_since is None:
      self._cross_since = now
    if now - self._cross_since < min(CROSS_WAIT_S, self._timeout_s / 2):
      return None
    waits = sorted([(self._p, self._ex.namespace), (peer, theirs[0])])
    (a, sa), (b, sb) = waits
    message = (
      f"process {a} waits for the first batch of iterator {_iterator(sa)!r} and"
      f" process {b} for that of iterator {_iterator(sb)!r}, and neither has"
      " started the other's: the processes called next() on their iterators"
      " in a different order (an iterator's stream starts at its first"
      " next()); start every iterator in the same order on every process"
    )
    error = plan_lib.ReportedError(
      ErrorKind.CLOSED, message, peer, self._yielded, "RuntimeError", (peer,)
    )
    # The same ending in the peer's stream, where it waits: whichever of the
    # two finds it first, both raise this message (not a close of the other).
    exchange_lib.pre_end(theirs[0], message)
    try:
      post_end(self._ex.sibling(theirs[0]), 0, error)
    except Exception as e:  # noqa: BLE001 - the peer still finds it itself.
      logger.warning("grain_jax_sync: could not post the ending to %s: %s", theirs[0], e)
    return error

  def _first_decided(self) -> None:
    exchange_lib.waiting_first(self._ex.namespace, False)

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


class Decider(Streamed):
  """Process 0: reads every chunk, decides, posts the decisions."""

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self._led = ledger_lib.Ledger(
      self._n, digests=bool(self._who.groups), sizes=self._options.shapes is not None
    )
    who = self._who
    self._led.set_own(
      self._p, signature=None, devices=who.devices, config=who.config, resume=who.resume
    )
    self._sent_signature = False
    # An ending found here (an unreadable chunk, a timed-out or lost peer).
    self._abort: plan_lib.ReportedError | None = None
    self._acked = 0  # Decisions deleted below this.
    # After `End.WAIT`: the processes whose next batch (or end) is awaited,
    # with the positions they had reported then.
    self._wait: dict[int, int] | None = None

  def __iter__(self) -> Iterator[build_lib.Run]:
    while True:
      plan = self._plan()
      if plan is not None and plan.end == End.WAIT:
        self._wait = {p: self._led.count(p) for p in plan.waiting}
        plan = plan_lib.Plan(plan.steps, End.CONTINUE, batch_size=plan.batch_size)
        if not plan.steps:
          plan = None
      if plan is None:
        self._advance()
        continue
      if plan.end == End.CONTINUE and self._news_stale():
        self._absorb(self._timed(self._ex.read_chunks))
        continue  # Decide again with what the peers posted meanwhile.
      decision = self._post(plan)
      self._first_decided()
      run = self._apply(decision)
      self._led.forget(self._j)
      if decision.end != End.CONTINUE:
        self._ex.end()
      if run is not None:
        yield run
      if decision.end != End.CONTINUE:
        self._finish(decision)
        return

  def _plan(self) -> plan_lib.Plan | None:
    """The next plan, or None while the next position is not known for everyone."""
    error = self._abort or self._led.abort
    if error is not None:
      return plan_lib.Plan((), End.RAISE, error)
    if self._wait is not None:
      if self._needed():
        return None  # Deciding again before a waited process has news would spin.
      self._wait = None
    size = self._led.window(self._j)
    if size == 0:
      return None
    if self._j > 0 and not self._who.groups and (quick := self._led.full_plan(self._j)):
      return quick  # Full batches everywhere: no reports to build (`Ledger.full_plan`).
    reports = self._led.window_reports(self._j, size, with_config=self._j == 0)
    plan = common.decide(reports, self._options, groups=self._who.groups, position=self._yielded)
    self._options = plan_lib.pin(self._options, plan)
    full = plan.batch_size
    if full is not None and plan.error is None and any(s.rows == full for s in plan.steps):
      self._led.set_full(full)
    return plan

  def _news_stale(self) -> bool:
    """Whether the peers' chunks were last read too long ago to decide on.

    A follower that got no decision for `sync_timeout_s` plus a grace posts a
    timed-out ending and raises it one grace later. A decision posted later
    than one grace after the decider's last read of the chunks (after a long
    read of its own source, say) could reach a follower that has already
    raised; so the decider reads the chunks again first, and finds the
    ending if there is one.
    """
    return time.monotonic() - self._last_poll >= common.FOLLOWER_GRACE_S / 2

  def _needed(self) -> list[int]:
    """The processes whose next batch (or end) the next decision waits for."""
    if self._wait is None:
      return self._led.missing(self._j)
    return [
      p for p, count in self._wait.items() if self._led.count(p) <= count and not self._led.ended(p)
    ]

  def _post(self, plan: plan_lib.Plan) -> ledger_lib.Decision:
    sig = None
    if not self._sent_signature and plan.steps:
      sig = self._led_signature()
      self._sent_signature = sig is not None
    table = None
    if self._job is not None:
      self._job.decided(plan.steps)
      self._job.check_stragglers()  # Process 0's own times are fresh here.
      table = self._job.rows_to_send(final=plan.end != End.CONTINUE)
    decision = ledger_lib.Decision(
      self._j, plan.steps, plan.end, plan.error, sig, self._options.batch_size, table
    )
    self._ex.post_decision(self._seq, decision.to_json())
    self._seq += 1
    return decision

  def _led_signature(self) -> dict[str, Any] | None:
    reports = self._led.window_reports(self._j, 0, with_config=False)
    return ledger_lib.signature_of(reports)

  def _advance(self) -> None:
    """Reads this host's next batch, or gathers the peers' chunks, or waits."""
    missing = self._needed()
    own = self._p in missing
    if own or (self._own.room() and not self._poll_due()):
      self._read_run()
      return
    if self._absorb(self._timed(self._ex.read_chunks)):
      return
    if self._own.room():
      self._read()
      return
    peer = missing[0]
    if self._live.dead(peer):
      self._abort = self._lost(peer)
    elif (note := self._live.closed(peer)) is not None:
      self._absorb(self._timed(self._ex.read_chunks))  # Its ending here, if it posted one.
      # A closing ending it posted here (`reset()`, `set_state()`, a close)
      # is the one to raise: the ledger holds it as its abort.
      if self._abort is None and self._led.abort is None and peer in self._needed():
        message = endings.closed_peer_message(note, self._ex.namespace)
        self._abort = plan_lib.ReportedError(
          ErrorKind.CLOSED, message, peer, self._yielded, "closed", (peer,)
        )
    elif self._waited_s() > self._timeout_s:
      self._abort = self._timeout(peer)
    elif self._j == 0 and (cross := self._cross_wait(peer)) is not None:
      self._abort = cross
    else:
      self._absorb(self._blocking(self._ex.wait_chunk, peer))

  def _read_run(self) -> None:
    """Reads, while reads are quick, a window's worth or up to the furthest
    position a peer has posted, so that positions are decided (and decisions
    posted) in runs as long as the peers' chunks rather than one by one."""
    t0 = time.monotonic()
    self._read()
    want = max(self._own.lookahead, self._led.furthest() - self._j)
    while (
      self._own.room()
      and self._own.count - self._j < want
      and time.monotonic() - t0 < common.FLUSH_AFTER_S
    ):
      self._read()

  def _read(self) -> None:
    item = self._own.read()
    if isinstance(item, reader_lib.End):
      sig = None if self._own.signature is None else self._own.signature.to_json()
      self._led.end(common.make_report(self._who, (), item, sig, False))
      return
    if self._own.count == 1:
      self._led.set_own(
        self._p,
        signature=item.batch.signature.to_json(),
        devices=self._who.devices,
        config=self._who.config,
        resume=self._who.resume,
      )
    self._led.add_rows(self._p, item.batch.rows, item.digest, item.batch.sizes)

  def _absorb(self, items: list[tuple[int, str]]) -> bool:
    news = []  # (process, times) for `stats(all_hosts=True)`.
    for p, text in items:
      try:
        q, times = self._led.add_json(text)
      except ledger_lib.ProtocolError as e:
        message = wire.version_error(p, e.version, self._p)
        if e.version == wire.PROTOCOL_VERSION or e.version is None:
          message = (
            f"process {p} posted {e}; every process must run the same version of the library"
          )
        self._abort = plan_lib.ReportedError(ErrorKind.VALUE, message, p, self._yielded)
        return True
      if times is not None:
        news.append((q, times))
    if items and self._job is not None:
      self._job.add_times(news)
      self._job.check_stragglers()
    if items and self._n > 1:
      acked = min(self._led.ack(p) for p in range(self._n) if p != self._p)
      if acked > self._acked:
        self._ex.delete_decisions(acked)
        self._acked = acked
    return bool(items)

  def _timeout(self, peer: int) -> plan_lib.ReportedError:
    return plan_lib.ReportedError(
      ErrorKind.TIMEOUT,
      f"process {peer} did not report batch {self._yielded} (position"
      f" {self._j}) within `sync_timeout_s`={self._timeout_s:g}s; it is alive"
      " or only just silent (its liveness beat is recent), so it may have"
      " died just now, hung in its source, paused its training loop for"
      " longer than `sync_timeout_s`, or created its iterators in a different"
      " order (pass the same `name=` on every process)",
      peer,
      self._yielded,
      "PeerTimeoutError",
      (peer,),
    )

  def _lost(self, peer: int) -> plan_lib.ReportedError:
    return plan_lib.ReportedError(
      ErrorKind.LOST,
      f"process {peer} is lost: its liveness beat stopped for"
      f" {self._live.dead_after_s:g}s while the other processes waited for"
      f" its batch {self._yielded} (position {self._j}); it died (killed,"
      " out of memory, crashed) or froze",
      peer,
      self._yielded,
      "PeerLostError",
      (peer,),
    )

  def close(self, at_batch: int, error: plan_lib.ReportedError | None = None) -> None:
    """Posts this host's ending (closed, or `error`) as the final decision."""
    if self._ex.ended:
      return
    final = ledger_lib.Decision(self._j, (), End.RAISE, error or self._closed_error(at_batch))
    try:
      self._ex.post_decision(self._seq, final.to_json(), final=True)
    finally:
      self._ex.end()


def _iterator(namespace: str) -> str:
  """An iterator's key prefix, without its stream's generation."""
  return namespace.rsplit("/", 1)[0]


def post_end(
  ex: exchange_lib.KeyValueExchange, at_batch: int, error: plan_lib.ReportedError | None
) -> None:
  """Posts this host's ending (closed, or `error`) to a stream it never started.

  Process 0 posts it as the stream's first and final decision, any other
  process as its first and final chunk: where each would have posted it
  from a started stream's `close`.
  """
  p = ex.process_index
  error = error or endings.closed_error(p, at_batch)
  try:
    if p == 0:
      final = ledger_lib.Decision(0, (), End.RAISE, error)
      ex.post_decision(0, final.to_json(), final=True)
    else:
      report = plan_lib.Report(process_index=p, error=error, local_devices=1)
      ex.post_chunk(ledger_lib.Chunk(start=0, ack=0, report=report).to_json(), final=True)
  finally:
    ex.end()
