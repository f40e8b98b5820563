"""tf.data sources, and the core without TensorFlow installed."""

import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import scenarios_sources as ss

import grain_jax_sync as gjs
from grain_jax_sync import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tf():
  return pytest.importorskip("tensorflow")


def run_tf(sizes: list[int], kwargs: dict[str, Any]) -> dict[str, Any]:
  import tensorflow as tf

  ids = ss.my_ids(sizes)
  ds = tf.data.Dataset.from_tensor_slices(
    {
      "id": ids,
      "feat": {"x": np.stack([ids, -ids], 1).astype(np.float32)},
      "pair": (ids.astype(np.int32), (2 * ids).astype(np.int32)),
    }
  ).batch(ss.BATCH)
  with gjs.iter_jax_batches(ds, **kwargs) as it:
    batches = [ss.gather(b) for b in it]
  return ss.summarize(batches)


@pytest.mark.multiprocess
def test_tf_data_two_processes_uneven_shards_every_example_once(tf):
  sizes = [13, 6]
  outs = testing.values(
    testing.run_processes(
      run_tf,
      num_processes=2,
      devices_per_process=4,
      args=(sizes, {"batch_size": 4, "paddings": 0, "mask_key": "mask"}),
      timeout_s=180,
    )
  )
  assert outs[0] == outs[1]
  out = outs[0]
  assert out["consistent"]  # Nested dict and tuple columns kept together.
  real = [i for ids, m in zip(out["ids"], out["mask"]) for i, ok in zip(ids, m) if ok]
  assert sorted(real) == list(range(sum(sizes)))
  assert len(out["ids"]) == 4
  assert out["mask"][3] == [True] + [False] * 7


def _bad_dataset(tf):
  return tf.data.Dataset.from_tensor_slices(
    {
      "x": np.arange(16, dtype=np.float32),
      "text": np.array([b"a"] * 16),
      "meta": {"ragged": tf.ragged.constant([[1]] * 8 + [[1, 2]] * 8)},
    }
  ).batch(8)


def test_tf_data_ragged_and_string_columns_raise_naming_each(tf):
  with pytest.raises(
    ValueError, match=r"'meta/ragged' is a ragged tensor; column 'text' is a string"
  ):
    gjs.iter_jax_batches(_bad_dataset(tf), batch_size=8)


def test_tf_data_sparse_column_raises(tf):
  ds = tf.data.Dataset.from_tensor_slices(
    {"x": np.arange(8.0), "s": tf.sparse.from_dense(np.eye(8))}
  ).batch(8)
  with pytest.raises(ValueError, match=r"column 's' is a sparse tensor.*drop_unsupported=True"):
    gjs.iter_jax_batches(ds, batch_size=8)


def test_tf_data_drop_unsupported_keeps_only_dense_numeric_columns(tf):
  src = gjs.from_tf_data(_bad_dataset(tf), drop_unsupported=True)
  with gjs.iter_jax_batches(src, batch_size=8) as it:
    got = [{k: np.asarray(v) for k, v in b.items()} for b in it]
  assert [sorted(b) for b in got] == [["x"], ["x"]]  # "meta" held only the ragged column.
  np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), np.arange(16.0))


def test_tf_data_drop_unsupported_cannot_drop_a_tuple_position(tf):
  ds = tf.data.Dataset.from_tensor_slices((np.arange(8), np.array([b"a"] * 8))).batch(8)
  with pytest.raises(ValueError, match=r"dict entries only.*\['1'\]"):
    gjs.from_tf_data(ds, drop_unsupported=True)


def test_tf_data_tuple_elements_and_bare_tensors(tf):
  ds = tf.data.Dataset.from_tensor_slices((np.arange(16), np.arange(16.0) * 2)).batch(8)
  with gjs.iter_jax_batches(ds, batch_size=8) as it:
    got = [tuple(np.asarray(x) for x in b) for b in it]
  assert len(got) == 2 and all(isinstance(b, tuple) for b in got)
  np.testing.assert_array_equal(got[1][0], np.arange(8, 16))
  np.testing.assert_array_equal(got[1][1], np.arange(8, 16) * 2.0)


def test_tf_data_unbatched_elements_raise_with_batch_hint(tf):
  ds = tf.data.Dataset.from_tensor_slices({"x": np.arange(16)})
  it = gjs.iter_jax_batches(ds, batch_size=8)
  with it, pytest.raises(ValueError, match=r"column 'x': 0-d leaf.*tf\.data's `\.batch\(n\)`"):
    next(it)


def test_from_tf_data_rejects_other_objects():
  with pytest.raises(ValueError, match=r"`dataset` must be a tf.data.Dataset, got list"):
    gjs.from_tf_data([1, 2])


def test_import_and_plain_iterable_work_without_tensorflow_grain_or_tfds():
  code = textwrap.dedent(
    """
    import sys
    for name in ("tensorflow", "tensorflow_datasets", "grain", "orbax", "array_record"):
      sys.modules[name] = None  # `import name` now raises ImportError.
    import numpy as np
    import grain_jax_sync as gjs
    batches = [{"x": np.arange(8) + 8 * i} for i in range(3)]
    with gjs.iter_jax_batches(batches, batch_size=8) as it:
      got = [np.asarray(b["x"]).tolist() for b in it]
      state = it.get_state()
    assert got == [list(range(8 * i, 8 * i + 8)) for i in range(3)], got
    assert state["source"] == {"index": 3}, state
    print("ok", sorted(m for m in ("tensorflow", "grain") if sys.modules.get(m) is not None))
    """
  )
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip() == "ok []"


def test_tf_data_reset_reopens_the_dataset_from_its_start(tf):
  ds = tf.data.Dataset.range(32).batch(8).map(lambda x: {"x": x})
  it = gjs.iter_jax_batches(ds, batch_size=8)
  first = [np.asarray(next(it)["x"])[0] for _ in range(2)]
  it.reset()
  assert [np.asarray(b["x"])[0] for b in it] == [0, 8, 16, 24] and first == [0, 8]
  it.close()
