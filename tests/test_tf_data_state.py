"""Exact resume of tf.data pipelines through TensorFlow's iterator checkpointing."""

import functools
import json
import os
from typing import Any

import numpy as np
import pytest
import scenarios_sources as ss
from helpers import check_each

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src.sources import tf_data_state

tf = pytest.importorskip("tensorflow")


# -- 2 processes x 4 devices: every case in one run (TensorFlow imports slowly) --


# `resume_cases` runs every case in the same processes and returns what each
# produced; the tests check the parts.
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


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("orbax.checkpoint")
  root = tmp_path_factory.mktemp("tf_state")
  # 40 examples on real TFRecord files (TFDS's mock cannot be checkpointed).
  ss.build_tiny_ids(str(root / "tfds"), 40, "tfrecord")
  outs = testing.values(
    testing.run_processes(
      resume_cases,
      num_processes=2,
      devices_per_process=4,
      args=(str(root / "ckpt"), str(root / "tfds")),
      timeout_s=420,
    )
  )
  return outs


def _real_ids(summary):
  return sorted(i for ids, m in zip(summary["ids"], summary["mask"]) for i, ok in zip(ids, m) if ok)


def check_tf_data_json_state_after_k_batches_resumes_shuffle_and_prefetch(cases, k):
  # Host 0: 6 batches, host 1: 4 (then masked dummies). k=3 leaves both
  # shuffle buffers partly consumed; k=5 is after host 1 ran out.
  for out in cases:
    got = out["json"][k]
    assert got["resumed"] == got["full"]
    assert got["lengths"] == [6, 6]
    assert got["full"]["consistent"]
    assert _real_ids(got["full"]) == list(range(sum(SIZES)))
    assert got["state_bytes"] < tf_data_state.JSON_STATE_LIMIT_BYTES
  assert cases[0]["json"][k]["full"] == cases[1]["json"][k]["full"]
  # Shuffled: not in id order.
  assert cases[0]["json"][k]["full"]["ids"][0][:8] != list(range(8))


def check_tf_data_state_every_n_on_a_host_that_ran_out_between_snapshots(cases):
  # `state_every=5`: host 1's dataset ended after read 4, and its dummy
  # batches carried read 4's state, which had no snapshot: get_state() at
  # batch 5 raised on host 1 alone. The end state is taken instead.
  for out in cases:
    got = out["every_5"]
    assert got["resumed"] == got["full"] and got["lengths"] == [6, 6]
    assert _real_ids(got["full"]) == list(range(sum(SIZES)))


def check_tf_data_orbax_checkpoint_manager_resumes_one_file_per_process(cases):
  for out in cases:
    got = out["orbax"]
    assert got["resumed"] == got["full"]
    assert got["lengths"] == [6, 6]
    assert [f for f in got["files"] if f.endswith(".json")] == [
      "process_0-of-2.json",
      "process_1-of-2.json",
    ]
  assert cases[0]["orbax"]["full"] == cases[1]["orbax"]["full"]


def check_tfds_pipeline_tf_data_reader_resumes(cases):
  for out in cases:
    got = out["tfds"]
    assert got["resumed"] == got["full"]
    assert got["lengths"][0] == got["lengths"][1] >= 10  # 2 epochs of 20 per host.
    real = sorted(i for ids, m in got["full"] for i, ok in zip(ids, m) if ok)
    assert real == sorted(list(range(40)) * 2)
    # The 10,000-slot default buffer is capped at the 20 examples of the
    # shard (unused slots would make the state 1.7 MB, over the JSON limit).
    assert got["state_bytes"] < 50_000
  assert cases[0]["tfds"]["full"] == cases[1]["tfds"]["full"]


UNCHECKPOINTABLE = {"py_function": "EagerPyFunc", "from_generator": "PyFunc", "tfds_mock": "PyFunc"}


def check_tf_data_uncheckpointable_pipeline_raises_naming_the_op(cases, name, op):
  for out in cases:
    message = out["errors"][name]
    assert message.startswith("RuntimeError: a tf.data.Dataset")
    assert f"cannot be checkpointed: it contains the op {op!r}" in message
    assert "ExternalStatePolicy.IGNORE" in message


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_tf_data_states_resume_across_two_processes(cases):
  # One launch (the `cases` fixture) runs every scenario; each case's own checks.
  calls = {
    f"json_k={k}": functools.partial(
      check_tf_data_json_state_after_k_batches_resumes_shuffle_and_prefetch, cases, k
    )
    for k in (3, 5)
  }
  calls["every_5"] = functools.partial(
    check_tf_data_state_every_n_on_a_host_that_ran_out_between_snapshots, cases
  )
  calls["orbax"] = functools.partial(
    check_tf_data_orbax_checkpoint_manager_resumes_one_file_per_process, cases
  )
  calls["tfds"] = functools.partial(check_tfds_pipeline_tf_data_reader_resumes, cases)
  for name, op in UNCHECKPOINTABLE.items():
    calls[f"errors/{name}"] = functools.partial(
      check_tf_data_uncheckpointable_pipeline_raises_naming_the_op, cases, name, op
    )
  check_each(calls)


# -- one process, in this interpreter ---------------------------------------------


def _pipeline(n=64, buffer=40):
  ds = tf.data.Dataset.range(n).shuffle(buffer, seed=7).map(lambda i: {"id": i})
  return ds.batch(8).prefetch(2)


def _ids(it):
  return [np.asarray(b["id"]).tolist() for b in it]


def _resume(state, make, **kwargs):
  with gjs.iter_jax_batches(make(), batch_size=8, **kwargs) as it:
    it.set_state(json.loads(json.dumps(state)))
    return _ids(it)


