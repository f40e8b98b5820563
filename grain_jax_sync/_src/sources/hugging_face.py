"""Hugging Face `datasets`: a `Dataset` or `IterableDataset` as a source, and `hf_pipeline`.

* A `datasets.Dataset` (map-style, Arrow) passed as is: its items are the
  batches (``ds.batch(n)``), read by position in NumPy format; the state is
  the next index.
* A `datasets.IterableDataset` (streaming) passed as is: its items are the
  batches; the state is its own `state_dict()`.
* `hf_pipeline`: a data set (or `load_dataset` arguments for local files) in,
  this process's batches out. Map-style: this input shard's contiguous rows
  (`tfds.shard_range`), a seeded order per epoch, read as Arrow slices (or
  takes when shuffled) in NumPy format, so columns share Arrow's buffers where
  Arrow allows; the state is the epoch and the position in its order, so a
  `map_fn` / `filter_fn` resumes exactly. With ``elastic=True`` the whole
  data set goes to `elastic_source` (resumable on any process count).
  Streaming: `split_dataset_by_node`, HF's own shuffle buffer, `map` and
  `filter`, and `set_epoch` per epoch; the state is the epoch and
  `state_dict()`.

Variable-length columns (token lists) are padded to the batch's longest by
`collate`, which adds a boolean ``"<column>_mask"``; `iter_jax_batches`'s
`pad_shapes` and `shape_buckets` pad them further to the size every host
agrees on. `datasets` is imported only when this module reads one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from grain_jax_sync._src import extras
from grain_jax_sync._src.sources import base, iterable
from grain_jax_sync._src.sources import tfds as tfds_lib

logger = logging.getLogger(__name__)

_NEEDED_BY = "grain_jax_sync.hf_pipeline"


def collate(batch: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, pad_id: Any = 0) -> Any:
  """One batch as a dict of arrays: rows or columns in, variable-length columns padded.

  Args:
    batch: A dict of columns (NumPy format: arrays, or object arrays of
      arrays of different lengths), or a list of rows (dicts).
    pad_id: What pads a variable-length column past each row's length.

  Returns:
    A dict of arrays sharing their first (row) dimension. A column whose rows
    have different leading lengths is padded to the longest, and gets a
    boolean ``"<column>_mask"`` (True for real elements).
  """
  if not isinstance(batch, Mapping):
    rows = list(batch)
    batch = {k: [r[k] for r in rows] for k in (rows[0] if rows else {})}
  out: dict[str, Any] = {}
  for name, column in batch.items():
    if isinstance(column, np.ndarray) and column.dtype != object:
      out[name] = column  # Arrow's buffer, not copied.
      continue
    items = [np.asarray(x) for x in column]
    lengths = [x.shape[0] if x.ndim else -1 for x in items]
    if len(set(lengths)) <= 1 or min(lengths) < 0:
      out[name] = np.stack(items) if items else np.asarray(column)
      continue
    dense = np.full((len(items), max(lengths), *items[0].shape[1:]), pad_id, items[0].dtype)
    mask = np.zeros(dense.shape[:2], bool)
    for i, (x, n) in enumerate(zip(items, lengths, strict=True)):
      dense[i, :n] = x
      mask[i, :n] = True
    out[name], out[f"{name}_mask"] = dense, mask
  return out


@dataclasses.dataclass(frozen=True, eq=False)  # The data set is unhashable.
class HFSource:
  """What `hf_pipeline` returns: this process's share, opened by `iter_jax_batches`."""

  # Map-style: this shard's `Dataset` (NumPy format); streaming: the split `IterableDataset`.
  dataset: Any
  batch_size: int
  map_fn: Callable[[Any], Any] | None
  filter_fn: Callable[[Any], bool] | None
  pad_id: Any
  shuffle: bool
  seed: int
  num_epochs: int | None
  drop_remainder: bool = False


