"""Hugging Face `datasets`: a `Dataset` or `IterableDataset` of batches as a source, and `hf_pipeline`.

`hf_pipeline` reads this input shard's rows: map-style, a contiguous range of
the Arrow table read as NumPy views of Arrow's buffers (`arrow_columns`);
streaming, `split_dataset_by_node` in windows of rows.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from grain_jax_sync._src import extras, leaves, padding
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src.sources import base, iterable
from grain_jax_sync._src.sources import tfds as tfds_lib

logger = logging.getLogger(__name__)

_NEEDED_BY = "grain_jax_sync.hf_pipeline"


def collate(
  batch: Mapping[str, Any] | Sequence[Mapping[str, Any]],
  *,
  ragged: Collection[str] = (),
  pad_id: Any = 0,
) -> dict[str, Any]:
  """One batch (a dict of NumPy columns, or a list of row dicts) as a dict of arrays.

  Each `ragged` column is padded with `pad_id` to the batch's longest row and
  gets a boolean ``"<column>_mask"`` (True for real elements), in every batch.
  Another column whose rows differ in shape raises `leaves.DataError`.
  """
  if not isinstance(batch, Mapping):
    rows = list(batch)
    batch = {k: [r[k] for r in rows] for k in (rows[0] if rows else {})}
  out: dict[str, Any] = {}
  for name, column in batch.items():
    if (
      name not in ragged and isinstance(column, (np.ndarray, np.generic)) and column.dtype != object
    ):
      # Arrow's buffer, not copied. A scalar (a row of an unbatched `Dataset`)
      # passes too: the reader refuses it as it does any unbatched element.
      out[name] = column
      continue
    items = [np.asarray(x) for x in column]
    if name not in ragged:
      if len({x.shape for x in items}) > 1:
        raise leaves.DataError(
          f"column {name!r} has rows of different shapes ({items[0].shape} and others):"
          " name it in hf_pipeline's `ragged_columns`, which pads it and adds a mask"
        )
      out[name] = np.stack(items) if items else np.asarray(column)
      continue
    dense = np.full(
      (len(items), *_ragged_shape(name, items)), pad_id, _ragged_dtype(name, items, pad_id)
    )
    mask = np.zeros(dense.shape[:2], bool)
    for i, x in enumerate(items):
      dense[i, : len(x)] = x
      mask[i, : len(x)] = True
    out[name], out[f"{name}_mask"] = dense, mask
  return out


def _ragged_shape(name: str, items: Sequence[np.ndarray]) -> tuple[int, ...]:
  """A ragged column's padded row shape: the longest row, and the trailing dims every row shares."""
  trailing = {x.shape[1:] for x in items if x.ndim}
  if any(x.ndim == 0 for x in items) or len(trailing) > 1:
    shapes = sorted({x.shape for x in items})
    raise leaves.DataError(
      f"ragged column {name!r} has rows of shapes {shapes[:4]}; expected rows of one or"
      " more dims that differ in their first only"
    )
  return (max((len(x) for x in items), default=0), *(trailing.pop() if trailing else ()))


def _ragged_dtype(name: str, items: Sequence[np.ndarray], pad_id: Any) -> np.dtype:
  """The one dtype of a ragged column's non-empty rows, which `pad_id` fits; never a cast."""
  found = {x.dtype for x in items if x.size} or {items[0].dtype if items else np.dtype(float)}
  if len(found) > 1:
    raise leaves.DataError(
      f"ragged column {name!r} has rows of dtypes {sorted(d.name for d in found)}; every"
      " row must have one dtype (cast it in `map_fn`)"
    )
  dtype = found.pop()
  if not padding.fits(pad_id, dtype):
    raise leaves.DataError(
      f"`pad_id` {pad_id!r:.40} is no value of ragged column {name!r} ({dtype})"
    )
  return dtype


@dataclasses.dataclass(frozen=True, eq=False)  # The data set is unhashable.
class HFSource:
  """What `hf_pipeline` returns: this process's share, opened by `iter_jax_batches`."""

  # Map-style: this shard's `pyarrow.Table`; streaming: makes its `IterableDataset` (`_stream`).
  dataset: Any
  batch_size: int
  map_fn: Callable[[Any], Any] | None
  filter_fn: Callable[[Any], bool] | None
  pad_id: Any
  ragged: tuple[str, ...]
  shuffle: bool
  seed: int
  num_epochs: int | None
  drop_remainder: bool = False
  window: int = 0  # Streaming: rows per shuffled window.


