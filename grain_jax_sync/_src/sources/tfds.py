"""TFDS: a dataset name and split in, this process's batched pipeline out.

With ``n`` examples and ``P`` input shards, shard ``p`` is
``[p*n//P, (p+1)*n//P)`` (``reader="tf_data"``: `tfds.even_splits`): no
example dropped, sizes differing by at most one. An input shard is a process,
or the processes that feed the same rows of a mesh (`data_shard_info`): they
read the same examples with the same seed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from grain_jax_sync._src import extras
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src.sources import base

if TYPE_CHECKING:
  import grain
  import tensorflow as tf

logger = logging.getLogger(__name__)

_READERS = ("data_source", "tf_data")


def shard_range(num_examples: int, process_index: int, process_count: int) -> tuple[int, int]:
  """This process's contiguous ``[start, stop)`` share of `num_examples` (sizes differ by <= 1)."""
  start = process_index * num_examples // process_count
  stop = (process_index + 1) * num_examples // process_count
  return start, stop


def process_seed(seed: int, process_index: int) -> int:
  """A 32-bit seed for this process derived from the shared `seed`."""
  return int(np.random.SeedSequence([int(seed), int(process_index)]).generate_state(1)[0])


def _unsupported_features(tensor_info: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
  """Paths of features that cannot be batched into numeric arrays."""
  if isinstance(tensor_info, Mapping):
    return [p for k, v in tensor_info.items() for p in _unsupported_features(v, (*prefix, k))]
  dtype = getattr(tensor_info, "np_dtype", None)  # TFDS >= 4.9.3.
  if dtype is None:
    dtype = getattr(tensor_info, "dtype", None)
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # A tf.DType.
  shape = getattr(tensor_info, "shape", ()) or ()
  try:
    kind = np.dtype(dtype).kind
  except TypeError:
    kind = "O"
  if kind in "OSUV" or any(d is None for d in shape):
    return [prefix]
  return []


def tfds_pipeline(
  name: str,
  *,
  split: str,
  batch_size: int,
  reader: str = "data_source",
  shuffle: bool = False,
  seed: int = 0,
  num_epochs: int | None = 1,
  drop_remainder: bool = False,
  map_fn: Callable[[Any], Any] | None = None,
  drop_unsupported: bool = False,
  data_dir: str | None = None,
  download: bool = False,
  builder_kwargs: Mapping[str, Any] | None = None,
  read_options: Any = None,
  shuffle_buffer_size: int = 10_000,
  process_index: int | None = None,
  process_count: int | None = None,
  mesh: Any = None,
  data_axes: str | Sequence[str] | None = None,
  sharding: Any = None,
  elastic: bool = False,
) -> grain.IterDataset | tf.data.Dataset:
  """Builds this process's batched pipeline over a TFDS split, in one call.

  Pass the result to `iter_jax_batches` (with `paddings` and `mask_key`, so
  that the one-example-longer shards are padded and masked) or to
  `grain_jax_sync.device_put`.

  Args:
    name: TFDS name, e.g. ``"mnist"`` or ``"mnist:3.0.1"``.
    split: TFDS split, e.g. ``"train"`` or ``"train[:10%]"``.
    batch_size: Examples per batch on this process.
    reader: ``"data_source"`` (ArrayRecord through Grain) or ``"tf_data"``
      (`tfds.load`).
    shuffle: Shuffle this process's examples, differently every epoch.
    seed: The shared seed; each process derives its own from it.
    num_epochs: Passes over the shard; None repeats forever.
    drop_remainder: Drop this process's last, short batch.
    map_fn: Optional per-example transform, applied before batching (a
      Python function of NumPy dicts for ``"data_source"``, a traceable
      function of tensors for ``"tf_data"``).
    drop_unsupported: Drop string, ragged and other non-numeric features
      (they cannot become `jax.Array` values) instead of failing on them.
    data_dir: TFDS data directory.
    download: Download and prepare the dataset if missing (better: once,
      with ``tfds build``).
    builder_kwargs: Passed to the TFDS builder.
    read_options: A `grain.ReadOptions` for ``"data_source"``.
    shuffle_buffer_size: tf.data shuffle buffer for ``"tf_data"``, capped at
      this process's number of examples.
    process_index: The input shard this process reads; default: from the
      mesh (see `mesh`), else ``jax.process_index()``.
    process_count: Input shards; default: from the mesh, else
      ``jax.process_count()``.
    mesh: The mesh the batches will land on: the process reads input shard
      `data_shard_info(mesh).shard_index`, so processes that share rows read
      identical examples in the same order. Default: the mesh set by
      `jax.set_mesh` if any, else one shard per process.
    data_axes: With `mesh`: the axes the rows are split over.
    sharding: Instead of `mesh`: the sharding (or PartitionSpec) the batches
      will have.
    elastic: Return an `elastic_source` over the whole split (``"data_source"``
      only), resumable on any process count; no `mesh`, `process_index` or
      `process_count`.

  Returns:
    A `grain.IterDataset` (``"data_source"``) or `tf.data.Dataset`
    (``"tf_data"``) of dict batches of NumPy arrays / tensors.

  Raises:
    ValueError: For bad arguments.

  Example:

    >>> ds = tfds_pipeline("mnist", split="train", batch_size=32, shuffle=True, seed=1)
    >>> for batch in iter_jax_batches(ds, batch_size=32, paddings=0, mask_key="mask"):
    ...   state = train_step(state, batch)
  """
  if reader not in _READERS:
    raise ValueError(f"`reader` must be one of {_READERS}, got {reader!r}")
  if elastic and reader != "data_source":
    raise ValueError(f"`elastic=True` needs reader='data_source', got reader={reader!r}")
  batch_size = check_args(
    batch_size, num_epochs, seed, elastic, (process_index, process_count, mesh, data_axes, sharding)
  )
  process_index, process_count = input_shard(
    process_index, process_count, mesh=mesh, data_axes=data_axes, sharding=sharding
  )
  tfds = extras.require("tensorflow_datasets", needed_by="grain_jax_sync.tfds_pipeline")

  req = _Request(
    name=name,
    split=split,
    batch_size=batch_size,
    shuffle=options_lib.checked_bool("shuffle", shuffle),
    seed=int(seed) if elastic else process_seed(seed, process_index),
    num_epochs=num_epochs,
    drop_remainder=options_lib.checked_bool("drop_remainder", drop_remainder),
    map_fn=map_fn,
    drop_unsupported=drop_unsupported,
    load={
      "data_dir": data_dir,
      "download": download,
      "builder_kwargs": dict(builder_kwargs) if builder_kwargs else None,
    },
    process_index=int(process_index),
    process_count=int(process_count),
  )
  if elastic:
    return _elastic_pipeline(tfds, req)
  if reader == "data_source":
    return _grain_pipeline(tfds, req, read_options=read_options)
  return _tf_pipeline(tfds, req, shuffle_buffer_size=shuffle_buffer_size)


def check_args(
  batch_size: int, num_epochs: Any, seed: Any, elastic: bool, placement_args: tuple[Any, ...]
) -> int:
  """The checked `batch_size` of `tfds_pipeline` or `hf_pipeline`; ValueError for a bad option."""
  batch_size = options_lib.checked_int("batch_size", batch_size)
  options_lib.checked_int_or_none("num_epochs", num_epochs)
  if options_lib.checked_int("seed", seed, minimum=0) >= 2**32:
    raise ValueError(f"`seed` must be in [0, 2**32), got {seed!r}")
  if options_lib.checked_bool("elastic", elastic) and any(x is not None for x in placement_args):
    raise ValueError(
      "`elastic=True` splits the records over the processes itself: pass no"
      " `process_index`, `process_count`, `mesh`, `data_axes` or `sharding`"
    )
  return batch_size


def input_shard(
  process_index: int | None, process_count: int | None, *, mesh: Any, data_axes: Any, sharding: Any
) -> tuple[int, int]:
  """(index, count) of the input shard to read: explicit, from a mesh, or per process."""
  import jax  # pylint: disable=g-import-not-at-top

  from grain_jax_sync._src import placement  # pylint: disable=g-import-not-at-top

  by_mesh = mesh is not None or sharding is not None or data_axes is not None
  if by_mesh and (process_index is not None or process_count is not None):
    raise ValueError(
      "pass `process_index`/`process_count`, or `mesh`/`data_axes`/`sharding`, not both"
    )
  if by_mesh or (
    process_index is None and process_count is None and placement.context_mesh() is not None
  ):
    p = placement.resolve_placement(mesh=mesh, data_axes=data_axes, sharding=sharding)
    return p.shard_index, p.shard_count
  if process_index is not None:
    process_index = options_lib.checked_int("process_index", process_index, minimum=0)
  if process_count is not None:
    process_count = options_lib.checked_int("process_count", process_count)
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"`process_index` must be in [0, {process_count}), got {process_index}")
  return process_index, process_count


