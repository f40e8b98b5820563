"""The iterator's lifetime: one state machine, the turn, one close.

```
OPEN --close()--> CLOSING --> CLOSED
```

The concurrency contract:

* `next()`, `set_state()`, `reset()` and a source restore belong to one
  thread at a time (the turn): a call made while another is in progress
  raises RuntimeError at once, naming the call in progress. There is no queue.
* `close()` and `request_stop()` come from any thread or a signal handler.
  A close asked for inside a call of the same thread (a signal handler, the
  source itself) only asks: it wakes the stream without taking a lock, and
  the call carries the close out on its way out. A close from a stage's own
  thread (the source), and the finalizer's in any thread but the main one (a
  garbage collection runs where something allocates: a stage, a source's
  own thread), hand the close to a new thread, so that no close joins its
  own thread or waits on a stage that waits on it. A close from another
  thread waits for the call in progress to end (it was woken), then closes.

The phase, the turn and the call in progress are guarded by ``_lock``; a
close asked for is `session.Streams.closing`, set without a lock; the
streams carry every ending out.
"""

from __future__ import annotations

import enum
import logging
import threading

from grain_jax_sync._src import prefetch as prefetch_lib
from grain_jax_sync._src import session as session_lib

logger = logging.getLogger(__name__)

CLOSER_THREAD = "grain_jax_sync-close"


class Phase(enum.Enum):
  OPEN = "open"
  CLOSING = "closing"
  CLOSED = "closed"


class Lifetime:
  """The state machine and the turn of one iterator; holds no reference to it (its finalizer closes this).

  Args:
    streams: The iterator's streams, which this lifetime closes once.
  """

  def __init__(self, streams: session_lib.Streams):
    self.streams = streams
    self._lock = threading.Lock()
    self._idle = threading.Condition(self._lock)  # A closer waits here for the call to end.
    self._local = threading.local()  # Per thread: inside a call, or a close.
    self._phase = Phase.OPEN
    self._turn: int | None = None  # The thread in a call (None: nobody).
    self._call = ""  # The call in progress, for messages.
    self._closed = threading.Event()

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
        if self._phase is not Phase.OPEN or self.streams.closing:
          raise RuntimeError("the iterator is closed")
        if self._turn is not None:
          raise RuntimeError(
            f"{what} was called while {self._call} is in progress in another"
            " thread; next(), set_state() and reset() belong to one thread at"
            " a time (get_state(), stats(), close() and request_stop() may be"
            " called from any thread)"
          )
        self._turn, self._call = threading.get_ident(), what
    except BaseException:
      self._local.turn = False
      self._close_if_asked()  # By this thread's handler, after the check above.
      raise

  def give_turn(self) -> None:
    """Ends this thread's call; carries out a close asked for meanwhile."""
    finish = False
    with self._lock:
      self._turn, self._call = None, ""
      if self.streams.closing and self._phase is Phase.OPEN:
        self._phase, self._turn, self._call = Phase.CLOSING, threading.get_ident(), "close()"
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
    """Out of a turn: carries out a close that a handler asked for after the turn's last look."""
    if self.streams.closing and not self._closed.is_set():
      self.close()

  def request_stop(self) -> None:
    """Asks every host to stop at one position; no lock, returns at once (any thread, a handler)."""
    if not self._closed.is_set():
      self.streams.request_stop()

  # -- the close -------------------------------------------------------------------

  def close(self) -> None:
    """The one close path, whoever calls it; idempotent, never raises."""
    if self._closed.is_set():
      return  # Also at interpreter exit, where module globals may be gone.
    if self.in_turn() or getattr(self._local, "closing", False):
      self.streams.interrupt()  # Inside this thread's own turn or close: that call finishes it.
      return
    if prefetch_lib.in_library_thread():
      # A stage's own thread (the source): this close would join it.
      self._hand_off()
      return
    self._local.closing = True
    try:
      self._close()
    finally:
      self._local.closing = False

  def collected(self) -> None:
    """The finalizer's close: the main thread closes (a ``del``, the exit); another asks.

    A collection runs wherever something allocates (a stage, a source's own
    thread that a stage waits on): a close there would wait on that very
    thread, so a new thread closes.
    """
    if threading.current_thread() is threading.main_thread():
      self.close()
    else:
      self._hand_off()

  def _hand_off(self) -> None:
    """Asks for the close, then closes from a new thread (this one is a stage's, or a collection's)."""
    self.streams.interrupt()
    try:
      threading.Thread(target=self.close, name=CLOSER_THREAD, daemon=True).start()
    except RuntimeError:  # At interpreter exit no thread starts; the stages are daemons.
      logger.debug("grain_jax_sync: could not start the closing thread", exc_info=True)

  def _close(self) -> None:
    with self._lock:
      first = self._phase is Phase.OPEN
      if first:
        self._phase = Phase.CLOSING
    self.streams.interrupt()
    if not first:
      self._closed.wait(prefetch_lib.JOIN_TIMEOUT_S)  # Another thread closes.
      return
    with self._lock:
      # A turn in progress was woken above; one that reads the source itself
      # (a generator cannot be closed while it runs) carries the close out
      # when its read returns, if it outlasts this wait.
      if self._turn is not None and not self._idle.wait_for(
        lambda: self._turn is None, prefetch_lib.JOIN_TIMEOUT_S
      ):
        self._phase = Phase.OPEN
        return  # `give_turn` finishes it.
      self._turn, self._call = threading.get_ident(), "close()"
    self._finish()

  def _finish(self) -> None:
    """Ends the streams (this host's ending, the source closed); holds the turn. Once."""
    try:
      self.streams.close()
    except Exception as e:  # noqa: BLE001 - best effort: close never raises.
      logger.warning("grain_jax_sync: closing the iterator failed: %s", e)
    finally:
      with self._lock:
        self._phase, self._turn, self._call = Phase.CLOSED, None, ""
        self._idle.notify_all()
      self._closed.set()