class _MapStyle(base.SourceIterator):
  """An `HFSource` over a `Dataset`: the state is the epoch and the position in its order."""

  supports_state = True

  def __init__(self, spec: HFSource):
    self._spec = spec
    self._n = len(spec.dataset)
    self.description = f"hf_pipeline over {self._n} rows"
    self._epoch, self._pos, self._order = 0, 0, self._epoch_order(0)

  def _epoch_order(self, epoch: int) -> np.ndarray | None:
    if not self._spec.shuffle:
      return None
    return np.random.default_rng([self._spec.seed, epoch]).permutation(self._n)

  def _read(self, count: int) -> dict[str, Any]:
    """The next `count` rows of this epoch's order, as columns."""
    stop = min(self._pos + count, self._n)
    if self._order is None:
      cols = self._spec.dataset[self._pos : stop]  # A slice of the Arrow table.
    else:
      cols = self._spec.dataset[self._order[self._pos : stop]]
    self._pos = stop
    return cols

  def _rows(self) -> list[Any]:
    """Up to `batch_size` rows through `map_fn` and `filter_fn`, reading no row past the last kept."""
    spec, rows = self._spec, []
    while len(rows) < spec.batch_size and self._pos < self._n:
      cols = self._read(spec.batch_size - len(rows))
      for i in range(len(next(iter(cols.values())))):
        row = {k: v[i] for k, v in cols.items()}
        row = row if spec.map_fn is None else spec.map_fn(row)
        if spec.filter_fn is None or spec.filter_fn(row):
          rows.append(row)
    return rows

  def __next__(self) -> Any:
    spec = self._spec
    while spec.num_epochs is None or self._epoch < spec.num_epochs:
      if spec.map_fn is None and spec.filter_fn is None:
        batch = self._read(spec.batch_size) if self._pos < self._n else {}
        rows = len(next(iter(batch.values()))) if batch else 0
      else:
        batch = self._rows()
        rows = len(batch)
      if rows == spec.batch_size or (rows and not spec.drop_remainder):
        return collate(batch, pad_id=spec.pad_id)
      if self._pos >= self._n:
        self._epoch, self._pos = self._epoch + 1, 0
        self._order = self._epoch_order(self._epoch)
    raise StopIteration

  def get_state(self) -> Any:
    return {"epoch": self._epoch, "position": self._pos}

  def set_state(self, state: Any) -> None:
    epoch, pos = int(state["epoch"]), int(state["position"])
    if not 0 <= pos <= self._n or epoch < 0:
      raise ValueError(f"state {state!r} is outside {self.description}")
    self._epoch, self._pos, self._order = epoch, pos, self._epoch_order(epoch)


class _Streaming(base.SourceIterator):
  """An `IterableDataset`'s batches (its items, or `batch_size` rows); the state is its `state_dict()`."""

  supports_state = True

  def __init__(self, dataset: Any, *, batch_size: int | None, num_epochs: int | None, pad_id: Any):
    self._ds, self._batch_size, self._num_epochs, self._pad_id = (
      dataset,
      batch_size,
      num_epochs,
      pad_id,
    )
    self.description = f"a streaming datasets.IterableDataset ({dataset.n_shards} shards)"
    self._epoch, self._it = 0, None

  def __next__(self) -> Any:
    while self._num_epochs is None or self._epoch < self._num_epochs:
      if self._it is None:
        self._ds.set_epoch(self._epoch)
        b = self._batch_size
        self._it = iter(self._ds if b is None else self._ds.iter(batch_size=b))
      try:
        return collate(next(self._it), pad_id=self._pad_id)
      except StopIteration:
        self._epoch, self._it = self._epoch + 1, None
    raise StopIteration

  def get_state(self) -> Any:
    return self._kept({"epoch": self._epoch, "hf": self._ds.state_dict()})

  def set_state(self, state: Any) -> None:
    epoch, hf_state = int(state["epoch"]), state["hf"]
    if not isinstance(hf_state, Mapping) or epoch < 0:
      raise ValueError(
        f"`state['hf']` must be an IterableDataset.state_dict(), got {hf_state!r:.80}"
      )
    self._ds.load_state_dict(base.decode_state(hf_state))
    self._epoch, self._it = epoch, None


