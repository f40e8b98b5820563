"""JaxBatchIterator: the stages composed, started and closed in one place.

```
source -> Reader -> agreement (lockstep, or Decider / Follower) -> Builder -> Prefetcher -> user
```

`_Pipeline` builds the stages of one (re)start in the order of the diagram and
closes them in reverse order. Each produced batch carries the source state
after it, so the state the user sees is the state after the last batch they
received.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from grain_jax_sync._src import agreement, reader, sources, streamed
from grain_jax_sync._src import build as build_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import prefetch as prefetch_lib
from grain_jax_sync._src import settings as settings_lib
from grain_jax_sync._src import sharding as sharding_lib

logger = logging.getLogger(__name__)

Settings = settings_lib.Settings
STATE_VERSION = settings_lib.STATE_VERSION
AGREE_THREAD = "grain_jax_sync-agree"
# Decided runs of positions (each at most the read-ahead) queued between the
# agreement thread and the build thread.
STAGE_BUFFER = 1


class _Pipeline:
  """The stages of one (re)start; closes them in reverse order, once.

  Args:
    it: What the stages need from the iterator (read here, not kept).
    exchange: This start's exchange.
    start_error: A malformed-state error to end with before reading.
  """

  def __init__(self, it: JaxBatchIterator, exchange: Any, start_error: BaseException | None):
    s = it._settings  # noqa: SLF001 - the iterator composes its own pipeline.
    pc = jax.process_count()
    self._position = it._position  # noqa: SLF001
    self.delivered = 0
    self._agreement: streamed.Streamed | None = None
    self._stages: list[prefetch_lib.Prefetcher[Any]] = []
    read = reader.Reader(
      it._source,  # noqa: SLF001
      process_index=exchange.process_index,
      check_int32=not jax.config.jax_enable_x64,
      start_error=start_error,
    )
    who = agreement.Identity(
      process=exchange.process_index,
      devices=it._local_devices,  # noqa: SLF001
      config=s.digest(),
      resume=self._position,
    )
    inline = isinstance(exchange, exchange_lib.CollectiveExchange)  # Never in a thread.
    runs: Iterator[build_lib.Run]
    if isinstance(exchange, exchange_lib.KeyValueExchange):
      kind = streamed.Decider if exchange.process_index == 0 else streamed.Follower
      self._agreement = kind(
        read,
        exchange,
        s.options(),
        who,
        lookahead=s.lookahead,
        timeout_s=s.sync_timeout_s,
        position=self._position,
        threads=s.prefetch > 0,
      )
      runs = iter(self._agreement)
      if s.prefetch > 0:
        runs = self._thread(runs, STAGE_BUFFER, AGREE_THREAD)
    else:
      window = s.lookahead if pc > 1 else 1
      runs = agreement.lockstep(
        read, exchange, s.options(), who, window=window, position=self._position
      )
    builder = build_lib.Builder(s, it._sharding, pc, it._state)  # noqa: SLF001
    items: Iterator[build_lib.Item] = builder(runs)
    if s.prefetch > 0 and not inline:
      items = self._thread(items, s.prefetch, "grain_jax_sync-prefetch")
    self._items = items
    self._closed = False

  def _thread(self, it: Iterator[Any], size: int, name: str) -> prefetch_lib.Prefetcher[Any]:
    cancel = self._agreement.close_stage if self._agreement is not None else None
    stage = prefetch_lib.Prefetcher(it, buffer_size=size, on_close=cancel, name=name)
    self._stages.insert(0, stage)  # Closed from the user's end back to the source.
    return stage

  def __next__(self) -> build_lib.Item:
    item = next(self._items)
    self.delivered += 1
    return item

  def close(self, error: plan_lib.ReportedError | None = None) -> None:
    """Stops every stage, then posts this host's ending if the stream is still open."""
    if self._closed:
      return
    self._closed = True
    if self._agreement is not None:
      self._agreement.close_stage()
    for stage in self._stages:
      stage.close()
    if not self._stages:
      close = getattr(self._items, "close", None)
      if callable(close):
        close()
    if self._agreement is None:
      return
    self._agreement.release()
    if any(stage.thread.is_alive() for stage in self._stages):
      logger.warning("grain_jax_sync: a stage thread is still blocked; not posting this host's end")
      return
    try:
      self._agreement.close(self._position + self.delivered, error)
    except Exception as e:  # noqa: BLE001 - best effort: close never raises.
      logger.warning("grain_jax_sync: could not post this host's end: %s", e)


