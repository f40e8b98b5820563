"""The stages of one (re)start, composed in one place and closed in reverse order.

```
source -> Reader -> agreement (lockstep, or Decider / Follower) -> Builder -> Prefetcher -> user
```

`Pipeline` builds the stages in the order of the diagram, starting every
thread here; `close()` stops them from the user's end back to the source, then
posts this host's ending if the stream is still open. `Lifetime` is what the
iterator's finalizer closes: it holds no reference to the iterator.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import jax

from grain_jax_sync._src import agreement, build_stage, follower, reader, streamed
from grain_jax_sync._src import build as build_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import prefetch as prefetch_lib
from grain_jax_sync._src import settings as settings_lib
from grain_jax_sync._src import sharding as sharding_lib
from grain_jax_sync._src import stats as stats_lib

logger = logging.getLogger(__name__)

Settings = settings_lib.Settings
AGREE_THREAD = "grain_jax_sync-agree"
BUILD_THREAD = "grain_jax_sync-prefetch"
# Decided runs of positions (each at most the read-ahead) queued between the
# agreement thread and the build thread.
STAGE_BUFFER = 1


class Pipeline:
  """The stages of one (re)start; closes them in reverse order, once.

  Args:
    it: What the stages need from the iterator (read here, not kept).
    exchange: This start's exchange.
    start_error: A malformed-state error to end with before reading.
  """

  def __init__(self, it: Any, exchange: Any, start_error: BaseException | None):
    s = it._settings  # noqa: SLF001 - the iterator composes its own pipeline.
    # Rows shared across processes are compared wherever reports are exchanged.
    local = isinstance(exchange, exchange_lib.LocalExchange)
    shares = it._placement.shares_rows and not local  # noqa: SLF001
    mark = it._mark  # noqa: SLF001 - where the consumer is.
    self._position = mark.position
    self.namespace = getattr(exchange, "namespace", None)  # Its stream's keys (key-value store).
    self._lookahead = s.lookahead
    self.delivered = 0
    self._agreement: streamed.Streamed | None = None
    self._stages: list[prefetch_lib.Prefetcher[Any] | build_stage.BuildStage[Any]] = []
    read = reader.Reader(
      it._source,  # noqa: SLF001
      process_index=exchange.process_index,
      check_int32=not jax.config.read("jax_enable_x64"),
      start_error=start_error,
      digest=sharding_lib.rows_digest if shares else None,
    )
    who = agreement.Identity(
      process=exchange.process_index,
      devices=it._local_devices,  # noqa: SLF001
      # The settings, and the sharding (not saved in a state: a resumed job
      # may run on another mesh, but its processes must share one).
      config={**s.digest(), **it._placement.fingerprint()},  # noqa: SLF001
      resume=self._position,
      groups=it._placement.groups if shares else (),  # noqa: SLF001
    )
    options = s.options(pinned=mark.pinned)
    inline = isinstance(exchange, exchange_lib.CollectiveExchange)  # Never in a thread.
    runs: Iterator[build_lib.Run]
    if isinstance(exchange, exchange_lib.KeyValueExchange):
      kind = streamed.Decider if exchange.process_index == 0 else follower.Follower
      self._agreement = kind(
        read,
        exchange,
        options,
        who,
        lookahead=s.lookahead,
        timeout_s=s.sync_timeout_s,
        position=self._position,
        threads=s.prefetch > 0,
        job=it._job,  # noqa: SLF001 - stats(all_hosts=True)'s table.
      )
      runs = iter(self._agreement)
      if s.prefetch > 0:
        runs = self._thread(runs, STAGE_BUFFER, AGREE_THREAD)
    else:
      # Unsynchronized, each process decides alone: one read per batch (lazy).
      window = s.lookahead if exchange.process_count > 1 else 1
      runs = agreement.lockstep(
        read, exchange, options, who, window=window, position=self._position
      )
    builder = build_lib.Builder(s, it._placement, mark.state)  # noqa: SLF001
    self._counted = (read, exchange, builder)  # Each counts its own time (`times`).
    items: Iterator[build_lib.Item]
    if s.prefetch > 0 and not inline:
      # The consumer builds a decided position itself when nothing is built
      # yet (see `build_stage.BuildStage`); exchange waits stay in threads, and
      # reads too, except quick ones in one process with no step to hide them.
      items = build_stage.BuildStage(
        runs,
        builder.step,
        buffer_size=s.prefetch,
        read_ahead=self._read_ahead,
        read_bytes=_read_bytes,
        on_close=self._cancel(),
        wait_ready=_wait_ready if _host_copies(it._placement.sharding) else None,  # noqa: SLF001
        name=BUILD_THREAD,
        inline_fetch=self._agreement is None,  # Lockstep: no exchange wait.
      )
      self._stages.insert(0, items)
    else:
      items = builder(runs)
    self._items = items
    self._halted = False
    self._closed = False

  def _read_ahead(self, read: reader.Read) -> int:
    # Decided positions the build stage may hold unbuilt, bounded like the
    # agreement's read-ahead. In one process its thread reads the source in
    # bursts of that many (one wake-up per burst, not per batch); with the
    # agreement thread, it takes each decided run at once, so that the
    # agreement never blocks on a full hand-off queue and keeps its exchange
    # moving (2 processes x 4 devices: 0.49-0.61 ms per synchronized batch
    # instead of 0.76-0.77 with room for one position).
    return agreement.read_ahead_limit(read, self._lookahead)

  def _cancel(self) -> Any:
    return self._agreement.close_stage if self._agreement is not None else None

  def _thread(self, it: Iterator[Any], size: int, name: str) -> prefetch_lib.Prefetcher[Any]:
    stage = prefetch_lib.Prefetcher(it, buffer_size=size, on_close=self._cancel(), name=name)
    self._stages.insert(0, stage)  # Closed from the user's end back to the source.
    return stage

  def __next__(self) -> build_lib.Item:
    item = next(self._items)
    self.delivered += 1
    return item

  def times(self) -> stats_lib.Times:
    """The stages' time so far (each written by its own thread only)."""
    read, exchange, builder = self._counted
    return stats_lib.Times(read.source_s, exchange.busy_s, builder.transfer_s)

  @property
  def at(self) -> int:
    """This host's position: output batches before the next one."""
    return self._position + self.delivered

  def trailing_drops(self) -> int:
    """Positions dropped after the last item; exact once the stream ended."""
    return self._counted[2].dropped

  @property
  def threaded(self) -> bool:
    """Whether the stages run in threads (else in the consumer's `next()`)."""
    return bool(self._stages)

  def request_stop(self) -> None:
    """Asks every stage to stop, taking none of their locks; `close()` follows.

    For `close()` from a signal handler that interrupted the consumer inside
    `next()`: the interrupted frames may hold a stage's lock, so the stages
    are only told (their waits end), and that `next()` closes them on its
    way out.
    """
    if self._agreement is not None:
      self._agreement.close_stage()
    for stage in self._stages:
      stage.request_stop()

  def halt(self) -> None:
    """Stops every stage (no thread reads the source after it); posts nothing. Once."""
    if self._halted:
      return
    self._halted = True
    if self._agreement is not None:
      self._agreement.close_stage()
    for stage in self._stages:
      stage.close()
    if not self._stages:
      close = getattr(self._items, "close", None)
      if callable(close):
        try:
          close()
        except ValueError:  # Running in another thread (the finalizer at exit).
          logger.debug("the inline stages are running; left to finish", exc_info=True)
    if self._agreement is not None:
      self._agreement.release()

  def close(self, error: plan_lib.ReportedError | None = None, at: int | None = None) -> None:
    """Stops every stage, then posts this host's ending if the stream is still open.

    `at`: the batches this host's consumer received, where the iterator
    knows them better than `self.at` (a close from another thread while a
    decided batch was on its way to the consumer, which then drops it).
    """
    if self._closed:
      return
    self._closed = True
    self.halt()
    if self._agreement is None:
      return
    if any(stage.thread.is_alive() for stage in self._stages):
      logger.warning("grain_jax_sync: a stage thread is still blocked; not posting this host's end")
      return
    try:
      self._agreement.close(self.at if at is None else at, error)
    except Exception as e:  # noqa: BLE001 - best effort: close never raises.
      logger.warning("grain_jax_sync: could not post this host's end: %s", e)


