"""The streams of one iterator and their endings: each (re)start one `Stream`, ended in one place.

The stages, in docs/internals.md's diagram ("Data flow"): with
`prefetch_batches=0` every stage runs in the caller's `next()`; with
prefetch, each threaded stage is a `prefetch.Prefetcher` (at most three
threads per stream) and `next()` is one queue get.

The thread in the call (`next()`, `set_state()`, ...) makes, advances and
ends the streams. Other threads only `ask` (a stop or a close: a put on the
inbox, and the write-once ``closing``) and read `times`: fields set before
the stream was published, and stage counters each written by one thread.
The inbox (`Streams.asks`) belongs to the stream running or to start next,
whose agreement drains it at each step: an ask put before, during or after
its start reaches it; a restart gives the next stream a new inbox.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax

from grain_jax_sync._src import build as build_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import (
  job_stats,
  liveness,
  messages,
  reader,
  signal_at,
  sources,
  tracebacks,
)
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src import prefetch as prefetch_lib
from grain_jax_sync._src import stats as stats_lib
from grain_jax_sync._src.agreement import core, decider, driver, endings, lockstep
from grain_jax_sync._src.agreement.common import Agreement, Identity, Run
from grain_jax_sync._src.agreement.interpreter import best_effort
from grain_jax_sync._src.agreement.streamed import unstarted
from grain_jax_sync._src.exchange import collective, key_value
from grain_jax_sync._src.exchange import streams as exchange_streams
from grain_jax_sync._src.sources import base as sources_base

logger = logging.getLogger(__name__)

READ_THREAD = "grain_jax_sync-read"
AGREE_THREAD = "grain_jax_sync-agree"
BUILD_THREAD = "grain_jax_sync-prefetch"
# The collective fallback's window where `synchronize_lookahead` is None: a
# window amortizes its all-gathers (each a round trip over every device).
LOCKSTEP_WINDOW = 10
# Decided positions queued for the build thread: one, so that positions are
# decided just ahead of the build; the read-ahead overlaps the exchange.
AGREE_BUFFER = 1
# What `Streams.ask` takes: `request_stop()`, and a close (`lifetime.Lifetime`).
STOP = "stop"
CLOSE = "close"


class Mark(NamedTuple):
  """Where the consumer is: replaced whole, so that a reader never mixes two batches.

  `batch_size`: the agreed full batch size (given, or pinned by the first
  position and saved with the state); None until known.
  """

  position: int  # Batches received.
  state: Any  # The source state after them.
  batch_size: int | None
  delivered: stats_lib.Delivered  # Over the iterator's life.


@dataclasses.dataclass(frozen=True)
class Start:
  """Everything one (re)start is built from."""

  options: options_lib.Options
  placement: placement_lib.BatchPlacement
  source: sources_base.SourceIterator
  mark: Mark
  start_error: BaseException | None
  namespace: str | None  # This stream's keys; None: nothing is exchanged.
  job: Any = None  # `job_stats.JobTable`: every host's counters (`stats(all_hosts=True)`).
  asks: Any = None  # The inbox of this stream (`Streams.asks`): stops and a close, asked.


class Stream:
  """One (re)start of the stream: its stages in the diagram's order, its threads and its exchange."""

  stopper: (
    Agreement  # Either form (a bare one if pre-ended): the batch size it pinned, who stopped.
  )

  def __init__(self, start: Start):
    options = start.options
    ex = exchange_lib.make_exchange(
      synchronize=options.synchronize_batches, namespace=start.namespace
    )
    if isinstance(ex, key_value.KeyValueExchange):
      liveness.Beat.ensure(ex.client, ex.process_index)  # Peers tell dead from slow by it.
    self.reached_end = False  # This host's consumer reached the agreed end (not an error).
    self._failed = False  # The stream ended with an error here: no peer waits at its end.
    self._exchange = ex
    self._ended = False
    self.agreement: driver.Driver | None = None
    self._inline: driver.Driver | None = None  # Run in the consumer's call, which holds its turn.
    self._threads: list[prefetch_lib.Prefetcher[Any]] = []
    read = reader.Reader(
      start.source,
      process_index=ex.process_index,
      check_int32=not jax.config.read("jax_enable_x64"),
      start_error=start.start_error,
      digest=reader.rows_digest if self._shares(start) else None,
      shapes=options.pad_shapes,  # `pad_shapes`: the dims whose sizes vary.
      narrowing=functools.partial(build_lib.narrowing, dtypes=options.dtypes),
    )
    self.builder = build_lib.Builder(options, start.placement, start.mark.state)
    runs = self._agree(start, read)
    self._read = read  # Counts its own time (`times`).
    self._items = self._build(start, runs)

  def _shares(self, start: Start) -> bool:
    """Whether processes that share rows compare them (wherever reports are exchanged)."""
    return start.placement.shares_rows and self._exchange.process_count > 1

  def _agree(self, start: Start, read: reader.Reader) -> Iterator[Run]:
    """The agreement of the form the exchange picks: decided runs."""
    options, ex = start.options, self._exchange
    who = Identity(
      process=ex.process_index,
      devices=len(start.placement.local_blocks),
      # The options, the sharding and the source's settings (not saved in a state: a
      # resumed job may run on another mesh, but its processes must share one).
      config={**options.digest(), **start.placement.fingerprint(), **start.source.fingerprint()},
      resume=start.mark.position,
      groups=start.placement.groups if self._shares(start) else (),
    )
    rules = options.rules(batch_size=start.mark.batch_size)
    if not isinstance(ex, key_value.KeyValueExchange):
      # Lockstep: one process, or each alone; the collective fallback in the caller's thread.
      window = (options.synchronize_lookahead or LOCKSTEP_WINDOW) if ex.process_count > 1 else 1
      self.stopper = lockstep.Lockstep(
        rules, who, process_count=ex.process_count, window=window, position=start.mark.position
      )
      stepper = driver.Stepper(self.stopper, read, ex, start.asks)
      if ex.process_count == 1 and options.prefetch_batches > 0 and options.read_ahead is not None:
        return self._agree_thread(stepper, options)  # `device_put`'s `cpu_buffer_size`.
      return iter(stepper)
    ended = exchange_streams.pre_ended(start.namespace)
    if ended is not None:  # Posted here already (the crosswise wait): raised, no exchange.
      self.stopper = Agreement(rules, who)
      return _raising(RuntimeError(ended))
    threaded = options.prefetch_batches > 0
    self.agreement = driver.Driver(
      decider.core_for(
        rules,
        who,
        # With a build thread, what it has not built counts in the read-ahead.
        threaded=threaded,
        namespace=ex.namespace,
        process_count=ex.process_count,
        lookahead=options.synchronize_lookahead,
        timeout_s=options.sync_timeout_s,
        position=start.mark.position,
        read_ahead=options.read_ahead,
        job=start.job,
      ),
      # A reading thread: a stuck read holds up no decision, stop or close.
      self._thread(prefetch_lib.OnDemand(read, name=READ_THREAD)) if threaded else read,
      ex,
      self.builder,
      asks=start.asks,
    )
    self.stopper = self.agreement.core
    if not threaded:
      self._inline = self.agreement
      return iter(self.agreement)
    return self._agree_thread(self.agreement, options)

  def _agree_thread(self, runs: Any, options: options_lib.Options) -> Iterator[Run]:
    """The agreement in its own thread, one decided position queued (Grain's: `read_ahead`)."""
    producer = iter(runs) if options.read_ahead is None else _one_by_one(runs)
    return self._prefetched(producer, options.read_ahead or AGREE_BUFFER, AGREE_THREAD)

  def _build(self, start: Start, runs: Iterator[Run]) -> Iterator[build_lib.Item]:
    """Built items: in a thread `prefetch_batches` ahead, or inline (collectives; pre-ended)."""
    if (
      start.options.prefetch_batches == 0
      or isinstance(self._exchange, collective.CollectiveExchange)
      or exchange_streams.pre_ended(start.namespace) is not None
    ):
      return self.builder(runs)
    return self._prefetched(self.builder(runs), start.options.prefetch_batches, BUILD_THREAD)

  def _prefetched(self, producer: Iterator[Any], buffer_size: int, name: str) -> Iterator[Any]:
    """`producer` in a stage thread that takes a slot before it produces an item (so the
    agreement decides only once the build took the last position)."""
    stage = prefetch_lib.Prefetcher(
      producer,
      buffer_size=buffer_size,
      in_hand=False,
      # The exchange's own method: one of this stream's would make a cycle.
      on_close=getattr(self._exchange, "cancel", None),
      name=name,
    )
    return self._thread(stage)

  def _thread(self, stage: Any) -> Any:
    self._threads.insert(0, stage)  # Closed from the user's end back to the source.
    return stage

  def __next__(self) -> build_lib.Item:
    inline = self._inline
    if inline is not None:
      inline.turn.acquire()  # A stop being posted meanwhile (`post_stop`) is one write.
    try:
      item = next(self._items)
    except key_value.Cancelled:
      raise
    except StopIteration:
      if self.agreement is not None and self.agreement.core.reached_end:
        # The agreed end: every peer's consumer gets there, or this raises naming one.
        self.reached_end = True
        self.agreement.wait_for_peers_at_end()
      raise
    except BaseException:
      self._failed = True
      raise
    finally:
      if inline is not None:
        inline.turn.release()
        # One asked for during this call (a signal handler, a thread).
        inline.post_stop(in_call=True)
    return item

  def first_run(self) -> build_lib.FirstRun:
    """The first decided run, waited for without building a batch (its signature None: ended)."""
    first = self.builder.first
    with self._turn():
      first.wait()
    if self._inline is not None:
      self._inline.post_stop(in_call=True)  # One asked for during this call.
    return first

  def times(self) -> stats_lib.Times:
    """The stages' time so far (each written by its own thread only)."""
    return stats_lib.Times(self._read.source_s, self._exchange.busy_s, self.builder.transfer_s)

  def heard(self, close: bool) -> None:
    """Something was put in the inbox (any thread, a signal handler): a wake (`driver.Driver.heard`)."""
    if close:
      self.wake()
    if self.agreement is not None:  # Lockstep takes it at its next window.
      self.agreement.heard(close)

  def wake(self) -> None:
    """Wakes every wait of the stages, taking no lock (a signal handler may hold one)."""
    cancel = getattr(self._exchange, "cancel", None)
    if cancel is not None:
      cancel()
    for stage in self._threads:
      stage.wake()

  @property
  def left(self) -> bool:
    """Whether an ending now leaves before the agreed end (peers waiting there are told too)."""
    return not self.reached_end and not self._failed

  def halt(self, ended: bool = False) -> None:
    """Stops every stage, from the user's end back to the source; `ended`: the stream's last. Once.

    Ended, the agreement's thread posts the ending asked (`Streams.end`) as it
    returns; every wait is woken first, a read in progress is not waited for
    (`reading`). Inline, under the agreement's turn, and posted here.
    """
    if ended:
      if self._ended:
        return
      self._ended = True
      self.builder.wake()  # The agreement thread may wait for the build thread's room.
      self.wake()  # Every wait at once, before any join.
    with self._turn():
      for stage in self._threads:
        stage.close(wait=not ended or not isinstance(stage, prefetch_lib.OnDemand))
      if not self._threads:
        prefetch_lib.close_producer(self._items)
      if self.agreement is None:
        return
      self.agreement.not_waiting()  # No longer a crosswise wait.
      if not ended:
        return
      blocked = [s for s in self._threads if not isinstance(s, prefetch_lib.OnDemand)]
      if any(stage.thread.is_alive() for stage in blocked):
        logger.warning(
          "grain_jax_sync: a stage thread is still blocked; not posting this host's end"
        )
        return
      self.agreement.post_ending()  # Where no thread posted it (inline, or it had returned).

  def _turn(self) -> contextlib.AbstractContextManager[Any]:
    """Inline, the agreement's turn (a stop being posted is one write); else nothing."""
    return self._inline.turn if self._inline is not None else contextlib.nullcontext()

  @property
  def reading(self) -> prefetch_lib.OnDemand[Any] | None:
    """The reading thread's stage, if this stream has one (a closed one may still be in the source)."""
    return next((s for s in self._threads if isinstance(s, prefetch_lib.OnDemand)), None)


