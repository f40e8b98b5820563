"""tf.data sources. Imported only when a TensorFlow object is passed.

Elements are read as NumPy through `EagerTensor._numpy()`, which shares the
tensor's host buffer instead of copying it (as `as_numpy_iterator` does).
Ragged, sparse, string and other non-dense columns cannot become `jax.Array`s;
they are found in `element_spec` before anything is read, and either raise a
`ValueError` naming every such column or, with ``drop_unsupported=True``, are
dropped from dict elements inside the pipeline (so they are never read into
Python).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from grain_jax_sync._src import extras
from grain_jax_sync._src.sources import base

logger = logging.getLogger(__name__)


def _walk(spec: Any, prefix: str, out: list[tuple[str, tuple[Any, ...], Any]], path: tuple):
  """Lists (name, path, leaf spec) of a nested element spec."""
  if isinstance(spec, Mapping):
    for k in sorted(spec, key=str):
      _walk(spec[k], f"{prefix}/{k}" if prefix else str(k), out, (*path, k))
  elif isinstance(spec, (tuple, list)):
    fields = getattr(type(spec), "_fields", None)
    for i, sub in enumerate(spec):
      key = fields[i] if fields else i
      _walk(sub, f"{prefix}/{key}" if prefix else str(key), out, (*path, i))
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


def unsupported_columns(element_spec: Any) -> list[tuple[str, tuple[Any, ...], str]]:
  """Returns (column name, path, what it is) for every non-dense leaf."""
  leaves: list[tuple[str, tuple[Any, ...], Any]] = []
  _walk(element_spec, "", leaves, ())
  out = []
  for name, path, spec in leaves:
    why = _problem(spec)
    if why is not None:
      out.append((name, path, why))
  return out


def _drop_paths(element: Any, paths: list[tuple[Any, ...]]) -> Any:
  """Returns `element` without the dict entries at `paths` (traced by tf.data)."""
  if paths and not isinstance(element, Mapping):
    raise AssertionError("only dict entries can be dropped")
  return base.drop_dict_paths(element, paths)


def _droppable(element_spec: Any, path: tuple[Any, ...]) -> bool:
  spec = element_spec
  for key in path:
    if not isinstance(spec, Mapping):
      return False
    spec = spec[key]
  return True


def drop_unsupported_columns(dataset: Any, *, drop: bool = True) -> Any:
  """Checks a dataset's columns; drops or raises on those JAX cannot hold.

  Args:
    dataset: A `tf.data.Dataset`.
    drop: Drop ragged, sparse, string and other non-numeric dict columns
      (logging their names) instead of raising.

  Returns:
    `dataset`, or a mapped dataset without the dropped columns.

  Raises:
    ValueError: Naming every bad column (when `drop` is False), or naming
      bad columns that are tuple positions rather than dict entries.
  """
  spec = dataset.element_spec
  bad = unsupported_columns(spec)
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
  stuck = [n for n, p, _ in bad if not _droppable(spec, p)]
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
  return dataset.map(lambda e: _drop_paths(e, paths))


def _to_numpy(t: Any) -> Any:
  # `_numpy()` shares the tensor's host buffer; `.numpy()` may copy.
  return t._numpy() if hasattr(t, "_numpy") else t.numpy()


class TfDataSource(base.SourceIterator):
  """A `tf.data.Dataset` read as NumPy batches (no resume state)."""

  def __init__(self, dataset: Any, *, drop_unsupported: bool = False):
    tf = extras.require("tensorflow", needed_by="a tf.data source")

    self._dataset = drop_unsupported_columns(dataset, drop=drop_unsupported)
    self._it = iter(self._dataset)
    self._map = tf.nest.map_structure
    self.description = f"a tf.data.Dataset ({type(dataset).__name__})"

  def __next__(self) -> Any:
    return self._map(_to_numpy, next(self._it))


def open_tf_data(source: Any, *, drop_unsupported: bool = False) -> base.SourceIterator | None:
  """Adapts a tf.data.Dataset, or returns None to use the generic path.

  Args:
    source: Any TensorFlow object.
    drop_unsupported: Drop ragged, sparse and string dict columns instead of
      raising.

  Returns:
    A `TfDataSource` for a `tf.data.Dataset`, else None.

  Raises:
    ValueError: If the dataset has ragged, sparse or string columns (and
      `drop_unsupported` is False), naming each.
  """
  tf = extras.require("tensorflow", needed_by="a tf.data source")

  if isinstance(source, tf.data.Dataset):
    return TfDataSource(source, drop_unsupported=drop_unsupported)
  return None


def from_tf_data(dataset: Any, *, drop_unsupported: bool = False) -> base.SourceIterator:
  """Reads a `tf.data.Dataset` of batches, optionally dropping bad columns.

  `iter_jax_batches(ds)` already accepts a `tf.data.Dataset`; use this to
  drop the ragged, sparse and string columns of dict elements (for example a
  TFDS ``"id"`` or ``"text"`` feature) instead of raising on them.

  Args:
    dataset: A `tf.data.Dataset` whose elements are batches (call `.batch(n)`
      first): tensors, or dicts/tuples of tensors, sharing the first dimension.
    drop_unsupported: Drop ragged, sparse and string (and other non-numeric)
      dict columns, logging a warning that names them, instead of raising.

  Returns:
    A one-pass source to pass to `iter_jax_batches` (or `jax_sync_generator`).

  Raises:
    ValueError: If `dataset` is not a `tf.data.Dataset`, or has bad columns
      and `drop_unsupported` is False, or a bad column is not a dict entry.

  Example:

    >>> ds = tfds.load("imdb_reviews", split="train").batch(32)
    >>> it = iter_jax_batches(from_tf_data(ds, drop_unsupported=True), batch_size=32)
  """
  module = type(dataset).__module__ or ""
  source = None
  if module.startswith("tensorflow"):
    source = open_tf_data(dataset, drop_unsupported=drop_unsupported)
  if source is None:
    raise ValueError(f"`dataset` must be a tf.data.Dataset, got {type(dataset).__qualname__}")
  return source
