"""The streamed agreement on a process other than 0: post rows, follow decisions.

A `Follower` decides nothing: when process 0 is dead it raises naming it;
when it is silent beyond `sync_timeout_s` plus `common.FOLLOWER_GRACE_S` it
posts a timed-out ending and raises it.
"""

from __future__ import annotations

import collections
from typing import Any

from grain_jax_sync._src import messages, periods
from grain_jax_sync._src.agreement import common, core, endings
from grain_jax_sync._src.agreement.streamed import Streamed, reached
from grain_jax_sync._src.messages import Outcome


class Follower(Streamed):
  """A process other than 0: posts its rows, acts on process 0's decisions."""

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self._posted = 0  # Own positions posted.
    self._unposted: list[core.Read] = []  # Read, not posted yet (also in `_own.pending`).
    self._end_posted = False
    self._sent_first = False
    self._sent_signature = False
    self._chunks: collections.deque[tuple[int, int]] = collections.deque()  # (seq, start)
    self._gave_up: messages.ReportedError | None = None

  def _run(self) -> core.Steps:
    while True:
      text = yield from self._next_decision()
      if text is None:
        continue
      try:
        decision = messages.Decision.from_json(text)
      except messages.ProtocolError as e:
        yield from self._end_exchange()
        raise ValueError(messages.unreadable_error(0, e, self._process)) from e
      if decision.table is not None and self._job is not None:
        self._job.merge(decision.table)
      self._seq += 1
      yield from self._hand_on(decision)
      if decision.end != Outcome.CONTINUE:
        return

  def _next_decision(self) -> core.Steps:
    """A decision if one is posted; else reads ahead (posting every half read-ahead) or waits.

    Only with its read-ahead full does this host post what it holds and block in the
    store; while a read has not come it looks for a decision once per liveness period.
    """
    yield from self.stop_now()
    if self._own.room():
      # The build thread waits for a decision on what was posted: no read first.
      urgent = self._posted > self._decided and not self._own.waits_on_build()
      # Inline a read holds the consumer's call: where it waits on a posted read, the
      # decision first (else a millisecond's race), but not after a short read (the next judges it).
      posted = None
      if not urgent or not self._own.inline or self._own.short():
        posted = yield from self._read(0.0 if urgent else periods.LIVENESS_PERIOD_S)
      if posted is None:  # No read came: a slow or stuck source, a stop asked for, or inline.
        if urgent:
          yield from self._flush()
          return (yield from self._wait())
        return (yield from self._timed(core.TryDecision(self._seq)))
      if not posted or self._own.waits_on_build():
        return None
      # Posted, nothing decided left to build: wait in the store for the
      # stream's first decision, and with a build thread for one on a full
      # batch (a short one may wait for the next read: `Rules.wait_for_last`).
      if self._seq == 0 or self.threaded and not self._own.short():
        return (yield from self._wait())
      return None if self.threaded else (yield from self._timed(core.TryDecision(self._seq)))
    if self._posted <= self._decided and self._own.end is None:
      if self._own.waits_on_build():
        # Posts come in runs, not a batch each.
        yield from self._own.wait_for_build(until_room=True)
        return None
      yield from self._flush()
    elif self._own.end is not None:
      yield from self._flush()
    return (yield from self._wait())

  def _wait(self) -> core.Steps:
    if self._idle and (yield core.IsDead(0)):
      yield from self._end_exchange()
      when = f"while process {self._process} waited for its decision on batch {self._yielded}"
      cause = "process 0 hosts the coordination service, so the job must be restarted"
      raise endings.to_exception(endings.lost(0, self._yielded, when, cause), self._process, None)
    note = (yield core.ClosedNote(0)) if self._idle else None
    if note is not None:
      text = yield from self._timed(core.TryDecision(self._seq))  # Its ending here, if any.
      if text is not None:
        return text
      yield from self._end_exchange()
      raise RuntimeError(endings.closed_peer_message(note, self._namespace))
    if self._idle and self._seq == 0 and (cross := (yield from self._crosswise(0))):
      yield from self._post(final=True, error=cross)
      yield from self._end_exchange()
      raise endings.to_exception(cross, self._process, None)
    waited = self._waited_s()
    limit = self._timeout_s + common.FOLLOWER_GRACE_S
    if self._gave_up is None and reached(waited, limit):
      # Process 0 should have named the slow peer by now: report it ourselves.
      self._gave_up = self._timeout_error()
      yield from self._post(final=True, error=self._gave_up)
    elif self._gave_up is not None and reached(waited, limit + common.FOLLOWER_GRACE_S):
      yield from self._end_exchange()
      raise endings.to_exception(self._gave_up, self._process, None)
    left_s = limit + (0.0 if self._gave_up is None else common.FOLLOWER_GRACE_S) - waited
    return (yield from self._wait_slice(core.WaitDecision(self._seq, self._until(left_s))))

  def _post_stop(self, stop: messages.ReportedError) -> core.Steps:
    # An ending's report carries no rows (`_post`): unposted rows are void.
    yield from self._post(final=False, error=stop)  # Then follows the decisions to the stop.

  def _timeout_error(self) -> messages.ReportedError:
    cause = "its agreement thread is stuck (in its source?)"
    if self._seq == 0:
      # Nothing decided in this stream yet: process 0 may not have made or
      # started this iterator, which looks the same from here.
      cause = f"it has posted no decision on this iterator yet: {cause}, or {endings.order_cause()}"
    message = (
      f"process {self._process} got no decision on batch {self._yielded} from"
      f" process 0 within `sync_timeout_s`={self._timeout_s:g}s (+"
      f" {common.FOLLOWER_GRACE_S:g}s); process 0 is alive but {cause}"
    )
    return messages.ReportedError(
      messages.ErrorKind.TIMEOUT, message, self._process, self._yielded, "PeerTimeoutError", (0,)
    )

  def _read(self, wait_s: float) -> core.Steps:
    """Takes the reads at hand; True where it then posted (`common.OwnReads.due`), None where none came."""
    items = yield from self._own.read(wait_s)
    if not items:
      return None
    self._unposted += [r for r in items if type(r) is core.Read]
    if self._own.end is not None:
      yield from self._flush()
      return False
    if self._own.due(len(self._unposted)):
      yield from self._flush()  # Process 0 decides it while this host reads on.
      return True
    return False

  def _flush(self) -> core.Steps:
    final = self._own.end is not None and not self._end_posted
    if self._unposted or final:
      yield from self._post(final=False, error=None)

  def _post(self, *, final: bool, error: messages.ReportedError | None) -> core.Steps:
    """Posts unposted rows and, once read, the ending (or `error`, a closing one)."""
    start = self._posted
    seq = yield self._chunk(final=final, error=error)
    if self._posted > start:
      self._chunks.append((seq, start))

  def _chunk(self, *, final: bool, error: messages.ReportedError | None) -> core.PostChunk:
    """The next chunk's text, with `final`: unposted rows and, once read, the ending (or `error`)."""
    end = self._own.end if not self._end_posted else None
    sig = None
    if not self._sent_signature and self._own.signature is not None:
      sig = self._own.signature.to_json()
      self._sent_signature = True
    report = common.make_report(
      self._who, self._unposted, self._rules, end, sig, not self._sent_first
    )
    if error is not None:
      report = messages.Report(
        process_index=self._process, error=error, local_devices=self._who.devices
      )
    times = self._job.times_to_post() if self._job is not None else None
    chunk = messages.Chunk(start=self._posted, ack=self._seq, report=report, times=times)
    self._sent_first = True
    self._posted += len(report.rows)
    self._unposted.clear()
    self._end_posted = self._end_posted or end is not None or error is not None
    return core.PostChunk(chunk.to_json(), final)

  def _forget_decided(self) -> core.Steps:
    """Deletes own chunks the decider has read (a later position is decided)."""
    read = None
    while self._chunks and self._chunks[0][1] < self._decided:
      read = self._chunks.popleft()[0] + 1
    if read is not None:
      yield core.DeleteChunks(read)

  def _closing(self, at_batch: int, error: messages.ReportedError | None) -> list[core.StoreCall]:
    """Posts this host's ending (closed, or `error`) as its final chunk."""
    calls: list[core.StoreCall] = []
    if not self._end_posted or error is None or error.kind in messages.ABORTS:
      self._unposted.clear()
      error = error or endings.closed_error(self._process, at_batch)
      calls.append(self._chunk(final=True, error=error))
    return [*calls, core.EndExchange()]
