"""The streamed agreement's process 0: one decider, O(processes).

`Decider` reads every peer's chunks with one directory read, decides with
`plan.decide` and posts each decision once for the others (`follower.Follower`).
"""

from __future__ import annotations

from typing import Any

from grain_jax_sync._src import messages, periods
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.agreement import common, core, endings, follower
from grain_jax_sync._src.agreement import ledger as ledger_lib
from grain_jax_sync._src.agreement.streamed import Streamed, reached, unstarted
from grain_jax_sync._src.messages import Outcome


class Decider(Streamed):
  """Process 0: reads every chunk, decides, posts the decisions."""

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self._ledger = ledger_lib.Ledger(
      self._process_count, digests=bool(self._who.groups), sizes=self._rules.shapes is not None
    )
    self._set_own(signature=None)
    self._sent_signature = False
    self._sent_batch_size = False
    # An ending found here (an unreadable chunk, a timed-out or lost peer).
    self._abort: messages.ReportedError | None = None
    self._acked = 0  # Decisions deleted below this.
    # After `Outcome.WAIT`: the processes whose next batch (or end) is awaited,
    # with the positions they had reported then.
    self._wait: dict[int, int] | None = None
    self._waited = False  # Waited since the peers' chunks were last read (`_run`: stale news).

  def _run(self) -> core.Steps:
    while True:
      yield from self.stop_now()
      plan = self._plan()
      if plan is not None and plan.end == Outcome.WAIT:
        self._wait = {p: self._ledger.count(p) for p in plan.waiting}
        plan = plan_lib.Plan(plan.steps, Outcome.CONTINUE)  # Its batch size is pinned.
        if not plan.steps:
          plan = None
      if plan is None:
        yield from self._advance()
        continue
      # Stale where this host waited since the peers' chunks were read (an ending posted
      # meanwhile), or read them long ago (a follower without a decision for `sync_timeout_s`
      # plus a grace raises its timed-out ending a grace later): read again, then decide.
      stale = self._waited or self.now.t - self._last_poll >= common.FOLLOWER_GRACE_S / 2
      if plan.end == Outcome.CONTINUE and stale:
        self._wait = None  # Its steps are decided again, not held back by the wait.
        yield from self._absorb((yield from self._timed(core.ReadChunks())))
        continue  # Decide again with what the peers posted meanwhile.
      decision = yield from self._post(plan)
      yield from self._hand_on(decision)
      if decision.end != Outcome.CONTINUE:
        return
      # The consumer stepped meanwhile (inline), or the build thread took the run
      # before (the agreement thread waited for it): a peer may have posted a stop.
      self._waited = self._waited or bool(decision.steps)

  def _forget_decided(self) -> core.Steps:
    self._ledger.forget(self._decided)
    yield from ()

  def _post_stop(self, stop: messages.ReportedError) -> core.Steps:
    if self._abort is None and self._ledger.abort is None:
      self._abort = stop  # Decided at the first position not decided yet.
    yield from ()

  def _plan(self) -> plan_lib.Plan | None:
    """The next plan, or None while the next position is not known for everyone."""
    error = self._abort or self._ledger.abort
    if error is not None:
      return plan_lib.Plan((), Outcome.RAISE, error)
    if self._wait is not None:
      if self._needed():
        return None  # Deciding again before a waited process has news would spin.
      self._wait = None
    size = self._ledger.window(self._decided)
    if size == 0 or (self._own.room() and not self._own.due(size) and self._own.ready()):
      return None  # Read on: decided in runs (`common.OwnReads.due`).
    # The horizon less what the build thread holds, at least 1 when it holds none
    # (so a stop lands behind the built batches and one horizon).
    held = self._own.held() or 0
    allowance = max(self._own.limit - held, 1 if held == 0 else 0)
    if allowance == 0:
      return None  # A horizon's worth is decided: wait for the build thread.
    reports = self._ledger.window_reports(self._decided, size, with_config=self._decided == 0)
    plan = plan_lib.decide(reports, self._rules, position=self._yielded, groups=self._who.groups)
    if plan.end == Outcome.CONTINUE and len(plan.steps) > allowance:
      # Decided position by position, so a prefix of the plan is the plan of
      # that prefix; the rest is decided once the consumer takes what is ahead.
      plan = plan_lib.Plan(plan.steps[:allowance], Outcome.CONTINUE)
    self._rules = plan_lib.pin(self._rules, plan)
    return plan

  def _needed(self) -> list[int]:
    """The processes whose next batch (or end) the next decision waits for."""
    if self._wait is None:
      return self._ledger.missing(self._decided)
    return [
      p
      for p, count in self._wait.items()
      if self._ledger.count(p) <= count and not self._ledger.ended(p)
    ]

  def _post(self, plan: plan_lib.Plan) -> core.Steps:
    sig = None
    if not self._sent_signature and plan.steps:
      sig = messages.signature_of(self._ledger.window_reports(self._decided, 0, with_config=False))
      self._sent_signature = sig is not None
    table = None
    if self._job is not None:
      self._job.decided(plan.steps)
      self._job.check_stragglers(self.now.t)  # Process 0's own times are fresh here.
      table = self._job.rows_to_send(final=plan.end != Outcome.CONTINUE, now=self.now.t)
    batch_size = None  # Sent once, in the first decision that knows it.
    if not self._sent_batch_size and self._rules.batch_size is not None:
      batch_size = self._rules.batch_size
      self._sent_batch_size = True
    decision = messages.Decision(
      self._decided, plan.steps, plan.end, plan.error, sig, batch_size, table
    )
    yield core.PostDecision(self._seq, decision.to_json())
    self._seq += 1
    return decision

  def _advance(self) -> core.Steps:
    """Reads this host's next batch while its read-ahead has room (work the job needs anyway);
    only then looks at the store, once, and blocks on the first peer still awaited. While it
    waits for its own read, it reads the peers' posts once per liveness period (a stop, an end)."""
    missing = self._needed()
    if self._process in missing:
      # A wait for the source: a read asked of the reading thread that is not there yet.
      self._waited = self._waited or (not self._own.ready() and self._own.asked > 0)
      if not (yield from self._read(periods.LIVENESS_PERIOD_S)):
        yield from self._absorb((yield from self._timed(core.ReadChunks())))
      return
    # Before the stream's first decision the job waits for it: with its own
    # first read in hand, process 0 waits for the peers' rather than reads on.
    if self._own.room() and (self._decided > 0 or not missing) and self._own.ready():
      # Where the build thread holds nothing decided, look as often as the peers post.
      look = not self._own.waits_on_build() and self._own.due(self._reads_since_look)
      if look and (yield from self._absorb((yield from self._timed(core.ReadChunks())))):
        return
      yield from self._read(0.0)  # Read on, and look again half a read-ahead later.
      return
    if not missing:
      # Decided a horizon ahead (`_plan`'s allowance): as the build
      # thread takes a position, one more may be decided.
      yield from self._own.wait_for_build()
      self._waited = True
      return
    yield from self._wait_for_peer(missing[0])

  def _wait_for_peer(self, peer: int) -> core.Steps:
    """Waits for `peer`'s next post; names it where it is dead, closed, timed out or crosswise."""
    if self._idle and (yield core.IsDead(peer)):
      where = f"its batch {self._yielded} (position {self._decided})"
      when = f"while the other processes waited for {where}"
      self._abort = endings.lost(peer, self._yielded, when)
    elif self._idle and (note := (yield core.ClosedNote(peer))) is not None:
      # Its ending here, if it posted one.
      yield from self._absorb((yield from self._timed(core.ReadChunks())))
      # A closing ending it posted here (`reset()`, `set_state()`, a close)
      # is the one to raise: the ledger holds it as its abort.
      if self._abort is None and self._ledger.abort is None and peer in self._needed():
        message = endings.closed_peer_message(note, self._namespace)
        self._abort = messages.ReportedError(
          messages.ErrorKind.CLOSED, message, peer, self._yielded, "closed", (peer,)
        )
    elif reached(waited := self._waited_s(), self._timeout_s):
      message = (
        f"process {peer} did not report batch {self._yielded} (position"
        f" {self._decided}) within `sync_timeout_s`={self._timeout_s:g}s; it is alive"
        " or only just silent (its liveness beat is recent), so it may have"
        " died just now, hung in its source, paused its training loop for"
        f" longer than `sync_timeout_s`, or {endings.order_cause()}"
      )
      self._abort = messages.ReportedError(
        messages.ErrorKind.TIMEOUT, message, peer, self._yielded, "PeerTimeoutError", (peer,)
      )
    elif self._idle and not self._decided and (cross := (yield from self._crosswise(peer))):
      self._abort = cross
    else:
      stale = self._waited
      wait = core.WaitChunk(peer, self._until(self._timeout_s - waited))
      yield from self._absorb((yield from self._wait_slice(wait)))
      # With one peer, the one chunk waited for: a stop that peer posted
      # after it (during this host's last wait) is read before deciding.
      self._waited = stale and self._process_count == 2

  def _read(self, wait_s: float) -> core.Steps:
    """Takes this host's next reads into the ledger; False where none came within `wait_s`."""
    items = yield from self._own.read(wait_s)
    self._reads_since_look += len(items)
    for item in items:
      if isinstance(item, core.End):
        sig = None if self._own.signature is None else self._own.signature.to_json()
        self._ledger.add_end(common.make_report(self._who, (), self._rules, item, sig, False))
        break
      if self._ledger.count(self._process) == 0:
        self._set_own(signature=item.batch.signature.to_json())
      self._ledger.add_rows(self._process, item.batch.rows, item.digest, item.batch.sizes)
    return bool(items)

  def _set_own(self, *, signature: dict[str, Any] | None) -> None:
    """Records this process's identity in the ledger, with its structure once read."""
    who = self._who
    self._ledger.set_own(
      self._process, signature=signature, devices=who.devices, config=who.config, resume=who.resume
    )

  def _absorb(self, items: list[tuple[int, str]]) -> core.Steps:
    self._waited = False
    news = []  # (process, times) for `stats(all_hosts=True)`.
    for p, text in items:
      try:
        q, times = self._ledger.add_json(text)
      except messages.ProtocolError as e:
        message = messages.unreadable_error(p, e, self._process)
        self._abort = messages.ReportedError(messages.ErrorKind.VALUE, message, p, self._yielded)
        return True
      if times is not None:
        news.append((q, times))
    if items and self._job is not None:
      self._job.add_times(news)
      self._job.check_stragglers(self.now.t)
    if items and self._process_count > 1:
      acked = min(self._ledger.ack(p) for p in range(self._process_count) if p != self._process)
      if acked > self._acked:
        yield core.DeleteDecisions(acked)
        self._acked = acked
    return bool(items)

  def _closing(self, at_batch: int, error: messages.ReportedError | None) -> list[core.StoreCall]:
    """Posts this host's ending (closed, or `error`) as the final decision."""
    return unstarted(self._process, at_batch, error, seq=self._seq, start=self._decided)


def core_for(
  rules: plan_lib.Rules, who: common.Identity, *, threaded: bool, **settings: Any
) -> Decider | follower.Follower:
  """The streamed core of process `who.process`: process 0 decides, the others follow.

  `threaded`: a build thread and a reading thread run (else the consumer's
  `next()` reads); `settings`: `Streamed`'s other keyword arguments.
  """
  kind = Decider if who.process == 0 else follower.Follower
  return kind(rules, who, threaded=threaded, inline=not threaded, **settings)
