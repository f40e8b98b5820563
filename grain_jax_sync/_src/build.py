"""The build stage: decided runs -> global batches (pad, dummy, mask, cast, transfer).

`Layout` (the dtype policy, `split_casts`, and the pad values) is computed
once from the agreed structure; `Builder` applies each decided step to this
host's read (or to none: a dummy batch), one `transfer.to_global_leaves` per batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import ml_dtypes
import numpy as np

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import leaves as leaves_lib
from grain_jax_sync._src import messages, padding, transfer, trees
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src import shapes as shapes_lib
from grain_jax_sync._src import stats as stats_lib

if TYPE_CHECKING:  # Runs come from the agreement; this module needs only their type.
  from grain_jax_sync._src.agreement import common as agreement_common
  from grain_jax_sync._src.agreement import core

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)  # Per batch: no frozen-init cost.
class Item:
  """One output batch and the source state after it."""

  value: Any  # The global batch.
  state: Any  # The source state after it.
  real: int = 0  # This host's real rows in it (0: a dummy batch).
  rows: int = 0  # This host's rows in it, padding included.
  dropped: int = 0  # Positions dropped on every host since the previous item.


def split_casts(
  src: Sequence[np.dtype], want: Sequence[Any]
) -> tuple[list[np.dtype], list[np.dtype | None]]:
  """The dtype policy: shrink on the host, grow on the device.

  A cast to a dtype of fewer or equal bytes (float32 -> bfloat16, int64 ->
  int32) runs on the host before the transfer, so fewer bytes cross the link.
  A cast to a wider dtype (uint8 -> float32) runs on the device after it.
  Returns per leaf the dtype it is transferred in, and the dtype to cast it to
  on the device afterwards (None for none); `want` is None to keep a dtype.
  """
  host: list[np.dtype] = []
  device: list[np.dtype | None] = []
  for s, w in zip(src, want, strict=True):
    w = None if w is None else np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(w)))
    grows = w is not None and w.itemsize > s.itemsize
    host.append(s if w is None or grows else w)
    device.append(w if grows else None)
  return host, device


@dataclasses.dataclass(frozen=True)
class Layout:
  """Per-leaf host dtypes, device dtypes and pad values; the same on every host."""

  host: list[np.dtype]
  device: list[np.dtype | None]
  pads: list[np.ndarray] | None
  # No host cast: a batch with the decided row count is transferred as read.
  as_read: bool = False
  # A dict of leaves only: its keys in leaf order (rebuilt with one `zip`).
  keys: tuple[Any, ...] | None = None
  # `shape_mask_keys`: (leaf index, mask key) per element mask.
  masks: tuple[tuple[int, str], ...] = ()
  # The masks' keys, as they follow the leaves: `mask_key`'s row mask, then `masks`.
  mask_keys: tuple[Any, ...] = ()

  @classmethod
  def of(
    cls,
    sig: batches_lib.Signature,
    *,
    dtypes: Any,
    paddings: Any,
    mask_key: Any,
    shapes: Any = None,
  ) -> Layout:
    want = padding.per_leaf(dtypes, sig, what="dtypes")
    try:
      host, device = split_casts(sig.np_dtypes(), want)
    except TypeError as e:
      raise ValueError(f"`dtypes` has a value that is not a dtype: {e}") from e
    for name, w in zip(sig.names, want, strict=True):
      if w is not None and not leaves_lib.dtype_ok(np.dtype(w)):
        raise ValueError(
          f"`dtypes` asks for {np.dtype(w)} for column {name!r}; expected a"
          " numeric or bool dtype that a jax.Array can hold, in native byte order"
        )
    pads = None
    if paddings is not None:
      values = padding.per_leaf(paddings, sig, what="paddings")
      for k, (pad, grown) in enumerate(zip(values, device, strict=True)):
        if grown is not None and pad is not None and not padding.fits(pad, host[k]):
          # A widening cast whose padding value the source dtype cannot hold
          # (-1 for uint8 labels cast to float32): cast on the host instead.
          host[k], device[k] = grown, None
      # Checked against the dtype that lands on the device (x64 off: int64
      # travels as int32), so that a padding value is never wrapped.
      landed = [np.dtype(jax.dtypes.canonicalize_dtype(h)) for h in host]
      pads = padding.check_pad_values(values, landed, sig.names)
      pads = [np.asarray(p, h) for p, h in zip(pads, host, strict=True)]
    if mask_key is not None:
      if not trees.is_dict_spec(sig.spec):
        raise ValueError(
          f"`mask_key`={mask_key!r} needs dict batches, but the batches are"
          f" structured as {sig.spec!r}; use dict batches or mask_key=None"
        )
      if mask_key in trees.spec_keys(sig.spec):
        raise ValueError(
          f"`mask_key`={mask_key!r} is already a column of the batches; pick another name"
        )
    as_read = all(h == d for h, d in zip(host, sig.np_dtypes(), strict=True))
    masks = _element_masks(sig, shapes, mask_key)
    mask_keys = (() if mask_key is None else (mask_key,)) + tuple(k for _, k in masks)
    return cls(host, device, pads, as_read, trees.flat_dict_keys(sig.spec), masks, mask_keys)


def _layout(sig: batches_lib.Signature, options: Any) -> Layout:
  """The `Layout` of `sig` under the iterator's options."""
  return Layout.of(
    sig,
    dtypes=options.dtypes,
    paddings=options.paddings,
    mask_key=options.mask_key,
    shapes=options.pad_shapes,
  )