def arrow_columns(table: Any) -> dict[str, np.ndarray]:
  """A `pyarrow.Table`'s columns as NumPy views of Arrow's buffers where the type allows.

  A variable-length list column is an object array of views, one per row;
  nulls and other types are copied by Arrow.
  """
  columns = zip(table.column_names, table.columns, strict=True)
  # One chunk is read as is; `combine_chunks` copies even then.
  return {k: _array(c.chunk(0) if c.num_chunks == 1 else c.combine_chunks()) for k, c in columns}


def _array(array: Any) -> np.ndarray:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top

  kind = array.type
  if array.null_count or not (
    pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)
  ):
    return array.to_numpy(zero_copy_only=False)
  values = _array(array.flatten())  # This slice's values only.
  if pa.types.is_fixed_size_list(kind):
    return values.reshape(len(array), kind.list_size, *values.shape[1:])
  offsets = array.offsets.to_numpy()
  offsets = offsets - offsets[0]
  out = np.empty(len(array), object)
  out[:] = [values[i:j] for i, j in zip(offsets[:-1], offsets[1:], strict=True)]
  return out


class _Epochs(base.SourceIterator):
  """`hf_pipeline`'s reader: batches of `batch_size` rows, epoch after epoch; a short batch is
  its epoch's last. A subclass reads up to `count` rows of this epoch (`_take`: rows, or
  columns) and moves to an epoch's start (`_start`)."""

  supports_state = True
  _epoch: int
  _start: Callable[[int], None]
  _take: Callable[[int], Any]

  def __init__(self, spec: HFSource):
    self._spec = spec
    self._start(0)

  def __next__(self) -> Any:
    spec = self._spec
    while spec.num_epochs is None or self._epoch < spec.num_epochs:
      rows = self._take(spec.batch_size)
      count = len(next(iter(rows.values()))) if isinstance(rows, dict) else len(rows)
      if count == spec.batch_size or (count and not spec.drop_remainder):
        return collate(rows, ragged=spec.ragged, pad_id=spec.pad_id)
      self._start(self._epoch + 1)
    raise StopIteration


class _MapStyle(_Epochs):
  """An `HFSource` over an Arrow table: the state is the epoch and the position in its order."""

  def __init__(self, spec: HFSource):
    self._n = spec.dataset.num_rows
    self.description = f"hf_pipeline over {self._n} rows"
    super().__init__(spec)

  def _start(self, epoch: int, position: int = 0) -> None:
    """Moves to `position` in `epoch`'s order."""
    self._epoch, self._pos = epoch, position
    self._order = None
    if self._spec.shuffle:
      self._order = np.random.default_rng([self._spec.seed, epoch]).permutation(self._n)

  def _read(self, count: int) -> dict[str, Any]:
    """The next `count` rows of this epoch's order, as columns."""
    stop = min(self._pos + count, self._n)
    if self._order is None:
      table = self._spec.dataset.slice(self._pos, stop - self._pos)  # No copy.
    else:
      table = self._spec.dataset.take(self._order[self._pos : stop])
    self._pos = stop
    return arrow_columns(table)

  def _take(self, count: int) -> Any:
    """Through `map_fn` and `filter_fn`, reading no row past the last kept."""
    spec, rows = self._spec, list[Any]()
    if self._pos < self._n and spec.map_fn is None and spec.filter_fn is None:
      return self._read(count)
    while len(rows) < count and self._pos < self._n:
      cols = self._read(count - len(rows))
      for i in range(len(next(iter(cols.values())))):
        row = {k: v[i] for k, v in cols.items()}
        row = row if spec.map_fn is None else spec.map_fn(row)
        if spec.filter_fn is None or spec.filter_fn(row):
          rows.append(row)
    return rows

  def get_state(self) -> Any:
    return {"epoch": self._epoch, "position": self._pos}

  def set_state(self, state: Any) -> None:
    epoch, pos = int(state["epoch"]), int(state["position"])
    if not 0 <= pos <= self._n or epoch < 0:
      raise ValueError(f"state {state!r} is outside {self.description}")
    self._start(epoch, pos)


class _Rows:
  """An Arrow table as a random-access sequence of rows (an elastic source's records)."""

  def __init__(self, table: Any):
    self._table = table

  def __len__(self) -> int:
    return self._table.num_rows

  def __getitem__(self, i: int) -> dict[str, Any]:
    return {k: v[0] for k, v in arrow_columns(self._table.slice(int(i), 1)).items()}