def _post_unstarted_end(
  settings: Settings, namespace: str | None, position: int, error: plan_lib.ReportedError | None
) -> None:
  """Posts the ending of an iterator closed before its (re)start, if peers may wait."""
  if namespace is None:
    return
  try:
    ex = exchange_lib.make_exchange(synchronize=settings.synchronize, namespace=namespace)
    if not isinstance(ex, exchange_lib.KeyValueExchange):
      return
    kind = streamed.Decider if ex.process_index == 0 else streamed.Follower
    who = agreement.Identity(process=ex.process_index, devices=1, config=None, resume=position)
    stage = kind(
      iter(()), ex, settings.options(), who, lookahead=1, timeout_s=1.0, position=position
    )
    stage.close(position, error)
  except Exception as e:  # noqa: BLE001 - best effort: close never raises (also at exit).
    logger.warning("grain_jax_sync: could not post this host's end: %s", e)


class _Lifetime:
  """What must happen when the iterator goes away; holds no reference to it."""

  def __init__(self, settings: Settings):
    self.settings = settings
    self.pipeline: _Pipeline | None = None
    self.unstarted: tuple[str | None, int] | None = None  # (namespace, position)
    self.error: plan_lib.ReportedError | None = None

  def stop(self) -> None:
    pipeline, self.pipeline = self.pipeline, None
    if pipeline is not None:
      pipeline.close(self.error)

  def close(self) -> None:
    self.stop()
    unstarted, self.unstarted = self.unstarted, None
    if unstarted is not None:
      _post_unstarted_end(self.settings, unstarted[0], unstarted[1], self.error)