@dataclasses.dataclass(frozen=True)
class _Request:
  """What both readers build: one process's share of a TFDS split."""

  name: str
  split: str
  batch_size: int
  shuffle: bool
  seed: int
  num_epochs: int | None
  drop_remainder: bool
  map_fn: Callable[[Any], Any] | None
  drop_unsupported: bool
  load: dict[str, Any]  # What `tfds.data_source` and `tfds.load` both take.
  process_index: int
  process_count: int
  filter_fn: None = None  # As `hf_pipeline`'s, for `elastic_batches`.


def elastic_batches(records: Any, spec: Any, batch_fn: Any = None) -> Any:
  """`records` as an `elastic_source`: `spec`'s `map_fn`, `filter_fn` and batches per process.

  `spec`: a `_Request` or an `hf_pipeline` source (fields of the same names).
  """
  from grain_jax_sync._src.sources.elastic import source as elastic  # pylint: disable=g-import-not-at-top

  per_process = functools.partial(_per_process, spec=spec, batch_fn=batch_fn)
  return elastic.elastic_source(
    records, per_process, shuffle=spec.shuffle, seed=spec.seed, num_epochs=spec.num_epochs
  )


def _per_process(ds: Any, *, spec: Any, batch_fn: Any) -> Any:
  ds = ds if spec.map_fn is None else ds.map(spec.map_fn)
  ds = ds if spec.filter_fn is None else ds.filter(spec.filter_fn)
  return ds.batch(spec.batch_size, drop_remainder=spec.drop_remainder, batch_fn=batch_fn)