def test_tf_data_state_every_n_is_taken_only_after_multiples_of_n():
  full = _ids(gjs.iter_jax_batches(_pipeline(), batch_size=8))
  with gjs.iter_jax_batches(gjs.from_tf_data(_pipeline(), state_every=2), batch_size=8) as it:
    head = _ids([next(it)])
    with pytest.raises(RuntimeError, match=r"snapshot every 2 batches.*batch 1 read from it"):
      it.get_state()
    head += _ids([next(it)])
    state = it.get_state()
  assert state["source"]["reads"] == 2
  tail = _resume(state, lambda: gjs.from_tf_data(_pipeline(), state_every=2))
  assert head + tail == full and len(full) == 8


def test_tf_data_state_every_none_takes_no_snapshot_and_says_so():
  with gjs.iter_jax_batches(gjs.from_tf_data(_pipeline(), state_every=None), batch_size=8) as it:
    assert len(_ids(it)) == 8
    with pytest.raises(RuntimeError, match=r"`state_every=None`.*cannot be checkpointed"):
      it.get_state()


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_tf_data_state_every_must_be_positive_int_or_none(every):
  with pytest.raises(ValueError, match=r"`state_every` must be a positive int or None"):
    gjs.from_tf_data(_pipeline(), state_every=every)


def test_tf_data_state_from_another_pipeline_is_refused():
  with gjs.iter_jax_batches(_pipeline(), batch_size=8) as it:
    next(it)
    state = it.get_state()
  other = lambda: tf.data.Dataset.range(64).batch(8)  # noqa: E731
  with pytest.raises(ValueError, match=r"saved tf.data state does not fit"):
    _resume(state, other)


def test_tf_data_corrupt_state_is_refused_before_tensorflow_sees_it():
  # TensorFlow segfaults on some corrupt states; the checksum refuses them.
  with gjs.iter_jax_batches(_pipeline(), batch_size=8) as it:
    next(it)
    state = json.loads(json.dumps(it.get_state()))
  text = state["source"]["tf_data_iterator"]
  bad = text[:-8] + ("A" if text[-8] != "A" else "B") + text[-7:]
  state["source"]["tf_data_iterator"] = bad
  with pytest.raises(ValueError, match=r"state for a tf.data.Dataset .* is corrupt: its \d+ bytes"):
    _resume(state, _pipeline)


def test_tf_data_external_state_policy_set_on_the_dataset_is_respected():
  double = lambda x: tf.py_function(lambda y: y * 2, [x], tf.int64)  # noqa: E731
  options = tf.data.Options()
  options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
  ds = tf.data.Dataset.range(32).map(double).batch(8).with_options(options)
  with gjs.iter_jax_batches(ds, batch_size=8) as it:
    assert np.asarray(next(it)).tolist() == list(range(0, 16, 2))
    state = it.get_state()  # The user chose to save without the op's state.
  assert state["source"]["reads"] == 1
  with gjs.iter_jax_batches(ds, batch_size=8) as it:
    it.set_state(state)
    tail = [np.asarray(b).tolist() for b in it]
  assert tail == [list(range(16 * i, 16 * i + 16, 2)) for i in (1, 2, 3)]


def test_tf_data_state_after_set_state_is_the_restored_one():
  with gjs.iter_jax_batches(_pipeline(), batch_size=8) as it:
    next(it)
    state = json.loads(json.dumps(it.get_state()))
  with gjs.iter_jax_batches(_pipeline(), batch_size=8) as it:
    it.set_state(state)
    assert it.get_state() == state


def test_tf_data_state_over_json_limit_points_to_orbax_which_saves_it(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  # 6,000 buffered scalars: about 1.2 MB of serialized state.
  make_big = lambda: tf.data.Dataset.range(8000).shuffle(6000, seed=1).batch(1000)  # noqa: E731
  full = [np.asarray(b).tolist() for b in gjs.iter_jax_batches(make_big(), batch_size=1000)]
  it = gjs.iter_jax_batches(make_big(), batch_size=1000)
  head = [np.asarray(next(it)).tolist()]
  with pytest.raises(RuntimeError, match=r"over the 1048576-byte limit.*checkpoint_save"):
    it.get_state()
  mngr = ocp.CheckpointManager(tmp_path)
  mngr.save(1, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))
  mngr.wait_until_finished()
  it.close()
  fresh = gjs.iter_jax_batches(make_big(), batch_size=1000)
  mngr.restore(1, args=ocp.args.Composite(data=gjs.checkpoint_restore(fresh)))
  mngr.close()
  tail = [np.asarray(b).tolist() for b in fresh]
  fresh.close()
  assert head + tail == full and len(full) == 8
  saved = (tmp_path / "1" / "data" / "process_0-of-1.json").stat().st_size
  assert saved > tf_data_state.JSON_STATE_LIMIT_BYTES


def test_tf_data_slow_snapshots_warn_and_jax_sync_generator_takes_none(caplog):
  # 10,000 shuffle slots: about 100 ms or more per snapshot, over the 10 ms
  # warning threshold; the generator drop-in has no get_state(), so no cost.
  make = lambda: tf.data.Dataset.range(10_400).shuffle(10_000, seed=1).batch(8)  # noqa: E731
  warning = "snapshot of a tf.data.Dataset"
  with caplog.at_level("WARNING"):
    gen = gjs.jax_sync_generator(make(), drop_last=False, batch_size=8)
    got = [np.asarray(next(gen)).tolist() for _ in range(5)]
    gen.close()
  assert warning not in caplog.text
  with caplog.at_level("WARNING"), gjs.iter_jax_batches(make(), batch_size=8) as it:
    assert [np.asarray(next(it)).tolist() for _ in range(5)] == got
  assert warning in caplog.text and "state_every=N" in caplog.text
