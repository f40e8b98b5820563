"""Scenarios for tf.data resume, run inside simulated hosts.

TensorFlow is slow to import, so one scenario, `resume_cases`, runs every
multi-process case in the same processes and returns what each produced; the
tests in test_tf_data_state.py check the parts.
"""

from __future__ import annotations

import json
import os
from typing import Any

import scenarios_sources as ss

SIZES = [45, 30]  # Examples per host: 6 and 4 batches of 8 (the last ones short).
BATCH = 8
KWARGS = {"batch_size": BATCH, "paddings": -1, "mask_key": "mask"}


def _example(i: Any) -> dict[str, Any]:
  """`scenarios_sources.make_example` traced by tf.data."""
  import tensorflow as tf

  return {
    "id": i,
    "feat": {"x": tf.cast(tf.stack([i, -i]), tf.float32)},
    "pair": (tf.cast(i, tf.int32), tf.cast(2 * i, tf.int32)),
  }


def shuffled_pipeline() -> Any:
  """This host's ids, a partly consumed shuffle buffer, parallel map, prefetch."""
  import tensorflow as tf

  ids = ss.my_ids(SIZES)
  ds = tf.data.Dataset.range(int(ids[0]), int(ids[-1]) + 1)
  ds = ds.shuffle(40, seed=7).map(_example, num_parallel_calls=2)
  return ds.batch(BATCH).prefetch(2)


def every_5() -> Any:
  """`shuffled_pipeline` with a snapshot every 5 batches: host 1 runs out after read 4."""
  import grain_jax_sync as gjs

  return gjs.from_tf_data(shuffled_pipeline(), state_every=5)


def _drain(it: Any) -> list[Any]:
  out = [ss.gather(b) for b in it]
  it.close()
  return out


def _head(it: Any, k: int) -> list[Any]:
  return [ss.gather(next(it)) for _ in range(k)]


def _streams(full: list[Any], resumed: list[Any], state: Any) -> dict[str, Any]:
  source = state["source"] if isinstance(state, dict) else None
  return {
    "full": ss.summarize(full),
    "resumed": ss.summarize(resumed),
    "lengths": [len(full), len(resumed)],
    "state_bytes": len(json.dumps(source)) if source is not None else None,
  }


def _json_resumed(make: Any, k: int, kwargs: dict[str, Any]) -> tuple[list, list, Any]:
  """(uninterrupted run, k batches + the rest after a JSON get_state/set_state, the state)."""
  import grain_jax_sync as gjs

  full = _drain(gjs.iter_jax_batches(make(), **kwargs))
  it = gjs.iter_jax_batches(make(), **kwargs)
  head = _head(it, k)
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  fresh = gjs.iter_jax_batches(make(), **kwargs)
  fresh.set_state(state)
  return full, head + _drain(fresh), state


def json_resume(make: Any, k: int, kwargs: dict[str, Any]) -> dict[str, Any]:
  """Uninterrupted run vs. k batches, get_state as JSON, set_state in a new pipeline."""
  return _streams(*_json_resumed(make, k, kwargs))


def orbax_resume(make: Any, k: int, kwargs: dict[str, Any], directory: str) -> dict[str, Any]:
  """The same through Orbax's CheckpointManager and `checkpoint_save`."""
  import orbax.checkpoint as ocp

  import grain_jax_sync as gjs

  full = _drain(gjs.iter_jax_batches(make(), **kwargs))
  it = gjs.iter_jax_batches(make(), **kwargs)
  head = _head(it, k)
  mngr = ocp.CheckpointManager(directory)
  mngr.save(k, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))
  mngr.wait_until_finished()
  mngr.close()
  it.close()
  fresh = gjs.iter_jax_batches(make(), **kwargs)
  mngr = ocp.CheckpointManager(directory)
  mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data=gjs.checkpoint_restore(fresh)))
  mngr.close()
  out = _streams(full, head + _drain(fresh), None)
  out["files"] = sorted(os.listdir(os.path.join(directory, str(k), "data")))
  return out


def _error_after_one_batch(ds: Any) -> str:
  import grain_jax_sync as gjs

  with gjs.iter_jax_batches(ds, batch_size=BATCH) as it:
    next(it)
    try:
      it.get_state()
    except Exception as e:  # noqa: BLE001 - returned to the test.
      return f"{type(e).__name__}: {e}"
  return "no error"


def uncheckpointable_errors() -> dict[str, str]:
  """get_state() after one batch of pipelines tf.data cannot save."""
  import tensorflow as tf
  import tensorflow_datasets as tfds

  import grain_jax_sync as gjs

  double = lambda x: tf.py_function(lambda y: y * 2, [x], tf.int64)  # noqa: E731
  spec = tf.TensorSpec([], tf.int64)
  out = {
    "py_function": _error_after_one_batch(tf.data.Dataset.range(32).map(double).batch(BATCH)),
    "from_generator": _error_after_one_batch(
      tf.data.Dataset.from_generator(lambda: iter(range(32)), output_signature=spec).batch(BATCH)
    ),
  }
  # TFDS's mock reads through Dataset.from_generator.
  with tfds.testing.mock_data(num_examples=32, policy=tfds.testing.MockPolicy.USE_CODE):
    ds = gjs.tfds_pipeline("mnist", split="train", batch_size=BATCH, reader="tf_data")
    out["tfds_mock"] = _error_after_one_batch(ds)
  return out


def tfds_pipeline_maker(data_dir: str) -> Any:
  import grain_jax_sync as gjs

  def make():
    return gjs.tfds_pipeline(
      "tiny_ids",
      split="train",
      batch_size=4,
      reader="tf_data",
      data_dir=data_dir,
      shuffle=True,
      seed=3,
      num_epochs=2,
    )

  return make


def tfds_streams(full: list[Any], resumed: list[Any]) -> dict[str, Any]:
  def ids(batches):
    return [(b["id"].tolist(), b["mask"].tolist()) for b in batches]

  return {"full": ids(full), "resumed": ids(resumed), "lengths": [len(full), len(resumed)]}


def tfds_resume(data_dir: str, k: int) -> dict[str, Any]:
  """tfds_pipeline(reader="tf_data") over prepared files: JSON resume after k."""
  make = tfds_pipeline_maker(data_dir)
  kwargs = {"batch_size": 4, "paddings": 0, "mask_key": "mask"}
  full, resumed, state = _json_resumed(make, k, kwargs)
  out = tfds_streams(full, resumed)
  out["state_bytes"] = len(json.dumps(state["source"]))
  return out


def resume_cases(directory: str, tfds_dir: str) -> dict[str, Any]:
  """Every multi-process tf.data resume case, in one set of processes.

  Args:
    directory: The Orbax checkpoint directory, the same on every process.
    tfds_dir: Where the test prepared the "tiny_ids" TFDS data set.
  """
  return {
    "json": {k: json_resume(shuffled_pipeline, k, KWARGS) for k in (3, 5)},
    # At batch 5 host 1 is on dummies after read 4, between two snapshots.
    "every_5": json_resume(every_5, 5, KWARGS),
    "orbax": orbax_resume(shuffled_pipeline, 3, KWARGS, directory),
    "errors": uncheckpointable_errors(),
    "tfds": tfds_resume(tfds_dir, 3),
  }
