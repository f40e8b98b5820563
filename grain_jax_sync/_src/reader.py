"""The reader stage: source -> `Read(batch, state)` ... then one `End`. No JAX.

Everything that can fail on this host alone happens here, before the batch's
row count is posted to any peer: `next()`, validation, the range checks and
`source.get_state()`. Any exception, of any type (KeyboardInterrupt and
SystemExit too), becomes the `End` at the position of the read that failed: a
position whose row was never posted, which every host can agree on.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import leaves as leaves_lib
from grain_jax_sync._src import shapes as shapes_lib
from grain_jax_sync._src.agreement import core, endings
from grain_jax_sync._src.sources import base as sources_base

_INT_RANGE = {
  np.dtype(np.int64): (np.iinfo(np.int32).min, np.iinfo(np.int32).max, "int32"),
  np.dtype(np.uint64): (0, np.iinfo(np.uint32).max, "uint32"),
}
_WIDE = frozenset(d.name for d in _INT_RANGE)


class Narrowing(NamedTuple):
  """A leaf (by index) cast on the host to a float `dtype` of smaller range.

  `why` completes "the dtype ..." (x64 off, or `dtypes`); `fix` says how to keep the values.
  """

  leaf: int
  dtype: np.dtype
  why: str
  fix: str


class Reader:
  """Iterates `Read`s from the source, then one `End`, then stops.

  Args:
    check_int32: Refuse int64/uint64 values outside the int32/uint32 range
      (JAX holds 64-bit integers as 32-bit ones while x64 is off).
    start_error: An error to end with before reading (a malformed state).
    digest: Where processes share rows: the digest of a batch's leaves
      (`rows_digest`), computed in the reading thread.
    shapes: `pad_shapes` and its kin: the dims that may vary.
    narrowing: The batch structure -> its `Narrowing` leaves (`build.narrowing`),
      whose finite values must stay finite.

  Attributes:
    source_s: Seconds in the source's ``next()`` and ``get_state()`` (reading thread only).
  """

  def __init__(
    self,
    source: sources_base.SourceIterator,
    *,
    process_index: int,
    check_int32: bool,
    start_error: BaseException | None = None,
    digest: Callable[[Sequence[np.ndarray]], str] | None = None,
    shapes: shapes_lib.Shapes | None = None,
    narrowing: Callable[[batches_lib.Signature], Sequence[Narrowing]] | None = None,
  ):
    self._source = source
    self._varying = None if shapes is None else functools.partial(shapes_lib.leaf_dims, shapes)
    self._digest = digest
    self.source_s = 0.0
    self._p = process_index
    self._check_int32 = check_int32
    self._position = 0  # Non-empty batches read.
    self._index = 0  # Source batches read (for messages).
    self._signature: batches_lib.Signature | None = None
    # From the first batch: its structure's matcher (later batches skip the
    # full walk), and the range checks it needs (64-bit integers, narrowing float casts).
    self._matcher: batches_lib.Matcher | None = None
    self._wide = False
    self._narrowing = narrowing
    self._narrow: Sequence[Narrowing] = ()
    self._done = False
    self._start_error = start_error

  def __iter__(self) -> Reader:
    return self

  def __next__(self) -> core.Read | core.End:
    if self._done:
      raise StopIteration
    if self._start_error is not None:
      self._done = True
      return endings.failed(self._p, 0, 0, self._start_error, "restoring its state", data=True)
    item = self._read()
    while item is None:  # An empty batch: skipped.
      item = self._read()
    self._done = isinstance(item, core.End)
    return item

  def _read(self) -> core.Read | core.End | None:
    index = self._index
    t0 = time.monotonic()
    try:
      raw = next(self._source)
    except StopIteration:
      return core.End(self._position)
    except leaves_lib.DataError as e:  # Bad records: the same ValueError on every host.
      error = ValueError(f"{leaves_lib.where(self._p, index)}: {e}")
      error.__cause__ = e
      return self._failed(index, error, "reading", data=True)
    except BaseException as e:  # noqa: BLE001 - any type becomes the ending.
      return self._failed(index, e, f"reading batch {index} from its source")
    finally:
      self.source_s += time.monotonic() - t0
    self._index += 1
    try:
      hb = self._validate(raw, index)
    except BaseException as e:  # noqa: BLE001 - any type becomes the ending.
      return self._failed(index, e, f"converting batch {index}", data=True)
    t0 = time.monotonic()
    try:
      state = self._source.get_state() if self._source.supports_state else None
    except BaseException as e:  # noqa: BLE001 - any type becomes the ending.
      return self._failed(index, e, f"taking the source state after batch {index}")
    finally:
      self.source_s += time.monotonic() - t0
    if hb.rows == 0:
      return None
    self._position += 1
    digest = None if self._digest is None else self._digest(hb.leaves)
    return core.Read(hb, state, digest)

  def _failed(self, index: int, e: BaseException, doing: str, *, data: bool = False) -> core.End:
    return endings.failed(self._p, self._position, index, e, doing, data=data)

  def _validate(self, raw: Any, index: int) -> batches_lib.HostBatch:
    hb = None if self._matcher is None else self._matcher.match(raw)
    if hb is not None:
      if hb.rows:
        self._check_ranges(hb, index)
      return hb
    hb = batches_lib.validate(
      raw,
      process_index=self._p,
      batch_index=index,
      expected=self._signature,
      varying=self._varying,
    )
    if not hb.rows:
      return hb
    if self._signature is None:
      self._signature = hb.signature
      self._matcher = batches_lib.Matcher.compile(raw, hb.signature)
      self._wide = self._check_int32 and any(d in _WIDE for d in hb.signature.dtypes)
      if self._narrowing is not None:
        self._narrow = self._narrowing(hb.signature)
    elif hb.signature is not self._signature:
      diffs = batches_lib.diff(self._signature, hb.signature)
      raise ValueError(
        f"{leaves_lib.where(self._p, index)}: the batch structure"
        f" changed mid-stream ({'; '.join(diffs)}; earlier batches had"
        f" [{self._signature.describe()}]); expected every batch to"
        " have the same columns, dtypes and trailing shapes"
      )
    self._check_ranges(hb, index)
    return hb

  def _check_ranges(self, hb: batches_lib.HostBatch, index: int) -> None:
    """The range checks of the leaves that the first batch found narrowed."""
    if self._wide:
      check_int_range(hb, self._p, index)
    if self._narrow:
      check_float_range(hb, self._narrow, self._p, index)


def check_int_range(hb: batches_lib.HostBatch, process: int, index: int) -> None:
  """Raises if a 64-bit integer leaf holds a value its 32-bit form would wrap."""
  for leaf, name in zip(hb.leaves, hb.signature.names, strict=True):
    bounds = _INT_RANGE.get(leaf.dtype)
    if bounds is None or leaf.size == 0:
      continue
    lo, hi, kind = bounds
    low, high = leaf.min(), leaf.max()
    if low < lo or high > hi:
      bad = low if low < lo else high
      raise ValueError(
        f"{leaves_lib.where(process, index, name)}: value {int(bad)} does not"
        f" fit {kind}, the dtype JAX holds {leaf.dtype} values in while x64 is"
        " off (it would wrap silently); enable x64"
        " (jax.config.update('jax_enable_x64', True)) or bring the values"
        f" into the {kind} range"
      )


def check_float_range(
  hb: batches_lib.HostBatch, narrow: Sequence[Narrowing], process: int, index: int
) -> None:
  """Raises if a finite value of a narrowed leaf would not be finite in its float dtype.

  A cast is monotonic: casting each leaf's two extremes checks every value.
  NaN and inf are data and pass (then the finite values' extremes are cast).
  """
  for n in narrow:
    leaf = hb.leaves[n.leaf]
    if _overflowing(leaf, n.dtype) is None:
      continue
    extremes = _overflowing(leaf[np.isfinite(leaf)], n.dtype)
    if extremes is None:
      continue
    with np.errstate(over="ignore", invalid="ignore"):
      landed = extremes.astype(n.dtype)
    k = 0 if not np.isfinite(landed[0]) else 1
    raise ValueError(
      f"{leaves_lib.where(process, index, hb.signature.names[n.leaf])}: value"
      f" {extremes[k]!s} does not fit {n.dtype}, the dtype {n.why} (it would become"
      f" {landed[k]!s} silently); {n.fix} or bring the values into the"
      f" {n.dtype} range (magnitude at most {float(ml_dtypes.finfo(n.dtype).max):.8g})"
    )


def _overflowing(values: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
  """The extremes of `values` where one of them casts to a non-finite `dtype` value; else None."""
  if values.size == 0:
    return None
  extremes = np.array([values.min(), values.max()])
  with np.errstate(over="ignore", invalid="ignore"):
    return None if np.isfinite(extremes.astype(dtype)).all() else extremes


# -- identical rows where processes share a data shard ----------------------------

# Leaves up to this size are hashed whole; a larger leaf is sampled, so that a
# leaf's digest reads a bounded number of bytes whatever its size and the
# check costs little beside reading and transferring the rows on any host.
DIGEST_FULL_BYTES = 256 << 10
# Larger leaves: at most this many rows, evenly spaced (first and last kept), and
# at most this many bytes of each (evenly strided elements).
DIGEST_SAMPLE_ROWS = 64
DIGEST_ROW_BYTES = 1024


def rows_digest(leaves: Sequence[np.ndarray]) -> str:
  """A cheap digest (16 hex digits) of a batch's leaves, for processes that share a data shard.

  Hashes each leaf's dtype, shape and bytes: whole up to `DIGEST_FULL_BYTES`,
  else a strided sample of rows and of each row's elements. Rows from another
  shard or shuffle differ in the sample with near certainty.
  """
  h = hashlib.blake2b(digest_size=8)
  for leaf in leaves:
    a = np.asarray(leaf)
    h.update(f"{a.dtype.str}{a.shape};".encode())
    if a.nbytes <= DIGEST_FULL_BYTES or a.ndim == 0:
      h.update(np.ascontiguousarray(a).tobytes())
      continue
    rows = a.shape[0]
    picks = np.unique(np.linspace(0, rows - 1, min(rows, DIGEST_SAMPLE_ROWS)).astype(np.int64))
    per_row = max(1, a[0].size)
    stride = max(1, -(-per_row * a.itemsize // DIGEST_ROW_BYTES))
    for r in picks:
      h.update(np.ascontiguousarray(a[r].reshape(-1)[::stride]).tobytes())
  return h.hexdigest()
