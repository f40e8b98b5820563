"""The iterator's lifetime: one session per (re)start, one state machine, one close.

```
IDLE --next()--> RUNNING --end, set_state(), reset()--> IDLE
  \\                 \\
   +---close()-------+--> CLOSING --> CLOSED
```

The concurrency contract:

* `next()`, `set_state()`, `reset()` and a source restore belong to one
  thread at a time: a call made while another is in progress raises
  RuntimeError at once, naming the call in progress. There is no queue.
* `get_state()` and `stats()` read one value each (``mark``, ``_state``),
  replaced whole: any thread, any time, no lock.
* `close()` and `request_stop()` come from any thread or a signal handler.
  A close asked for inside a call of the same thread (a signal handler, the
  source itself) only asks: it wakes the stages without taking a lock, and
  the call carries the close out on its way out. A close from a stage's own
  thread (the source), and the finalizer's in any thread but the main one (a
  garbage collection runs where something allocates: a stage, a source's
  own thread), hand the close to a new thread, so that no close joins its
  own thread or waits on a stage that waits on it. A close from another
  thread waits for the call in progress to end (it was woken), then closes.

Fields that more than one thread touches, and their guard (every other
field is touched only by the thread in the call):

* ``_state``: the phase, the call in progress, the running stages and the
  times of stopped ones, as one `State` value replaced whole under
  ``_lock`` (``_idle`` waits on it). Read without the lock as one value.
* ``mark``: where the consumer is (`session.Mark`); replaced whole by the
  thread in the call, read without a lock (`get_state`, `stats`).
* ``_asked`` and ``_stop_at``: a close or a stop was asked for; set without
  a lock (a signal handler).
* ``_closed``: an event, set once the close is done.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from typing import Any, NamedTuple

import jax

from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import messages, reader, sources
from grain_jax_sync._src import prefetch as prefetch_lib
from grain_jax_sync._src import session as session_lib
from grain_jax_sync._src import stats as stats_lib
from grain_jax_sync._src.session import Mark

logger = logging.getLogger(__name__)

CLOSER_THREAD = "grain_jax_sync-close"


def open_source(
  origin: Any, options: Any, namespace: str | None
) -> tuple[sources.SourceIterator, Any]:
  """Opens the source and reads its first state (None without states).

  Where either fails, this host's ending goes to the first stream before the
  error is raised: its peers would otherwise wait `sync_timeout_s` for a host
  that never reports.
  """
  try:
    source = sources.open_source(origin)
    return source, source.get_state() if source.supports_state else None
  except BaseException as e:
    end = reader.failed(jax.process_index(), 0, 0, e, "opening its source")
    first = None if namespace is None else f"{namespace}/1"
    session_lib.end_unstarted(options, first, 0, end.error)
    raise


class Phase(enum.Enum):
  IDLE = "idle"  # No stages: not started yet, restarted, or the stream ended.
  RUNNING = "running"
  CLOSING = "closing"
  CLOSED = "closed"


class State(NamedTuple):
  """The lifetime's shared state: one value, replaced whole under the lock.

  Attributes:
    phase: Where the state machine is.
    turn: The thread in a call (None: nobody).
    call: The call in progress (`next()`, `set_state()`, ...), for messages.
    stages: The running session's stages (None: not running).
    finished: The stage times of the sessions stopped so far.
  """

  phase: Phase = Phase.IDLE
  turn: int | None = None
  call: str = ""
  stages: session_lib.Stages | None = None
  finished: stats_lib.Times = stats_lib.Times()


class Lifetime:
  """The sessions of one iterator; holds no reference to it (its finalizer closes this).

  Args:
    options: The iterator's options (`options.Options`).
    placement: Where the rows go.
    source: The opened source (replaced by `reset()`), closed at the close.
    namespace: The iterator's key prefix (None: nothing is exchanged).
    mark: Where the consumer starts.
  """

  def __init__(
    self,
    *,
    options: Any,
    placement: Any,
    source: Any,
    namespace: str | None,
    mark: Mark,
  ):
    self._options = options
    self._placement = placement
    self.source = source
    self._namespace = namespace
    self._lock = threading.Lock()
    self._idle = threading.Condition(self._lock)  # A closer waits here for the call to end.
    self._local = threading.local()  # Per thread: inside a call, or a close.
    self._state = State()
    self._asked = False
    self._stop_at: int | None = None  # `request_stop()`: the batches received then.
    self.stopped_by: int | None = None  # The process whose stop ended the last stream.
    self._closed = threading.Event()
    self.mark = mark
    self.generation = 0  # Streams started or ended so far; names their keys.
    self.start_error: BaseException | None = None  # Raised by the next start.
    self.refusal: str | None = None  # A refused state's error, raised by `next()`.
    self.exhausted = False
    # No stream started since the last (re)start: the peers may wait in the
    # next one, so a close or a refusal posts this host's ending there.
    self.pending_start = True
    self.job: Any = None  # `stats(all_hosts=True)`'s table, fed by the agreement.
    # The last stopped stages' reading thread: it may still be in the source.
    self._reading: prefetch_lib.OnDemand[Any] | None = None

  # -- turns ---------------------------------------------------------------------

  def in_turn(self) -> bool:
    """Whether this thread is inside a call (`next()`, `set_state()`, ...), wherever in it."""
    return bool(getattr(self._local, "turn", False))

  def take_turn(self, what: str) -> None:
    """Begins call `what` in this thread; raises if closed or another call is in progress."""
    if self.in_turn():
      raise RuntimeError(
        f"{what} was called from inside this thread's own next() (a signal"
        " handler, the source?); call it between batches"
      )
    self._local.turn = True  # Before the lock: a handler landing in it only asks.
    try:
      with self._lock:
        state = self._state
        if state.phase in (Phase.CLOSING, Phase.CLOSED) or self._asked:
          raise RuntimeError("the iterator is closed")
        if state.turn is not None:
          raise RuntimeError(
            f"{what} was called while {state.call} is in progress in another"
            " thread; next(), set_state() and reset() belong to one thread at"
            " a time (get_state(), stats(), close() and request_stop() may be"
            " called from any thread)"
          )
        self._set(turn=threading.get_ident(), call=what)
    except BaseException:
      self._local.turn = False
      self._close_if_asked()  # By this thread's handler, after the check above.
      raise

  def give_turn(self) -> None:
    """Ends this thread's call; carries out a close asked for meanwhile."""
    finish = False
    with self._lock:
      self._set(turn=None, call="")
      if self._asked and self._state.phase not in (Phase.CLOSING, Phase.CLOSED):
        self._set(phase=Phase.CLOSING, turn=threading.get_ident(), call="close()")
        finish = self._local.closing = True  # Before the call ends: a handler only asks.
      self._idle.notify_all()  # A closer waiting for the call to end.
    self._local.turn = False
    if finish:
      try:
        self._finish()
      finally:
        self._local.closing = False
    else:
      self._close_if_asked()  # By this thread's handler, after the check above.

  def _close_if_asked(self) -> None:
    """Out of a turn: carries out a close asked for too late for the turn to see it.

    A signal handler that lands after the turn's last look at the request
    (here, or past `take_turn`'s) only asked, as it was still inside the
    turn; nobody else would close.
    """
    if self._asked and not self._closed.is_set():
      self.close()

  def receive(self, item: Any, wait_s: float, batch_size: int | None) -> bool:
    """Counts a batch in the mark, unless a close came first (then it is dropped).

    `batch_size` is the stream's agreed full batch size (`session.Stages.batch_size`).

    In the call: the mark is replaced whole, so readers in other threads
    see the old mark or the new one, never a mix.
    """
    if self._asked:
      return False
    d = self.mark.delivered.added(item.real, item.rows, item.dropped, wait_s)
    self.mark = Mark(self.mark.position + 1, item.state, batch_size, d)
    return True

  def waited(self, wait_s: float, dropped: int) -> None:
    """Counts a `next()` that ended the stream (in the call)."""
    d = self.mark.delivered.ended(wait_s, dropped)
    self.mark = self.mark._replace(delivered=d)

  @property
  def asked(self) -> bool:
    return self._asked

  def request_stop(self) -> None:
    """Asks every host to stop at one position; no lock, returns at once (any thread, a handler).

    The running stages' agreement posts it from its own thread; stages not
    started yet get it when they start. Once asked, later requests change
    nothing.
    """
    if self._stop_at is not None or self.exhausted or self._closed.is_set():
      return
    self._stop_at = self.mark.position
    stages = self._state.stages
    if stages is not None:
      stages.request_stop(self._stop_at)

  def _set(self, **changes: Any) -> None:
    """Under the lock: replaces the shared state with these fields changed."""
    self._state = self._state._replace(**changes)

  # -- sessions ------------------------------------------------------------------

  def stages(self) -> session_lib.Stages:
    """The running stages, started now if there are none. In a turn."""
    stages = self._state.stages
    if stages is None:
      self.generation += 1
      ns = None if self._namespace is None else f"{self._namespace}/{self.generation}"
      start_error, self.start_error = self.start_error, None
      start = session_lib.Start(
        self._options, self._placement, self.source, self.mark, start_error, ns, self.job
      )
      stages = session_lib.Stages(start)
      self.pending_start = False
      with self._lock:
        self._set(stages=stages, phase=Phase.RUNNING)
      if self._asked:  # A close asked for meanwhile, before these stages could hear it.
        stages.interrupt()
      if self._stop_at is not None:  # A stop asked for before these stages.
        stages.request_stop(self._stop_at)
    return stages

  @property
  def running(self) -> bool:
    return self._state.stages is not None

  def halt(self) -> None:
    """Stops the running stages' threads (the source may be moved); posts nothing. In a turn."""
    stages = self._state.stages
    if stages is not None:
      stages.halt()
    self._settle_reads()

  def _settle_reads(self) -> None:
    """Waits for a read that stopped stages left in the source, before it is moved or reopened."""
    if self._reading is not None:
      self._reading.close()
      self._reading = None

  def restart(self, mark: Mark) -> None:
    """Stops the running stages; the next `stages()` starts a new stream at `mark`. In a turn."""
    self.stop()
    self.mark = mark
    self.refusal = None
    self.exhausted = False
    self.pending_start = True
    self._stop_at = None  # A request ended (or would have ended) the old stream only.
    self.stopped_by = None

  def stop(self, ending: messages.ReportedError | None = None) -> None:
    """Stops the running stages, posting `ending` (default: closed); the next `stages()` restarts.

    A read stuck in the source is left to return on its own (`_settle_reads`).
    """
    with self._lock:
      stages = self._state.stages
      phase = Phase.IDLE if self._state.phase is Phase.RUNNING else self._state.phase
      self._set(stages=None, phase=phase)
    if stages is not None:
      self._reading = stages.reading  # Not the stages: their ending may hold this iterator.
      stages.close(self.mark.position, ending)
      with self._lock:
        self._set(finished=self._state.finished + stages.times())
      if self.job is not None:
        # The figures of the batches built after the final decision too;
        # posted for the peers only after an agreed end (an error ends every
        # host, and its keys would outlive an iterator never closed).
        self.job.ended(post=stages.reached_end)

  def leave(self, how: str) -> None:
    """Stops the running stream with this host's ending "process p {how} at batch i". In a turn."""
    p, at = jax.process_index(), self.mark.position
    self.stop(
      messages.ReportedError(
        messages.ErrorKind.CLOSED, f"process {p} {how} at batch {at}", p, at, "reset"
      )
    )
    self._settle_reads()  # The source is moved or reopened next.

  def refuse(self, message: str) -> None:
    """Makes a refused state's error this host's ending; `next()` raises it. In a turn.

    Posted at once, to the running stream or to the one it would have
    started, not when this host next iterates or closes: a host that lets the
    error propagate keeps the iterator alive in its traceback, and its peers
    waited `sync_timeout_s`. Until a `set_state` or `reset` succeeds,
    `next()` raises the same error.
    """
    ending = messages.ReportedError(messages.ErrorKind.VALUE, message, jax.process_index(), 0)
    if self.running:
      self.stop(ending)
    else:
      # The peers wait in the stream this host would have started: end it
      # there now; a later restart takes the stream after it, as theirs do.
      self.end_unstarted(ending)
    self.pending_start = True
    self.refusal = message

  def end_unstarted(self, ending: messages.ReportedError | None = None) -> None:
    """Posts `ending` (default: closed) to the stream this host would start next; in a turn.

    A later restart takes the stream after it, as the peers' do.
    """
    if self._state.stages is None and self._namespace is not None and self.pending_start:
      self.generation += 1
      ns = f"{self._namespace}/{self.generation}"
      session_lib.end_unstarted(self._options, ns, self.mark.position, ending)

  def times(self) -> stats_lib.Times:
    state = self._state  # One value: no lock.
    running = state.stages
    return state.finished if running is None else state.finished + running.times()

  def snapshot(self) -> dict[str, Any]:
    """This host's `stats()`: no lock, from any thread or a signal handler."""
    return stats_lib.snapshot(self.mark.delivered, self.times())

  # -- the close -------------------------------------------------------------------

  def close(self) -> None:
    """The one close path, whoever calls it; idempotent, never raises."""
    if self._closed.is_set():
      return  # Also at interpreter exit, where module globals may be gone.
    if self.in_turn() or getattr(self._local, "closing", False):
      self._ask()  # Inside this thread's own turn or close: that call finishes it.
      return
    if prefetch_lib.in_library_thread():
      # A stage's own thread (the source): this close would join it.
      self._ask()
      self._hand_off()
      return
    self._local.closing = True
    try:
      self._close()
    finally:
      self._local.closing = False

  def collected(self) -> None:
    """The finalizer's close: the main thread closes (a ``del``, the exit); another asks.

    A collection runs it wherever something allocates: a stage, or a
    source's own thread that a stage waits on. A close there would wait on
    that very thread, then give up without posting: a new thread closes.
    """
    if threading.current_thread() is threading.main_thread():
      self.close()
      return
    self._ask()
    self._hand_off()

  def _ask(self) -> None:
    """Asks for the close without a lock: wakes the stages' waits."""
    self._asked = True
    stages = self._state.stages
    if stages is not None:
      stages.interrupt()

  def _hand_off(self) -> None:
    """Closes from a new thread: this one is a stage's own, or a collection's (`collected`)."""
    try:
      threading.Thread(target=self.close, name=CLOSER_THREAD, daemon=True).start()
    except RuntimeError:  # At interpreter exit no thread starts; the stages are daemons.
      logger.debug("grain_jax_sync: could not start the closing thread", exc_info=True)

  def _close(self) -> None:
    with self._lock:
      first = self._state.phase not in (Phase.CLOSING, Phase.CLOSED)
      if first:
        self._set(phase=Phase.CLOSING)
      self._asked = True
    if not first:
      self._closed.wait(prefetch_lib.JOIN_TIMEOUT_S)  # Another thread closes.
      return
    self._ask()
    with self._lock:
      # A turn in progress was woken above; one that reads the source itself
      # (a generator cannot be closed while it runs) carries the close out
      # when its read returns, if it outlasts this wait.
      if self._state.turn is not None and not self._idle.wait_for(
        lambda: self._state.turn is None, prefetch_lib.JOIN_TIMEOUT_S
      ):
        self._set(phase=Phase.RUNNING if self._state.stages is not None else Phase.IDLE)
        return  # `give_turn` finishes it.
      self._set(turn=threading.get_ident(), call="close()")
    self._finish()

  def _finish(self) -> None:
    """Stops the stages, posts this host's ending, closes the source; holds the turn. Once."""
    try:
      at = self.mark.position
      self.stop()  # Closed: the peers raise "process p closed its iterator".
      self.end_unstarted()
      stream = f"{self._namespace}/{self.generation}"
      if self._namespace is not None and self._options.synchronize_batches:
        message = f"process {jax.process_index()} closed its iterator at batch {at}"
        exchange_lib.register_close(self._namespace, json.dumps([stream, message]))
      if self._namespace is not None:
        exchange_lib.forget(self._namespace)  # Nothing of a closed iterator stays recorded.
      if self._reading is None:
        self.source.close()
      else:
        self._reading.after(self.source.close)  # Once a read stuck in the source returns.
    except Exception as e:  # noqa: BLE001 - best effort: close never raises.
      logger.warning("grain_jax_sync: closing the iterator failed: %s", e)
    finally:
      with self._lock:
        self._set(phase=Phase.CLOSED, turn=None, call="")
        self._idle.notify_all()
      self._closed.set()
