"""JaxBatchIterator: source -> validate -> agree -> pad/mask -> global jax.Array.

The producer (`_Producer`) reads a window of batches, exchanges one report per
host, lets `plan.decide` say what every host does, and builds the global
arrays. It runs in the prefetch thread (or inline with `prefetch_batches=0`).
Each produced batch carries the source state after it, so the state the user
sees is the state after the last batch they received.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import ledger as ledger_lib
from grain_jax_sync._src import padding, sources
from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import prefetch as prefetch_lib
from grain_jax_sync._src import sharding as sharding_lib

logger = logging.getLogger(__name__)

STATE_VERSION = 1

# The pipelined exchange (key-value store) reads at most
#   max(1, min(READ_AHEAD_WINDOWS * synchronize_lookahead,
#              READ_AHEAD_BYTES // bytes of the first batch))
# undecided batches ahead; see docs/performance.md for the memory formula.
READ_AHEAD_BYTES = 64 << 20
READ_AHEAD_WINDOWS = 4
# A batch that took this long to read is posted at once (a slow source); faster
# reads are posted in chunks of up to `synchronize_lookahead` batches.
FLUSH_AFTER_S = 0.01
# The agreement thread asks the store for news at most this often while it
# still has batches to read.
POLL_MIN_S = 0.002
AGREE_THREAD = "grain_jax_sync-agree"
READ_THREAD = "grain_jax_sync-read"
# The source moves to its own thread once a read takes this long on average: a
# slow source then overlaps with the exchange, and a fast one is not charged a
# thread hand-off per batch (measured on 2 cores: agreement throughput 0.5-0.6
# of unsynchronized with the thread from the start, 0.6-0.9 without it).
READ_THREAD_AFTER_S = 0.002
# Decided runs of positions (each at most the read-ahead) queued between the
# agreement thread and the build thread.
STAGE_BUFFER = 1


@dataclasses.dataclass(frozen=True)
class Settings:
  """The iterator's options, validated."""

  batch_size: int | None
  drop_last: bool
  paddings: Any
  mask_key: str | None
  dtypes: Any
  synchronize: bool
  lookahead: int
  prefetch: int
  sync_timeout_s: float
  name: str | None

  def digest(self) -> dict[str, Any]:
    """What every host must agree on (compared in the first exchange)."""
    return plan_lib.settings_digest(
      {
        "batch_size": self.batch_size,
        "drop_last": self.drop_last,
        "paddings": _describe(self.paddings),
        "mask_key": self.mask_key,
        "dtypes": _describe(self.dtypes),
        "synchronize_lookahead": self.lookahead,
      }
    )