class Streams:
  """The streams of one iterator: opens the source, starts each stream, and ends each in `end`.

  Every ending goes through `end`: the stream's own (from `next`), a restart
  (`reset`, `restore`; a refused state too) and the close (``last``). Other
  threads read ``mark``, ``stream`` and ``finished``, each replaced whole.
  `origin`: what the user passed (reopened by `reset`); `namespace`: the
  iterator's key prefix (None: nothing is exchanged).
  """

  def __init__(
    self,
    origin: Any,
    *,
    options: options_lib.Options,
    placement: placement_lib.BatchPlacement,
    namespace: str | None,
  ):
    self._options = options
    self._placement = placement
    self._namespace = namespace
    self._origin = origin
    self.generation = 0  # Streams started or ended so far; names their keys.
    self.pending_start = True  # No stream since the last (re)start: a close posts there.
    try:
      self.source = sources.open_source(origin)
      self.initial = self.source.get_state() if self.source.supports_state else None
    except BaseException as e:  # The first stream's ending: peers would wait for it.
      self.generation = 1
      end = endings.failed(jax.process_index(), 0, 0, e, "opening its source")
      _post_unstarted(options, self._keys(), 0, end.error)
      raise
    self.mark = Mark(0, self.initial, options.batch_size, stats_lib.Delivered())
    self.stream: Stream | None = None
    self.finished = stats_lib.Times()  # The stage times of the streams ended so far.
    self.closing = False  # A close was asked for: written once (False to True) by `ask`, no lock.
    self.start_error: BaseException | None = None  # Raised by the next start.
    self.refusal: str | None = None  # A refused state's error, raised by `next()`.
    self.exhausted = False
    self.stopped_by: int | None = None  # The process whose stop ended the last stream.
    # The inbox of the stream running or to start next: `ask` puts, its agreement drains it.
    self.asks: queue.SimpleQueue[Any] = queue.SimpleQueue()
    # The last ended stream's reading thread: it may still be in the source.
    self._reading: prefetch_lib.OnDemand[Any] | None = None
    # stats(all_hosts=True): every host's counters, through the agreement's messages.
    self.job = job_stats.JobTable(self.snapshot, namespace)

  def _keys(self) -> str | None:
    return None if self._namespace is None else f"{self._namespace}/{self.generation}"

  def current(self) -> Stream:
    """The running stream, started now if there is none. In the call."""
    stream = self.stream
    if stream is None:
      self.generation += 1
      start_error, self.start_error = self.start_error, None
      options, asks = self._options, self.asks
      start = Start(
        options, self._placement, self.source, self.mark, start_error, self._keys(), self.job, asks
      )
      self.stream = stream = Stream(start)
      self.pending_start = False
      if not asks.empty():  # Asked before it was published: its agreement takes it; a wake.
        stream.heard(close=self.closing)
    return stream

  def next(self) -> Any:
    """The next batch of the running stream; its ending ends it (`end`). In the call."""
    if self.refusal is not None:
      raise ValueError(self.refusal)
    if self.exhausted:
      raise StopIteration
    t0 = time.monotonic()
    stream = self.stream or self.current()
    try:
      item = next(stream)
    except BaseException as e:
      d = self.mark.delivered.ended(time.monotonic() - t0, stream.builder.dropped)
      self.mark = self.mark._replace(delivered=d)
      self.exhausted = True
      self.stopped_by = stream.stopper.stop_requested_by
      if not self.closing:  # Else the close ends it, with its count.
        self.end()
      del stream  # Holds the ending (see `tracebacks.clear_library_frames`).
      if self.closing and isinstance(e, (key_value.Cancelled, StopIteration)):
        raise StopIteration from None  # Closed from another thread meanwhile.
      tracebacks.clear_library_frames(e)
      tracebacks.for_user(e)  # The user's frames and the message, not the library's threads.
      raise
    if self.closing:  # Closed meanwhile (another thread, a handler): no batch after `close()`.
      raise StopIteration
    # Replaced whole: readers in other threads see the old mark or the new one.
    mark = self.mark
    d = mark.delivered.added(item.real, item.rows, item.dropped, time.monotonic() - t0)
    # Pinned by the stream's first decided position, and the same from then on.
    batch_size = stream.stopper.batch_size if mark.batch_size is None else mark.batch_size
    self.mark = Mark(mark.position + 1, item.state, batch_size, d)
    if mark.position + 1 == signal_at.AFTER_BATCH:  # -1 unless under `testing`'s signal_at.
      signal_at.send()
    return item.value

  def end(
    self,
    ending: messages.ReportedError | None = None,
    *,
    unstarted: bool = True,
    last: bool = False,
  ) -> None:
    """The one ending path: ends the running stream with `ending` (default: closed). In the call.

    The ending, with this host's exact count, is asked before any wait is
    woken. With no stream running and `unstarted`, it goes to the stream this
    host would start next if none started since the last (re)start (peers
    wait in it). `last`: the close: this host marked closed, the source closed.
    """
    stream, at = self.stream, self.mark.position
    if stream is not None:
      self.stream = None
      self._reading = stream.reading  # Not the stream: its ending may hold this iterator.
      if stream.agreement is not None:
        stream.agreement.ask(core.Closing(at, ending, stream.left))
      stream.halt(ended=True)
      self.finished = self.finished + stream.times()
      # Posted for the peers after an agreed end only (an error's would outlive the iterator).
      self.job.ended(post=stream.reached_end)
    elif unstarted and self._namespace is not None and self.pending_start:
      self.generation += 1
      _post_unstarted(self._options, self._keys(), at, ending)
    if not last:
      return
    if self._namespace is not None:  # Closed for the peers; nothing of it stays recorded.
      note = key_value.close_note(self._keys(), jax.process_index(), at)
      key_value.register_close(self._namespace, note)
      exchange_streams.forget(self._namespace)
    if self._reading is None:
      self.source.close()
    else:
      self._reading.after(self.source.close)  # Once a read stuck in the source returns.

  def ask(self, what: str) -> None:
    """`STOP` or `CLOSE`, from any thread or a signal handler: one put, then a wake; no lock.

    A stop ends every host at one position (the first asked wins). A close:
    the agreement decides no more, every wait is woken; `end` asks its ending.
    """
    close = what == CLOSE
    if close:
      if self.closing:
        return  # Asked already (a handler at every line of a close, say).
      self.closing = True
    self.asks.put(core.CLOSING if close else self.mark.position)
    stream = self.stream
    if stream is not None:
      stream.heard(close)  # A wake: an old stream's is harmless, a new one drains anyway.

  def reset(self) -> None:
    """Ends the stream as this host's reset and restarts at the source's beginning (reopened)."""
    self._restart(self.mark, "reset its iterator")
    self.source = sources.reopen(self._origin, self.source, self.initial)
    self.initial = self.source.get_state() if self.source.supports_state else None
    self.mark = Mark(0, self.initial, self._options.batch_size, self.mark.delivered)

  def restore(self, how: str, resolve: Callable[[], tuple[Any, int, Any]]) -> None:
    """Restarts at the state `resolve` gives: (source state, batches received, batch size).

    Raises:
      ValueError: `resolve` or the source refused the state: this host's
        ending, posted at once (the traceback keeps the iterator alive, and
        peers would wait), and `next()`'s until a restart.
    """
    try:
      source_state, batches, batch_size = resolve()
      self.move(source_state)
    except ValueError as e:
      p = jax.process_index()
      error = ValueError(f"process {p}: {e}")
      self.end(messages.ReportedError(messages.ErrorKind.VALUE, str(error), p, 0))
      self.pending_start = True
      self.refusal = str(error)
      raise error from e
    mark = Mark(batches, source_state, batch_size or self._options.batch_size, self.mark.delivered)
    self._restart(mark, f"restored a state ({how})")

  def move(self, source_state: Any) -> None:
    """Moves the source, once no stage thread reads it (the callers restart after)."""
    if not self.source.supports_state:
      self.source.set_state(source_state)  # Raises; the running stream goes on.
      return
    if self.stream is not None:
      self.stream.halt()
    self._settle_reads()
    try:
      self.source.set_state(source_state)
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(
        f"`state['source']` is not a state of {self.source.description}: {type(e).__name__}: {e}"
      ) from e
    except Exception as e:
      self.start_error = e  # Halted: the next start raises it, on every host.
      self._restart(self.mark)
      raise

  def _restart(self, mark: Mark, how: str | None = None) -> None:
    """Ends the running stream ("process p {how} at batch i", or closed); the next starts at `mark`."""
    p, at = jax.process_index(), self.mark.position
    self.end(None if how is None else endings.closed_error(p, at, how), unstarted=False)
    self._settle_reads()  # The source may be moved or reopened next.
    self.mark = mark
    self.refusal = None
    self.exhausted = False
    self.pending_start = True
    self.asks = queue.SimpleQueue()  # A request ended (or would have ended) the old stream only.
    self.stopped_by = None

  def _settle_reads(self) -> None:
    """Waits for a read that an ended stream left in the source, before it is moved or reopened."""
    if self._reading is not None:
      self._reading.close()
      self._reading = None

  def times(self) -> stats_lib.Times:
    stream = self.stream  # One value each: no lock.
    return self.finished if stream is None else self.finished + stream.times()

  def snapshot(self) -> dict[str, Any]:
    """This host's `stats()`: no lock, from any thread or a signal handler."""
    return stats_lib.snapshot(self.mark.delivered, self.times())


def _one_by_one(runs: Iterator[Run]) -> Iterator[Run]:
  """Each decided position as a run of its own, so that queues bound positions."""
  for run in runs:
    steps, sig = build_lib.taken(run.steps), run.signature
    del run  # Each position is held by its own run only.
    for step in steps:
      yield Run((step,), sig)
      del step


def _raising(error: BaseException) -> Iterator[Run]:
  """A generator that raises `error` at its first `next()`."""
  yield from ()
  raise error


def _post_unstarted(
  options: options_lib.Options,
  namespace: str | None,
  position: int,
  error: messages.ReportedError | None,
) -> None:
  """Posts this host's ending of a stream it never started, where peers may wait in it."""
  if namespace is None or exchange_streams.pre_ended(namespace) is not None:
    return  # Nothing to tell, or told already.
  try:
    ex = exchange_lib.make_exchange(synchronize=options.synchronize_batches, namespace=namespace)
    if isinstance(ex, key_value.KeyValueExchange):
      best_effort(ex, unstarted(ex.process_index, position, error))
  except Exception as e:  # noqa: BLE001 - best effort: close never raises (also at exit).
    logger.warning("grain_jax_sync: could not post this host's end: %s", e)
