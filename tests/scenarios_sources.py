"""Scenarios for the source adapters, run inside simulated hosts.

Module-level functions only (each process imports this file). Examples carry
a global id so that a test can check that every example of the data set
appears exactly once among the unmasked rows. TensorFlow and TFDS are imported
only by the scenarios that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

BATCH = 4


# -- examples -------------------------------------------------------------------


def make_example(i: Any) -> dict[str, Any]:
  """A nested element: dict of dict and tuple, identified by `id`."""
  i = int(i)
  return {
    "id": np.int64(i),
    "feat": {"x": np.array([i, -i], dtype=np.float32)},
    "pair": (np.int32(i), np.int32(2 * i)),
  }


def my_ids(sizes: list[int]) -> np.ndarray:
  """This process's global example ids: a contiguous range of `sizes`."""
  import jax

  p = jax.process_index()
  start = sum(sizes[:p])
  return np.arange(start, start + sizes[p], dtype=np.int64)


def gather(tree: Any) -> Any:
  import jax
  from jax.experimental import multihost_utils

  return jax.tree_util.tree_map(
    lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree
  )


def summarize(batches: list[Any]) -> dict[str, Any]:
  """Per batch: ids, mask and a check that every leaf matches its id."""
  out = {"ids": [], "mask": [], "consistent": True}
  for b in batches:
    ids = b["id"]
    out["ids"].append(ids.tolist())
    out["mask"].append(b["mask"].tolist() if "mask" in b else [True] * len(ids))
    real = np.asarray(out["mask"][-1], dtype=bool)
    ok = np.array_equal(b["feat"]["x"][real], np.stack([ids, -ids], 1)[real].astype(np.float32))
    ok = ok and np.array_equal(b["pair"][0][real], ids[real].astype(np.int32))
    ok = ok and np.array_equal(b["pair"][1][real], (2 * ids[real]).astype(np.int32))
    ok = ok and isinstance(b["pair"], tuple)
    out["consistent"] = bool(out["consistent"] and ok)
  return out


# -- Grain pipelines --------------------------------------------------------------


def grain_source(kind: str, sizes: list[int], *, shuffle: bool = True) -> Any:
  """This process's Grain pipeline of batches.

  Args:
    kind: "dataloader", "iterdataset", "mapdataset" or "iterdataset_raw"
      (a started `DatasetIterator`).
    sizes: Examples per process; process p holds the ids
      ``[sum(sizes[:p]), sum(sizes[:p + 1]))``.
    shuffle: Shuffle with a fixed seed.
  """
  import grain

  if kind == "dataloader":
    # Each host's own records (a per-host file, say). Grain 0.2.18's
    # ShardByJaxProcess(drop_remainder=False) still drops the remainder
    # (`len = records // shards`), so uneven shards are built here.
    ids = my_ids(sizes).tolist()
    sampler = grain.samplers.IndexSampler(
      num_records=len(ids),
      shard_options=grain.sharding.NoSharding(),
      shuffle=shuffle,
      num_epochs=1,
      seed=7,
    )
    return grain.DataLoader(
      data_source=ids,
      sampler=sampler,
      operations=[_to_example(), grain.transforms.Batch(BATCH)],
      worker_count=0,
    )
  ds = grain.MapDataset.source(my_ids(sizes).tolist())
  if shuffle:
    ds = ds.shuffle(seed=11)
  ds = ds.map(make_example)
  if kind == "mapdataset":
    return ds.batch(BATCH)
  ds = ds.to_iter_dataset().batch(BATCH)
  if kind == "iterdataset_raw":
    return iter(ds)
  return ds


def _to_example() -> Any:
  """`make_example` as a grain.transforms.Map (Grain imported lazily)."""
  import grain

  class ToExample(grain.transforms.Map):
    def map(self, element):
      return make_example(element)

  return ToExample()


# -- resume ----------------------------------------------------------------------


def _pipeline(kind: str, sizes: list[int], kwargs: dict[str, Any]) -> Any:
  """A fresh iterator of `kind` over this process's data."""
  import grain_jax_sync as gjs

  if kind == "device_put":
    return iter(gjs.device_put(grain_source("iterdataset", sizes), **kwargs))
  return gjs.iter_jax_batches(grain_source(kind, sizes), **kwargs)


def _close(it: Any) -> None:
  close = getattr(it, "close", None)
  if callable(close):
    close()


