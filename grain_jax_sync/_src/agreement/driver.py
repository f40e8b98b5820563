"""The streamed core's driver on a real host: its world (threads, monotonic time), its inbox.

The same driver runs the core in the agreement thread and inline, in the
consumer's `next()`, by `interpreter.drive`. Asking (a stop, or this host's
ending: a `core.Closing`) is one put into the inbox, from any thread or a
signal handler; the thread that runs the core takes it at its next step and
posts the ending on its way out (else the ending thread: `post_ending`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from grain_jax_sync._src import liveness as liveness_lib
from grain_jax_sync._src import periods, prefetch
from grain_jax_sync._src.agreement import common, core, interpreter, streamed
from grain_jax_sync._src.exchange import key_value
from grain_jax_sync._src.exchange import streams as exchange_streams

logger = logging.getLogger(__name__)


class Driver(interpreter.World):
  """Runs one host's core over the real exchange: its world (`interpreter.World`), waits that block.

  Args:
    agreement: The core.
    reader: This host's reads: inline (an iterator) or the reading thread's stage.
    exchange: The key-value exchange of this stream.
    built: The build stage (`build.Builder`): its progress and the consumer's pace.
    asks: The inbox (default: its own): stops asked (positions) and `Closing`s.
    beat: Inline, its thread posts a stop asked between calls (default: the
      process's `liveness.Beat` of this client, if started; else the asker).
  """

  def __init__(
    self,
    agreement: streamed.Streamed,
    reader: Iterator[core.Read | core.End] | prefetch.OnDemand[Any],
    exchange: key_value.KeyValueExchange,
    built: Any,
    asks: queue.SimpleQueue[int | core.Closing] | None = None,
    beat: liveness_lib.Beat | None = None,
  ):
    self.core = agreement
    self._reader: Any = reader
    self.threaded = isinstance(reader, prefetch.OnDemand)  # The core runs in the agreement thread.
    self._exchange = exchange
    self._built = built
    self._live = liveness_lib.Liveness(exchange)
    self._beat = beat or liveness_lib.Beat.running(exchange.client, exchange.process_index)
    # Held by whoever runs the core (inline, the consumer's call; else the
    # agreement thread, but while it hands a run on); else `post_stop` takes it.
    self.turn = threading.Lock()
    self._asks: queue.SimpleQueue[int | core.Closing] = asks or queue.SimpleQueue()
    exchange_streams.stream_started(exchange.namespace)

  def _take_asks(self) -> bool:
    """Hands what was asked to the core (in the thread that runs it); whether a close was."""
    for _ in range(self._asks.qsize()):  # Those put by now: a handler may put at every line.
      self.core.asked(self._asks.get_nowait())
    return self.core.close.asked

  def __iter__(self) -> Iterator[common.Run]:
    """The core's runs (`interpreter.runs`), the inbox taken before each step; an ending asked for,
    posted on the way out. The agreement thread holds `turn` but while a run is handed on."""
    turn = self.turn if self.threaded else None
    try:
      yield from interpreter.runs(
        self.core, self._exchange, self, self._take_asks, self.threaded, turn
      )
    finally:
      self._take_asks()
      # The agreement thread posts it, with its count, asked once the consumer's call returned.
      while self.threaded and self.core.close.awaited:
        self.core.asked(self._asks.get())
      self.post_ending()

  # -- the core's world on a real host (`interpreter.World`) ---------------------

  def now(self) -> core.Now:
    done = self._built.done() if self.core.threaded else 0
    return core.Now(time.monotonic(), done, not self.threaded or self._reader.ready())

  def call(self, fn: Any, *args: Any) -> core.Steps:
    yield from ()  # A real call blocks in the client.
    return fn(*args)

  def ask_reads(self, n: int) -> None:
    self._reader.ask(n)

  def next_read(self, wait_s: float) -> core.Steps:
    yield from ()  # A real wait blocks in the reading stage (inline, in the read).
    return self._reader.take(wait_s) if self.threaded else next(self._reader)

  def wait_build(self, beyond: int) -> core.Steps:
    yield from ()  # A real wait blocks on the build stage.
    self._exchange.check()
    self._built.wait_done(beyond, periods.LIVENESS_PERIOD_S)

  def pace(self) -> int:
    return int(self._built.pace())

  def dead(self, peer: int) -> bool:
    return self._live.dead(peer)

  def closed(self, peer: int) -> str | None:
    return self._live.closed(peer)

  def crosswise(self, peer: int) -> list[str]:
    ns = self._exchange.namespace
    exchange_streams.waiting_first(ns, True)
    # Made here but not started (one never made here is the timeout's case).
    return [
      t
      for t in self._live.waiting(peer)
      if t != ns and exchange_streams.is_created(t) and not exchange_streams.is_started(t)
    ]

  def not_waiting(self) -> None:
    exchange_streams.waiting_first(self._exchange.namespace, False)

  def pre_end(self, namespace: str, message: str) -> None:
    exchange_streams.pre_end(namespace, message)

  # -- what the session asks of the stream's agreement -------------------------------

  def ask(self, ask: int | core.Closing) -> None:
    """A stop after batch `ask`, or this host's ending: one put, then a wake (`heard`); no lock."""
    self._asks.put(ask)
    self.heard(close=isinstance(ask, core.Closing))

  def heard(self, close: bool = False) -> None:
    """Something was put in the inbox: the core's thread takes it now; a stop, the beat's thread
    (`post_stop`), so that the asker (a signal handler, say) takes no lock and calls no store."""
    if self.threaded:
      self._reader.nudge()
      self._built.wake()  # A wait for the build thread's room, too.
    if close:
      return
    if self._beat is not None:
      self._beat.wake(self.post_stop)
    elif not self.threaded:
      self.post_stop()

  def post_stop(self, *, in_call: bool = False) -> None:
    """Posts a stop asked for here now, unless the core's thread holds `turn` (it posts it then).

    By the beat's thread, or by the consumer's call as it ends (`in_call`); never waits for the turn.
    """
    while (not self._asks.empty() or (in_call and self.core.stop_pending())) and self.turn.acquire(
      False
    ):
      try:
        if self.core.ended:  # The inbox is the next stream's now.
          return
        self._take_asks()
        side = self.core.side(self.core.stop_now())
        for _ in interpreter.runs(side, self._exchange, self, self._take_asks, self.threaded):
          pass
      except Exception as e:  # noqa: BLE001 - from `request_stop()`: it never raises.
        logger.warning("grain_jax_sync: could not post the stop: %s", e)
      finally:
        self.turn.release()

  def post_ending(self) -> None:
    """Posts the ending asked for (`ask`) and ends the exchange, once: by the core's thread, else here."""
    self._take_asks()
    interpreter.best_effort(self._exchange, self.core.ending())

  def wait_for_peers_at_end(self) -> None:
    """At the agreed end: returns once every peer's consumer got there, or raises naming one."""
    for _ in interpreter.runs(self.core.side(self.core.at_end()), self._exchange, self):
      pass


class Stepper(interpreter.World):
  """Runs the lockstep core (`lockstep.Lockstep`) in the calling thread; stops asked reach it per step."""

  def __init__(
    self, stepper: Any, reader: Iterator[core.Read | core.End], exchange: Any, asks: Any
  ):
    self.core, self._reader, self._exchange, self._asks = stepper, reader, exchange, asks

  def __iter__(self) -> Iterator[common.Run]:
    return interpreter.runs(self.core, self._exchange, self, self._take_stops, early=True)

  def _take_stops(self) -> bool:
    """Hands the stops asked by now to the core, before each of its steps; never an ending."""
    for _ in range(0 if self._asks is None else self._asks.qsize()):
      if isinstance(ask := self._asks.get_nowait(), int):
        self.core.stop_asked(ask)
    return False

  def now(self) -> None:  # Lockstep reads no clock.
    pass

  def read_window(self, count: int) -> list[core.Read | core.End]:
    """Up to `count` reads, the last one the stream's `End` if reached."""
    out = [next(self._reader)]
    while len(out) < count and not isinstance(out[-1], core.End):
      out.append(next(self._reader))
    return out