def narrowing(sig: batches_lib.Signature, *, dtypes: Any) -> list[reader_lib.Narrowing]:
  """The leaves whose values are cast on the host to a float dtype of smaller range.

  A host cast (`split_casts`), or float64 held as float32 with x64 off, would
  turn a finite value beyond the range of the dtype it lands in into inf
  silently, so the reader checks these leaves (`reader.check_float_range`).
  A `dtypes` that is no dtype gives none here: `Layout.of` raises it.
  """
  src = sig.np_dtypes()
  try:
    want = padding.per_leaf(dtypes, sig, what="dtypes")
    host, _ = split_casts(src, want)
  except (TypeError, ValueError):
    return []
  out = []
  for k, (s, w, h) in enumerate(zip(src, want, host, strict=True)):
    landed = np.dtype(jax.dtypes.canonicalize_dtype(h))
    top, below = _largest(s), _largest(landed)
    if top is None or below is None or below >= top or landed.kind in "iub":
      continue
    if w is not None and np.dtype(w) == landed:
      why, fix = "`dtypes` casts it to on the host", "pass a wider dtype in `dtypes`"
    else:
      why = f"JAX holds {s} values in while x64 is off"
      fix = "enable x64 (jax.config.update('jax_enable_x64', True))"
    out.append(reader_lib.Narrowing(k, landed, why, fix))
  return out


def _largest(dtype: np.dtype) -> float | None:
  """The largest finite value of a real float or integer dtype (NumPy's or ml_dtypes'), else None."""
  if dtype.kind in "cb":
    return None
  for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
    try:
      return float(info(dtype).max)
    except ValueError:
      continue
  return None


