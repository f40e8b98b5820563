"""A stage in its own thread: a producer drained into a bounded buffer.

Grain's `ThreadPrefetchIterDataset` is the model: the thread holds at most
`buffer_size` items its consumer has not taken, plus the one it is producing;
the end and exceptions travel through the buffer and are raised in the
consumer with their original traceback. Neither side polls: each blocks on a
`queue.SimpleQueue` (C code; its `put` is reentrant, so a signal handler may
`wake` the consumer), the consumer on items, the producer on free slots, one
token each, so a steady ``next()`` takes no lock of Python's `threading`.
`close()` wakes both, lets `on_close` cancel the producer's own wait, and joins
the thread, unless it is that thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

END = object()  # The end of a stream, as a buffer item.
_WAKE = object()  # Wakes the consumer to stop (`Prefetcher.wake`, `close`).
# How long `close()` waits for a stage thread. Only a source's own `next()` blocks it
# (a store wait is cancelled, a full buffer woken): a read that outlives this is left
# to finish in a daemon thread, whatever the host.
JOIN_TIMEOUT_S = 30.0


# Every thread the library's stages start (any iterator's).
_library_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def in_library_thread() -> bool:
  """Whether the calling thread is one of the stages' own (of any iterator)."""
  return threading.current_thread() in _library_threads


class Raised(NamedTuple):
  """An exception travelling to the consumer, as a buffer item."""

  error: BaseException


def close_producer(producer: Any) -> None:
  """Closes a producer generator, if it has `close` (errors are logged)."""
  close = getattr(producer, "close", None)
  if callable(close):
    try:
      close()
    except Exception:  # noqa: BLE001 - best effort: a close never raises.
      logger.debug("producer close failed", exc_info=True)


class Prefetcher(Generic[T]):
  """Runs `producer` in a daemon thread, at most `buffer_size` items ahead.

  Args:
    producer: The iterator to drain. It is advanced only in the thread.
    buffer_size: Items held ready (>= 1), besides the one being produced.
    in_hand: Whether the item being produced comes on top of `buffer_size`
      (True), or counts in it (False: Grain's `device_put` buffers).
    on_close: Called by `close()` before joining, to unblock the producer
      (for example to cancel an exchange wait).
    name: The thread's name.
  """

  _on_demand = False  # `OnDemand`: nothing is produced before it is asked for.

  def __init__(
    self,
    producer: Iterator[T],
    *,
    buffer_size: int,
    in_hand: bool = True,
    on_close: Callable[[], None] | None = None,
    name: str = "grain_jax_sync-prefetch",
  ):
    if buffer_size < 1:
      raise ValueError(f"`buffer_size` must be >= 1, got {buffer_size}")
    self._size = buffer_size
    self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
    # Free slots, one token each: the producer takes one per item, the consumer gives it back.
    self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()
    if not self._on_demand:
      self.ask(buffer_size)
    self._early = not in_hand  # A slot is taken before producing, not after.
    # Set under `_exit` by `close`, and without a lock by `wake` (a signal handler).
    self._stopped = False
    self._exit = threading.Lock()  # Guards `_busy` (and `OnDemand`'s `_exited`, `_hooks`).
    # Whether the producer may be inside its own `next()`: always, unless `OnDemand` watches it.
    self._busy = not self._on_demand
    self._done = False  # The consumer saw the final item (consumer only).
    self._on_close = on_close
    self.thread = threading.Thread(target=self._run, args=(producer,), name=name, daemon=True)
    _library_threads.add(self.thread)  # Known from now on to `in_library_thread`.
    self.thread.start()

  def __iter__(self) -> Prefetcher[T]:
    return self

  def __next__(self) -> T:
    if self._done:
      raise StopIteration
    item = self._items.get()
    if item is _WAKE or self._stopped:
      self._done = True  # Stopped meanwhile: `close()` follows.
      raise StopIteration
    self._slots.put(None)  # Room for the producer.
    return self._unwrap(item)

  def ask(self, n: int = 1) -> None:
    """Lets the producer make `n` more items: `n` more slots (reentrant: no lock)."""
    put = self._slots.put
    for _ in range(n):
      put(None)

  def _unwrap(self, item: Any) -> Any:
    """A buffer item as the consumer sees it: the value, the end, or the error (both final)."""
    if item is END:
      self._done = True
      raise StopIteration
    if isinstance(item, Raised):
      self._done = True
      raise item.error.with_traceback(item.error.__traceback__)
    return item

  def wake(self) -> None:
    """Wakes a waiting consumer to stop, taking no lock (a signal handler may hold one)."""
    self._stopped = True
    self._items.put(_WAKE)

  def close(self, *, wait: bool = True) -> None:
    """Stops and joins the thread (unless called from it); idempotent.

    Without `wait`, a producer inside its own ``next()`` is not waited for
    (`OnDemand`: a read stuck in the source; the final close reads no more).
    """
    with self._exit:
      self._done = self._stopped = True
      busy = self._busy  # Else the thread waits for a slot at most: joined at once.
    self._items.put(_WAKE)  # A consumer waiting in another thread.
    self.ask(self._size + 1)  # A producer waiting for room.
    if self._on_close is not None:
      self._on_close()
    thread = self.thread
    if (wait or not busy) and thread is not threading.current_thread():
      thread.join(JOIN_TIMEOUT_S)
      if thread.is_alive():
        logger.warning(
          "grain_jax_sync: the %s thread is still blocked (in the source?) after"
          " %.0fs; leaving it as a daemon thread",
          thread.name,
          JOIN_TIMEOUT_S,
        )
    # Nothing built stays referenced. As many gets as items now: a signal
    # handler's `wake` may put more meanwhile.
    for _ in range(self._items.qsize()):
      try:
        self._items.get_nowait()
      except queue.Empty:
        break
    # The drain may have taken the wake-up before a consumer in another
    # thread got it: one more, which holds nothing.
    self._items.put(_WAKE)

  def _put(self, item: Any) -> bool:
    """Waits for room (unless taken before producing); False if the stage was stopped meanwhile."""
    if not self._early:
      self._slots.get()
    if self._stopped:
      return False
    self._items.put(item)
    return True

  def _run(self, producer: Iterator[Any]) -> None:
    try:
      while True:
        if self._early:
          self._slots.get()
          if self._stopped:
            return
        item = next(producer, END)
        if not self._put(item) or item is END:
          return
        # Not held while the next one is produced: a batch handed on is the
        # consumer's alone, so it is freed as soon as the consumer drops it.
        del item
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer.
      self._put(Raised(e))
    finally:
      close_producer(producer)
      # The error's traceback holds this frame, which may still run when the
      # consumer clears the library's frames: it must not hold the stream.
      del producer


