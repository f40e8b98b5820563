"""The build stage: decided runs -> built items, in a thread and, when it is behind, the consumer.

One rule decides who builds: the thread builds ahead while there is room
(`built` items); a consumer that finds nothing built but a decided position
builds that position itself. Builds run one at a time, oldest position first,
so the order of items and states is exact whoever builds. Nothing here
measures time or polls: the thread waits on a condition, the consumer on a
queue that a signal handler may also wake (`request_stop`).
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from grain_jax_sync._src import prefetch

T = TypeVar("T")


def _is_item(x: Any) -> bool:
  return x is not None and not prefetch.is_final(x)


class BuildStage(Generic[T]):
  """Builds decided positions ahead in a thread; a consumer with nothing built builds itself.

  Args:
    runs: Decided runs (`build.Run`); advanced only by the thread.
    build: ``(read, step, signature, batch_size) -> item or None`` (None: a
      dropped position); called in position order, one call at a time.
    built: Items built ahead of the consumer (>= 1).
    decided: Decided positions the thread holds unbuilt before it fetches
      more (>= 1; a run of several positions is taken whole).
    on_close: Called by `close()` before joining (to cancel an exchange wait).
    name: The thread's name.
  """

  def __init__(
    self,
    runs: Iterator[Any],
    build: Callable[[Any, Any, Any, Any], T | None],
    *,
    built: int,
    decided: int,
    on_close: Callable[[], None] | None = None,
    name: str = "grain_jax_sync-build",
  ):
    if built < 1 or decided < 1:
      raise ValueError(f"`built` and `decided` must be >= 1, got {built} and {decided}")
    self._runs = runs
    self._build = build
    self._max_built = built
    self._max_decided = decided
    self._on_close = on_close
    self._cond = threading.Condition(threading.Lock())
    # Under `_cond`: decided positions (read, step, signature, size), then the
    # final marker once the runs ended; built items after them.
    self._decided: collections.deque[Any] = collections.deque()
    self._built: collections.deque[Any] = collections.deque()
    self._fetched_all = False  # The final marker is in `_decided` (or was).
    self._building = False  # A build is under way, outside the lock.
    self._consumer_waits = False  # The consumer waits on `_wake`.
    # Written without the lock (`request_stop` from a signal handler).
    self._stopped = False
    self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()  # Reentrant: a handler may put.
    self._done = False  # The consumer saw the final item (consumer only).
    self._thread = prefetch.start_thread(self._run, name=name)

  @property
  def thread(self) -> threading.Thread:
    return self._thread

  def __iter__(self) -> BuildStage[T]:
    return self

  def __next__(self) -> T:
    if self._done:
      raise StopIteration
    while True:
      with self._cond:
        work, item = self._take()
      if work is None and item is None:
        self._wake.get()  # Woken by the thread, a close, or a signal handler's request.
        continue
      if work is not None:
        item = self._build_one(work)
        with self._cond:
          self._building = False
          if isinstance(item, prefetch.Raised):
            self._failed()
          self._cond.notify_all()
        if item is None:
          continue  # A dropped position.
      if prefetch.is_final(item):
        self._done = True
      return prefetch.unwrap(item)

  def _take(self) -> tuple[Any, Any]:
    """Under the lock: (a position to build here, None) or (None, an item); (None, None): wait."""
    if self._built:
      item = self._built.popleft()
      self._cond.notify_all()  # Room to build ahead.
      return None, item
    if self._stopped:
      return None, prefetch.END
    if self._decided and not self._building:
      if prefetch.is_final(self._decided[0]):
        return None, self._decided.popleft()
      self._building = True
      return self._decided.popleft(), None
    if not self._thread.is_alive():  # Never without an ending; a hang must fail.
      return None, prefetch.Raised(RuntimeError("internal: the build thread ended early"))
    self._consumer_waits = True
    return None, None

  def _build_one(self, work: Any) -> Any:
    """One build, outside the lock: its item, None (dropped), or its error as `Raised`."""
    try:
      return self._build(*work)
    except BaseException as e:  # noqa: BLE001 - raised in the consumer, in order.
      return prefetch.Raised(e)

  def _failed(self) -> None:
    """Under the lock: nothing after a build's error is built or fetched."""
    self._decided.clear()
    self._fetched_all = True

  def _wake_consumer(self) -> None:
    """Under the lock: wakes a waiting consumer (there is an item, or work for it)."""
    if self._consumer_waits:
      self._consumer_waits = False
      self._wake.put(None)

  def _run(self) -> None:
    try:
      with self._cond:
        while not self._stopped:
          if self._decided and not self._building and len(self._built) < self._max_built:
            self._build_ahead()
          elif not self._fetched_all and len(self._decided) < self._max_decided:
            self._fetch()
          elif self._fetched_all and not self._decided:
            return
          else:
            self._cond.wait()
    finally:
      prefetch.close_producer(self._runs)

  def _build_ahead(self) -> None:
    """Under the lock: builds the oldest decided position (lock released meanwhile)."""
    work = self._decided.popleft()
    if prefetch.is_final(work):
      self._built.append(work)
      self._wake_consumer()
      return
    self._building = True
    self._cond.release()
    try:
      item = self._build_one(work)
    finally:
      self._cond.acquire()
      self._building = False
    if isinstance(item, prefetch.Raised):
      self._failed()
    if item is not None and not self._stopped:
      self._built.append(item)
    self._cond.notify_all()
    self._wake_consumer()

  def _fetch(self) -> None:
    """Under the lock: the next decided run (lock released meanwhile), its positions queued."""
    self._cond.release()
    work: list[Any]
    try:
      run = next(self._runs)
      work = [(read, step, run.signature, run.batch_size) for read, step in run.steps]
    except StopIteration:
      work = [prefetch.END]
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer.
      work = [prefetch.Raised(e)]
    finally:
      self._cond.acquire()
    if self._stopped:
      return
    self._decided.extend(work)
    self._fetched_all = bool(work) and prefetch.is_final(work[-1])
    self._wake_consumer()

  def request_stop(self) -> None:
    """Wakes the consumer to stop, taking no lock (a signal handler may hold one); `close()` follows."""
    self._stopped = True
    self._wake.put(None)

  def close(self) -> None:
    """Stops and joins the thread (unless called from it); idempotent."""
    self._stopped = True
    with self._cond:
      self._built.clear()
      self._decided.clear()
      self._cond.notify_all()
    self._wake.put(None)
    if self._on_close is not None:
      self._on_close()
    prefetch.join(self._thread, "build")