def _element_masks(sig: batches_lib.Signature, shapes: Any, mask_key: Any) -> tuple[Any, ...]:
  """`shape_mask_keys` resolved to (leaf index, key) pairs, or a ValueError naming it."""
  if shapes is None or not shapes.masks:
    return ()
  keys = trees.spec_keys(sig.spec)
  out: list[tuple[int, str]] = []
  for column, key in shapes.masks:
    leaves = [k for k, n in enumerate(sig.names) if n == column or n.startswith(f"{column}/")]
    if not trees.is_dict_spec(sig.spec):
      raise ValueError(
        f"`shape_mask_keys` needs dict batches, but the batches are structured"
        f" as {sig.spec!r}; use dict batches or shape_mask_keys=None"
      )
    if len(leaves) != 1 or not sig.varying[leaves[0]]:
      raise ValueError(
        f"`shape_mask_keys` names column {column!r}, which is not one leaf with"
        f" dims named in `pad_shapes`; the leaves are {list(sig.names)}"
      )
    if key in keys or key == mask_key or key in [k for _, k in out]:
      raise ValueError(
        f"`shape_mask_keys` for column {column!r} is {key!r}, which is already"
        " a column of the batches, `mask_key` or another mask; pick another name"
      )
    out.append((leaves[0], key))
  return tuple(out)


def _local_leaves(
  read: core.Read | None, step: messages.Step, layout: Layout, shapes: Any
) -> list[np.ndarray]:
  """This host's leaves of one batch, padded (rows and varying dims) and cast."""
  if (
    read is not None
    and read.batch.rows == step.rows
    and layout.as_read
    and (not step.sizes or all(x.shape[1:] == t for x, t in zip(read.batch.leaves, shapes)))
  ):
    return list(read.batch.leaves)
  leaves_in = read.batch.leaves if read is not None else [None] * len(layout.host)
  pads = layout.pads
  return [
    padding.fill_leaf(
      leaf,
      target=step.rows,
      shape=shapes[k],
      dtype=layout.host[k],
      pad=None if pads is None else pads[k],
    )
    for k, leaf in enumerate(leaves_in)
  ]


