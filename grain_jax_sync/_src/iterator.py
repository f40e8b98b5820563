"""JaxBatchIterator and iter_jax_batches: options, state, lifetime.

The stages of each (re)start are composed in `pipeline.Pipeline`. Each
produced batch carries the source state after it, so the state the user sees
is the state after the last batch they received.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import job_stats, sources, tracebacks
from grain_jax_sync._src import pipeline as pipeline_lib
from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import prefetch as prefetch_lib
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src import settings as settings_lib
from grain_jax_sync._src import stats as stats_lib

logger = logging.getLogger(__name__)

Settings = settings_lib.Settings
STATE_VERSION = settings_lib.STATE_VERSION


class _Mark(NamedTuple):
  """Where the consumer is: batches received, the source state after them, the derived size."""

  position: int
  state: Any
  pinned: int | None


class JaxBatchIterator(Iterator[Any]):
  """Iterates global `jax.Array` batches that every host agrees on.

  Build it with `iter_jax_batches` (or get one from `device_put`'s and
  `jax_sync_generator`'s pipelines): that function is the public constructor,
  with keyword options checked and documented there. The class is exported
  for type annotations and ``isinstance`` checks; its ``__init__`` takes an
  internal settings object and may change between releases.

  Supports `get_state`/`set_state` for exact resume, `close()` and use as a
  context manager.
  """

  def __init__(
    self,
    source: Any,
    *,
    settings: Settings,
    placement: placement_lib.BatchPlacement,
  ):
    self._settings = settings
    self._placement = placement
    # Local rows split among the data shards this process holds.
    self._local_devices = placement.local_shards
    if (
      settings.paddings is not None
      and settings.batch_size is not None
      and settings.batch_size % self._local_devices
    ):
      raise ValueError(
        f"`batch_size` must be divisible by {placement.describe_local()}"
        f" when `paddings` is given, got {settings.batch_size}"
      )
    self._origin = source  # Reopened by reset().
    # Named at construction, so that a process that never iterates still
    # counts this iterator (and can tell its peers it closed or failed).
    self._namespace = None
    if settings.synchronize and jax.process_count() > 1:
      self._namespace = exchange_lib.new_namespace(settings.name)
    try:
      self._source = sources.open_source(source)
      initial = self._source.get_state() if self._source.supports_state else None
    except BaseException as e:
      # Peers would wait `sync_timeout_s` for a host that never reports.
      end = reader_lib.failed(jax.process_index(), 0, 0, e, "opening its source")
      first = None if self._namespace is None else f"{self._namespace}/1"
      pipeline_lib.post_unstarted_end(settings, first, 0, end.error)
      raise
    self._initial = initial
    # The batches received, the source state after the last of them, and
    # (without `batch_size`) the full size derived from the first position:
    # one tuple, replaced whole, so that `get_state()` (from a checkpoint
    # thread or a signal handler) never pairs the count of one batch with
    # the state of another, and takes no lock.
    self._mark = _Mark(0, initial, None)
    # Taken with the mark's and the counts' updates in `next()`, and by
    # `close()` and `stats()`: a batch is either received and counted, or
    # dropped by a concurrent close. Reentrant: a signal handler in the
    # consumer's thread may call `stats()` while `next()` holds it.
    self._mark_lock = threading.RLock()
    self._closed = False
    self._exhausted = False
    self._generation = 0  # Pipeline (re)starts; names exchange keys.
    self._start_error: BaseException | None = None
    self._refusal: str | None = None  # A refused state's error (`_refused`).
    # Reentrant only so that `_holds_next()` can tell a signal handler (or
    # the source) in this thread's own `next()`, also between its lines;
    # `next()` and the calls that take turns with it refuse to nest.
    self._next_lock = threading.RLock()
    self._closer: int | None = None  # The thread running the first `close()`.
    self._source_closed = False
    # The close, left to the thread in `next()` (by a signal handler's
    # `close()`, or one that could not wait out a long source read).
    self._close_deferred = False
    self._close_done = threading.Event()  # Set once the first `close()` has stopped everything.
    self._in_next: int | None = None  # The thread inside `next()`, if any.
    self._delivered = stats_lib.Delivered()
    self._life = pipeline_lib.Lifetime(settings, self._namespace)
    # stats(all_hosts=True): every host's counters, through the agreement's messages.
    self._job = job_stats.JobTable(stats_lib.Probe(self._delivered, self._life.times))
    self._life.unstarted = (self._next_namespace(), 0)
    self._finalizer = weakref.finalize(self, self._life.close)

  def _next_namespace(self) -> str | None:
    return None if self._namespace is None else f"{self._namespace}/{self._generation + 1}"

  def _start(self) -> None:
    s = self._settings
    namespace = self._next_namespace()
    self._generation += 1
    exchange = exchange_lib.make_exchange(synchronize=s.synchronize, namespace=namespace)
    self._life.unstarted = None
    self._life.pipeline = pipeline_lib.Pipeline(self, exchange, self._start_error)

  def __iter__(self) -> JaxBatchIterator:
    return self

  def __next__(self) -> Any:
    # One `next()` at a time: two threads starting the stream at once started
    # two pipelines (two streams for the peers), and two inline reads of a
    # generator collided.
    if self._holds_next():
      raise RuntimeError(
        "next() was called from inside this thread's own next() (a signal handler, the source?)"
      )
    with self._next_lock:
      self._in_next = threading.get_ident()
      try:
        return self._next()
      finally:
        with self._mark_lock:
          self._in_next = None
          deferred, self._close_deferred = self._close_deferred, False
        if deferred:  # `close()` left it to us.
          self._finish_close()

  def _holds_next(self) -> bool:
    """Whether this thread is inside `next()` (holds its lock), wherever in it."""
    return bool(self._next_lock._is_owned())  # type: ignore[attr-defined]  # noqa: SLF001

  @contextlib.contextmanager
  def _turn(self, what: str) -> Iterator[None]:
    """Holds `next()`'s lock for a call that moves the stream: they take turns.

    `set_state`, `reset` and `local_iterator.set_state` from another thread
    while `next()` ran raced its delivery: the stream could end silently
    (`next()` marked it exhausted after the restart) or the restored count
    move on by the batch in flight. A closed iterator refuses them.
    """
    if self._holds_next():
      raise RuntimeError(
        f"{what} was called from inside this thread's own next() (a signal"
        " handler?); call it between batches"
      )
    with self._next_lock:
      if self._closed:
        raise RuntimeError("the iterator is closed")
      yield

  def _next(self) -> Any:
    if self._closed:
      raise RuntimeError("the iterator is closed")
    if self._refusal is not None:
      raise ValueError(self._refusal)
    if self._exhausted:
      raise StopIteration
    t0 = time.monotonic()
    if self._life.pipeline is None:
      self._start()
      if self._closed:  # From another thread meanwhile: it waits for us to close.
        raise StopIteration
    pipeline = self._life.pipeline
    assert pipeline is not None
    try:
      item = next(pipeline)
    except BaseException as e:
      with self._mark_lock:
        self._delivered.wait_s += time.monotonic() - t0
        self._delivered.dropped_batches += pipeline.trailing_drops()
      self._exhausted = True
      if not self._closed:  # Else the closing call stops it, with its count.
        self._life.stop()
      del pipeline  # Holds the ending (see `tracebacks.clear_library_frames`).
      if self._closed and isinstance(e, exchange_lib.Cancelled):
        # Closed from another thread while waiting for a peer inline
        # (`prefetch_batches=0`): the call ends as with the stages' threads.
        raise StopIteration from None
      tracebacks.clear_library_frames(e)
      raise
    with self._mark_lock:
      if self._closed:
        # Closed from another thread meanwhile (its count excludes this
        # batch), or from a signal handler inside this call: no batch after
        # `close()`.
        raise StopIteration
      self._delivered.wait_s += time.monotonic() - t0
      self._delivered.add(item.real, item.rows, item.dropped)
      pinned = item.batch_size if self._settings.batch_size is None else None
      self._mark = _Mark(self._mark.position + 1, item.state, pinned)
    return item.value

  def stats(self, *, all_hosts: bool = False) -> dict[str, Any]:
    """What the input pipeline did on this host so far (or on every host).

    Counts are of the batches this consumer received (never of batches
    still prefetched), over the iterator's life, across `set_state`. Times
    are seconds of each stage's own thread, so with prefetching they overlap
    each other and the training step; ``wait_s`` is the part the consumer
    did not hide.

    Returns:
      A dict: ``batches`` received; this host's ``real_rows`` and
      ``padded_rows`` in them (padding of short batches and every row of
      its dummy batches: the rows the mask marks False); ``dummy_batches``
      (this host had no data of its own); ``dropped_batches`` (dropped on
      every host by `drop_last`, up to the last batch received, or to the
      end once iteration ended); and seconds: ``wait_s`` waiting in
      ``next()``, ``source_s`` in the source's ``next()`` and
      ``get_state()``, ``exchange_s`` in key-value store calls and waits
      (or the collective fallback's all-gathers; 0 in one process),
      ``transfer_s`` building global arrays (padding, mask, host casts,
      ``make_array_from_process_local_data``).

      With ``all_hosts=True``: ``{"hosts": [...], "slowest": p}``, one
      mapping per process (``process_index``, the keys above and
      ``padding_fraction``, padded over all rows), and the process with the
      most ``source_s``. This host's mapping is its live `stats()`. A
      peer's lags: at process 0 its counts are those decided for it and its
      times those it posted with its last rows (up to a window old); other
      hosts see process 0's table as of the last decision that carried it
      (at most once a second, every (P / 64)^2 s above 64 processes, and
      always the final one, so the counts are exact once the stream ended).
      One process, or the collective fallback: this host only. See
      docs/performance.md, "Seeing the job".
    """
    if all_hosts:
      return self._job.view()
    with self._mark_lock:
      delivered = dataclasses.replace(self._delivered)
    return stats_lib.snapshot(delivered, self._life.times())

  # -- state -------------------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    """The resume state after the last batch this consumer received.

    Returns:
      A JSON-serialisable dict, per process; restore it with `set_state` in a
      freshly built iterator on the same process.

    Raises:
      RuntimeError: If the source cannot report its position.
    """
    if not self._source.supports_state:
      self._source.get_state()  # Raises with the source's description.
    position, source_state, pinned = self._mark
    state = {
      "version": STATE_VERSION,
      "batches": position,
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "settings": self._settings.digest(),
      "source": self._source.export_state(source_state),
    }
    if pinned is not None:
      state["batch_size"] = pinned  # Derived: later batches are judged by it.
    return state

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Resumes after the batch that `state` was taken at.

    Every process's resume position is compared before the first batch: a
    difference raises the same ValueError on every process.

    Args:
      state: A dict from `get_state` on the same process index.

    Raises:
      ValueError: If the state is malformed (naming the field), from another
        version, process or process count, or saved with other settings. The
        source is not touched, and the error is this process's ending: its
        peers raise it too, at once, and so does `next()` here until a
        `set_state` or `reset` succeeds.
      RuntimeError: If the iterator is closed, the source cannot resume, or
        it is called from inside this thread's own `next()` (a signal
        handler). From another thread it waits for a `next()` in progress:
        calls take turns.
    """
    with self._turn("set_state()"):
      self._set_state(state)

  def _set_state(self, state: Mapping[str, Any]) -> None:
    p = jax.process_index()
    try:
      batches, source_state = settings_lib.check_state(
        state, settings=self._settings, process_index=p, process_count=jax.process_count()
      )
      pinned = settings_lib.pinned_batch_size(state)
      self._set_source_state(source_state)
    except ValueError as e:
      raise self._refused(e) from e
    self._leave("restored a state (set_state())")
    self._restart(None, None)
    derived = None if self._settings.batch_size is not None else pinned
    self._mark = _Mark(batches, source_state, derived)

  def _leave(self, how: str) -> None:
    """Ends the running stream here: a peer still in it raises naming this process."""
    p, at = jax.process_index(), self._mark.position
    self._life.error = plan_lib.ReportedError(
      plan_lib.ErrorKind.CLOSED, f"process {p} {how} at batch {at}", p, at, "reset"
    )
    self._life.stop()
    self._life.error = None

  def _refused(self, e: ValueError) -> ValueError:
    """Makes a refused state this host's ending (its peers raise it too).

    Posted at once, to the running stream or to the one it would have
    started, not when this host next iterates or closes: a host that lets the
    error propagate keeps the iterator alive in its traceback, and its peers
    waited `sync_timeout_s`. Until a `set_state` or `reset` succeeds,
    `next()` raises the same error.
    """
    p = jax.process_index()
    error = ValueError(f"process {p}: {e}")
    running = self._life.pipeline is not None  # Its stream gets the ending (`stop`).
    self._restart(plan_lib.ReportedError(plan_lib.ErrorKind.VALUE, str(error), p, 0), error)
    if not running:
      # The peers wait in the stream this host would have started: end it
      # there now; a later restart takes the stream after it, as theirs do.
      self._life.post_unstarted()
      self._generation += 1
    self._refusal = str(error)
    return error

  def _set_source_state(self, source_state: Any) -> None:
    """Moves the source, once no stage thread reads it (the callers restart after)."""
    if not self._source.supports_state:
      self._source.set_state(source_state)  # Raises; the running stream goes on.
      return
    self._life.halt()
    try:
      self._source.set_state(source_state)
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(
        f"`state['source']` is not a state of {self._source.description}: {type(e).__name__}: {e}"
      ) from e
    except Exception as e:
      self._restart(None, e)  # Halted: the next start raises it, on every host.
      raise

  def reset(self) -> None:
    """Restarts the stream from the source's beginning, on every host.

    Every process calls it at the same point (as MaxText's trainer calls
    ``eval_iterator.reset()`` before each eval). A process still iterating
    the stream this one left raises a RuntimeError naming this process. The
    source is reopened if it is re-iterable (a sequence, a Grain dataset or
    DataLoader, a `tf.data.Dataset`), else restored to its first state.

    Raises:
      RuntimeError: If the iterator is closed, the source can be read only
        once (a generator without get_state()/set_state()), or it is called
        from inside this thread's own `next()` (a signal handler). From
        another thread it waits for a `next()` in progress.
    """
    with self._turn("reset()"):
      self._reset()

  def _reset(self) -> None:
    self._leave("reset its iterator")
    self._source = sources.reopen(self._origin, self._source, self._initial)
    initial = self._source.get_state() if self._source.supports_state else None
    self._initial = initial
    self._mark = _Mark(0, initial, None)
    self._restart(None, None)

  # -- the source's own iterator (MaxText checkpoints it) ----------------------

  @property
  def local_iterator(self) -> Any:
    """The source's own iterator type (Grain sources), as seen through this one.

    Its ``get_state()`` is the source state after the last batch this
    consumer received (not the read-ahead), its ``set_state()`` restarts this
    iterator from such a state, so Grain's checkpoint handler saves and
    restores it as MaxText's trainer does. A `grain.DatasetIterator` for
    Grain datasets, a `DataLoaderIterator`-like object (JSON bytes) for a
    `grain.DataLoader`; None for other sources.
    """
    return self._source.local_iterator(self)

  def local_state(self) -> Any:
    """The source's JSON state after the last batch received (`local_iterator`)."""
    if not self._source.supports_state:
      self._source.get_state()  # Raises with the source's description.
    return self._source.export_state(self._mark.state)

  def restore_local(self, source_state: Any) -> None:
    """Restarts from a `local_state()` (`local_iterator.set_state`).

    Raises:
      ValueError: If the source refuses the state (on the peers too).
    """
    with self._turn("local_iterator.set_state()"):
      self._restore_local(source_state)

  def _restore_local(self, source_state: Any) -> None:
    try:
      self._set_source_state(source_state)
    except ValueError as e:
      raise self._refused(e) from e
    self._leave("restored a state (local_iterator.set_state())")
    self._restart(None, None)
    # The source's state has no batch count: counting starts again, as after
    # `reset()`, and so does every host's resume position.
    self._mark = _Mark(0, source_state, None)

  def _restart(self, error: plan_lib.ReportedError | None, exc: BaseException | None) -> None:
    """Stops the running stages; the next start (or close) reports `error`, if any."""
    self._life.error = error
    self._life.stop()
    self._start_error = exc
    self._refusal = None
    self._life.unstarted = (self._next_namespace(), self._mark.position)
    self._exhausted = False

  # -- lifetime ----------------------------------------------------------------

  def close(self) -> None:
    """Stops the stages, tells the peers, releases the source; idempotent.

    Peers end with "process p closed its iterator at batch i" after the
    batches already decided. Called from another thread while the consumer
    waits in `next()`, that call ends the iteration (`StopIteration`); any
    later `next()` raises `RuntimeError` (closed), and no batch is received
    after `close()` (one on its way is dropped). If that `next()` is reading
    the source itself, `close()` waits for the read (up to 30 s, then the
    reading thread closes the source when its read returns); with
    `prefetch_batches=0`, whose stages post from the consumer's thread, this
    host's ending is posted after that read too. A second call from another
    thread returns once the first has stopped everything; from a signal
    handler that interrupted `next()` it only asks the stages to stop, and
    that `next()` finishes the close.
    """
    me = threading.get_ident()
    if self._in_next == me:
      # From inside this thread's own `next()` (a signal handler, the source
      # itself): the interrupted frames may hold the stages' locks, so the
      # stages are only asked to stop, taking no lock, and that `next()`
      # closes everything when it returns.
      if not self._closed:
        self._closed = True
        self._finalizer.detach()
        self._close_deferred = True
        self._life.request_stop()
      return
    # A handler that interrupted `next()` between its own lines (outside the
    # stages: no stage lock is held), or this thread's own `close()`.
    nested = self._holds_next()
    with self._mark_lock:
      first = not self._closed
      self._closed = True  # No batch is received after this (one in flight is dropped).
      if first:
        self._closer = me
    if not first:
      if nested or self._closer == me:
        return  # The interrupted call finishes the close; it cannot be waited for here.
      # Another thread's close() (or one left to a `next()`) is under way:
      # return once the stages are stopped, as the first caller does.
      self._close_done.wait(prefetch_lib.JOIN_TIMEOUT_S)
      return
    self._finalizer.detach()
    if nested:
      self._finish_close()  # This thread holds `next()`'s lock already.
      return
    if self._life.threaded():
      # Only the stages' threads post, and `Lifetime.close` joins them before
      # it posts this host's ending: at once, however long a `next()` in
      # progress takes to return (a long read of its own).
      self._life.close(self._mark.position)
    else:
      # Inline stages post from the consumer's thread: a `next()` in
      # progress ends its waits and returns first, and the ending is posted
      # under its lock (the consumer's chunk and this ending took one key).
      self._life.request_stop()
    if not self._next_lock.acquire(timeout=prefetch_lib.JOIN_TIMEOUT_S):
      with self._mark_lock:
        if self._in_next is not None:
          # That `next()` is reading the source itself (a generator cannot
          # be closed while it runs): it closes everything on its way out.
          self._close_deferred = True
          return
      self._next_lock.acquire()  # It returned meanwhile.
    try:
      self._finish_close()
    finally:
      self._next_lock.release()

  def _finish_close(self) -> None:
    """Stops the stages, posts this host's ending, closes the source; once each."""
    try:
      self._life.close(self._mark.position)
      if not self._source_closed:
        self._source_closed = True
        self._source.close()
    finally:
      self._close_done.set()

  def __enter__(self) -> JaxBatchIterator:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  @property
  def sharding(self) -> jax.sharding.Sharding:
    """The sharding of every yielded leaf (its spec cut to the leaf's rank)."""
    return self._placement.sharding

  @property
  def placement(self) -> placement_lib.BatchPlacement:
    """Where the rows go: the data shards this process feeds, and with whom."""
    return self._placement


# The default of `mask_key` (not given) and its warning live with the settings.
UNSET: Any = settings_lib.UNSET
warn_if_unmasked = settings_lib.warn_if_unmasked


def iter_jax_batches(
  source: Any,
  *,
  batch_size: int | None = None,
  drop_last: bool = False,
  paddings: Any = None,
  mask_key: str | None = UNSET,
  dtypes: Any = None,
  synchronize_batches: bool = True,
  synchronize_lookahead: int = 10,
  prefetch_batches: int = 2,
  mesh: jax.sharding.Mesh | None = None,
  data_axes: str | tuple[str, ...] | None = None,
  sharding: jax.sharding.Sharding | jax.sharding.PartitionSpec | None = None,
  sync_timeout_s: float = 600.0,
  name: str | None = None,
) -> JaxBatchIterator:
  """Iterates global `jax.Array` batches that every process agrees on.

  Each process passes its own shard of the data. For every batch, all
  processes agree (in windows of `synchronize_lookahead` batches) on whether
  there is one and how many rows it has, then each yields the same structure
  of global arrays, rows split over the data axes of the mesh (by default
  the 1-D ``"data"`` mesh over every device) and replicated over its other
  axes. The leading dimension is ``rows * shard_count``: processes that hold
  the same data shards (a model axis across processes) feed identical rows
  (see `data_shard_info`); otherwise it is ``rows * jax.process_count()``.

  Rules, identical on every process:
    * all sources ended: every process stops;
    * some ended: stop if `drop_last`; else the ended ones yield dummy batches
      of `paddings` values (all-False mask) if `paddings` is given; else
      every process raises ValueError;
    * row counts differ: pad to `batch_size` with `paddings`; with
      `drop_last` a position whose short batches are all their processes'
      last batches is dropped on every process, and a short batch that is
      not its process's last raises ValueError naming both sizes; otherwise
      ValueError with the range of sizes;
    * batch structure (tree, dtypes, trailing shapes) or settings differ:
      ValueError naming the processes and columns;
    * a source raises: that process re-raises its exception, the others raise
      RuntimeError naming it.

  Args:
    source: Per-process batches: a sequence or iterable of NumPy arrays or
      pytrees of them (dicts, lists, tuples), a Grain `DataLoader`,
      `IterDataset` or `MapDataset`, or a `tf.data.Dataset`.
    batch_size: Rows per process per batch that padding fills to and
      `drop_last` compares with; batches larger than it pass through when
      every process has one of the same size. None (the default): the
      largest host batch of the first position, agreed across processes
      (and saved with the state); a short batch that is not its host's last
      then raises naming both sizes. Without `paddings` and `drop_last`
      every batch keeps its size (host batches must be equal).
    drop_last: Stop when any process runs out; drop a short last batch on
      every process (a short batch mid-stream raises, naming both sizes).
    paddings: Fill value for padded rows and dummy batches: a scalar or a dict
      of column name (or prefix) to scalar. None disables padding. A value
      must be one of its column's output dtype (as it lands on the device:
      int64 is int32 with x64 off): -1 for uint8, 0.5 for an integer or
      1e6 for float16 raise a `ValueError` naming the column.
    mask_key: If set, dict batches get a boolean ``(rows,)`` column of that
      name: True for real rows, False for padding and dummy batches. Left
      unset with `paddings`, one warning is logged that padded rows look
      real; pass None to silence it.
    dtypes: Output dtype: one dtype or a dict of column name to dtype.
      Narrowing casts run on the host before the transfer, widening casts on
      the device after it; either way the values are `jax.Array.astype`'s
      (float to integer saturates, NaN becomes 0; integer to integer wraps).
    synchronize_batches: Agree across processes (a single process never
      exchanges anything).
    synchronize_lookahead: Batches per agreement window: a process posts its
      rows once it holds a window (at once after a read slower than 10 ms;
      in bigger chunks, up to 16 windows, while reads are quicker), and holds
      at most R = 32 windows (at most 64 MiB) read but not yet agreed on.
      Agreed batches waiting to be built add up to about 4 R more with
      `prefetch_batches` > 0 (docs/performance.md, Memory).
    prefetch_batches: Batches prepared ahead in a background thread (0: none).
    mesh: The mesh the batch lands on, over every device of the job; rows
      are split over `data_axes` and replicated over its other axes. Default:
      the mesh set by `jax.set_mesh`, else `default_mesh()`.
    data_axes: With a mesh: the axis (or tuple of axes) the rows are split
      over; default ``"data"`` if the mesh has it, else every axis.
    sharding: Instead of `mesh`: the sharding of every leaf (a spec longer
      than a leaf's rank is cut), or a `PartitionSpec` applied to `mesh` (or
      to the context or default mesh).
    sync_timeout_s: How long to wait for a live peer (one whose liveness
      beat goes on: a slow source, a long checkpoint save or compile) before
      every process raises `PeerTimeoutError` naming it. A dead peer (no beat
      for 8 s) is named within about 10 s whatever this is.
    name: Names the exchange keys; needed only when processes do not create
      their iterators in the same order. Iterators of one name are counted
      (a new one each epoch is fine): every process creates as many.

  Returns:
    A `JaxBatchIterator`.

  Raises:
    ValueError: For bad arguments (checked here) and bad data (on iteration,
      on every process).

  Example:

    >>> batches = [{"x": np.arange(8.0)}, {"x": np.arange(4.0)}]
    >>> with iter_jax_batches(batches, batch_size=8, paddings=0, mask_key="mask") as it:
    ...   for batch in it:
    ...     loss = step(batch["x"], batch["mask"])
  """
  mask_key = warn_if_unmasked(paddings, mask_key)
  sizes = [("synchronize_lookahead", synchronize_lookahead)]
  if batch_size is not None:
    sizes.append(("batch_size", batch_size))
  for arg, value in sizes:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"`{arg}` must be a positive int, got {value!r}")
  if (
    isinstance(prefetch_batches, bool)
    or not isinstance(prefetch_batches, (int, np.integer))
    or prefetch_batches < 0
  ):
    raise ValueError(f"`prefetch_batches` must be an int >= 0, got {prefetch_batches!r}")
  if mask_key is not None and not isinstance(mask_key, str):
    raise ValueError(f"`mask_key` must be a str or None, got {mask_key!r}")
  if not sync_timeout_s > 0:
    raise ValueError(f"`sync_timeout_s` must be > 0, got {sync_timeout_s!r}")
  settings = Settings(
    batch_size=None if batch_size is None else int(batch_size),
    drop_last=bool(drop_last),
    paddings=paddings,
    mask_key=mask_key,
    dtypes=dtypes,
    synchronize=bool(synchronize_batches),
    lookahead=int(synchronize_lookahead),
    prefetch=int(prefetch_batches),
    sync_timeout_s=float(sync_timeout_s),
    name=name,
  )
  placement = placement_lib.resolve_sharding(mesh=mesh, data_axes=data_axes, sharding=sharding)
  return JaxBatchIterator(source, settings=settings, placement=placement)