def _describe(x: Any) -> Any:
  if x is None:
    return None
  if isinstance(x, Mapping):
    return {str(k): _describe(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
  if isinstance(x, (np.generic, np.ndarray)):
    # A NumPy value, not a dtype: np.dtype(np.float32(1)) is float32, which
    # would hide different padding values.
    return repr(np.asarray(x).tolist())
  try:
    return np.dtype(x).name
  except TypeError:
    return repr(x)


@dataclasses.dataclass
class _Item:
  value: Any
  state: Any


@dataclasses.dataclass
class _Read:
  batch: batches_lib.HostBatch
  state: Any


class _Producer:
  """Reads, agrees and converts; one instance per (re)start."""

  def __init__(
    self,
    settings: Settings,
    source: sources.SourceIterator,
    exchange: exchange_lib.Exchange,
    placement: placement_lib.BatchPlacement,
    *,
    local_devices: int,
    start_state: Any,
    start_position: int,
  ):
    self._s = settings
    self._source = source
    self._exchange = exchange
    self._placement = placement
    self._local_devices = local_devices
    self._pi = exchange.process_index
    self._pc = jax.process_count()
    self._window = settings.lookahead if exchange.process_count > 1 else 1
    self._options = plan_lib.Options(
      batch_size=settings.batch_size,
      drop_last=settings.drop_last,
      pad=settings.paddings is not None,
    )
    self._last_state = start_state
    self._position = start_position
    self._reads = 0  # Source batches read by this producer (for messages).
    self._exhausted = False
    self._error: BaseException | None = None
    self._reported: plan_lib.ReportedError | None = None
    self._own_signature: batches_lib.Signature | None = None
    self._signature: batches_lib.Signature | None = None
    self._layout: dict[str, Any] | None = None
    self._sent_config = False
    self._stage: prefetch_lib.Prefetcher[Any] | None = None  # The agreement thread.
    self._reader: prefetch_lib.Prefetcher[Any] | None = None  # The read thread.

  # -- reading ---------------------------------------------------------------

  def _fail(self, error: BaseException, kind: plan_lib.ErrorKind, message: str) -> None:
    self._error = error
    self._reported = plan_lib.ReportedError(
      kind, message, self._pi, self._reads, type(error).__qualname__
    )

  def _read_window(self) -> list[_Read]:
    out: list[_Read] = []
    while len(out) < self._window:
      read = self._read_one(track_empty=True)
      if read is None:
        break
      out.append(read)
    return out

  def _read_one(self, *, track_empty: bool) -> _Read | None:
    """The next non-empty source batch, or None once the stream ended or failed.

    Args:
      track_empty: Let a skipped empty batch advance the resume state (only
        where reading and yielding share a thread).
    """
    while not self._exhausted and self._error is None:
      index = self._reads
      try:
        raw = next(self._source)
      except StopIteration:
        self._exhausted = True
        return None
      except Exception as e:  # noqa: BLE001 - travels in the exchange.
        self._fail(
          e,
          plan_lib.ErrorKind.SOURCE,
          f"process {self._pi} failed while reading batch {index} from its"
          f" source: {type(e).__qualname__}: {e}",
        )
        return None
      self._reads += 1
      try:
        hb = batches_lib.validate(raw, process_index=self._pi, batch_index=index)
        if hb.rows and self._own_signature is None:
          self._own_signature = hb.signature
        elif hb.rows and hb.signature != self._own_signature:
          assert self._own_signature is not None
          diffs = batches_lib.diff(self._own_signature, hb.signature)
          raise ValueError(
            f"{batches_lib.where(self._pi, index)}: the batch structure"
            f" changed mid-stream ({'; '.join(diffs)}; earlier batches had"
            f" [{self._own_signature.describe()}]); expected every batch to"
            " have the same columns, dtypes and trailing shapes"
          )
      except ValueError as e:
        self._fail(e, plan_lib.ErrorKind.VALUE, str(e))
        return None
      state = self._source.get_state() if self._source.supports_state else None
      if hb.rows == 0:  # Empty batches are skipped.
        if track_empty:
          self._last_state = state
        continue
      return _Read(hb, state)
    return None

  def _report(self, reads: list[_Read]) -> plan_lib.Report:
    config = None
    if not self._sent_config:
      config = self._s.digest()
      self._sent_config = True
    return plan_lib.Report(
      process_index=self._pi,
      rows=tuple(r.batch.rows for r in reads),
      exhausted=self._exhausted,
      error=self._reported,
      signature=None if self._own_signature is None else self._own_signature.to_json(),
      local_devices=self._local_devices,
      config=config,
    )

  # -- building --------------------------------------------------------------

  def _learn_signature(self, reports: list[plan_lib.Report]) -> None:
    if self._signature is not None:
      return
    if self._own_signature is not None:
      self._signature = self._own_signature
      return
    for r in reports:
      if r.signature is not None:
        self._signature = batches_lib.Signature.from_json(r.signature)
        return

  def _get_layout(self) -> dict[str, Any]:
    """Per-leaf dtypes and padding values; same on every host."""
    if self._layout is not None:
      return self._layout
    sig = self._signature
    assert sig is not None
    src = sig.np_dtypes()
    want = padding.per_leaf(self._s.dtypes, sig, what="dtypes")
    try:
      host, device = sharding_lib.split_casts(src, want)
    except TypeError as e:
      raise ValueError(f"`dtypes` has a value that is not a dtype: {e}") from e
    pads = None
    if self._s.paddings is not None:
      values = padding.per_leaf(self._s.paddings, sig, what="paddings")
      pads = padding.check_pad_values(values, host, sig.names)
    mask_key = self._s.mask_key
    if mask_key is not None:
      if not batches_lib.is_dict_spec(sig.spec):
        raise ValueError(
          f"`mask_key`={mask_key!r} needs dict batches, but the batches are"
          f" structured as {sig.spec!r}; use dict batches or mask_key=None"
        )
      if mask_key in batches_lib.spec_keys(sig.spec):
        raise ValueError(
          f"`mask_key`={mask_key!r} is already a column of the batches; pick another name"
        )
    self._layout = {"host": host, "device": device, "pads": pads}
    return self._layout

  def _build(self, read: _Read | None, step: plan_lib.Step) -> Any:
    sig = self._signature
    assert sig is not None
    layout = self._get_layout()
    leaves_in = read.batch.leaves if read is not None else [None] * len(sig.names)
    pads = layout["pads"]
    local = [
      padding.fill_leaf(
        leaf,
        target=step.rows,
        shape=sig.shapes[k],
        dtype=layout["host"][k],
        pad=None if pads is None else pads[k],
      )
      for k, leaf in enumerate(leaves_in)
    ]
    device = layout["device"]
    if self._s.mask_key is not None:
      real = read.batch.rows if read is not None else 0
      local.append(padding.mask(real, step.rows))
      device = [*device, None]
    # One call for every leaf: a single batched transfer in a single process.
    out = sharding_lib.to_global_leaves(local, self._placement, device)
    if self._s.mask_key is not None:
      mask = out.pop()
      tree = batches_lib.unflatten(sig.spec, out)
      tree[self._s.mask_key] = mask
      return tree
    return batches_lib.unflatten(sig.spec, out)

  def _emit(self, read: _Read | None, step: plan_lib.Step) -> _Item | None:
    """Applies one decided step: the built batch and its state, or None (drop)."""
    if read is not None:
      self._last_state = read.state
    if step.action == plan_lib.Action.DROP:
      logger.warning(
        "grain_jax_sync: drop_last dropped a batch on every host (real"
        " rows per process %s, batch_size %d)",
        list(step.real_rows),
        self._s.batch_size,
      )
      return None
    value = self._build(read, step)
    self._position += 1
    return _Item(value, self._last_state)

  # -- the loop --------------------------------------------------------------

  def __iter__(self) -> Iterator[_Item]:
    if isinstance(self._exchange, exchange_lib.KeyValueExchange):
      yield from self._iter_pipelined()
      return
    window = 0
    while True:
      reads = self._read_window()
      report = self._report(reads)
      if isinstance(self._exchange, exchange_lib.LocalExchange):
        reports = [report]  # Nothing to exchange: skip the JSON round trip.
      else:
        payloads = self._exchange.all_gather(window, report.to_json())
        reports = [plan_lib.Report.from_json(p) for p in payloads]
      window += 1
      self._learn_signature(reports)
      decision = plan_lib.decide(reports, self._options, position=self._position)
      for i, step in enumerate(decision.steps):
        value = self._emit(reads[i] if i < len(reads) else None, step)
        if value is not None:
          yield value
      # Drop this window's batches before reading the next one, so that at
      # most one window is held (not two).
      reads = value = None
      if decision.end == plan_lib.End.CONTINUE:
        continue
      self._exchange.finish()
      if decision.end == plan_lib.End.STOP:
        return
      self._raise(decision.error)

  # -- the pipelined loop (key-value store) ----------------------------------

  def _read_ahead_limit(self, read: _Read) -> int:
    """Batches the agreement stage may hold: `lookahead`, capped by bytes."""
    nbytes = sum(leaf.nbytes for leaf in read.batch.leaves)
    return max(1, min(READ_AHEAD_WINDOWS * self._s.lookahead, READ_AHEAD_BYTES // max(1, nbytes)))

  def _iter_pipelined(self) -> Iterator[_Item]:
    """Builds what the agreement stage decided; the stage runs in its own thread."""
    stage: Any = self._agree_pipelined()
    if self._s.prefetch > 0:
      stage = prefetch_lib.Prefetcher(
        stage, buffer_size=STAGE_BUFFER, on_close=self._exchange.close, name=AGREE_THREAD
      )
      self._stage = stage
    try:
      for decided in stage:
        while decided:
          value = self._emit(*decided.popleft())
          if value is not None:  # Holds no host batch while the consumer has it.
            yield value
    finally:
      if isinstance(stage, prefetch_lib.Prefetcher):
        stage.close()
      if self._reader is not None:
        self._reader.close()

  def _read_all(self) -> Iterator[_Read | None]:
    """Source batches, then None once the stream ended or failed."""
    while True:
      read = self._read_one(track_empty=False)
      yield read
      if read is None:
        return

  def _agree_pipelined(
    self,
  ) -> Iterator[collections.deque[tuple[_Read | None, plan_lib.Step]]]:
    """Reads ahead, posts rows as read, decides positions as soon as all are in.

    Every process posts the row counts of the batches it reads in chunks
    (`ledger.Chunk`), and decides with `plan.decide` every position for which
    each process's batch (or end of stream) is known, so no position waits for
    a whole window. It reads in runs of up to `synchronize_lookahead` batches
    while reads are quick, holds at most `_read_ahead_limit` undecided
    batches, and hands each decided run to the build stage at once, after
    posting its own rows for it. With `prefetch_batches > 0` a slow source
    (reads of `READ_THREAD_AFTER_S` or more on average) moves to its own
    thread.
    """
    ex = self._exchange
    assert isinstance(ex, exchange_lib.KeyValueExchange)
    pi = self._pi
    reader: Iterator[_Read | None] = self._read_all()
    read_s = 0.0  # Moving average of the time a read takes, while inline.
    led = ledger_lib.Ledger(self._pc)
    led.set_own(pi, signature=None, devices=self._local_devices, config=self._s.digest())
    pending: collections.deque[_Read] = collections.deque()
    unposted: list[int] = []
    end_posted = False
    posted = 0  # Own positions posted.
    chunk_ends: collections.deque[tuple[int, int]] = collections.deque()  # (seq, end)
    sent_signature = False
    j = 0  # Positions decided.
    yielded = self._position  # Output batches decided (for messages).
    limit = self._s.lookahead
    last_poll = -1.0
    rpc_s = 0.001
    deadline: float | None = None

    own_ended = False  # Set when the reader says the stream ended or failed.

    def own_end() -> bool:
      return own_ended

    def flush() -> None:
      nonlocal posted, end_posted, sent_signature, rpc_s
      final = own_end() and not end_posted
      if not unposted and not final:
        return
      signature = None
      if not sent_signature and self._own_signature is not None:
        signature = self._own_signature.to_json()
        sent_signature = True
      config = None
      if not self._sent_config:
        config = self._s.digest()
        self._sent_config = True
      report = plan_lib.Report(
        process_index=pi,
        rows=tuple(unposted),
        exhausted=self._exhausted if final else False,
        error=self._reported if final else None,
        signature=signature,
        local_devices=self._local_devices,
        config=config,
      )
      t0 = time.monotonic()
      seq = ex.post(ledger_lib.Chunk(start=posted, ack=j, report=report).to_json())
      rpc_s = 0.8 * rpc_s + 0.2 * (time.monotonic() - t0)
      posted += len(unposted)
      # An end-of-stream marker is needed to decide position `posted` itself.
      chunk_ends.append((seq, posted + (1 if final else 0)))
      unposted.clear()
      end_posted = end_posted or final

    def absorb(items: list[tuple[int, str]]) -> None:
      for _, text in items:
        led.add(ledger_lib.Chunk.from_json(text))
      if items:  # Release own chunks that every peer has acknowledged.
        acked = min(led.ack(p) for p in range(self._pc) if p != pi)
        below = None
        while chunk_ends and chunk_ends[0][1] <= acked:
          below = chunk_ends.popleft()[0] + 1
        if below is not None:
          ex.release(below)

    def read() -> None:
      nonlocal limit, own_ended, reader, read_s
      t0 = time.monotonic()
      first = led.count(pi) == 0
      r = next(reader)
      if self._reader is None and self._s.prefetch > 0:
        read_s = 0.8 * read_s + 0.2 * (time.monotonic() - t0)
        if read_s >= READ_THREAD_AFTER_S and r is not None:
          # A slow source: read it in its own thread from now on, so that it
          # overlaps with the exchange.
          self._reader = prefetch_lib.Prefetcher(reader, buffer_size=1, name=READ_THREAD)
          reader = self._reader
      if r is None:
        own_ended = True
        led.end(
          plan_lib.Report(
            process_index=pi,
            exhausted=self._exhausted,
            error=self._reported,
            signature=None if self._own_signature is None else self._own_signature.to_json(),
            local_devices=self._local_devices,
          )
        )
        flush()
        return
      if first:
        limit = self._read_ahead_limit(r)
        assert self._own_signature is not None
        led.set_own(
          pi,
          signature=self._own_signature.to_json(),
          devices=self._local_devices,
          config=self._s.digest(),
        )
      pending.append(r)
      led.add_rows(pi, r.batch.rows)
      unposted.append(r.batch.rows)
      # Post at once what took long to read (a slow source); batch up the rest.
      if (
        time.monotonic() - t0 >= FLUSH_AFTER_S
        or len(unposted) >= self._s.lookahead
        or len(unposted) * 2 >= limit
      ):
        flush()

    def room() -> bool:
      return len(pending) < limit and not own_end()

    while True:
      size = led.window(j)
      if size > 0:
        deadline = None
        reports = led.window_reports(j, size, with_config=j == 0)
        self._learn_signature(reports)
        decision = plan_lib.decide(reports, self._options, position=yielded)
        decided: collections.deque[tuple[_Read | None, plan_lib.Step]] = collections.deque()
        for step in decision.steps:
          decided.append((pending.popleft() if j < led.count(pi) else None, step))
          j += 1
          if step.action == plan_lib.Action.YIELD:
            yielded += 1
        led.forget(j)
        if decided:
          # Never hand a position on (the hand-off may block on the consumer)
          # before this host's row for it is posted: a peer may need that row
          # to decide the batch that this host's training step is waiting for
          # in a collective with that peer. Rows read further ahead may wait
          # for their chunk; no peer needs them to reach these positions.
          if j > posted:
            flush()
          yield decided  # One hand-off per decided run; the builder empties it.
        if decision.end == plan_lib.End.CONTINUE:
          continue
        flush()
        ex.finish()
        if decision.end == plan_lib.End.STOP:
          return
        self._raise(decision.error)
        return
      missing = led.missing(j)
      if pi in missing:
        # Read a chunk's worth while reads are quick, so that rows travel (and
        # positions get decided and handed on) in runs rather than one by one.
        t0 = time.monotonic()
        read()
        while (
          unposted
          and room()
          and len(unposted) < self._s.lookahead
          and time.monotonic() - t0 < FLUSH_AFTER_S
        ):
          read()
        continue
      if j >= posted:
        flush()  # Peers need our row for `j` now; reading ahead may block.
      now = time.monotonic()
      if room() and now - last_poll < max(POLL_MIN_S, 2 * rpc_s):
        read()  # Read ahead instead of asking the store again so soon.
        continue
      flush()
      t0 = time.monotonic()
      items = ex.poll()
      last_poll = time.monotonic()
      rpc_s = 0.8 * rpc_s + 0.2 * (last_poll - t0)
      absorb(items)
      if items:
        continue
      if room():
        read()
        continue
      if deadline is None:
        deadline = now + ex.timeout_s
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        raise ex.timeout_error(led.missing(j), f"batch {yielded} (position {j})")
      absorb(ex.wait(missing[0], remaining))

  def _raise(self, error: plan_lib.ReportedError | None) -> None:
    assert error is not None
    if error.process_index == self._pi and self._error is not None:
      raise self._error
    if error.kind == plan_lib.ErrorKind.VALUE:
      raise ValueError(error.message)
    raise RuntimeError(
      f"{error.message} (process {error.process_index} raised"
      f" {error.type_name}; process {self._pi} stops too so that no host"
      " waits forever)"
    )

  def close(self) -> None:
    self._exchange.close()
    if self._stage is not None:
      self._stage.close()
    if self._reader is not None:
      self._reader.close()


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
    if settings.paddings is not None and settings.batch_size % self._local_devices:
      raise ValueError(
        f"`batch_size` must be divisible by {placement.describe_local()}"
        f" when `paddings` is given, got {settings.batch_size}"
      )
    self._source = sources.open_source(source)
    self._state = self._source.get_state() if self._source.supports_state else None
    self._position = 0
    self._pipeline: Any = None
    self._producer: _Producer | None = None
    self._closed = False
    self._exhausted = False
    self._generation = 0  # Pipeline (re)starts; names exchange keys.
    self._finalizer = weakref.finalize(self, _shutdown, [None, None])

  # -- pipeline ----------------------------------------------------------------

  def _start(self) -> None:
    s = self._settings
    self._generation += 1
    name = None if s.name is None else f"{s.name}/{self._generation}"
    exchange = exchange_lib.make_exchange(
      synchronize=s.synchronize, name=name, timeout_s=s.sync_timeout_s
    )
    producer = _Producer(
      s,
      self._source,
      exchange,
      self._placement,
      local_devices=self._local_devices,
      start_state=self._state,
      start_position=self._position,
    )
    self._producer = producer
    if s.prefetch > 0:
      self._pipeline = prefetch_lib.Prefetcher(
        iter(producer), buffer_size=s.prefetch, on_close=producer.close
      )
    else:
      self._pipeline = iter(producer)
    self._finalizer.detach()
    self._finalizer = weakref.finalize(self, _shutdown, [self._pipeline, producer])

  def _stop_pipeline(self) -> None:
    _shutdown([self._pipeline, self._producer])
    self._pipeline = None
    self._producer = None

  def __iter__(self) -> JaxBatchIterator:
    return self

  def __next__(self) -> Any:
    if self._closed:
      raise RuntimeError("the iterator is closed")
    if self._exhausted:
      raise StopIteration
    if self._pipeline is None:
      self._start()
    try:
      item = next(self._pipeline)
    except BaseException:
      self._exhausted = True
      self._stop_pipeline()
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
      "source": self._source.export_state(self._state),
    }

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Resumes after the batch that `state` was taken at.

    Args:
      state: A dict from `get_state` on the same process index.

    Raises:
      ValueError: If the state is from another version, process or process
        count.
      RuntimeError: If the source cannot resume.
    """
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
      raise ValueError(
        f"`state` must be a dict from JaxBatchIterator.get_state() with"
        f" version {STATE_VERSION}, got {state!r:.200}"
      )
    for key, now in (
      ("process_count", jax.process_count()),
      ("process_index", jax.process_index()),
    ):
      if state[key] != now:
        raise ValueError(
          f"`state` was taken with {key}={state[key]}, but this process has"
          f" {key}={now}; each process must restore its own state with the"
          " same process count"
        )
    self._stop_pipeline()
    self._source.set_state(state["source"])
    self._state = state["source"]
    self._position = int(state["batches"])
    self._exhausted = False

  # -- lifetime ----------------------------------------------------------------

  def close(self) -> None:
    """Stops the prefetch thread and releases the source; idempotent."""
    if self._closed:
      return
    self._closed = True
    self._stop_pipeline()
    self._finalizer.detach()
    self._source.close()

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


def _shutdown(parts: list[Any]) -> None:
  pipeline, producer = parts
  if producer is not None:
    producer.close()
  if isinstance(pipeline, prefetch_lib.Prefetcher):
    pipeline.close()
  elif pipeline is not None:
    close = getattr(pipeline, "close", None)
    if callable(close):
      close()


class _Unset:
  """The default of `mask_key`: not given (an explicit None silences the warning)."""

  def __repr__(self) -> str:
    return "UNSET"


UNSET: Any = _Unset()


def warn_if_unmasked(paddings: Any, mask_key: Any) -> str | None:
  """Logs one warning if `paddings` is given and `mask_key` was left unset.

  Args:
    paddings: The `paddings` argument.
    mask_key: The `mask_key` argument, `UNSET` if not given.

  Returns:
    `mask_key` with `UNSET` resolved to None.
  """
  if mask_key is UNSET:
    if paddings is not None:
      logger.warning(
        "grain_jax_sync: `paddings` is set but `mask_key` is not, so padded"
        " rows and dummy batches are indistinguishable from real rows (a loss"
        ' or an eval metric counts them). Pass `mask_key="mask"` to get a'
        " boolean mask column, or `mask_key=None` to silence this warning"
      )
    return None
  return mask_key


def iter_jax_batches(
  source: Any,
  *,
  batch_size: int | None = 256,
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
      `drop_last` compares with; batches larger than it pass through when
      every process has one of the same size. None (allowed without
      `paddings` and `drop_last`): every batch keeps its size.
    drop_last: Stop when any process runs out; drop batches shorter than
      `batch_size`.
    paddings: Fill value for padded rows and dummy batches: a scalar or a dict
      of column name (or prefix) to scalar. None disables padding.
    mask_key: If set, dict batches get a boolean ``(rows,)`` column of that
      name: True for real rows, False for padding and dummy batches. Left
      unset with `paddings`, one warning is logged that padded rows look
      real; pass None to silence it.
    dtypes: Output dtype: one dtype or a dict of column name to dtype.
      Narrowing casts run on the host before the transfer, widening casts on
      the device after it.
    synchronize_batches: Agree across processes (a single process never
      exchanges anything).
    synchronize_lookahead: Batches per agreement window.
    prefetch_batches: Batches prepared ahead in a background thread (0: none).
    mesh: The mesh the batch lands on, over every device of the job; rows
      are split over `data_axes` and replicated over its other axes. Default:
      the mesh set by `jax.set_mesh`, else `default_mesh()`.
    data_axes: With a mesh: the axis (or tuple of axes) the rows are split
      over; default ``"data"`` if the mesh has it, else every axis.
    sharding: Instead of `mesh`: the sharding of every leaf (a spec longer
      than a leaf's rank is cut), or a `PartitionSpec` applied to `mesh` (or
      to the context or default mesh).
    sync_timeout_s: How long to wait for a peer's report before raising an
      error that names the missing processes.
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
  mask_key = warn_if_unmasked(paddings, mask_key)
  if batch_size is None and (paddings is not None or drop_last):
    raise ValueError(
      "`batch_size` is required with `paddings` or `drop_last`: the rows per"
      " host batch to pad to or to compare with"
    )
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
