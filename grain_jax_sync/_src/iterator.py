"""`JaxBatchIterator` (options, state, stats, the lifetime) and `iter_jax_batches`, its constructor.

Each (re)start is one stream (`session.Stream`), started and ended by
`session.Streams`; `lifetime.Lifetime` holds the state machine, the turn and
the one close path. Each batch carries the source state after it: the state
the user sees is the one after the last batch they received.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Unpack

import jax

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import build as build_lib
from grain_jax_sync._src import lifetime as lifetime_lib
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src import session as session_lib
from grain_jax_sync._src.exchange import streams as exchange_streams
from grain_jax_sync._src.sources.elastic import resume as elastic_resume


def make_state(
  count: int, source: Any, options: options_lib.Options | None = None
) -> dict[str, Any]:
  """A `JaxBatchIterator` state at batch `count`; without `options`, version 1 (no options digest)."""
  state = {
    "version": 1 if options is None else options_lib.STATE_VERSION,
    "batches": count,
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
  }
  if options is not None:
    state["settings"] = options.digest()
  return {**state, "source": source}


class _Resumable:
  """The resume state of a `JaxBatchIterator`, its restarts, and the source's own iterator."""

  _options: options_lib.Options
  _streams: session_lib.Streams
  _life: lifetime_lib.Lifetime

  def _in_turn(self, what: str, fn: Any, *args: Any) -> Any:
    """Runs call `what` as this thread's turn (two threads would start two streams for the peers)."""
    life = self._life
    life.take_turn(what)
    try:
      return fn(*args)
    finally:
      life.give_turn()

  def get_state(self) -> dict[str, Any]:
    """The resume state after the last batch this consumer received.

    Takes no lock and makes no store call: safe from a checkpoint thread or
    a signal handler, and before the first batch.

    Returns:
      A JSON-serialisable dict, per process; restore it with `set_state` in a
      freshly built iterator on the same process.

    Raises:
      RuntimeError: If the source cannot report its position.
    """
    mark = self._streams.mark
    state = make_state(mark.position, self.local_state(mark), self._options)
    if self._options.batch_size is None and mark.batch_size is not None:
      state["batch_size"] = mark.batch_size  # Derived: later batches are judged by it.
    return state

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Resumes after the batch that `state` was taken at.

    Every process's resume position is compared before the first batch: a
    difference raises the same ValueError on every process.

    Args:
      state: A dict from `get_state` on the same process index, or the list
        of every process's `get_state()` in process order (an elastic source
        restores it on any process count).

    Raises:
      ValueError: If the state is malformed (naming the field), from another
        version, process or process count, or saved with other settings. The
        source is not touched, and the error is this process's ending: its
        peers raise it too, at once, and so does `next()` here until a
        `set_state` or `reset` succeeds.
      RuntimeError: If the iterator is closed, the source cannot resume, or
        out of turn: from inside this thread's own `next()` (a signal
        handler) or while another thread's `next()` is in progress.
    """
    self._in_turn("set_state()", self._set_state, state)

  def _set_state(self, state: Mapping[str, Any]) -> None:
    p, streams = jax.process_index(), self._streams

    def resolve() -> tuple[Any, int, Any]:
      # A list of every old process's state (issue 24): this process's, or
      # for an elastic source on another count, a re-split one.
      mine = elastic_resume.for_this_process(
        streams.source,
        state,
        process_index=p,
        process_count=jax.process_count(),
        settings=self._options.digest(),
      )
      return options_lib.check_state(
        mine, options=self._options, process_index=p, process_count=jax.process_count()
      )

    streams.restore("set_state()", resolve)

  def reset(self) -> None:
    """Restarts the stream from the source's beginning, on every host.

    Every process calls it at the same point (as MaxText's trainer calls
    ``eval_iterator.reset()`` before each eval). A process still iterating
    the stream this one left raises a RuntimeError naming this process. The
    source is reopened if it is re-iterable (a sequence, a Grain dataset or
    DataLoader, a `tf.data.Dataset`), else restored to its first state.

    Raises:
      RuntimeError: If the iterator is closed, the source can be read only
        once (a generator without get_state()/set_state()), or out of turn
        (as for `set_state`).
    """
    self._in_turn("reset()", self._streams.reset)

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
    return self._streams.source.local_iterator(self)

  def local_state(self, mark: session_lib.Mark | None = None) -> Any:
    """The source's JSON state after the last batch received (`local_iterator`), or at `mark`;
    raises if the source cannot report one."""
    source = self._streams.source
    if not source.supports_state:
      source.get_state()  # Raises with the source's description.
    return source.export_state((mark or self._streams.mark).state)

  def restore_local(self, source_state: Any) -> None:
    """Restarts from a `local_state()` (`local_iterator.set_state`).

    Raises:
      ValueError: If the source refuses the state (on the peers too).
    """
    # The source's state has no batch count: counting starts again, as after
    # `reset()`, and so does every host's resume position.
    what = "local_iterator.set_state()"
    self._in_turn(what, self._streams.restore, what, lambda: (source_state, 0, None))


class JaxBatchIterator(_Resumable, Iterator[Any]):
  """Iterates global `jax.Array` batches that every host agrees on; a context manager.

  Build it with `iter_jax_batches`, its public constructor (or get one from
  `device_put`'s and `jax_sync_generator`'s pipelines). The class is exported
  for type annotations and ``isinstance`` checks; its ``__init__`` takes an
  internal options value and may change between releases.
  """

  def __init__(
    self,
    source: Any,
    *,
    options: options_lib.Options,
    placement: placement_lib.BatchPlacement,
  ):
    placement.check_divisible(options)
    self._options = options
    self._placement = placement
    # Named at construction, so that a process that never iterates still
    # counts this iterator (and can tell its peers it closed or failed).
    namespace = None
    if options.synchronize_batches and jax.process_count() > 1:
      namespace = exchange_streams.new_namespace(options.name)
    self._streams = session_lib.Streams(
      source, options=options, placement=placement, namespace=namespace
    )
    # Holds no reference to this iterator: its finalizer closes it.
    self._life = lifetime_lib.Lifetime(self._streams)
    # The first run of the latest stream, and its rows per batch (`batch_specs`).
    self._first: tuple[batches_lib.Signature, int] | None = None
    self._finalizer = weakref.finalize(self, self._life.collected)

  def __iter__(self) -> JaxBatchIterator:
    return self

  def __next__(self) -> Any:
    # `_in_turn`, written out: an error's traceback then shows the user one
    # frame of this library, this one (`tracebacks.for_user`).
    life = self._life
    life.take_turn("next()")
    try:
      return self._streams.next()
    finally:
      life.give_turn()

  def stats(self, *, all_hosts: bool = False) -> dict[str, Any]:
    """What the input pipeline did on this host so far (or on every host).

    Counts are of the batches this consumer received (never of batches
    still prefetched), over the iterator's life, across `set_state`. Times
    are seconds of each stage's own thread, so with prefetching they overlap
    each other and the training step; ``wait_s`` is the part the consumer
    did not hide. Takes no lock: safe from any thread or a signal handler.

    Returns:
      A dict of counts: ``batches`` received, this host's ``real_rows`` and
      ``padded_rows`` (the rows the mask marks False) in them,
      ``dummy_batches`` and ``dropped_batches`` (`drop_last`); and seconds:
      ``wait_s`` (in ``next()``), ``source_s``, ``exchange_s`` and
      ``transfer_s``; each defined in docs/api.md's table. A mixture
      (`elastic_mixture`) adds ``sources``: per source, the ``rows`` this
      host consumed, their ``share`` of its rows and the source's ``weight``.

      With ``all_hosts=True``: ``{"hosts": [...], "slowest": p}``, one
      mapping per process (``process_index``, the keys above and
      ``padding_fraction``, padded over all rows), and the process with the
      most ``source_s`` (None where it ties with another's at 0.1 ms). This
      host's mapping is its live `stats()`; a peer's lags (it is exact once
      every host's stream ended). One process, or the collective fallback:
      this host only. See docs/performance.md, "Seeing the job".
    """
    if all_hosts:
      return self._streams.job.view()
    mark = self._streams.mark
    return {**self._streams.snapshot(), **self._streams.source.stats(mark.state)}

  # -- shapes ahead of time ------------------------------------------------------

  def batch_specs(self) -> list[Any]:
    """The global batches' shapes, dtypes and shardings, before the first batch.

    One pytree of `jax.ShapeDtypeStruct` per shape the batches can take, in
    the batches' structure, `mask_key` and `shape_mask_keys` included: one
    without `pad_shapes`; with it, one per combination of the `shape_buckets`
    of the dims that vary, ascending. Compile each step with
    ``jax.jit(step).lower(spec).compile()`` before the loop, and the loop
    compiles nothing (docs/shapes.md). A spec is of a full batch: a short
    last batch (without `paddings` or `drop_last`) has fewer rows.

    The structure comes from the first read, agreed across hosts: the first
    call starts the stream and waits for that agreement round (no batch is
    consumed; every host must iterate, as for ``next()``); later calls
    return at once.

    Returns:
      A list of pytrees of `jax.ShapeDtypeStruct`, each with its sharding.

    Raises:
      ValueError: If a dim of `pad_shapes` has no `shape_buckets`, or for
        the stream's own errors before its first batch (raised on every host).
      RuntimeError: If the stream ended before its first batch, or the
        iterator is closed.

    Example::

      step = jax.jit(train_step)
      compiled = {s["tokens"].shape: step.lower(s).compile() for s in it.batch_specs()}
      for batch in it:
        loss = compiled[batch["tokens"].shape](batch)  # Never compiles.
    """
    return self._in_turn("batch_specs()", self._batch_specs)

  def _batch_specs(self) -> list[Any]:
    streams = self._streams
    if streams.refusal is not None:
      raise ValueError(streams.refusal)
    if not streams.exhausted:
      stream = streams.current()
      first, self._first = stream.first_run(), None
      if first.signature is None:  # No batch: the stream's ending, raised as `next()` raises it.
        with contextlib.suppress(StopIteration):
          streams.next()
      else:
        rows = first.rows or stream.stopper.batch_size
        assert rows is not None  # Pinned by the first decided position.
        self._first = (first.signature, rows)
    if self._first is None:
      raise RuntimeError("batch_specs(): the stream ended before its first batch")
    sig, rows = self._first
    return build_lib.specs(sig, rows, options=self._options, placement=self._placement)

  # -- lifetime ----------------------------------------------------------------

  def request_stop(self) -> None:
    """Asks every host to end the stream at one same batch, then `StopIteration`.

    Safe from any thread and from a signal handler: it never waits on a lock
    and returns at once. This host's agreement posts the request; every host's
    stream then ends at the first position not yet decided when the request
    reaches the agreement, within about ``decide_ahead_s + (prefetch_batches
    + 1)`` steps + 1 s of the request (docs/multihost.md, Preemption), so
    that `get_state()` is at the same batch on every host and one checkpoint
    is consistent. Afterwards `stop_requested_by` names the process whose
    request ended the stream, on every host. A second request, or one after
    the stream ended, changes nothing; `set_state()` and `reset()` start a
    stream that no request has touched.

    Example::

      signal.signal(signal.SIGTERM, lambda *_: it.request_stop())
      for batch in it:
        state = train_step(state, batch)
      save(state, it.get_state())  # The same batch on every host.
    """
    self._streams.ask(session_lib.STOP)  # No lock; after a close, no stream hears it.

  @property
  def stop_requested_by(self) -> int | None:
    """The process whose `request_stop()` ended the stream (the same on every host).

    None while the stream runs, and after a natural end.
    """
    return self._streams.stopped_by

  def close(self) -> None:
    """Stops the stages, tells the peers, releases the source; idempotent.

    Peers end with "process p closed its iterator at batch i" after the
    batches already decided. Called from another thread while the consumer
    waits in `next()`, that call ends the iteration (`StopIteration`); any
    later `next()` raises `RuntimeError` (closed), and no batch is received
    after `close()` (one on its way is dropped). If that `next()` is reading
    the source itself (`prefetch_batches=0`), `close()` waits for the read
    (up to 30 s; then that `next()` closes everything when its read
    returns). A second call from another thread returns once the first has
    stopped everything. From a signal handler that interrupted `next()` (or
    from the source itself) it only asks: that `next()` stops at once and
    finishes the close. An iterator collected by a garbage collection in any
    thread but the main one (the library's, a source's own) is closed in a
    new thread.
    """
    self._finalizer.detach()
    self._life.close()

  def __enter__(self) -> JaxBatchIterator:
    return self

  def __exit__(self, *_: Any) -> None:
    self.close()

  @property
  def sharding(self) -> jax.sharding.Sharding:
    """The sharding of every yielded leaf (its spec cut to the leaf's rank)."""
    return self._placement.sharding

  @property
  def placement(self) -> placement_lib.BatchPlacement:
    """Where the rows go: the data shards this process feeds, and with whom."""
    return self._placement


def iter_jax_batches(
  source: Any,
  *,
  mesh: jax.sharding.Mesh | None = None,
  data_axes: str | tuple[str, ...] | None = None,
  sharding: jax.sharding.Sharding | jax.sharding.PartitionSpec | None = None,
  **options: Unpack[options_lib.Keywords],
) -> JaxBatchIterator:
  """Iterates global `jax.Array` batches that every process agrees on.

  Each process passes its own shard of the data. For every batch, all
  processes agree (about `decide_ahead_s` ahead of the consumer) on whether
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
    mesh: The mesh the batch lands on, over every device of the job; rows
      are split over `data_axes` and replicated over its other axes. Default:
      the mesh set by `jax.set_mesh`, else `default_mesh()`.
    data_axes: With a mesh: the axis (or tuple of axes) the rows are split
      over; default ``"data"`` if the mesh has it, else every axis.
    sharding: Instead of `mesh`: the sharding of every leaf (a spec longer
      than a leaf's rank is cut), or a `PartitionSpec` applied to `mesh` (or
      to the context or default mesh).
    **options: The options, by name, each documented once, with its
      default, under `Options` in the API reference (docs/api.md).

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
  checked = options_lib.make("iter_jax_batches", options, process_count=jax.process_count())
  placement = placement_lib.resolve_placement(mesh=mesh, data_axes=data_axes, sharding=sharding)
  return JaxBatchIterator(source, options=checked, placement=placement)
