"""What the two roles of the streamed core share: own reads, runs, the ending.

Process 0 decides (`decider.Decider`), every other process follows
(`follower.Follower`). Both are cores (`core`): generators of actions, with
no thread, clock or store; `interpreter.carry` carries their actions out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import messages, periods
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.agreement import common, core, endings

if TYPE_CHECKING:  # Handed in by the session (it reads the clock); the core only calls it.
  from grain_jax_sync._src import job_stats

# Two processes that each wait at the start of a stream the other has not
# started (iterators created or started in a different order: a stream starts
# at its first `next()`) can never go on. Named after this long crosswise, or half
# `sync_timeout_s` if shorter: longer than a live peer takes between the
# first `next()` calls of iterators it starts together (threads), on any host.
CROSS_WAIT_S = 30.0


class Streamed(common.Agreement):
  """What the decider and the followers share: own reads, the runs, the ending.

  Args:
    rules: The settings `plan.decide` needs.
    who: This process's identity.
    namespace: The stream's keys (named in messages).
    process_count: How many processes take part.
    timeout_s: `sync_timeout_s`.
    position: Output batches before the first one (the resume position).
    job: The iterator's cross-host view (`job_stats.JobTable`); None: none kept.
    **reads: `common.OwnReads`'s arguments (`lookahead`, `threaded`, `inline`, ...).
  """

  def __init__(
    self,
    rules: plan_lib.Rules,
    who: common.Identity,
    *,
    namespace: str,
    process_count: int,
    timeout_s: float,
    position: int,
    job: job_stats.JobTable | None = None,
    **reads: Any,
  ):
    super().__init__(rules, who)
    self._process = who.process
    self._namespace = namespace
    self._process_count = process_count
    self._timeout_s = timeout_s
    self._own = common.OwnReads(**reads)
    self._own.batch_size = rules.batch_size
    self._decided = 0  # Positions decided.
    self._yielded = position  # Output batches decided (for messages).
    self._seq = 0  # Decisions posted (decider) or consumed (follower).
    self._signature: batches_lib.Signature | None = None
    self._reads_since_look = 0  # Own reads since the peers' posts were last read.
    self._last_poll = -1.0  # When the peers' posts were last read (`Decider._run`: stale news).
    self._idle = False  # The last wait in the store brought nothing: read the beats.
    self._stop_posted = False
    self.reached_end = False  # The final decision ended the stream without an error.
    self.ended = False  # The exchange is ended (the final decision, or this host's own).
    self.close = core.Close()  # This host's close, asked (`asked`).
    self._waiting_since: float | None = None
    self._cross_since: float | None = None  # Since when a peer waits crosswise.
    self._cross_s = min(CROSS_WAIT_S, timeout_s / 2)
    self.timer = float("inf")  # When it next needs to run (aioquic's `get_timer`; `_until`).
    self._job = job
    if job is not None:
      job.attach(self._process, self._process_count)
    main = core.Side(self._run(), self._own, self.close)  # A close asked: it decides no more.
    self.send, self.throw = main.send, main.throw

  @property
  def now(self) -> core.Now:
    return self._own.now

  def side(self, steps: core.Steps) -> core.Side:
    """A side run of this core's steps (`stop_now`, `at_end`)."""
    return core.Side(steps, self._own)

  def _run(self) -> core.Steps:
    raise NotImplementedError

  def asked(self, ask: int | core.Closing) -> None:
    """An ask taken from the inbox: a stop after batch `ask`, or this host's close (`core.Close`)."""
    if isinstance(ask, core.Closing):
      self.close.take(ask)
    else:
      self.stop_asked(ask)

  def ending(self) -> list[core.StoreCall]:
    """The calls that post this host's ending asked for: none before it came, none twice."""
    e = self.close.to_post()
    return [] if e is None or e.at_batch is None else self.closing(e.at_batch, e.error, left=e.left)

  def closing(
    self, at_batch: int, error: messages.ReportedError | None, *, left: bool = False
  ) -> list[core.StoreCall]:
    """The store calls that post this host's ending (closed, or `error`); none once ended.

    `left`: this host leaves before the agreed end, so peers waiting there are told too.
    """
    calls = [] if self.ended else self._closing(at_batch, error)
    self.ended = True
    if left:
      why = error or endings.closed_error(self._process, at_batch)
      calls.insert(max(0, len(calls) - 1), core.PostLeft(why.message))
    return calls

  def _closing(self, at_batch: int, error: messages.ReportedError | None) -> list[core.StoreCall]:
    """The calls that post this host's ending in the stream, then `core.EndExchange`."""
    raise NotImplementedError

  def at_end(self) -> core.Steps:
    """At the agreed end, in the consumer's thread: ends once every peer's consumer got there.

    A peer that left before the end (a close, a restart, a kill), even after
    every position was decided, raises the error naming it; one that neither
    arrives nor leaves within `sync_timeout_s` raises `PeerTimeoutError`.
    """
    yield core.PostReachedEnd()
    since, yielded = self.now.t, self._yielded
    while not (yield core.WaitAllReachedEnd(self._until(self._timeout_s - (self.now.t - since)))):
      notes = yield core.EndNotes()
      left = [notes[q] for q in sorted(notes) if notes[q]]
      if left:
        raise RuntimeError(left[0])
      waiting = [q for q in range(self._process_count) if q not in notes]
      for peer in waiting:
        if (yield core.IsDead(peer)):
          when = f"before it received the last batch ({yielded} batches)"
          raise endings.to_exception(endings.lost(peer, yielded, when), self._process, None)
      if waiting and reached(self.now.t - since, self._timeout_s):
        error = endings.not_at_end(waiting, yielded, self._timeout_s)
        raise endings.to_exception(error, self._process, None)

  def _crosswise(self, peer: int) -> core.Steps:
    """The crosswise ending once `peer` waited long enough at the start of a stream not started here.

    Each of two processes waits for the first decision of a stream the other
    has not started: each beat carries the streams its process waits on, and
    both find it, with one message. It is posted to the peer's stream too,
    where it waits: whichever of the two finds it first, both raise it.
    """
    theirs = yield core.Crosswise(peer)
    if not theirs:
      self._cross_since = None
      return None
    now = self.now.t
    if self._cross_since is None:
      self._cross_since = now
    if not reached(now - self._cross_since, self._cross_s):
      return None
    error = endings.crosswise((self._process, self._namespace), (peer, theirs[0]), self._yielded)
    yield core.Elsewhere(theirs[0], error.message, tuple(unstarted(self._process, 0, error)))
    return error

  def _forget_decided(self) -> core.Steps:
    """Drops what the decided positions no longer need (`Decider` and `Follower` each their own)."""
    raise NotImplementedError

  def _post_stop(self, stop: messages.ReportedError) -> core.Steps:
    """Posts this host's stop (`Decider` and `Follower` each their own way)."""
    raise NotImplementedError

  def stop_now(self) -> core.Steps:
    """A stop asked for here and not posted yet: posted now (inline, between calls); reads end."""
    if self._stop_at is None or self._stop_posted:
      return
    self._stop_posted = True
    self._own.stopped = True
    if not self.ended:
      yield from self._post_stop(endings.stopped_error(self._process, self._stop_at))

  def _end_exchange(self) -> core.Steps:
    self.ended = True
    yield core.EndExchange()

  def _hand_on(self, decision: messages.Decision) -> core.Steps:
    """Delivers this host's reads for `decision` as a run for the builder, the batch size pinned;
    after the final decision, stops or raises the agreed error."""
    yield core.NotWaiting()  # Decided: no longer a crosswise wait.
    self._rules = plan_lib.pin(self._rules, decision)
    self._own.batch_size = self._rules.batch_size
    if self._signature is None:
      if self._own.signature is not None:
        self._signature = self._own.signature
      elif decision.signature is not None:
        self._signature = batches_lib.Signature.from_json(decision.signature)
    reads = yield from self._own.take(self._decided, len(decision.steps))
    self._decided += len(decision.steps)
    self._yielded += sum(1 for s in decision.steps if s.action == messages.Action.YIELD)
    self._waiting_since = None
    yield from self._forget_decided()
    final = decision.end != messages.Outcome.CONTINUE
    if final:
      yield from self._end_exchange()
    if decision.steps:  # The build thread's alone: freed once built, as the read-ahead counts.
      run = common.Run(tuple(zip(reads, decision.steps, strict=True)), self._signature)
      yield core.Deliver(run)
      del run
    del reads
    if final:
      self.reached_end = self._agreed_end(decision.end, decision.error, self._own.end)

  def _timed(self, call: core.StoreCall) -> core.Steps:
    """A store read of the peers' posts (its time marks the news as fresh where it read them all)."""
    out = yield call
    if type(call) is not core.WaitChunk or self._process_count > 2:
      # With one peer, a wait reads the one chunk waited for, not every post:
      # what follows it (a timed-out ending posted long ago) is read before
      # deciding once the last read of every post is old (`Decider._run`).
      self._last_poll = self.now.t
    self._reads_since_look = 0
    return out

  def _wait_slice(self, call: core.StoreCall) -> core.Steps:
    """A blocking read of the peers' posts; only after an empty one are beats read (`liveness`)."""
    out = yield from self._timed(call)
    self._idle = not out
    return out

  def _until(self, left_s: float) -> float:
    """A wait's length: to the core's next deadline (`left_s` from now, or the crosswise one).

    A liveness period at most: the beats are looked at again then.
    """
    if self._cross_since is not None:
      left_s = min(left_s, self._cross_since + self._cross_s - self.now.t)
    wait_s = max(0.0, min(periods.LIVENESS_PERIOD_S, left_s))
    self.timer = self.now.t + wait_s
    return wait_s

  def _waited_s(self) -> float:
    now = self.now.t
    if self._waiting_since is None:
      self._waiting_since = now
    return now - self._waiting_since

  @property
  def threaded(self) -> bool:
    """Whether a build thread runs (its progress comes in `core.Now.done`)."""
    return self._own.held() is not None

  def stop_pending(self) -> bool:
    """Whether a stop was asked for here and not posted yet."""
    return self._stop_at is not None and not self._stop_posted


def reached(waited_s: float, limit_s: float) -> bool:
  """Whether a wait of `waited_s` reached `limit_s` (a wait cut at its deadline ends there, but for rounding)."""
  return waited_s >= limit_s - 1e-9


def unstarted(
  process: int, at_batch: int, error: messages.ReportedError | None, *, seq: int = 0, start: int = 0
) -> list[core.StoreCall]:
  """The calls that post `process`'s ending (closed, or `error`) to a stream it never started.

  As the stream's first and final decision (process 0) or chunk (any other);
  process 0 posts its ending in a stream it runs the same way, as decision
  `seq` at position `start`.
  """
  error = error or endings.closed_error(process, at_batch)
  if process == 0:
    final = messages.Decision(start, (), messages.Outcome.RAISE, error)
    return [core.PostDecision(seq, final.to_json(), True), core.EndExchange()]
  report = messages.Report(process_index=process, error=error, local_devices=1)
  chunk = messages.Chunk(start=0, ack=0, report=report)
  return [core.PostChunk(chunk.to_json(), True), core.EndExchange()]