def _read_bytes(read: reader.Read) -> int:
  return read.batch.nbytes


def _wait_ready(item: build_lib.Item) -> None:
  jax.block_until_ready(item.value)


def _host_copies(sharding: jax.sharding.Sharding) -> bool:
  """Whether a transfer to `sharding`'s devices is a copy by this host's cores.

  On CPU devices it is (XLA's copies use every core), so time spent waiting
  for it is not a step to build beside (`pace.AWAY_BUILDS`). On an
  accelerator it is a DMA that leaves the host free: building the next batch
  beside it starts that batch's transfer sooner.
  """
  return all(getattr(d, "platform", None) == "cpu" for d in sharding.device_set)


def post_unstarted_end(
  settings: Settings, namespace: str | None, position: int, error: plan_lib.ReportedError | None
) -> None:
  """Posts the ending of an iterator closed before its (re)start, if peers may wait."""
  if namespace is None:
    return
  try:
    ex = exchange_lib.make_exchange(synchronize=settings.synchronize, namespace=namespace)
    if not isinstance(ex, exchange_lib.KeyValueExchange):
      return
    kind = streamed.Decider if ex.process_index == 0 else follower.Follower
    who = agreement.Identity(process=ex.process_index, devices=1, config=None, resume=position)
    stage = kind(
      iter(()), ex, settings.options(), who, lookahead=1, timeout_s=1.0, position=position
    )
    stage.close(position, error)
  except Exception as e:  # noqa: BLE001 - best effort: close never raises (also at exit).
    logger.warning("grain_jax_sync: could not post this host's end: %s", e)