def resume(kind: str, sizes: list[int], k: int, kwargs: dict[str, Any]) -> dict[str, Any]:
  """Uninterrupted run vs. k batches + get_state + set_state in a fresh pipeline."""
  full_it = _pipeline(kind, sizes, kwargs)
  full = [gather(b) for b in full_it]
  _close(full_it)

  first_it = _pipeline(kind, sizes, kwargs)
  head = []
  for b in first_it:
    head.append(gather(b))
    if len(head) == k:
      break
  state = json.loads(json.dumps(first_it.get_state()))  # As a checkpoint would.
  _close(first_it)

  second_it = _pipeline(kind, sizes, kwargs)
  second_it.set_state(state)
  tail = [gather(b) for b in second_it]
  _close(second_it)
  return {
    "full": summarize(full),
    "resumed": summarize(head + tail),
    "head": len(head),
    "state_keys": sorted(state),
  }


def orbax_resume(kind: str, sizes: list[int], k: int, kwargs: dict[str, Any], directory: str):
  """The same through Orbax's CheckpointManager and Grain's handler, on disk."""
  import grain
  import orbax.checkpoint as ocp

  import grain_jax_sync as gjs

  full_it = _pipeline(kind, sizes, kwargs)
  full = [gather(b) for b in full_it]
  _close(full_it)

  def save_args(it):
    if kind == "device_put":  # A grain.DatasetIterator: Grain's own args.
      return grain.checkpoint.CheckpointSave(it)
    return gjs.checkpoint_save(it)

  def restore_args(it):
    if kind == "device_put":
      return grain.checkpoint.CheckpointRestore(it)
    return gjs.checkpoint_restore(it)

  it = _pipeline(kind, sizes, kwargs)
  head = []
  for b in it:
    head.append(gather(b))
    if len(head) == k:
      break
  mngr = ocp.CheckpointManager(directory)
  mngr.save(k, args=ocp.args.Composite(data=save_args(it)))
  mngr.wait_until_finished()
  _close(it)
  mngr.close()

  mngr = ocp.CheckpointManager(directory)
  fresh = _pipeline(kind, sizes, kwargs)
  step = mngr.latest_step()
  mngr.restore(step, args=ocp.args.Composite(data=restore_args(fresh)))
  mngr.close()
  tail = [gather(b) for b in fresh]
  _close(fresh)
  files = sorted(os.listdir(os.path.join(directory, str(step), "data")))
  return {
    "full": summarize(full),
    "resumed": summarize(head + tail),
    "step": step,
    "files": files,
  }


# -- tf.data ---------------------------------------------------------------------


# -- TFDS ------------------------------------------------------------------------


def example_key(image: np.ndarray, label: Any) -> str:
  return hashlib.sha1(np.ascontiguousarray(image).tobytes() + str(int(label)).encode()).hexdigest()


def run_tfds_mock(num_examples: int, kwargs: dict[str, Any], *, device_put: bool = False):
  """tfds_pipeline over TFDS's mock mnist (data_source reader, no TensorFlow)."""
  import sys

  import tensorflow_datasets as tfds

  import grain_jax_sync as gjs

  with tfds.testing.mock_data(num_examples=num_examples, policy=tfds.testing.MockPolicy.USE_CODE):
    source = tfds.data_source("mnist", split="train")
    expected = sorted(
      example_key(source[i]["image"], source[i]["label"]) for i in range(len(source))
    )
    ds = gjs.tfds_pipeline("mnist", split="train", batch_size=BATCH, shuffle=True, seed=5)
    if device_put:
      it = iter(gjs.device_put(ds, **kwargs))
    else:
      it = gjs.iter_jax_batches(ds, **kwargs)
    keys, shapes = [], []
    for b in it:
      g = gather(b)
      shapes.append({k: list(v.shape) for k, v in g.items()})
      for img, label, m in zip(g["image"], g["label"], g["mask"]):
        if m:
          keys.append(example_key(img, label))
    it.close()
  return {
    "expected": expected,
    "seen": sorted(keys),
    "batches": len(shapes),
    "shapes": shapes,
    "tensorflow_imported": "tensorflow" in sys.modules,
  }


def build_tiny_ids(data_dir: str, num_examples: int, file_format: str) -> None:
  """Prepares a real TFDS data set "tiny_ids" ({"id", "x"}) under `data_dir`.

  Used where TFDS's mock cannot serve: `mock_data` ignores sub-splits, so the
  tf.data reader's `tfds.even_splits` shards can only be checked on real
  files. Needs TensorFlow (TFDS serializes examples with it).
  """
  import tensorflow_datasets as tfds

  class TinyIds(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    name = "tiny_ids"

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
          {"id": np.int64, "x": tfds.features.Tensor(shape=(2,), dtype=np.float32)}
        ),
      )

    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for i in range(num_examples):
        yield i, {"id": i, "x": np.array([i, -i], np.float32)}

  TinyIds(data_dir=data_dir, file_format=file_format).download_and_prepare()
