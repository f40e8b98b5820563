"""The build stage: decided runs -> built items, shared by a thread and the consumer.

A thread builds ahead while the consumer is in its training step; a consumer
that finds nothing built builds for itself ("work stealing"), and, where no
exchange is waited on, reads quick sources itself while it has nothing to
hide them behind. Order and state are exact whoever builds or reads.
`pipeline.Pipeline` composes it; `pace.Pace` chooses who works when, and
the tuning numbers here and there were measured on the 2-core machine of
`benchmarks/RESULTS.md` (docs/performance.md).
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from grain_jax_sync._src import pace as pace_lib
from grain_jax_sync._src import prefetch

logger = logging.getLogger(__name__)

T = TypeVar("T")
_UNBUILT = object()  # `_fetch_build`: a run of several positions, for `_pending`.


def _is_item(x: Any) -> bool:
  """Whether `x` is a built item (not a dropped position, a run to queue, an end or an error)."""
  return x is not None and x is not _UNBUILT and not prefetch.is_final(x)


# While the consumer steps (away longer than `pace.AWAY_BUILDS` builds on average),
# a thread with nothing to build yet checks again at most every STEP_POLL_S.
STEP_POLL_S = 0.0002
# The thread reads on without handing over while each run came within
# BURST_RUN_S and the burst is younger than BURST_S (one lock and wake-up per
# burst, not per position). After handing positions to a waiting consumer it
# waits up to HANDOVER_S for the consumer to take one, so that the consumer
# gets the GIL before the next burst (a thread that reads on keeps it for up
# to the interpreter's switch interval, 5 ms).
BURST_RUN_S = 0.0002
BURST_S = 0.001
HANDOVER_S = 0.002


class BuildStage(Generic[T]):
  """The build stage: a thread builds ahead; a consumer with nothing ready builds itself.

  The thread pulls decided runs from `runs` and turns their positions into
  items with `build`, at most `buffer_size` positions ahead of the consumer.
  A consumer that finds no built item but a decided position builds that
  position itself ("work stealing"): with nothing to hide (no training step)
  the consumer runs at inline speed instead of waiting for a hand-off from
  the thread; with a slow step the thread fills the buffer. Builds run one at
  a time, oldest position first, so the order of items and states is exact.

  Runs are fetched by the thread, except with `inline_fetch` (one process:
  no exchange to wait on), where a consumer with nothing pending fetches a
  quick run itself while it has no step to hide the fetch behind (see
  `pace.INLINE_FETCH_S`). Either way one fetch runs at a time.

  Args:
    runs: Decided runs (`build.Run`).
    build: ``(read, step, signature, batch_size) -> item or None`` (None: a
      dropped position); called in position order, one at a time.
    buffer_size: Positions built ahead of the consumer (>= 1).
    read_ahead: Given the first decided read, how many decided positions the
      thread may hold unbuilt (at least `buffer_size`): reads in bursts, so
      that a consumer that builds for itself rarely waits for the thread.
    read_bytes: Given the first decided read, a batch's bytes (see
      `pace.SLOW_BUILD_BPS`).
    on_close: Called by `close()` before joining (to cancel an exchange wait).
    wait_ready: Blocks until an item's arrays are ready;
      called by the thread, outside the lock; errors (a donated, deleted
      array) count as ready (see `pace.AWAY_BUILDS`).
    name: The thread's name.
    inline_fetch: Whether the consumer may fetch runs itself.
  """

  def __init__(
    self,
    runs: Iterator[Any],
    build: Callable[[Any, Any, Any, Any], T | None],
    *,
    buffer_size: int,
    read_ahead: Callable[[Any], int] | None = None,
    read_bytes: Callable[[Any], int] | None = None,
    on_close: Callable[[], None] | None = None,
    wait_ready: Callable[[T], Any] | None = None,
    name: str = "grain_jax_sync-prefetch",
    inline_fetch: bool = False,
  ):
    if buffer_size < 1:
      raise ValueError(f"`buffer_size` must be >= 1, got {buffer_size}")
    self._runs = runs
    self._build = build
    self._size = buffer_size
    self._read_ahead = read_ahead
    self._read_bytes = read_bytes
    self._ahead = buffer_size  # Decided positions held unbuilt, at most.
    self._pace = pace_lib.Pace(inline_fetch=inline_fetch)
    self._cond = threading.Condition(threading.Lock())
    # Decided positions (read, step, signature, size) not built yet, then the
    # end marker or the error once the runs ended; built items (or the end
    # marker, or the error) after them.
    self._pending: collections.deque[Any] = collections.deque()
    self._ready: collections.deque[Any] = collections.deque()
    self._upstream_done = False
    self._waiting = False  # The consumer waits for a position.
    self._building = False  # A position is being built (outside the lock).
    self._fetching = False  # A run is being fetched (outside the lock).
    self._handing = False  # The thread waits for the consumer to take a position.
    self._in_next = False  # The consumer is in `__next__`.
    self._stop = threading.Event()
    self._delivered: Any = None  # The last item handed out (see `__next__`).
    self._wait_ready = wait_ready
    # Items handed out so far; the count when the thread last saw the last
    # one ready (a count, not the item, which it would keep alive), and when.
    self._handed = 0
    self._seen = -1
    self._ready_at = 0.0
    self._on_close = on_close
    self._done = False
    self._solo = False  # The consumer fetches and builds alone (`_solo_next`).
    self._first = True  # No `__next__` yet.
    # Started by the first `__next__`, which then waits for the first
    # position: a thread started earlier reads a burst while holding the GIL
    # that the consumer needs to finish its own set-up (+1.5 ms to the first
    # batch, measured at 0.8 MB batches). With `inline_fetch` the consumer
    # reads the first batch itself and the thread starts when first needed
    # (`_wake`): a consumer that reads and builds every batch never starts it
    # (starting it and handing the first batch over cost about 0.35 ms).
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)

  @property
  def thread(self) -> threading.Thread:
    return self._thread

  def __iter__(self) -> BuildStage[T]:
    return self

  def __next__(self) -> T:
    if self._done:
      raise StopIteration
    if self._solo:
      return self._solo_next()
    if self._first:
      self._first = False
      self._pace.left()  # Set-up before it is not a step.
      if not self._pace.inline_fetch:
        self._waiting = True  # The first position is handed over alone.
        self._thread.start()
    self._pace.came_back()
    return self._deliver(self._take_locked())

  def _take_locked(self) -> Any:
    """`_take` under the lock, with the consumer marked in `__next__`."""
    with self._cond:
      self._in_next = True
      try:
        return self._take()
      finally:
        # Also after the first call, which sets it before `_take`: a stale
        # flag made the thread cut every burst short and wait `HANDOVER_S`
        # for a consumer that was not waiting.
        self._waiting = False
        self._in_next = False
        self._pace.left()

  def _deliver(self, item: Any) -> T:
    if prefetch.is_final(item):
      self._done = True
    # Held until the next item is built, as the inline path's generator holds
    # its last item: on the CPU backend device buffers come from the C heap,
    # and a consumer that drops each batch at once (`step(next(it))`) freed
    # the heap's top before the next build, which glibc trimmed and the build
    # faulted back in (18 page faults and about 60 us of system time per
    # 0.8 MB batch; none with this).
    self._delivered = item
    self._handed += 1
    return prefetch.unwrap(item)

  def _direct(self) -> Any:
    """Fetches one run and builds its first position in one go; under the lock.

    `_take`'s path for a consumer that fetches inline with nothing pending
    (no step, a quick source, short builds): one release of the lock around
    the fetch and the build, with the thread kept out by `_fetching` and
    `_building`, instead of a fetch, a hand-over and a build, each with its
    own release and bookkeeping. Measured in the consumer's loop at 0.8 MB
    batches (no step): the stage's own time per batch went from about 28 us
    to 14 us.

    Returns:
      The item or the terminal marker; None where `_take` must look again
      (a dropped position, a run of several positions now in `_pending`, or
      a close from another thread meanwhile).
    """
    timed = self._pace.count_fetch()
    self._fetching = self._building = True
    self._cond.release()
    try:
      run, item = self._fetch_build(timed)
    finally:
      self._cond.acquire()
      self._fetching = self._building = False
    item = self._after_direct(run, item)
    if _is_item(item) and self._solo_ok():
      # Go on alone (`_solo_next`), the thread kept out as during the fetch.
      self._solo = self._fetching = self._building = True
    return item

  def _solo_ok(self) -> bool:
    """Whether the consumer goes on fetching and building alone (`_solo_next`).

    `_direct`'s conditions: the consumer fetches inline, and builds are
    short enough to build in the same go.
    """
    return self._pace.builds_direct() and self._pace.fetches_inline() and not self._stop.is_set()

  def _solo_next(self) -> T:
    """`__next__` while the consumer alone fetches and builds: no lock, no hand-off.

    Entered at the end of a `_direct` build while its conditions hold;
    `_fetching` and `_building` stay set throughout, so the thread stays
    parked. Per 0.8 MB batch (no step, 1,000-batch trials): 91-93 us against
    92-94 through the lock and 86-89 inline. Anything but a plain item (a
    dropped position, a run of several positions, the end, an error, a
    close), or conditions that no longer hold, go back under the lock.
    """
    self._pace.came_back()
    run: Any = None
    item: Any = _UNBUILT
    if self._solo_ok():
      run, item = self._fetch_build(self._pace.count_fetch())
      if _is_item(item) and not self._stop.is_set():
        self._pace.left()
        self._delivered = item  # See `_deliver`.
        self._handed += 1
        return item
    with self._cond:
      self._solo = self._fetching = self._building = False
      self._cond.notify_all()  # The thread may fetch again.
      if run is not None:
        item = self._after_direct(run, item)
    if item is None or item is _UNBUILT:
      item = self._take_locked()
    return self._deliver(item)

  def _after_direct(self, run: Any, item: Any) -> Any:
    """`_direct`'s outcome under the lock: the item, or None where `_take` looks again."""
    if self._stop.is_set():  # Closed from another thread meanwhile: dropped.
      return None
    if prefetch.is_final(run):
      self._upstream_done = True
      return run
    if item is _UNBUILT:
      self._pending.extend((read, step, run.signature, run.batch_size) for read, step in run.steps)
      return None
    if isinstance(item, prefetch.Raised):
      self._upstream_done = True  # Nothing after an error is built.
    return item

  def _fetch_build(self, timed: bool) -> tuple[Any, Any]:
    """Outside the lock: the next run (or its end), and the item of its only position.

    The item is `_UNBUILT` for a run of several positions (or none).
    """
    t0, cpu0 = (time.perf_counter(), time.thread_time()) if timed else (0.0, 0.0)
    try:
      run = next(self._runs)
    except StopIteration:
      return prefetch.END, _UNBUILT
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer.
      return prefetch.Raised(e), _UNBUILT
    steps = run.steps
    if timed:
      self._pace.fetched(t0, cpu0, len(steps))
    if steps and (self._read_ahead is not None or self._read_bytes is not None):
      self._note_first_read(steps[0][0])
    if len(steps) != 1:
      return run, _UNBUILT
    read, step = steps[0]
    return run, self._timed_build(read, step, run.signature, run.batch_size)

  def _timed_build(self, read: Any, step: Any, sig: Any, size: Any) -> Any:
    """One build (its item, None, or its error as `Raised`); times it. Outside the lock."""
    t0 = time.perf_counter()
    try:
      item = self._build(read, step, sig, size)
    except BaseException as e:  # noqa: BLE001 - raised in the consumer, in order.
      return prefetch.Raised(e)
    self._pace.built(time.perf_counter() - t0)
    return item

  def _note_first_read(self, read: Any) -> None:
    """Sizes the positions held unbuilt, and a batch's bytes, from the first decided read."""
    if self._read_ahead is not None and read is not None:
      self._ahead = max(self._size, self._read_ahead(read))
      self._read_ahead = None
    if self._read_bytes is not None and read is not None:
      self._pace.bytes = self._read_bytes(read)
      self._read_bytes = None

  def _take(self) -> Any:
    """The next built item, stolen (built here) if only decided; under the lock."""
    stole = False
    while True:
      if self._ready:
        item = self._pop_ready()
      elif self._pending and not self._building:
        item = self._process(self._pending.popleft())
        stole = True
        if item is None:
          continue  # A dropped position.
      elif self._stop.is_set():
        self._done = True
        raise StopIteration
      elif (
        not self._pending
        and not self._fetching
        and not self._upstream_done
        and self._pace.fetches_inline()
      ):
        if self._building or not self._pace.builds_direct():
          self._fetch(burst=False)
          continue
        item = self._direct()
        if item is None:
          continue  # Dropped, queued (a run of several positions) or closed meanwhile.
      elif self._thread.ident is not None and not self._thread.is_alive():
        # Never without an ending; a hang must fail.
        item = prefetch.Raised(RuntimeError("internal: the build thread ended without an ending"))
      else:  # Nothing decided yet, or the thread is building the next position.
        if not self._fetching:
          # The thread may be parked for `WAKE_S`, left to a consumer that
          # fetched inline until its averages moved (longer builds, a step):
          # wake it to fetch. Without this the consumer slept out the thread's
          # wait (50 ms) at each such turn (32 MB batches: 0.43-0.64 of inline).
          self._wake()
        self._waiting = True
        self._cond.wait(prefetch.WAKE_S)
        self._waiting = False
        continue
      self._wake_after_take(stole)
      return item

  def _pop_ready(self) -> Any:
    """The oldest built item; wakes a thread that waits for room to build."""
    if len(self._ready) == self._size and self._pending:
      self._cond.notify_all()
    return self._ready.popleft()

  def _wake_after_take(self, stole: bool) -> None:
    """Wakes the thread where a take leaves it work; under the lock.

    The thread waits for this take (`_fetch`), there is room for a burst of
    reads, or the consumer built (`stole`) a batch in a step's time: the
    thread may be parked from before the steps began.
    """
    if (
      self._handing
      or (len(self._pending) <= self._ahead // 2 and not self._pace.fetches_inline())
      or (stole and self._pace.stepping())
    ):
      self._wake()

  def _wake(self) -> None:
    """Wakes the thread, starting it the first time; under the lock."""
    if self._thread.ident is None and not self._stop.is_set():
      self._thread.start()
    self._cond.notify_all()

  def _process(self, work: Any) -> Any:
    """A position's item (None: dropped), or the terminal marker.

    Called under the lock; builds with the lock released (so that the thread
    can hand over decided positions meanwhile), marked by `_building`, so
    that positions are built one at a time, in order.
    """
    if prefetch.is_final(work):
      return work
    self._building = True
    self._cond.release()
    try:
      item = self._timed_build(*work)
    finally:
      self._cond.acquire()
      self._building = False
    if isinstance(item, prefetch.Raised):
      self._pending.clear()
      self._upstream_done = True  # Nothing after an error is built.
    return item

  def _away_s(self) -> float:
    """How long the consumer has been away from `__next__` (0 while in it).

    Counted from when its last item was ready where the thread saw that
    (`pace.AWAY_BUILDS`).
    """
    if self._in_next:
      return 0.0
    since = self._pace.left_at
    if self._seen == self._handed:
      since = max(since, self._ready_at)
    return time.perf_counter() - since

  def _see_ready(self) -> bool:
    """Waits (lock released) until the consumer's last item is ready; under the lock.

    Returns whether it waited: False where there is nothing to wait for.
    """
    item, handed = self._delivered, self._handed
    if self._wait_ready is None or self._seen == handed or not _is_item(item):
      return False
    self._cond.release()
    try:
      self._wait_ready(prefetch.unwrap(item))
    except Exception:  # noqa: BLE001 - e.g. a donated array: nothing to wait for.
      logger.debug("waiting for a delivered item failed", exc_info=True)
    finally:
      del item  # Not kept alive by this frame.
      self._cond.acquire()
    self._seen, self._ready_at = handed, time.perf_counter()
    return True

  def _room(self) -> bool:
    return len(self._pending) < self._ahead

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        with self._cond:
          until = prefetch.WAKE_S  # How long to park where there is nothing to do.
          if self._pending and len(self._ready) < self._size and not self._building:
            # Build ahead only while the consumer is away longer than a build
            # takes (a training step); a consumer that comes straight back
            # builds its batch itself, with no hand-off.
            away = self._away_s()
            grace = self._pace.grace()
            stepping = self._pace.stepping()
            if stepping and away:
              if self._see_ready():
                continue  # Away counts from then on.
              if away >= grace:
                item = self._process(self._pending.popleft())
                if item is not None and not self._stop.is_set():
                  self._ready.append(item)
                self._cond.notify_all()
                continue
            if stepping:
              # Wake when it is worth building (at most every STEP_POLL_S
              # while the consumer is in `__next__`).
              until = max(grace - away, STEP_POLL_S)
            if self._upstream_done or not self._room():
              self._cond.wait(until)
              continue
          elif self._upstream_done and not self._pending and not self._building:
            return
          elif self._upstream_done or not self._room():
            self._cond.wait(prefetch.WAKE_S)
            continue
          if self._fetching or self._pace.fetches_inline():
            self._cond.wait(until)  # The consumer fetches (or is fetching).
            continue
          self._fetch(burst=True)
    finally:
      self._run_close()

  def _run_close(self) -> None:
    if inspect.isgenerator(self._runs):
      try:
        self._runs.close()
      except Exception:  # noqa: BLE001
        logger.debug("producer close failed", exc_info=True)

  def _fetch(self, *, burst: bool) -> None:
    """Decided runs, fetched with the lock released, handed over together; under the lock.

    With `burst` (the thread), reads on while each run came quickly (within
    `BURST_RUN_S`), the burst is younger than `BURST_S`, there is room and
    the consumer is not waiting: one hand-off per burst, not per position.
    """
    self._fetching = True
    want = self._ahead - len(self._pending)
    timed = self._pace.count_fetch() or burst
    self._cond.release()
    work: list[Any] = []
    try:
      start = t0 = time.perf_counter()
      cpu0 = time.thread_time() if timed else 0.0
      while True:
        try:
          run = next(self._runs)
        except StopIteration:
          work.append(prefetch.END)
          break
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer.
          work.append(prefetch.Raised(e))
          break
        sig, size = run.signature, run.batch_size
        work.extend((read, step, sig, size) for read, step in run.steps)
        if self._read_ahead is not None or self._read_bytes is not None:
          self._note_first_read(work[0][0])
          want = self._ahead - len(self._pending)
        if not timed:
          break
        now, cpu = self._pace.fetched(t0, cpu0, len(run.steps))
        cpu0 = cpu
        if (
          not burst
          or len(work) >= want
          or self._waiting
          or now - t0 > BURST_RUN_S
          or now - start > BURST_S
          or self._stop.is_set()
        ):
          break
        t0 = now
    finally:
      self._cond.acquire()
      self._fetching = False
    if self._stop.is_set() or self._upstream_done:
      return
    self._pending.extend(work)
    self._upstream_done = prefetch.is_final(work[-1])
    if not burst:
      return  # The consumer fetched for itself.
    self._cond.notify_all()
    if self._waiting:
      # Let the waiting consumer take the GIL before the next burst.
      self._handing = True
      self._cond.wait(HANDOVER_S)
      self._handing = False

  def request_stop(self) -> None:
    """Asks the stage to stop, without its lock (a signal handler may hold it); `close()` follows.

    A consumer waiting in `__next__` sees it within `prefetch.WAKE_S` and
    raises StopIteration once nothing decided is left to build.
    """
    self._stop.set()

  def close(self) -> None:
    """Stops and joins the thread; idempotent."""
    self._done = True
    self._delivered = None
    self._stop.set()
    if self._on_close is not None:
      self._on_close()
    with self._cond:
      self._ready.clear()
      self._pending.clear()
      self._cond.notify_all()
    if self._thread.ident is None:
      self._run_close()  # Never started: close the runs here.
      return
    self._thread.join(timeout=prefetch.JOIN_TIMEOUT_S)
    if self._thread.is_alive():
      logger.warning(
        "grain_jax_sync: the prefetch thread is still blocked (in the"
        " source?) after %.0fs; leaving it as a daemon thread",
        prefetch.JOIN_TIMEOUT_S,
      )
