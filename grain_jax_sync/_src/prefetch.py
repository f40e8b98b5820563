"""The background pipeline thread and its bounded queue.

The thread runs the whole producer (read, exchange, pad, cast, transfer) and
stays at most `buffer_size` items ahead of the consumer. Exceptions travel
through the queue and are raised in the consumer with their original
traceback. `close()` leaves no thread behind: it stops the producer at its next
check, cancels a pending exchange wait and joins the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

END = object()  # The end of a stream, as a queue item.
JOIN_TIMEOUT_S = 30.0
WAKE_S = 0.05  # How often a blocked consumer checks for close().


class Raised:
  """An exception travelling to the consumer, as a queue item."""

  __slots__ = ("error",)

  def __init__(self, error: BaseException):
    self.error = error


def is_final(item: Any) -> bool:
  """Whether a queue item ends the stream (the end, or an error)."""
  return item is END or isinstance(item, Raised)


def unwrap(item: Any) -> Any:
  """A queue item as the consumer sees it: the value, the end, or the error."""
  if item is END:
    raise StopIteration
  if isinstance(item, Raised):
    raise item.error.with_traceback(item.error.__traceback__)
  return item


class Prefetcher(Generic[T]):
  """Runs `producer` in a daemon thread, `buffer_size` items ahead.

  Args:
    producer: The iterator to drain. It is advanced only in the thread.
    buffer_size: Items held ready (>= 1).
    on_close: Called by `close()` before joining, to unblock the producer
      (for example to cancel an exchange wait).
    name: The thread's name.
  """

  def __init__(
    self,
    producer: Iterator[T],
    *,
    buffer_size: int,
    on_close: Callable[[], None] | None = None,
    name: str = "grain_jax_sync-prefetch",
  ):
    if buffer_size < 1:
      raise ValueError(f"`buffer_size` must be >= 1, got {buffer_size}")
    self._queue: queue.Queue[Any] = queue.Queue(maxsize=buffer_size)
    self._stop = threading.Event()
    self._on_close = on_close
    self._done = False
    self._thread = threading.Thread(
      target=_run, args=(producer, self._queue, self._stop), name=name, daemon=True
    )
    self._thread.start()

  def __iter__(self) -> Prefetcher[T]:
    return self

  def __next__(self) -> T:
    if self._done:
      raise StopIteration
    while True:
      try:
        item = self._queue.get(timeout=WAKE_S)
        break
      except queue.Empty:
        if self._stop.is_set():  # Closed from another thread.
          self._done = True
          raise StopIteration from None
    if is_final(item):
      self._done = True
    return unwrap(item)

  @property
  def thread(self) -> threading.Thread:
    return self._thread

  def request_stop(self) -> None:
    """Asks the thread to stop, taking none of this stage's locks; `close()` follows."""
    self._stop.set()

  def close(self) -> None:
    """Stops and joins the thread; idempotent."""
    self._done = True
    self._stop.set()
    if self._on_close is not None:
      self._on_close()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while self._thread.is_alive():
      try:  # Unblock a producer waiting on a full queue.
        while True:
          self._queue.get_nowait()
      except queue.Empty:
        pass
      self._thread.join(timeout=0.05)
      if self._thread.is_alive() and time.monotonic() > deadline:
        logger.warning(
          "grain_jax_sync: the prefetch thread is still blocked (in the"
          " source?) after %.0fs; leaving it as a daemon thread",
          JOIN_TIMEOUT_S,
        )
        break


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
  while not stop.is_set():
    try:
      q.put(item, timeout=0.05)
      return True
    except queue.Full:
      continue
  return False


def _run(producer: Iterator[Any], q: queue.Queue[Any], stop: threading.Event) -> None:
  try:
    for item in producer:
      if not _put(q, item, stop):
        return
      if stop.is_set():
        return
    _put(q, END, stop)
  except BaseException as e:  # noqa: BLE001 - re-raised in the consumer.
    if not stop.is_set():
      _put(q, Raised(e), stop)
  finally:
    close = getattr(producer, "close", None)
    if callable(close):
      try:
        close()
      except Exception:  # noqa: BLE001
        logger.debug("producer close failed", exc_info=True)