class _Batches(iterable.SequenceSource):
  """A map-style `Dataset` whose items are batches, read by position in NumPy format."""

  def __next__(self) -> Any:
    return collate(super().__next__())


def open_hf(source: Any) -> base.SourceIterator | None:
  """A `SourceIterator` over an `HFSource`, `Dataset` or `IterableDataset`; None for others."""
  if isinstance(source, HFSource):
    if _is_map_style(source.dataset):
      return _MapStyle(source)
    return _Streaming(
      source.dataset,
      batch_size=source.batch_size,
      num_epochs=source.num_epochs,
      pad_id=source.pad_id,
    )
  datasets = extras.require("datasets", needed_by="grain_jax_sync.iter_jax_batches")
  if isinstance(source, datasets.Dataset):
    return _Batches(_numpy(source))
  if isinstance(source, datasets.IterableDataset):
    return _Streaming(_numpy(source), batch_size=None, num_epochs=1, pad_id=0)
  return None


def _is_map_style(ds: Any) -> bool:
  return hasattr(ds, "__getitem__") and hasattr(ds, "__len__")


def _numpy(ds: Any) -> Any:
  """`ds` in NumPy format, unless the user chose a format."""
  fmt = getattr(ds, "format", None) or {}
  return ds.with_format("numpy") if fmt.get("type") is None else ds


def hf_pipeline(
  dataset: Any,
  *,
  batch_size: int,
  data_files: Any = None,
  split: str = "train",
  streaming: bool = False,
  load_kwargs: Mapping[str, Any] | None = None,
  columns: Sequence[str] | None = None,
  shuffle: bool = False,
  shuffle_buffer_size: int = 10_000,
  seed: int = 0,
  num_epochs: int | None = 1,
  drop_remainder: bool = False,
  map_fn: Callable[[Any], Any] | None = None,
  filter_fn: Callable[[Any], bool] | None = None,
  pad_id: Any = 0,
  elastic: bool = False,
  process_index: int | None = None,
  process_count: int | None = None,
  mesh: Any = None,
  data_axes: str | Sequence[str] | None = None,
  sharding: Any = None,
) -> Any:
  """Builds this process's batches over a Hugging Face data set, in one call.

  Pass the result to `iter_jax_batches` or `device_put` with `paddings` and
  `mask_key` (shards differ by a row, filters by more), and with
  ``pad_shapes={"tokens": 1, "tokens_mask": 1}`` (and `shape_buckets`) for
  a variable-length column ``"tokens"``.

  Args:
    dataset: A `datasets.Dataset` or `datasets.IterableDataset`, or what
      `datasets.load_dataset` takes first (``"parquet"``, ``"json"``,
      ``"arrow"``, a local folder) with `data_files`.
    batch_size: Rows per batch on this process.
    data_files: With a name: the files, as `load_dataset` takes them.
    split: With a name: the split to load.
    streaming: With a name: load an `IterableDataset`.
    load_kwargs: With a name: more `load_dataset` arguments.
    columns: The columns to read (default: all); every column read must be
      numeric after `map_fn`.
    shuffle: A seeded order of this process's rows, new each epoch
      (streaming: HF's shuffle buffer of `shuffle_buffer_size` rows and
      shuffled shards).
    seed: The shared seed; each input shard derives its own from it.
    num_epochs: Passes over the rows; None repeats forever.
    drop_remainder: Drop each epoch's last, short batch.
    map_fn: Row (dict of NumPy values) -> row, before `filter_fn`.
    filter_fn: Row -> whether to keep it.
    pad_id: Pads variable-length columns (see `collate`).
    shuffle_buffer_size: Streaming only: HF's shuffle buffer.
    process_index: The input shard this process reads; default: from the
      mesh, else ``jax.process_index()`` (as in `tfds_pipeline`).
    process_count: Input shards; default: from the mesh, else
      ``jax.process_count()``.
    mesh: The mesh the batches land on: processes that share rows (a model
      axis across processes) read the same rows in the same order.
    data_axes: With `mesh`: the axes the rows are split over.
    sharding: Instead of `mesh`: the batches' sharding (or PartitionSpec).
    elastic: Map-style only: an `elastic_source` over the whole data set,
      resumable on any process count (one input shard per process).

  Returns:
    A source for `iter_jax_batches` / `device_put`: an `HFSource`, or with
    `elastic` an `ElasticSource`.

  Raises:
    ValueError: For bad arguments, or `elastic` with a streaming data set.

  Example:

    >>> src = hf_pipeline("parquet", data_files="train.parquet", batch_size=32, shuffle=True)
    >>> it = iter_jax_batches(src, batch_size=32, paddings=0, mask_key="mask")
  """
  placement_args = (process_index, process_count, mesh, data_axes, sharding)
  batch_size = tfds_lib.check_args(batch_size, num_epochs, seed, elastic, placement_args)
  ds = _numpy(_load(dataset, data_files, split, streaming, load_kwargs, columns))
  spec = HFSource(ds, batch_size, map_fn, filter_fn, pad_id, bool(shuffle), int(seed), num_epochs)
  spec = dataclasses.replace(spec, drop_remainder=bool(drop_remainder))
  if elastic:
    return _elastic(spec)
  index, count = tfds_lib.input_shard(
    *placement_args[:2], mesh=mesh, data_axes=data_axes, sharding=sharding
  )
  if not _is_map_style(ds):
    datasets = extras.require("datasets.distributed", needed_by=_NEEDED_BY, extra="hf")
    ds = datasets.split_dataset_by_node(ds, rank=index, world_size=count)
    if shuffle:
      ds = ds.shuffle(seed=int(seed), buffer_size=shuffle_buffer_size)
    ds = ds if map_fn is None else ds.map(map_fn)
    ds = ds if filter_fn is None else ds.filter(filter_fn)
    return dataclasses.replace(spec, dataset=ds, map_fn=None, filter_fn=None)
  start, stop = tfds_lib.shard_range(len(ds), index, count)
  logger.info("grain_jax_sync: HF input shard %d/%d reads rows [%d, %d)", index, count, start, stop)
  return dataclasses.replace(
    spec, dataset=ds.select(range(start, stop)), seed=tfds_lib.process_seed(seed, index)
  )


