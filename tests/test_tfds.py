"""tfds_pipeline: a TFDS name and split in, this process's batches out."""

import functools
import os
import sys
from typing import Any

import numpy as np
import pytest
import scenarios_sources as ss
from helpers import check_cases, run_cases

import grain_jax_sync as gjs
from grain_jax_sync._src.sources import tfds as tfds_source

tfds = pytest.importorskip("tensorflow_datasets")
PADDED = {"batch_size": 4, "paddings": 0, "mask_key": "mask"}


@pytest.mark.parametrize("n", [0, 1, 7, 13, 100])
@pytest.mark.parametrize("processes", [1, 2, 3, 8])
def test_shard_range_gives_every_example_to_exactly_one_process(n, processes):
  ranges = [tfds_source.shard_range(n, p, processes) for p in range(processes)]
  covered = [i for start, stop in ranges for i in range(start, stop)]
  assert covered == list(range(n))
  sizes = [stop - start for start, stop in ranges]
  assert max(sizes) - min(sizes) <= 1


def check_tfds_data_source_mock_two_processes_every_example_once(outs):
  # 13 mock mnist examples: shards of 6 and 7, so 2 batches on each host,
  # the second of 2 and 3 real rows, padded to 4 and masked.
  assert outs[0] == outs[1]
  out = outs[0]
  assert len(out["expected"]) == 13 and len(set(out["expected"])) == 13
  assert out["seen"] == out["expected"]  # Every example exactly once.
  assert out["batches"] == 2
  assert out["shapes"][0] == {"image": [8, 28, 28, 1], "label": [8], "mask": [8]}
  assert not out["tensorflow_imported"]  # ArrayRecord + Grain: no TensorFlow.


def test_tfds_pipeline_single_process_shuffles_with_seed_and_repeats():
  with tfds.testing.mock_data(num_examples=8, policy=tfds.testing.MockPolicy.USE_CODE):
    source = tfds.data_source("mnist", split="train")
    labels = [int(source[i]["label"]) for i in range(8)]

    def read(**kw):
      ds = gjs.tfds_pipeline("mnist", split="train", batch_size=8, **kw)
      return [b["label"].tolist() for b in ds]

    plain = read()
    assert plain == [labels]
    a = read(shuffle=True, seed=1, num_epochs=2)
    assert a == read(shuffle=True, seed=1, num_epochs=2)  # Deterministic.
    assert len(a) == 2 and all(sorted(e) == sorted(labels) for e in a)
    assert a != read(shuffle=True, seed=2, num_epochs=2)


def test_tfds_pipeline_elastic_reads_the_whole_split_and_resumes_from_the_list():
  with tfds.testing.mock_data(num_examples=40, policy=tfds.testing.MockPolicy.USE_CODE):
    source = tfds.data_source("mnist", split="train")
    images = sorted(int(source[i]["image"].sum()) for i in range(40))

    def pipeline():
      src = gjs.tfds_pipeline(
        "mnist", split="train", batch_size=8, shuffle=True, seed=1, num_epochs=2, elastic=True
      )
      return gjs.iter_jax_batches(src, batch_size=8, paddings=0, mask_key="mask")

    def sums(batches):
      return [int(x.sum()) for b in batches for x, m in zip(b["image"], b["mask"]) if m]

    it = pipeline()
    head = sums(b for _, b in zip(range(3), it))
    state = it.get_state()
    it.close()
    resumed = pipeline()
    resumed.set_state([state])
    seen = head + sums(resumed)
    assert sorted(seen) == sorted(images * 2)  # Both epochs, each example once per epoch.
    assert sorted(seen[:40]) == images and seen[:40] != sorted(seen[:40])  # Shuffled.
  with pytest.raises(ValueError, match="`elastic=True` needs reader='data_source'"):
    gjs.tfds_pipeline("mnist", split="train", batch_size=8, reader="tf_data", elastic=True)
  with pytest.raises(ValueError, match="splits the records over the processes itself"):
    gjs.tfds_pipeline("mnist", split="train", batch_size=8, process_count=2, elastic=True)


def test_tfds_pipeline_string_feature_raises_by_name_or_is_dropped():
  with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
    ds = gjs.tfds_pipeline("imdb_reviews", split="train", batch_size=8)
    it = gjs.iter_jax_batches(ds, batch_size=8)
    with it, pytest.raises(ValueError, match=r"column 'text': a string array"):
      next(it)
    ds = gjs.tfds_pipeline("imdb_reviews", split="train", batch_size=8, drop_unsupported=True)
    with gjs.iter_jax_batches(ds, batch_size=8) as it:
      got = list(it)
  assert [sorted(b) for b in got] == [["label"], ["label"]]


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"reader": "files"}, r"`reader` must be one of"),
    ({"batch_size": 0}, r"`batch_size` must be a positive int, got 0"),
    ({"num_epochs": 0}, r"`num_epochs` must be a positive int or None, got 0"),
    ({"process_index": 2, "process_count": 2}, r"`process_index` must be in \[0, 2\), got 2"),
  ],
)
def test_tfds_pipeline_checks_arguments(kwargs, message):
  args = {"split": "train", "batch_size": 8, **kwargs}
  with pytest.raises(ValueError, match=message):
    gjs.tfds_pipeline("mnist", **args)