class _Streaming(base.SourceIterator):
  """An `IterableDataset` whose items are batches; the state is its `state_dict()`."""

  supports_state = True

  def __init__(self, dataset: Any):
    self._ds, self._it = dataset, None  # type: Any, Any
    self.description = f"a streaming datasets.IterableDataset ({dataset.n_shards} shards)"

  def __next__(self) -> Any:
    self._it = iter(self._ds) if self._it is None else self._it
    return collate(next(self._it))

  def get_state(self) -> Any:
    return self._kept(self._ds.state_dict())

  def set_state(self, state: Any) -> None:
    self._ds.load_state_dict(state)
    self._it = None


class _Windows(_Epochs):
  """`hf_pipeline` over an `IterableDataset`: windows of rows, each in a seeded order.

  The state is where the window started (HF's `state_dict()`), its index and
  rows consumed: a resume reads it again in the same order (HF's own shuffle
  buffer is not in its state: rows would be lost).
  """

  def __init__(self, spec: HFSource):
    self._ds = spec.dataset()
    self.description = f"hf_pipeline over a streaming data set ({self._ds.n_shards} shards)"
    self._window_rows = spec.window if spec.shuffle else spec.batch_size
    super().__init__(spec)

  def _start(self, epoch: int, window: int = 0, hf: Any = None, offset: int = 0) -> None:
    self._epoch, self._window, self._hf, self._offset = epoch, window, hf, offset
    self._rows: list[Any] | None = None
    self._windows: Any = None  # HF's iterator, opened at the cursor.

  def _load(self) -> bool:
    """Reads the window at the cursor; False at the epoch's end."""
    if self._windows is None:
      # A new one: HF keeps a loaded state for every later iteration of its epoch.
      self._ds = self._spec.dataset()
      self._ds.set_epoch(self._epoch)
      if self._hf is not None:
        self._ds.load_state_dict(self._hf)
      self._windows = iter(self._ds.iter(batch_size=self._window_rows))
    table = next(self._windows, None)
    if table is None:
      return False
    cols = arrow_columns(table)
    n = len(next(iter(cols.values())))
    order: Any = range(n)
    if self._spec.shuffle:
      order = np.random.default_rng([self._spec.seed, self._epoch, self._window]).permutation(n)
    self._rows = [{k: v[i] for k, v in cols.items()} for i in order]
    return True

  def _take(self, count: int) -> list[Any]:
    rows: list[Any] = []
    while len(rows) < count and (self._rows is not None or self._load()):
      assert self._rows is not None
      taken = self._rows[self._offset : self._offset + count - len(rows)]
      rows += taken
      self._offset += len(taken)
      if self._offset == len(self._rows):  # The next window starts at HF's state now.
        hf = base.encode_state(self._ds.state_dict())  # A copy.
        self._hf, self._window, self._offset, self._rows = hf, self._window + 1, 0, None
    return rows

  def get_state(self) -> Any:
    cursor = {"epoch": self._epoch, "window": self._window, "offset": self._offset}
    return self._kept({**cursor, "hf": self._hf})

  def set_state(self, state: Any) -> None:
    epoch, window, offset, hf = (state[k] for k in ("epoch", "window", "offset", "hf"))
    if not all(isinstance(x, int) and x >= 0 for x in (epoch, window, offset)):
      raise ValueError(
        f"`state` must hold ints >= 0 at 'epoch', 'window', 'offset', got {state!r:.200}"
      )
    self._start(epoch, window, hf, offset)


class _Batches(iterable.SequenceSource):
  """A map-style `Dataset` whose items are batches (rectangular columns), read by position."""

  def __next__(self) -> Any:
    return collate(super().__next__())


