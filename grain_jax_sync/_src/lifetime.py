"""The iterator's lifetime: one state machine, the turn, one close.

```
OPEN --close()--> CLOSING --> CLOSED
```

The concurrency contract is docs/internals.md's (`lifetime.py`): the calls
that move the stream belong to one thread at a time (the turn; no queue);
`close()` and `request_stop()` come from any thread or a signal handler. The
phase is changed under ``_lock``; the turn is claimed and given back with one
atomic `dict` operation each, so the steady `next()` takes no lock.
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


_OPEN = Phase.OPEN  # Read per batch (`take_turn`, `give_turn`): one global, not an enum lookup.


class Lifetime:
  """The state machine and the turn of one iterator (`streams`); holds no reference to the iterator."""

  def __init__(self, streams: session_lib.Streams):
    self.streams = streams
    self._lock = threading.Lock()
    self._idle = threading.Condition(self._lock)  # A closer waits here for the call to end.
    self._local = threading.local()  # Per thread: inside a call, or a close.
    self._phase = Phase.OPEN
    # The turn: {"turn": (thread, call)} while a call (or the close) is in
    # progress, claimed by `setdefault`, given back by `pop`. A call that ends
    # while the phase is not OPEN (or a close was asked) takes `_lock` to wake the closer.
    self._held: dict[str, tuple[int, str]] = {}
    self._closed = threading.Event()

  def take_turn(self, what: str) -> None:
    """Begins call `what` in this thread; raises if closed or another call is in progress."""
    local = self._local
    if getattr(local, "turn", False):  # Inside a call of this thread, wherever in it.
      raise RuntimeError(
        f"{what} was called from inside this thread's own next() (a signal"
        " handler, the source?); call it between batches"
      )
    local.turn = True  # Before the claim: a handler landing in it only asks.
    me = threading.get_ident()
    holder = self._held.setdefault("turn", (me, what))
    if holder[0] == me and self._phase is _OPEN and not self.streams.closing:
      return
    mine = holder[0] == me
    if mine:
      self._held.pop("turn", None)
      with self._lock:
        self._idle.notify_all()  # A closer waiting for the turn.
    self._local.turn = False
    closed = mine or self._phase is not Phase.OPEN or self.streams.closing
    self._close_if_asked()  # By this thread's handler, after the check above.
    if closed:
      raise RuntimeError("the iterator is closed")
    raise RuntimeError(
      f"{what} was called while {holder[1]} is in progress in another"
      " thread; next(), set_state() and reset() belong to one thread at"
      " a time (get_state(), stats(), close() and request_stop() may be"
      " called from any thread)"
    )

  def give_turn(self) -> None:
    """Ends this thread's call; carries out a close asked for meanwhile."""
    self._held.pop("turn", None)
    self._local.turn = False
    if self._phase is _OPEN and not self.streams.closing:
      return  # The steady state: nobody waits for this call to end.
    with self._lock:
      self._idle.notify_all()  # A closer waiting for the call to end.
    self._close_if_asked()  # Here, or by a closer that waited for this call.

  def _close_if_asked(self) -> None:
    """Out of a turn: carries out a close asked for after the turn's last look, unless a closer is at it.

    A closer in another thread (the phase is not OPEN) closes once this call
    gave the turn back; one that gave up waiting set the phase back to OPEN.
    """
    if not self.streams.closing or self._closed.is_set():
      return
    with self._lock:
      closer = self._phase is not Phase.OPEN
    if not closer:
      self.close()

  def close(self) -> None:
    """The one close path, whoever calls it; idempotent, never raises: asks at once, takes the
    turn once the call in progress returned, then ends the streams last."""
    if self._closed.is_set():
      return  # Also at interpreter exit, where module globals may be gone.
    if getattr(self._local, "turn", False) or getattr(self._local, "closing", False):
      self.streams.ask(session_lib.CLOSE)  # Inside this thread's own turn or close: it finishes.
      return
    if prefetch_lib.in_library_thread():
      # A stage's own thread (the source): this close would join it.
      self._hand_off()
      return
    self._local.closing = True  # A handler in this thread from here on only asks.
    try:
      with self._lock:
        first = self._phase is Phase.OPEN
        if first:
          self._phase = Phase.CLOSING
      self.streams.ask(session_lib.CLOSE)
      if not first:
        self._closed.wait(prefetch_lib.JOIN_TIMEOUT_S)  # Another thread closes.
        return
      me = threading.get_ident()
      with self._lock:
        # A turn in progress was woken above; one stuck in the source carries
        # the close out when its read returns, if it outlasts this wait.
        if not self._idle.wait_for(
          lambda: self._held.setdefault("turn", (me, "close()"))[0] == me,
          prefetch_lib.JOIN_TIMEOUT_S,
        ):
          self._phase = Phase.OPEN
          return  # `give_turn` closes.
      try:
        self.streams.end(last=True)  # Closed: the peers raise "process p closed its iterator".
      except Exception as e:  # noqa: BLE001 - best effort: close never raises.
        logger.warning("grain_jax_sync: closing the iterator failed: %s", e)
      finally:
        with self._lock:
          self._phase = Phase.CLOSED
          self._held.pop("turn", None)
          self._idle.notify_all()
        self._closed.set()
    finally:
      self._local.closing = False

  def collected(self) -> None:
    """The finalizer's close: the main thread closes; elsewhere (a stage's thread) a new thread does."""
    if threading.current_thread() is threading.main_thread():
      self.close()
    else:
      self._hand_off()

  def _hand_off(self) -> None:
    """Asks for the close, then closes from a new thread (this one is a stage's, or a collection's)."""
    self.streams.ask(session_lib.CLOSE)
    try:
      threading.Thread(target=self.close, name=CLOSER_THREAD, daemon=True).start()
    except RuntimeError:  # At interpreter exit no thread starts; the stages are daemons.
      logger.debug("grain_jax_sync: could not start the closing thread", exc_info=True)