def _load(
  dataset: Any, data_files: Any, split: str, streaming: bool, load_kwargs: Any, columns: Any
) -> Any:
  """`dataset`, or `load_dataset`'s, with only `columns`."""
  datasets = extras.require("datasets", needed_by=_NEEDED_BY, extra="hf")
  if isinstance(dataset, str):
    dataset = datasets.load_dataset(
      dataset, data_files=data_files, split=split, streaming=streaming, **dict(load_kwargs or {})
    )
  elif not isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
    raise ValueError(
      "`dataset` must be a datasets.Dataset or IterableDataset, or a load_dataset name,"
      f" got {type(dataset).__name__}"
    )
  return dataset if columns is None else dataset.select_columns(list(columns))


def _elastic(spec: HFSource) -> Any:
  """`spec`'s whole data set as an `elastic_source`: map, filter and batches per process."""
  from grain_jax_sync._src.sources import elastic  # pylint: disable=g-import-not-at-top

  if not _is_map_style(spec.dataset):
    raise ValueError(
      "`elastic=True` needs a map-style datasets.Dataset (streaming=False): a streaming"
      " data set resumes on the same process count only"
    )
  return elastic.elastic_source(
    spec.dataset,
    functools.partial(_per_process, spec=spec),
    shuffle=spec.shuffle,
    seed=spec.seed,
    num_epochs=spec.num_epochs,
  )


def _per_process(ds: Any, *, spec: HFSource) -> Any:
  """An elastic process's `grain.IterDataset` of rows -> its batches."""
  ds = ds if spec.map_fn is None else ds.map(spec.map_fn)
  ds = ds if spec.filter_fn is None else ds.filter(spec.filter_fn)
  batch_fn = functools.partial(collate, pad_id=spec.pad_id)
  return ds.batch(spec.batch_size, drop_remainder=spec.drop_remainder, batch_fn=batch_fn)