def open_hf(source: Any) -> base.SourceIterator | None:
  """A `SourceIterator` over an `HFSource`, `Dataset` or `IterableDataset`; None for others."""
  if isinstance(source, HFSource):
    return _Windows(source) if callable(source.dataset) else _MapStyle(source)
  datasets = extras.require("datasets", needed_by="grain_jax_sync.iter_jax_batches")
  if isinstance(source, datasets.Dataset):
    return _Batches(_numpy(source))
  if isinstance(source, datasets.IterableDataset):
    return _Streaming(_numpy(source))
  return None


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
  ragged_columns: Sequence[str] | None = None,
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
  ``pad_shapes={"tokens": 1, "tokens_mask": 1}`` for a variable-length
  column ``"tokens"``.

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
      (streaming: within windows of `shuffle_buffer_size` rows).
    seed: The shared seed; each input shard derives its own from it.
    num_epochs: Passes over the rows; None repeats forever.
    drop_remainder: Drop each epoch's last, short batch.
    map_fn: Row (dict of NumPy values) -> row, before `filter_fn`.
    filter_fn: Row -> whether to keep it.
    ragged_columns: The variable-length columns, padded to each batch's
      longest row with `pad_id` and masked by a ``"<column>_mask"`` column;
      default: the data set's variable-length lists (its features). Name
      them when `map_fn` makes them.
    pad_id: Pads the `ragged_columns`.
    shuffle_buffer_size: Streaming only: the rows of a shuffled window (a
      resume reads the window it stopped in again).
    process_index, process_count, mesh, data_axes, sharding: Pick this
      process's input shard, as in `tfds_pipeline` (processes that share
      rows read the same rows in the same order).
    elastic: Map-style only: an `elastic_source` over the whole data set.

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
  ds = _load(dataset, data_files, split, streaming, load_kwargs, columns)
  map_style = hasattr(ds, "__getitem__") and hasattr(ds, "__len__")  # Else streaming.
  ragged = _ragged(ds) if ragged_columns is None else tuple(ragged_columns)
  window = options_lib.checked_int("shuffle_buffer_size", shuffle_buffer_size)
  shuffle = options_lib.checked_bool("shuffle", shuffle)
  spec = HFSource(ds, batch_size, map_fn, filter_fn, pad_id, ragged, shuffle, int(seed), num_epochs)
  drop_remainder = options_lib.checked_bool("drop_remainder", drop_remainder)
  spec = dataclasses.replace(spec, drop_remainder=drop_remainder, window=window)
  if elastic:  # The whole data set as an `elastic_source`.
    if not map_style:
      raise ValueError(
        "`elastic=True` needs a map-style datasets.Dataset (streaming=False): a streaming"
        " data set resumes on the same process count only"
      )
    batch_fn = functools.partial(collate, ragged=ragged, pad_id=pad_id)
    return tfds_lib.elastic_batches(_Rows(_arrow(ds)), spec, batch_fn)
  index, count = tfds_lib.input_shard(
    *placement_args[:2], mesh=mesh, data_axes=data_axes, sharding=sharding
  )
  if not map_style:
    stream = functools.partial(_stream, ds, index, count, map_fn, filter_fn)
    return dataclasses.replace(spec, dataset=stream, map_fn=None, filter_fn=None)
  start, stop = tfds_lib.shard_range(len(ds), index, count)
  logger.info("grain_jax_sync: HF input shard %d/%d reads rows [%d, %d)", index, count, start, stop)
  table = _arrow(ds).slice(start, stop - start)
  return dataclasses.replace(spec, dataset=table, seed=tfds_lib.process_seed(seed, index))


def _stream(ds: Any, index: int, count: int, map_fn: Any, filter_fn: Any) -> Any:
  """A new `IterableDataset` of input shard `index`'s rows, mapped and filtered, in Arrow format."""
  datasets = extras.require("datasets.distributed", needed_by=_NEEDED_BY, extra="hf")
  ds = datasets.split_dataset_by_node(_numpy(ds), rank=index, world_size=count)
  if map_fn is not None:
    # `IterableDataset.map` merges the returned row into the input row: remove
    # the input's columns, so that the row is what `map_fn` returns, as in
    # the map-style and elastic pipelines.
    names = ds.column_names
    if names is None:  # Features unknown (a generator's): from its first row.
      names = ds._resolve_features().column_names
    ds = ds.map(map_fn, remove_columns=names)
  ds = ds if filter_fn is None else ds.filter(filter_fn)
  return ds.with_format("arrow")  # Read as Arrow tables (`arrow_columns`).


def _arrow(ds: Any) -> Any:
  """A map-style `Dataset`'s rows as one `pyarrow.Table` (an indices mapping applied)."""
  if getattr(ds, "_indices", None) is not None:  # After a shuffle, a sort, a filter.
    ds = ds.flatten_indices(keep_in_memory=True)
  return ds.data.table


def _ragged(ds: Any) -> tuple[str, ...]:
  """The names of `ds`'s variable-length list columns, from its features (none if unknown)."""
  datasets = extras.require("datasets", needed_by=_NEEDED_BY, extra="hf")
  lists = (datasets.List, datasets.LargeList)
  features = ds.features or {}
  return tuple(
    k for k, f in features.items() if isinstance(f, lists) and getattr(f, "length", -1) == -1
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
