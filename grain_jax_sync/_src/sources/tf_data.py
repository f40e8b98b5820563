"""tf.data sources. Imported only when a TensorFlow object is passed.

Columns that cannot become `jax.Array`s (ragged, sparse, string) are found in
`element_spec` before anything is read. Exact resume goes through TensorFlow's
own iterator checkpointing (`tf_data_state`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from grain_jax_sync._src import extras
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src.sources import base
from grain_jax_sync._src.sources import tf_data_state as tf_state

logger = logging.getLogger(__name__)

# Snapshots slower than this are logged, once, at the third (a single one can
# be slow under load): one per batch bounds the reading thread's rate. The cost
# grows with the shuffle buffer (`python -m benchmarks.tf_data_snapshot`).
_SLOW_SNAPSHOT_S = 0.01
_SLOW_SNAPSHOTS_BEFORE_WARNING = 3


def _walk(spec: Any, prefix: str, out: list[tuple[str, Any, Any]], path: tuple | None):
  """Lists (name, path of dict keys (None under a tuple position), leaf spec) of a spec."""
  if isinstance(spec, Mapping):
    for k in sorted(spec, key=str):
      _walk(
        spec[k], f"{prefix}/{k}" if prefix else str(k), out, None if path is None else (*path, k)
      )
  elif isinstance(spec, (tuple, list)):
    fields = getattr(type(spec), "_fields", None)
    for i, sub in enumerate(spec):
      key = fields[i] if fields else i
      _walk(sub, f"{prefix}/{key}" if prefix else str(key), out, None)
  else:
    out.append((prefix or "<batch>", path, spec))


def _problem(spec: Any) -> str | None:
  """Why a leaf spec cannot become a dense numeric array, or None."""
  tf = extras.require("tensorflow", needed_by="a tf.data source")

  if isinstance(spec, tf.RaggedTensorSpec):
    return "a ragged tensor"
  if isinstance(spec, tf.SparseTensorSpec):
    return "a sparse tensor"
  if not isinstance(spec, tf.TensorSpec):
    return f"a {type(spec).__name__}"
  if spec.dtype == tf.string:
    return "a string tensor"
  if not (spec.dtype.is_numpy_compatible and (spec.dtype.is_bool or spec.dtype.is_numeric)):
    return f"a {spec.dtype.name} tensor"
  return None


def drop_unsupported_columns(dataset: Any, *, drop: bool = True) -> Any:
  """`dataset` without the dict columns JAX cannot hold (logged), or with `drop` False, checked.

  A ValueError names every bad column (`drop` False), or those in tuple positions.
  """
  spec = dataset.element_spec
  leaves: list[tuple[str, Any, Any]] = []
  _walk(spec, "", leaves, ())
  bad = [(name, path, why) for name, path, leaf in leaves if (why := _problem(leaf)) is not None]
  if not bad:
    return dataset
  if not drop:
    shown = "; ".join(f"column {n!r} is {why}" for n, _, why in bad)
    raise ValueError(
      f"the tf.data.Dataset has columns that cannot become jax.Arrays: {shown}."
      " Convert them in the pipeline (e.g. `.to_tensor()` for ragged,"
      " `tf.sparse.to_dense` for sparse, tokenize strings), remove them with"
      " `.map(...)`, or pass the dataset through"
      " `grain_jax_sync.from_tf_data(ds, drop_unsupported=True)` to drop them"
    )
  stuck = [n for n, p, _ in bad if p is None]
  if stuck:
    raise ValueError(
      f"`drop_unsupported=True` can drop dict entries only, but columns {stuck}"
      f" are tuple or list positions of the element spec {spec!r}; make the"
      " elements dicts or remove those columns with `.map(...)`"
    )
  paths = [p for _, p, _ in bad]
  logger.warning(
    "grain_jax_sync: dropping tf.data columns that cannot become jax.Arrays: %s",
    ", ".join(f"{n} ({why})" for n, _, why in bad),
  )
  # Every path is a dict entry (`stuck` above), traced by tf.data.
  return dataset.map(lambda e: base.drop_dict_paths(e, paths))


def _to_numpy(t: Any) -> Any:
  # `_numpy()` shares the tensor's host buffer; `.numpy()` may copy.
  return t._numpy() if hasattr(t, "_numpy") else t.numpy()


class TfDataSource(base.SourceIterator):
  """A `tf.data.Dataset` read as NumPy batches, resumable exactly.

  `get_state` (in the reading thread) snapshots the iterator after every
  `state_every`-th batch; `export_state` turns it into base64 only when asked.
  """

  def __init__(self, dataset: Any, *, drop_unsupported: bool = False, state_every: int | None = 1):
    tf = extras.require("tensorflow", needed_by="a tf.data source")

    self._every = options_lib.checked_int_or_none("state_every", state_every)
    self._dataset = drop_unsupported_columns(dataset, drop=drop_unsupported)
    self._it = iter(self._dataset)
    self._map = tf.nest.map_structure
    self._errors = tf.errors
    self._exported: tuple[Any, dict[str, Any]] | None = None  # Last export.
    self._policy = tf_state.external_state_policy(self._dataset)
    self._reads = 0
    self._ended = False  # The dataset raised StopIteration (after `_reads` batches).
    self._end: tf_state.Snapshot | None = None  # Taken after the end (`_at_end`).
    self._broken: str | None = None  # Why this pipeline cannot be saved.
    self._slow = 0  # Snapshots slower than _SLOW_SNAPSHOT_S so far.
    self.supports_state = state_every is not None
    self.description = f"a tf.data.Dataset ({type(dataset).__name__})"

  def __next__(self) -> Any:
    try:
      element = next(self._it)
    except StopIteration:
      self._ended = True  # The reader thread reads no more: see `export_state`.
      raise
    batch = self._map(_to_numpy, element)
    self._reads += 1
    return batch

  def get_state(self) -> Any:
    """A snapshot after the last read; never raises once state is on."""
    if self._every is None:
      raise RuntimeError(
        f"{self.description} was opened with `state_every=None`, so it takes"
        " no snapshots and cannot be checkpointed; use"
        " `from_tf_data(ds, state_every=1)` (the default) or a larger N"
      )
    reads = self._reads
    if reads % self._every:
      why = (
        f"{self.description} takes a snapshot every {self._every} batches"
        f" (`state_every={self._every}`), and the last batch received was batch"
        f" {reads} read from it; call get_state() after a multiple of"
        f" {self._every} batches, or use a smaller `state_every`"
      )
      return tf_state.Snapshot(reads, error=why, between=True)
    if self._broken is not None:
      return tf_state.Snapshot(reads, error=self._broken)
    start = time.perf_counter()
    try:
      variant = tf_state.take(self._it, self._policy)
    except self._errors.FailedPreconditionError as e:  # A stateful op: final.
      self._broken = tf_state.cannot_checkpoint(e, self.description)
      return tf_state.Snapshot(reads, error=self._broken)
    except Exception as e:  # noqa: BLE001 - raised when the user asks.
      return tf_state.Snapshot(reads, error=tf_state.cannot_checkpoint(e, self.description))
    seconds = time.perf_counter() - start
    if seconds >= _SLOW_SNAPSHOT_S:
      self._slow += 1
      if self._slow == _SLOW_SNAPSHOTS_BEFORE_WARNING:
        logger.warning(
          "grain_jax_sync: a snapshot of %s took %.0f ms (taken after every %d"
          " batches for exact resume; each slot of a shuffle buffer costs about"
          " 10-20 us, used or not). Pass `from_tf_data(ds, state_every=N)` to"
          " take one every N batches, or `state_every=None` if you never call"
          " get_state()",
          self.description,
          seconds * 1e3,
          self._every,
        )
    return tf_state.Snapshot(reads, variant)

  def export_state(self, state: Any) -> Any:
    limit = None if base.TO_FILES.get() else tf_state.JSON_STATE_LIMIT_BYTES
    if not isinstance(state, dict):  # A dict: already exported (restored by set_state).
      if self._exported is None or self._exported[0] is not state:  # Else encoded already.
        self._exported = (state, tf_state.export(self._at_end(state), limit=None))
      state = dict(self._exported[1])
    tf_state.check_size(tf_state.exported_size(state), limit)
    return state

  def _at_end(self, snapshot: Any) -> Any:
    """The snapshot, or one taken now (caller's thread) if the dataset ended right after it.

    A host whose dataset ran out between two `state_every` steps goes on with
    dummy batches whose state has no snapshot; nothing reads the iterator now.
    """
    if not (snapshot.between and self._ended and snapshot.reads == self._reads):
      return snapshot
    if self._end is None:
      try:
        self._end = tf_state.Snapshot(self._reads, tf_state.take(self._it, self._policy))
      except Exception as e:  # noqa: BLE001 - raised by `export`, as any refusal.
        self._end = tf_state.Snapshot(
          self._reads, error=tf_state.cannot_checkpoint(e, self.description)
        )
    return self._end

  def set_state(self, state: Any) -> None:
    if self._every is None:
      self.get_state()  # Raises: state is off.
    self._reads = tf_state.restore(self._it, state, self.description)
    self._ended, self._end = False, None


def open_tf_data(
  source: Any, *, drop_unsupported: bool = False, state_every: int | None = 1
) -> base.SourceIterator | None:
  """A `TfDataSource` over a `tf.data.Dataset` (see `from_tf_data`), else None."""
  tf = extras.require("tensorflow", needed_by="a tf.data source")

  if isinstance(source, tf.data.Dataset):
    return TfDataSource(source, drop_unsupported=drop_unsupported, state_every=state_every)
  return None


def from_tf_data(
  dataset: Any, *, drop_unsupported: bool = False, state_every: int | None = 1
) -> base.SourceIterator:
  """Reads a `tf.data.Dataset` of batches, optionally dropping bad columns.

  `iter_jax_batches(ds)` already accepts a `tf.data.Dataset`; use this to
  drop the ragged, sparse and string columns of dict elements (a TFDS
  ``"text"`` feature) instead of raising on them, or to choose how often a
  resume snapshot is taken. Resume is exact: the state is TensorFlow's own
  serialized iterator (shuffle buffers, RNG, prefetch) after the last batch
  the consumer received; a snapshot costs in proportion to the elements held
  in the pipeline's buffers.

  Args:
    dataset: A `tf.data.Dataset` whose elements are batches (call `.batch(n)`
      first): tensors, or dicts/tuples of tensors, sharing the first dimension.
    drop_unsupported: Drop ragged, sparse and string (and other non-numeric)
      dict columns, logging a warning that names them, instead of raising.
    state_every: Take a resume snapshot after batches N, 2N, ... read from
      `dataset` (`get_state()` works only there); None takes none.

  Returns:
    A one-pass source to pass to `iter_jax_batches` (or `jax_sync_generator`).

  Raises:
    ValueError: If `dataset` is not a `tf.data.Dataset`, or has bad columns
      and `drop_unsupported` is False, or a bad column is not a dict entry,
      or `state_every` is not a positive int or None.

  Example:

    >>> ds = tfds.load("imdb_reviews", split="train").batch(32)
    >>> it = iter_jax_batches(from_tf_data(ds, drop_unsupported=True), batch_size=32)
    >>> big = tfds.load("mnist", split="train").shuffle(100_000).batch(32)
    >>> # A 100,000-element buffer: snapshot only at the steps you checkpoint.
    >>> it = iter_jax_batches(from_tf_data(big, state_every=1000), batch_size=32)
  """
  if (type(dataset).__module__ or "").startswith("tensorflow"):
    source = open_tf_data(dataset, drop_unsupported=drop_unsupported, state_every=state_every)
    if source is not None:
      return source
  raise ValueError(f"`dataset` must be a tf.data.Dataset, got {type(dataset).__qualname__}")