def trailing_shapes(sig: batches_lib.Signature, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
  """Each leaf's trailing shape, the varying dims (-1) set to the agreed `sizes`."""
  it = iter(sizes)
  return [tuple(next(it) if d == batches_lib.VARYING else d for d in shape) for shape in sig.shapes]


class FirstRun:
  """A stream's decided runs, whose first one can be waited for without building a batch.

  Whichever thread asks first takes the first run under a lock (the build thread,
  or `wait` in the consumer's call); the other waits for it. Later runs pass through.
  """

  def __init__(self, runs: Iterable[agreement_common.Run]):
    self._runs = iter(runs)
    self._lock = threading.Lock()
    self._taken = False  # The first run, or the runs' ending, was taken: set last.
    self._held: list[Any] = []  # That run or ending, not handed on yet.
    # The first run's agreed batch structure; None until it came, or where the runs ended
    # (or raised) before one.
    self.signature: batches_lib.Signature | None = None
    self.rows: int | None = None  # This host's rows in the first batch (None: the run only drops).

  def wait(self) -> None:
    """Returns once the first run came, or the runs ended before one."""
    with self._lock:
      if self._taken:
        return
      try:
        run = next(self._runs)
        self.rows = next((s.rows for _, s in run.steps if s.action == messages.Action.YIELD), None)
        self.signature = run.signature
        self._held.append(run)
      except BaseException as e:  # noqa: BLE001 - raised by `__next__`, in the build.
        self._held.append(e)
      self._taken = True

  def __iter__(self) -> FirstRun:
    return self

  def __next__(self) -> agreement_common.Run:
    if not self._taken:
      self.wait()
    if self._held:
      run = self._held.pop()
      if isinstance(run, BaseException):
        raise run
      return run
    return next(self._runs)


class Builder:
  """Turns decided runs into `Item`s (global batches with their state).

  `start_state` is the source state before the first read.
  """

  def __init__(self, options: Any, placement: Any, start_state: Any):
    self._options = options
    self._placement = placement
    self._state = start_state
    self._layout: Layout | None = None
    # Per row count (and agreed sizes): every leaf's (and the masks') sharding and global shape.
    self._targets: dict[Any, transfer.Targets] = {}
    # `pad_shapes`: per agreed sizes, each leaf's trailing shape.
    self._shapes: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    self.transfer_s = 0.0  # Seconds spent building global batches.
    # Positions dropped since the last item (counted in the next item; read at the end of
    # the stream for drops after the last one).
    self.dropped = 0
    self.first = FirstRun(())  # The stream's runs (`__call__`).
    self._done = 0  # Positions handed on or dropped (written by the build thread only).
    # `_done` as a waiter sees it, and the pace, under one lock: `wait_done`'s
    # `beyond` while it waits (None: nobody waits), woken by one token in
    # `_woken`. The build thread wakes it only once `_done` passed it, so a
    # batch built while nobody waits costs one uncontended lock.
    self._lock = threading.Lock()
    self._waiter: int | None = None
    self._woken: queue.SimpleQueue[None] = queue.SimpleQueue()
    # The positions done in the last `decide_ahead_s`, the queue's fill left out (`pace`).
    self._pace = stats_lib.Pace(options.decide_ahead_s, options.prefetch_batches)

  def done(self) -> int:
    """Positions handed on (queued, or taken) or dropped (read from the agreement's thread)."""
    return self._done

  def wait_done(self, beyond: int, timeout_s: float) -> None:
    """Blocks until more than `beyond` positions are done, `wake()`, or `timeout_s` passes.

    It may return early (a wake-up left by a wait that timed out): its
    caller looks at `done()` again.
    """
    with self._lock:
      if self._done > beyond:
        return
      self._waiter = beyond
    try:
      self._woken.get(timeout=timeout_s)
    except queue.Empty:
      pass
    finally:
      with self._lock:
        self._waiter = None

  def pace(self) -> int:
    """Positions done in the last `decide_ahead_s` seconds: the consumer's own pace, measured.

    With prefetch, a position is done once its batch is queued, which a full
    queue lets happen only as the consumer takes one.
    """
    with self._lock:
      return self._pace.count(time.monotonic())

  def wake(self) -> None:
    """Wakes a `wait_done` (the iterator is closing), or the next one; one put, no lock."""
    self._woken.put(None)

  def _advance(self) -> None:
    """One more position done (in the build thread): counted, and a waiter it passed woken."""
    with self._lock:
      done = self._done = self._done + 1
      self._pace.done(time.monotonic())
      waiter = self._waiter
      if waiter is None or done <= waiter:
        return
      self._waiter = None
    self._woken.put(None)

  def __call__(self, runs: Iterable[agreement_common.Run]) -> Iterator[Item]:
    """The items of `runs`, built one by one; `first` waits for the first run meanwhile."""
    self.first = FirstRun(runs)
    return self._items(self.first)

  def _items(self, runs: Iterator[agreement_common.Run]) -> Iterator[Item]:
    """One `Item` per position not dropped, in order (the state after each is tracked here)."""
    for run in runs:
      # Each host batch is let go once it is built, not held to the end of
      # its run or while the next run is awaited: a source batch lives only
      # until its global batch exists.
      steps, sig = taken(run.steps), run.signature
      del run
      for read, step in steps:
        if read is not None:
          self._state = read.state
        real = 0 if read is None else read.batch.rows
        if step.action == messages.Action.DROP:
          logger.warning(
            "grain_jax_sync: drop_last dropped a batch on every host (this host's real rows %d)",
            real,
          )
          self.dropped += 1
          del read
        else:
          assert sig is not None
          t0 = time.monotonic()
          value = self.build(read, step, sig)
          self.transfer_s += time.monotonic() - t0
          del read
          dropped, self.dropped = self.dropped, 0
          # Resumed once the item is handed on (queued, or taken).
          yield Item(value, self._state, real, step.rows, dropped)
          del value
        self._advance()

  def build(self, read: core.Read | None, step: messages.Step, sig: Any) -> Any:
    """One global batch: this host's rows (or a dummy), padded and masked."""
    if self._layout is None:
      self._layout = _layout(sig, self._options)
    layout = self._layout
    shapes = sig.shapes
    if step.sizes:
      shapes = self._shapes.get(step.sizes)
      if shapes is None:
        shapes = self._shapes[step.sizes] = trailing_shapes(sig, step.sizes)
    local = _local_leaves(read, step, layout, shapes)
    if self._options.mask_key is not None:
      local.append(padding.mask(read.batch.rows if read is not None else 0, step.rows))
    for k, _ in layout.masks:  # `shape_mask_keys`: element masks, after the row mask.
      real = None if read is None else read.batch.leaves[k].shape
      local.append(padding.element_mask(real, step.rows, shapes[k], sig.varying[k]))
    key = (step.rows, step.sizes) if step.sizes else step.rows
    targets = self._targets.get(key)
    if targets is None:
      targets = transfer.global_targets([x.shape for x in local], self._placement)
      self._targets[key] = targets
    # The one seam where local rows become global arrays (the masks, last, are not cast).
    out = transfer.to_global_leaves(local, self._placement, layout.device, targets=targets)
    return _tree(layout, sig, out)


def _tree(layout: Layout, sig: batches_lib.Signature, out: list[Any]) -> Any:
  """The batch's pytree of `out` (its leaves, then its masks: `Layout.mask_keys`)."""
  n = len(out) - len(layout.mask_keys)
  if layout.keys is not None:
    tree = dict(zip(layout.keys, out[:n], strict=True))
  else:
    tree = trees.unflatten(sig.spec, out[:n])
  for name, m in zip(layout.mask_keys, out[n:], strict=True):  # Masks need dict batches.
    tree[name] = m
  return tree


def taken(steps: Any) -> Iterator[Any]:
  """`steps` in order, each dropped from the list as it is given."""
  left = list(reversed(steps))
  del steps
  while left:
    yield left.pop()


def specs(sig: batches_lib.Signature, rows: int, *, options: Any, placement: Any) -> list[Any]:
  """Every global batch's pytree of `jax.ShapeDtypeStruct`, one per bucket, known before it is built.

  `rows` is this host's rows per batch. Each spec holds the leaves' global
  shapes, the dtypes they land in on the devices and their shardings, as
  `Builder.build` makes them, masks included. With `pad_shapes`, one spec per
  combination of the varying dims' `shape_buckets`, ascending.

  Raises:
    ValueError: If a varying dim has no `shape_buckets` (its size is each
      position's largest, not known ahead), or the options do not fit the
      batches (as the first batch would).
  """
  layout = _layout(sig, options)
  landed = [jax.dtypes.canonicalize_dtype(d or h) for d, h in zip(layout.device, layout.host)]
  dtypes = landed + [np.dtype(np.bool_)] * len(layout.mask_keys)
  every: list[tuple[int, ...]] = [()]  # Every combination of the varying dims' agreed sizes.
  if options.pad_shapes is not None:
    flat = shapes_lib.flat(options.pad_shapes, sig.names, sig.shapes)
    for name, buckets in zip(flat.names, flat.buckets, strict=True):
      if not buckets:
        raise ValueError(
          f"{name} varies (`pad_shapes`) without `shape_buckets`: its size is each"
          " batch's largest, not known before the batch. Give its column"
          " `shape_buckets` to know every shape ahead"
        )
    every = list(itertools.product(*flat.buckets))
  out = []
  for sizes in every:
    trailing = trailing_shapes(sig, sizes)
    local = [(rows, *t) for t in trailing]
    if options.mask_key is not None:
      local.append((rows,))
    local += [(rows, *trailing[k][: sig.varying[k][-1] + 1]) for k, _ in layout.masks]
    shardings, shapes = transfer.global_targets(local, placement)
    leaves = [
      jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
      for shape, dtype, sharding in zip(shapes, dtypes, shardings, strict=True)
    ]
    out.append(_tree(layout, sig, leaves))
  return out
