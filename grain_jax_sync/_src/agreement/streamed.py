"""What the two sides of the streamed agreement share: own reads, runs, the ending.

Process 0 decides (`decider.Decider`), every other process follows (`follower.Follower`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import job_stats, messages, prefetch
from grain_jax_sync._src import liveness as liveness_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src.agreement import common, cross_wait, endings

logger = logging.getLogger(__name__)


class Streamed(common.Agreement):
  """What the decider and the followers share: own reads, the runs, the ending.

  Args:
    reader: This host's reader.
    exchange: The key-value exchange of this iterator.
    rules: The settings `plan.decide` needs.
    who: This process's identity.
    lookahead: `synchronize_lookahead`.
    timeout_s: `sync_timeout_s`.
    position: Output batches before the first one (the resume position).
    live: Tells dead peers from slow ones (default: their beats).
    read_ahead: At most this many positions held (None: `common.read_ahead_limit`).
    built: The build thread's progress, where one runs.
    pace: The consumer's positions in the last `decide_ahead_s` seconds
      (`build.Builder.pace`); None: no time horizon.
    job: The iterator's cross-host view (`job_stats.JobTable`); None: none kept.
  """

  def __init__(
    self,
    reader: Iterator[reader_lib.Read | reader_lib.End] | prefetch.OnDemand[Any],
    exchange: exchange_lib.KeyValueExchange,
    rules: plan_lib.Rules,
    who: common.Identity,
    *,
    lookahead: int | None,
    timeout_s: float,
    position: int,
    live: liveness_lib.Liveness | None = None,
    read_ahead: int | None = None,
    built: common.Built | None = None,
    pace: Callable[[], int] | None = None,
    job: job_stats.JobTable | None = None,
  ):
    super().__init__(rules, who)
    self._exchange = exchange
    self._process = exchange.process_index
    self._process_count = exchange.process_count
    self._timeout_s = timeout_s
    self._own = common.OwnReads(
      reader, lookahead=lookahead, read_ahead=read_ahead, built=built, pace=pace
    )
    self._live = live or liveness_lib.Liveness(exchange)
    self._decided = 0  # Positions decided.
    self._yielded = position  # Output batches decided (for messages).
    self._seq = 0  # Decisions posted (decider) or consumed (follower).
    self._signature: batches_lib.Signature | None = None
    self._reads_since_look = 0  # Own reads since the peers' posts were last read.
    self._last_poll = -1.0  # When the peers' posts were last read (`Decider._news_stale`).
    self._idle = False  # The last wait in the store brought nothing: read the beats.
    self._stop_posted = False
    # Inline (no reading thread), the consumer's call runs the agreement: it
    # holds this while it does, and a stop asked for between calls is posted
    # under it (`post_stop`).
    self.turn = threading.Lock()
    self.reached_end = False  # The final decision ended the stream without an error.
    self._waiting_since: float | None = None
    self._cross = cross_wait.CrossWait(exchange, self._live, timeout_s)
    exchange_lib.stream_started(exchange.namespace)
    self._job = job
    if job is not None:
      job.attach(self._process, self._process_count)

  def request_stop(self, at_batch: int) -> None:
    """Asks every host to stop; wakes a wait for the reading thread, or inline posts it now."""
    super().request_stop(at_batch)
    self._own.nudge()
    if self._own.inline:
      self.post_stop()

  def post_stop(self) -> None:
    """Inline: posts a stop asked for here now, unless a call holds `turn` (it posts it as it ends).

    Never waits for the turn: a signal handler must not wait on a lock that
    the code it interrupted may hold.
    """
    while self._stop_at is not None and not self._stop_posted and self.turn.acquire(False):
      try:
        stop = self._stop_due()
        if stop is not None and not self._exchange.ended:
          self._post_stop(stop)
      except Exception as e:  # noqa: BLE001 - from `request_stop`: it never raises.
        logger.warning("grain_jax_sync: could not post the stop: %s", e)
      finally:
        self.turn.release()

  def _post_stop(self, stop: messages.ReportedError) -> None:
    """Posts this host's stop (`Decider` and `Follower` each their own way)."""
    raise NotImplementedError

  def _forget_decided(self) -> None:
    """Drops what the decided positions no longer need (`Decider` and `Follower` each their own)."""
    raise NotImplementedError

  def _hand_on(self, decision: messages.Decision) -> Iterator[common.Run]:
    """Yields this host's run of `decision`; after the final one, stops or raises the agreed error."""
    self._cross.done()  # Decided: no longer a crosswise wait.
    run = self._apply(decision)
    self._forget_decided()
    if decision.end != messages.Outcome.CONTINUE:
      self._exchange.end()
    if run is not None:
      yield run
      run = None  # The build thread's alone: freed once it is built, as the read-ahead counts.
    if decision.end != messages.Outcome.CONTINUE:
      self.reached_end = self._agreed_end(decision.end, decision.error, self._own.end)

  def _apply(self, decision: messages.Decision) -> common.Run | None:
    """This host's reads for a decision, as a run for the builder; the batch size pinned."""
    self._rules = plan_lib.pin(self._rules, decision)
    if self._signature is None:
      if self._own.signature is not None:
        self._signature = self._own.signature
      elif decision.signature is not None:
        self._signature = batches_lib.Signature.from_json(decision.signature)
    reads = self._own.take(self._decided, len(decision.steps))
    self._decided += len(decision.steps)
    self._yielded += sum(1 for s in decision.steps if s.action == messages.Action.YIELD)
    self._waiting_since = None
    if not decision.steps:
      return None
    steps = tuple(zip(reads, decision.steps, strict=True))
    return common.Run(steps, self._signature)

  def _stop_due(self) -> messages.ReportedError | None:
    """A stop asked for here and not posted yet: this host reads nothing more."""
    if self._stop_at is None or self._stop_posted:
      return None
    self._stop_posted = True
    self._own.stopped = True
    return endings.stopped_error(self._process, self._stop_at)

  def _timed(self, fn: Any, *args: Any) -> Any:
    """A store read of the peers' posts (its time marks the news as fresh)."""
    out = fn(*args)
    self._last_poll = time.monotonic()
    self._reads_since_look = 0
    return out

  def _wait_slice(self, fn: Any, *args: Any) -> Any:
    """A blocking read of the peers' posts; only after an empty one are beats read (`liveness`)."""
    out = self._timed(fn, *args)
    self._idle = not out
    return out

  def _waited_s(self) -> float:
    now = time.monotonic()
    if self._waiting_since is None:
      self._waiting_since = now
    return now - self._waiting_since

  def wait_for_peers_at_end(self) -> None:
    """At the agreed end, in the consumer's thread: returns once every peer's consumer got there.

    A peer that left before the end (a close, a restart, a kill), even after
    every position was decided, raises the error naming it; one that neither
    arrives nor leaves within `sync_timeout_s` raises `PeerTimeoutError`.
    """
    self._exchange.post_reached_end()
    since = time.monotonic()
    while not self._exchange.wait_all_reached_end():
      notes = self._exchange.end_notes()
      left = [notes[q] for q in sorted(notes) if notes[q]]
      if left:
        raise RuntimeError(left[0])
      waiting = [q for q in range(self._process_count) if q not in notes]
      for peer in waiting:
        if self._live.dead(peer):
          when = f"before it received the last batch ({self._yielded} batches)"
          error = endings.lost(peer, self._live.dead_after_s, self._yielded, when)
          raise endings.to_exception(error, self._process, None)
      if waiting and time.monotonic() - since > self._timeout_s:
        error = messages.ReportedError(
          messages.ErrorKind.TIMEOUT,
          f"processes {waiting} did not reach the end of the stream ({self._yielded}"
          f" batches) within `sync_timeout_s`={self._timeout_s:g}s; they are alive"
          " (their liveness beats are recent) but stopped iterating before the end"
          " without closing the iterator",
          waiting[0],
          self._yielded,
          "PeerTimeoutError",
          tuple(waiting),
        )
        raise endings.to_exception(error, self._process, None)

  def leave(self, at_batch: int, error: messages.ReportedError | None) -> None:
    """Tells peers waiting at the end that this host left before it (best effort)."""
    message = (error or endings.closed_error(self._process, at_batch)).message
    self._exchange.post_left(message)

  def release(self) -> None:
    self._cross.done()  # No longer a crosswise wait.

  def close(self, at_batch: int, error: messages.ReportedError | None = None) -> None:
    """Posts this host's ending (`Decider` and `Follower` each post their own)."""
    raise NotImplementedError
