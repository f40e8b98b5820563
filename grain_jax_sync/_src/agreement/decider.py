"""The streamed agreement's process 0: one decider, O(processes).

Process 0 (`Decider`, here) reads every peer's chunks with one directory
read, decides with `plan.decide` and posts each decision once; every other
process (`follower.Follower`) posts its chunks and reads the decisions. See
`streamed.Streamed` for what both share, `agreement` for the endings and
`exchange` for the keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from grain_jax_sync._src import ledger as ledger_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src import wire
from grain_jax_sync._src.agreement import common, endings
from grain_jax_sync._src.agreement.streamed import End, ErrorKind, Streamed


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

  def __iter__(self) -> Iterator[common.Run]:
    while True:
      stop = self._stop_due()
      if stop is not None and self._abort is None and self._led.abort is None:
        self._abort = stop  # Decided at the first position not decided yet.
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
    """Reads this host's next batch, or gathers the peers' chunks, or waits for them.

    This host reads while it holds fewer than its read-ahead of undecided
    batches: a read is work the job needs anyway, and the read-ahead bounds
    it. Only then does it look at the store, once, and block on the first
    peer still awaited: no timer decides when to look, on any host.
    """
    missing = self._needed()
    if self._p in missing or self._own.room():
      self._read()
      return
    if self._absorb(self._timed(self._ex.read_chunks)):
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
      self._absorb(self._timed(self._ex.wait_chunk, peer))

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
      f" longer than `sync_timeout_s`, or {endings.order_cause()}",
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