class Lifetime:
  """What must happen when the iterator goes away; holds no reference to it."""

  def __init__(self, settings: Settings, namespace: str | None = None):
    self.settings = settings
    self.namespace = namespace  # The iterator's key prefix (None: no exchange).
    self.pipeline: Pipeline | None = None
    self.unstarted: tuple[str | None, int] | None = None  # (namespace, position)
    self.at = 0  # Position when the last pipeline stopped,
    self.stream: str | None = None  # and its stream's key prefix.
    self.error: plan_lib.ReportedError | None = None
    self.finished = stats_lib.Times()  # Of the pipelines stopped so far.
    self.closed = False

  def halt(self) -> None:
    """Stops the running stages' threads, so that the source may be repositioned.

    The ending is posted by the `stop()` that follows, with `error` as set then.
    """
    if self.pipeline is not None:
      self.pipeline.halt()

  def stop(self, at: int | None = None) -> None:
    pipeline, self.pipeline = self.pipeline, None
    if pipeline is not None:
      pipeline.close(self.error, at)
      self.finished += pipeline.times()
      self.at, self.stream = (pipeline.at if at is None else at), pipeline.namespace

  def threaded(self) -> bool:
    """Whether stages run in threads (else they run in the consumer's `next()`)."""
    pipeline = self.pipeline
    return pipeline is not None and pipeline.threaded

  def request_stop(self) -> None:
    """`Pipeline.request_stop` of the running stages, if any."""
    pipeline = self.pipeline
    if pipeline is not None:
      pipeline.request_stop()

  def times(self) -> stats_lib.Times:
    """The stages' time over every (re)start."""
    running = self.pipeline
    return self.finished if running is None else self.finished + running.times()

  def post_unstarted(self) -> None:
    """Posts `error` (or closed) as this host's ending of the stream not started yet."""
    unstarted, self.unstarted = self.unstarted, None
    if unstarted is not None:
      post_unstarted_end(self.settings, unstarted[0], unstarted[1], self.error)

  def close(self, at: int | None = None) -> None:
    """Posts this host's ending to the running or next stream, then records the close.

    `at`: the batches the consumer received (see `Pipeline.close`). Once:
    the iterator's `close()` and the `next()` it leaves the close to may
    both call it.
    """
    if self.closed:
      return
    self.closed = True
    self.stop(at)
    unstarted = self.unstarted
    self.post_unstarted()
    if self.namespace is not None and self.settings.synchronize:
      stream, at = (self.stream, self.at) if unstarted is None else unstarted
      message = f"process {jax.process_index()} closed its iterator at batch {at}"
      exchange_lib.register_close(self.namespace, json.dumps([stream, message]))