class JaxBatchIterator(Iterator[Any]):
  """Iterates global `jax.Array` batches that every host agrees on.

  Built by `iter_jax_batches`. Supports `get_state`/`set_state` for exact
  resume, `close()` and use as a context manager.
  """

  def __init__(
    self,
    source: Any,
    *,
    settings: Settings,
    sharding: jax.sharding.Sharding | None = None,
  ):
    self._settings = settings
    self._sharding = sharding if sharding is not None else sharding_lib.default_sharding()
    self._local_devices = sharding_lib.local_row_shards(self._sharding)
    if settings.paddings is not None and settings.batch_size % self._local_devices:
      raise ValueError(
        f"`batch_size` must be divisible by the {self._local_devices} local"
        f" devices when `paddings` is given, got {settings.batch_size}"
      )
    self._source = sources.open_source(source)
    self._state = self._source.get_state() if self._source.supports_state else None
    self._position = 0
    self._closed = False
    self._exhausted = False
    self._generation = 0  # Pipeline (re)starts; names exchange keys.
    # Named at construction, so that a process that never iterates still
    # counts this iterator (and can tell its peers it closed).
    self._namespace = None
    if settings.synchronize and jax.process_count() > 1:
      self._namespace = exchange_lib.new_namespace(settings.name)
    self._start_error: BaseException | None = None
    self._life = _Lifetime(settings)
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
    self._life.pipeline = _Pipeline(self, exchange, self._start_error)

  def __iter__(self) -> JaxBatchIterator:
    return self

  def __next__(self) -> Any:
    if self._closed:
      raise RuntimeError("the iterator is closed")
    if self._exhausted:
      raise StopIteration
    if self._life.pipeline is None:
      self._start()
    assert self._life.pipeline is not None
    try:
      item = next(self._life.pipeline)
    except BaseException:
      self._exhausted = True
      self._life.stop()
      raise
    self._state = item.state
    self._position += 1
    return item.value

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
    return {
      "version": STATE_VERSION,
      "batches": self._position,
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "settings": self._settings.digest(),
      "source": self._source.export_state(self._state),
    }

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Resumes after the batch that `state` was taken at.

    Every process's resume position is compared before the first batch: a
    difference raises the same ValueError on every process.

    Args:
      state: A dict from `get_state` on the same process index.

    Raises:
      ValueError: If the state is malformed (naming the field), from another
        version, process or process count, or saved with other settings. The
        source is not touched, and the error reaches the peers too (as this
        process's ending, when it iterates or closes).
      RuntimeError: If the source cannot resume.
    """
    p = jax.process_index()
    try:
      batches, source_state = settings_lib.check_state(
        state, settings=self._settings, process_index=p, process_count=jax.process_count()
      )
      try:
        self._source.set_state(source_state)
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
          f"`state['source']` is not a state of {self._source.description}: {type(e).__name__}: {e}"
        ) from e
    except ValueError as e:
      error = ValueError(f"process {p}: {e}")
      self._restart(plan_lib.ReportedError(plan_lib.ErrorKind.VALUE, str(error), p, 0), error)
      raise error from e
    self._restart(None, None)
    self._state = source_state
    self._position = batches

  def _restart(self, error: plan_lib.ReportedError | None, exc: BaseException | None) -> None:
    """Stops the running stages; the next start (or close) reports `error`, if any."""
    self._life.error = error
    self._life.stop()
    self._start_error = exc
    self._life.unstarted = (self._next_namespace(), self._position)
    self._exhausted = False

  # -- lifetime ----------------------------------------------------------------

  def close(self) -> None:
    """Stops the stages, tells the peers, releases the source; idempotent."""
    if self._closed:
      return
    self._closed = True
    self._finalizer.detach()
    self._life.close()
    self._source.close()

  def __enter__(self) -> JaxBatchIterator:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  @property
  def sharding(self) -> jax.sharding.Sharding:
    """The sharding of every yielded leaf."""
    return self._sharding


def iter_jax_batches(
  source: Any,
  *,
  batch_size: int = 256,
  drop_last: bool = False,
  paddings: Any = None,
  mask_key: str | None = None,
  dtypes: Any = None,
  synchronize_batches: bool = True,
  synchronize_lookahead: int = 10,
  prefetch_batches: int = 2,
  sharding: jax.sharding.Sharding | None = None,
  sync_timeout_s: float = 600.0,
  name: str | None = None,
) -> JaxBatchIterator:
  """Iterates global `jax.Array` batches that every process agrees on.

  Each process passes its own shard of the data. For every batch, all
  processes agree (in windows of `synchronize_lookahead` batches) on whether
  there is one and how many rows it has, then each yields the same structure
  of global arrays whose leading dimension is ``rows * jax.process_count()``,
  sharded along the 1-D ``"data"`` mesh axis over all devices.

  Rules, identical on every process:
    * all sources ended: every process stops;
    * some ended: stop if `drop_last`; else the ended ones yield dummy batches
      of `paddings` values (all-False mask) if `paddings` is given; else
      every process raises ValueError;
    * row counts differ: pad to `batch_size` with `paddings`; with
      `drop_last` a batch shorter than `batch_size` on any process is dropped
      on every process; otherwise ValueError with the range of sizes;
    * batch structure (tree, dtypes, trailing shapes) or settings differ:
      ValueError naming the processes and columns;
    * a source raises: that process re-raises its exception, the others raise
      RuntimeError naming it.

  Args:
    source: Per-process batches: a sequence or iterable of NumPy arrays or
      pytrees of them (dicts, lists, tuples), a Grain `DataLoader`,
      `IterDataset` or `MapDataset`, or a `tf.data.Dataset`.
    batch_size: Rows per process per batch that padding fills to and
      `drop_last` compares with.
    drop_last: Stop when any process runs out; drop batches shorter than
      `batch_size`.
    paddings: Fill value for padded rows and dummy batches: a scalar or a dict
      of column name (or prefix) to scalar. None disables padding.
    mask_key: If set, dict batches get a boolean ``(rows,)`` column of that
      name: True for real rows, False for padding and dummy batches.
    dtypes: Output dtype: one dtype or a dict of column name to dtype.
      Narrowing casts run on the host before the transfer, widening casts on
      the device after it.
    synchronize_batches: Agree across processes (a single process never
      exchanges anything).
    synchronize_lookahead: Batches per agreement window.
    prefetch_batches: Batches prepared ahead in a background thread (0: none).
    sharding: Sharding of every leaf; default: `default_sharding()`.
    sync_timeout_s: How long to wait for a live peer (one whose liveness
      beat goes on: a slow source, a long checkpoint save or compile) before
      every process raises `PeerTimeoutError` naming it. A dead peer (no beat
      for 8 s) is named within about 10 s whatever this is.
    name: Names the exchange keys; needed only when processes do not create
      their iterators in the same order.

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
  for arg, value in (("batch_size", batch_size), ("synchronize_lookahead", synchronize_lookahead)):
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
    batch_size=int(batch_size),
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
  return JaxBatchIterator(source, settings=settings, sharding=sharding)