def _elastic_pipeline(tfds: Any, r: _Request) -> Any:
  """The whole split (read with Grain's default options) as an `elastic_source`."""
  grain = extras.require("grain", needed_by="tfds_pipeline(elastic=True)", extra="tfds")
  source = _data_source(tfds, r)
  return elastic_batches(_dropped(grain.MapDataset.source(source), source, r), r)


def _data_source(tfds: Any, r: _Request) -> Any:
  try:
    return tfds.data_source(r.name, split=r.split, **r.load)
  except ImportError as e:
    raise ImportError(
      f"tfds.data_source({r.name!r}) needs an optional dependency that could not be"
      f" imported ({e}). Install it with: {extras.install_command('tfds')}",
      name=e.name,
    ) from e
  except Exception as e:  # noqa: BLE001 - re-raised with the fix.
    raise RuntimeError(
      f"tfds.data_source({r.name!r}, split={r.split!r}) failed: {type(e).__name__}: {e}."
      " The data_source reader needs the dataset prepared in ArrayRecord format"
      " (`tfds build --file_format=array_record`), or use reader='tf_data'"
    ) from e


def _dropped(ds: Any, source: Any, r: _Request) -> Any:
  """`ds` without the features that cannot become `jax.Array`s, if asked."""
  if r.drop_unsupported:
    info = getattr(source, "dataset_info", None)
    features = getattr(info, "features", None)
    paths = _unsupported_features(features.get_tensor_info()) if features is not None else []
    if paths:
      logger.warning(
        "grain_jax_sync: dropping TFDS features that cannot become jax.Arrays: %s",
        ", ".join("/".join(p) for p in paths),
      )
      ds = ds.map(functools.partial(base.drop_dict_paths, paths=paths))  # Picklable.
  return ds


def _grain_pipeline(tfds: Any, r: _Request, *, read_options: Any) -> Any:
  grain = extras.require("grain", needed_by="tfds_pipeline(reader='data_source')", extra="tfds")
  source = _data_source(tfds, r)
  start, stop = shard_range(len(source), r.process_index, r.process_count)
  ds = grain.MapDataset.source(source)[start:stop]
  where = (r.process_index, r.process_count, start, stop)
  logger.info(
    "grain_jax_sync: %s[%s] input shard %d/%d reads examples [%d, %d)", r.name, r.split, *where
  )
  ds = _dropped(ds, source, r)
  ds = _batched(ds.shuffle(seed=r.seed) if r.shuffle else ds, r)
  return ds.to_iter_dataset(read_options)


def _tf_pipeline(tfds: Any, r: _Request, *, shuffle_buffer_size: int) -> Any:
  tf = extras.require("tensorflow", needed_by="tfds_pipeline(reader='tf_data')", extra="tfds")

  from grain_jax_sync._src.sources import tf_data  # pylint: disable=g-import-not-at-top

  sub = r.split
  if r.process_count > 1:
    sub = tfds.even_splits(r.split, n=r.process_count, drop_remainder=False)[r.process_index]
  ds = tfds.load(
    r.name,
    split=sub,
    shuffle_files=r.shuffle,
    read_config=tfds.ReadConfig(shuffle_seed=r.seed),
    **r.load,
  )
  if r.drop_unsupported:
    ds = tf_data.drop_unsupported_columns(ds)
  if r.shuffle:
    # Capped at the shard's size: TensorFlow saves every slot in a snapshot.
    n = int(ds.cardinality())  # TFDS asserts it; -1 infinite, -2 unknown.
    buffer = min(int(shuffle_buffer_size), n) if n > 0 else int(shuffle_buffer_size)
    ds = ds.shuffle(buffer, seed=r.seed, reshuffle_each_iteration=True)
  ds = _batched(ds, r, num_parallel_calls=tf.data.AUTOTUNE)
  return ds.prefetch(tf.data.AUTOTUNE)


def _batched(ds: Any, r: _Request, **map_kwargs: Any) -> Any:
  """`ds` (shuffled) repeated, mapped and batched as `r` asks."""
  ds = ds if r.num_epochs == 1 else ds.repeat(r.num_epochs)
  ds = ds if r.map_fn is None else ds.map(r.map_fn, **map_kwargs)
  return ds.batch(r.batch_size, drop_remainder=r.drop_remainder)