def run_tfds_files(reader: str, data_dir: str, kwargs: dict[str, Any]) -> dict[str, Any]:
  """tfds_pipeline over the prepared "tiny_ids" files with either reader."""
  import sys

  ds = gjs.tfds_pipeline(
    "tiny_ids", split="train", batch_size=ss.BATCH, reader=reader, data_dir=data_dir, shuffle=True
  )
  ids, masks, xs_ok = [], [], True
  with gjs.iter_jax_batches(ds, **kwargs) as it:
    for b in it:
      g = ss.gather(b)
      ids.append(g["id"].tolist())
      masks.append(g["mask"].tolist())
      real = g["mask"]
      xs_ok = xs_ok and np.array_equal(g["x"][real], np.stack([g["id"], -g["id"]], 1)[real])
  return {
    "ids": ids,
    "mask": masks,
    "x_ok": bool(xs_ok),
    "tensorflow_imported": "tensorflow" in sys.modules,
  }


def check_tfds_real_files_two_processes_every_example_once(outs, reader):
  # TFDS's mock ignores sub-splits, so both readers are also checked on a
  # small real data set prepared here (13 examples: shards of 6 and 7).
  assert outs[0] == outs[1]
  out = outs[0]
  real = [i for ids, m in zip(out["ids"], out["mask"]) for i, ok in zip(ids, m) if ok]
  assert sorted(real) == list(range(13))
  assert out["x_ok"]
  assert len(out["ids"]) == 2
  assert out["tensorflow_imported"] == (reader == "tf_data")
  np.testing.assert_array_equal(np.array(out["mask"]).sum(), 13)


def check_tfds_train_example_runs_on_mock_data_and_checkpoints(outs, tmp_path):
  assert outs[0] == outs[1]
  # 100 examples: shards of 50, batches of 32 -> 2 steps, every example once.
  assert outs[0]["steps"] == 2 and outs[0]["examples"] == 100
  # It learns: from a uniform guess's ln 10 (zero weights) to well below it in one step.
  first, last = outs[0]["loss_first_last"]
  assert first == round(np.log(10), 4) and last < 0.8 * first
  data = tmp_path / "ckpt" / "2" / "data"
  assert sorted(p.name for p in data.glob("*.json")) == [
    "process_0-of-2.json",
    "process_1-of-2.json",
  ]


# -- real processes: every case in one launch, each with its own checks -----------------


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_tfds_readers_and_the_train_example_across_two_processes(tmp_path):
  pytest.importorskip("tensorflow")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from examples import tfds_train

  dirs = {"data_source": str(tmp_path / "array_record"), "tf_data": str(tmp_path / "tfrecord")}
  ss.build_tiny_ids(dirs["data_source"], 13, "array_record")
  ss.build_tiny_ids(dirs["tf_data"], 13, "tfrecord")
  # The cases that must not import TensorFlow come before the tf.data reader.
  train_kw = {"mock_examples": 100, "checkpoint_dir": str(tmp_path / "ckpt")}
  cases = {
    "mock_iter_jax_batches": (ss.run_tfds_mock, (13, PADDED), {"device_put": False}),
    "mock_device_put": (ss.run_tfds_mock, (13, PADDED), {"device_put": True}),
    "files_data_source": (run_tfds_files, ("data_source", dirs["data_source"], PADDED), {}),
    "files_tf_data": (run_tfds_files, ("tf_data", dirs["tf_data"], PADDED), {}),
    "train_example": (tfds_train.train, (), train_kw),
  }
  mock = check_tfds_data_source_mock_two_processes_every_example_once
  files = check_tfds_real_files_two_processes_every_example_once
  check_cases(
    run_cases(2, 4, cases, timeout_s=360),
    {
      "mock_iter_jax_batches": mock,
      "mock_device_put": mock,
      "files_data_source": functools.partial(files, reader="data_source"),
      "files_tf_data": functools.partial(files, reader="tf_data"),
      "train_example": functools.partial(
        check_tfds_train_example_runs_on_mock_data_and_checkpoints, tmp_path=tmp_path
      ),
    },
  )