class OnDemand(Prefetcher[T]):
  """A stage that produces only the items its consumer asked for (`ask`): the reading thread.

  A producer stuck in its own ``next()`` (a source stalled on remote storage)
  holds up nothing but the items it has not produced: ``close(wait=False)``
  stops the stage without waiting for it, and the hooks given to `after` run
  once that ``next()`` returns.
  """

  _on_demand = True

  def __init__(self, producer: Iterator[T], *, name: str):
    self._exited = False
    self._hooks: list[Callable[[], None]] = []
    super().__init__(self._watched(producer), buffer_size=1, in_hand=False, name=name)

  def _watched(self, producer: Iterator[T]) -> Iterator[T]:
    """`producer`, marking the time spent in its `next()` (`close` tells whether it is in one)."""
    while True:
      with self._exit:
        if self._stopped:
          return
        self._busy = True
      try:
        item = next(producer)
      except StopIteration:
        return
      finally:
        self._busy = False
      yield item

  def take(self, timeout_s: float) -> T | None:
    """The next item, waiting up to `timeout_s` for it; None if none came (or a `nudge`)."""
    try:
      item = self._items.get(timeout=timeout_s) if timeout_s > 0 else self._items.get_nowait()
    except queue.Empty:
      return None
    if item is _WAKE or self._done:
      return None
    return self._unwrap(item)

  def ready(self) -> bool:
    """Whether an item (or a wake-up) waits to be taken."""
    return not self._items.empty()

  def nudge(self) -> None:
    """Wakes a `take` now; takes no lock (a signal handler may call it)."""
    self._items.put(_WAKE)

  def after(self, hook: Callable[[], None]) -> None:
    """Runs `hook` once the producer's thread is done: now, or when its ``next()`` returns."""
    with self._exit:
      if not self._exited:
        self._hooks.append(hook)
        return
    hook()

  def _run(self, producer: Iterator[Any]) -> None:
    try:
      super()._run(producer)
    finally:
      with self._exit:
        self._exited = True
        hooks, self._hooks = self._hooks, []
      for hook in hooks:
        try:
          hook()
        except Exception:  # noqa: BLE001 - best effort, as a close is.
          logger.warning("grain_jax_sync: closing after a stuck read failed", exc_info=True)
