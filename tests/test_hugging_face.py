"""Hugging Face `datasets` sources and `hf_pipeline`, on real processes over local files.

Each multi-process test runs one job that goes through several scenarios
(`hf_job`): a process launch costs more than the scenarios themselves.
"""

import inspect
import json
import os
from collections import Counter
from typing import Any

import numpy as np
import pytest

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src.sources import hugging_face

datasets = pytest.importorskip("datasets")
ocp = pytest.importorskip("orbax.checkpoint")

N = 45  # Rows 0..44; with the filter, hosts hold different numbers of them.
BATCH = 4
DROPPED = range(30, 40)  # The filter's: the last shard of 2 (or 4) loses most rows.
BUCKETS = [4, 8]
PAD_SHAPES = {"tokens": 1, "tokens_mask": 1}


def keep(row: Any) -> bool:
  return int(row["id"]) not in DROPPED


def kept() -> list[int]:
  return [i for i in range(N) if i not in DROPPED]


def write_files(directory: str) -> dict[str, str]:
  """A parquet and a JSON-lines copy of the rows: an id, variable-length tokens, a float."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = [{"id": i, "tokens": [i] * (1 + i % 6), "x": 0.5 * i} for i in range(N)]
  paths = {"parquet": os.path.join(directory, "rows.parquet")}
  pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
  paths["json"] = os.path.join(directory, "rows.jsonl")
  with open(paths["json"], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return paths


def pipeline(paths: dict[str, str], kind: str, mesh: Any = None, **kwargs: Any) -> Any:
  """The iterator every scenario reads: shuffled, filtered, 2 epochs, bucketed tokens."""
  streaming = kind == "json"
  src = gjs.hf_pipeline(
    kind,
    data_files=paths[kind],
    streaming=streaming,
    load_kwargs={"cache_dir": os.path.join(os.path.dirname(paths[kind]), "hf_cache")},
    batch_size=BATCH,
    shuffle=True,
    shuffle_buffer_size=8,
    seed=3,
    num_epochs=kwargs.pop("num_epochs", 2),
    filter_fn=keep,
    pad_id=-1,
    mesh=mesh,
    **kwargs,
  )
  return gjs.iter_jax_batches(
    src,
    mesh=mesh,
    batch_size=BATCH,
    paddings=0,
    mask_key="mask",
    pad_shapes=PAD_SHAPES,
    shape_buckets={"tokens": BUCKETS, "tokens_mask": BUCKETS},
  )


def gathered(it: Any, steps: int | None = None) -> list[dict[str, list[Any]]]:
  """Up to `steps` global batches, gathered to every host as lists."""
  import jax
  from jax.experimental import multihost_utils

  out = []
  for b in it:
    g = jax.tree_util.tree_map(
      lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), b
    )
    out.append({k: v.tolist() for k, v in g.items()})
    if len(out) == steps:
      break
  return out


def _manager(directory: str) -> Any:
  return ocp.CheckpointManager(directory)


def resumed(paths: dict[str, str], kind: str, k: int, via: str, ckpt: str) -> list[Any]:
  """The batches after `k`, read by a new iterator restored from a JSON or Orbax state."""
  it = pipeline(paths, kind)
  gathered(it, k)
  if via == "json":
    state = json.loads(json.dumps(it.get_state()))
  else:
    mngr = _manager(ckpt)
    mngr.save(k, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))
    mngr.wait_until_finished()
  it.close()
  it = pipeline(paths, kind)
  if via == "json":
    it.set_state(state)
  else:
    mngr.restore(k, args=ocp.args.Composite(data=gjs.checkpoint_restore(it)))
    mngr.close()
  with it:
    return gathered(it)


def mismatched_column(directory: str) -> str:
  """Each host's own `Dataset`; process 1's column 'x' is float, the others' int."""
  import jax

  p = jax.process_index()
  x = np.arange(6, dtype=np.float32 if p == 1 else np.int64)
  ds = datasets.Dataset.from_dict({"id": np.arange(6), "x": x})
  src = gjs.hf_pipeline(ds, batch_size=BATCH, process_index=0, process_count=1)
  try:
    with gjs.iter_jax_batches(src, batch_size=BATCH, paddings=0, mask_key="mask") as it:
      gathered(it)
  except ValueError as e:
    return str(e)
  return "no error"


def unbatched_error() -> tuple[str, str]:
  """A `Dataset` passed as is whose items are rows, not batches: the error's type and message."""
  ds = datasets.Dataset.from_dict(
    {"id": np.arange(16, dtype=np.int32), "x": np.ones((16, 3), np.float32)}
  )
  try:
    with gjs.iter_jax_batches(ds.with_format("numpy"), batch_size=BATCH) as it:
      next(it)
  except Exception as e:  # noqa: BLE001 - returned to the test.
    return type(e).__name__, str(e)
  return "none", "no error"


def hf_job(paths: dict[str, str], directory: str) -> dict[str, Any]:
  """Every scenario of one job; saves elastic and streaming checkpoints at batch 2."""
  import jax

  out: dict[str, Any] = {"mismatch": mismatched_column(directory), "unbatched": unbatched_error()}
  if jax.process_count() == 4:  # A model axis across processes 0-1 and 2-3: they share rows.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    out["shard"] = list(gjs.data_shard_info(mesh))
    with pipeline(paths, "parquet", mesh=mesh) as it:
      out["shared"] = gathered(it)
  for kind in ("parquet", "json"):
    with pipeline(paths, kind) as it:
      out[kind] = gathered(it)
    for via in ("json", "orbax"):
      ckpt = os.path.join(directory, f"{kind}_{via}_ckpt")
      out[f"{kind}_{via}"] = resumed(paths, kind, 3, via, ckpt)
  for kind, kwargs in (("parquet", {"elastic": True, "num_epochs": 1}), ("json", {})):
    it = pipeline(paths, kind, **kwargs)
    out[f"saved_{kind}"] = gathered(it, 2)
    mngr = _manager(os.path.join(directory, f"resize_{kind}"))
    mngr.save(2, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))
    mngr.wait_until_finished()
    it.close()
  return out


def resize_job(paths: dict[str, str], directory: str) -> dict[str, Any]:
  """On another process count: the elastic map-style checkpoint resumes, streaming refuses."""
  out: dict[str, Any] = {}
  for kind, kwargs in (("parquet", {"elastic": True, "num_epochs": 1}), ("json", {})):
    it = pipeline(paths, kind, **kwargs)
    mngr = _manager(os.path.join(directory, f"resize_{kind}"))
    try:
      mngr.restore(2, args=ocp.args.Composite(data=gjs.checkpoint_restore(it)))
      out[kind] = gathered(it)
    except ValueError as e:
      out[kind] = str(e)
    it.close()
    mngr.close()
  return out


def real_ids(batches: list[Any], processes: int, p: int | None = None) -> list[int]:
  """The unmasked ids, in order; only process `p`'s rows if given."""
  ids = []
  for b in batches:
    for row, (i, m) in enumerate(zip(b["id"], b["mask"], strict=True)):
      if m and (p is None or row // BATCH == p):
        ids.append(i)
  return ids


def check_batches(batches: list[Any], processes: int) -> None:
  """Shapes, pads and masks: tokens are the id repeated, bucketed, masked past their length."""
  for b in batches:
    assert len(b["id"]) == BATCH * processes
    width = len(b["tokens"][0])
    assert width in BUCKETS
    for i, m, tokens, tmask, x in zip(
      b["id"], b["mask"], b["tokens"], b["tokens_mask"], b["x"], strict=True
    ):
      n = 1 + i % 6 if m else 0
      assert tmask == [True] * n + [False] * (width - n)
      assert tokens[:n] == [i] * n
      assert x == (0.5 * i if m else 0)


def check_job(out: dict[str, Any], processes: int) -> None:
  for kind in ("parquet", "json"):
    full = out[kind]
    check_batches(full, processes)
    assert Counter(real_ids(full, processes)) == Counter({i: 2 for i in kept()})
    for via in ("json", "orbax"):
      assert out[f"{kind}_{via}"] == full[3:], (kind, via)  # Exact: values, pads, masks.
  # Map-style: each host's rows are its contiguous share, in a new order each epoch.
  counts = []
  for p in range(processes):
    ids = real_ids(out["parquet"], processes, p)
    half = len(ids) // 2
    assert sorted(ids[:half]) == sorted(ids[half:]) and ids[:half] != ids[half:]
    counts.append(half)
  assert len(set(counts)) > 1  # Hosts hold different numbers of rows.
  assert "column 'x'" in out["mismatch"] and "float32" in out["mismatch"]
  check_unbatched(out["unbatched"])


def check_unbatched(error: tuple[str, str]) -> None:
  """docs/sources.md's error for unbatched elements: a ValueError naming the column, with the hint."""
  kind, message = error
  assert kind == "ValueError", error
  assert "column 'id': 0-d leaf (a scalar of dtype int32)" in message
  assert "Batch the elements first" in message


def _strip_process(message: str) -> str:
  return message.split(": ", 1)[1] if message.startswith("process ") else message


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_hf_2x4_every_row_once_exact_resume_then_3x2_elastic_resume_and_streaming_refusal(
  tmp_path,
):
  paths = write_files(str(tmp_path))
  outs = testing.values(
    testing.run_processes(
      hf_job, num_processes=2, devices_per_process=4, args=(paths, str(tmp_path)), timeout_s=200
    )
  )
  assert outs[0] == outs[1]
  check_job(outs[0], 2)
  assert len({_strip_process(o["mismatch"]) for o in outs}) == 1  # The same error everywhere.
  assert outs[0]["unbatched"][1].startswith("process 0, batch 0,")  # Named on every host.
  resized = testing.values(
    testing.run_processes(
      resize_job, num_processes=3, devices_per_process=2, args=(paths, str(tmp_path)), timeout_s=120
    )
  )
  assert all(r["parquet"] == resized[0]["parquet"] for r in resized)
  # Elastic: the 2 batches before the resize and every batch after hold each kept row once.
  check_batches(resized[0]["parquet"], 3)
  seen = real_ids(outs[0]["saved_parquet"], 2) + real_ids(resized[0]["parquet"], 3)
  assert Counter(seen) == Counter(kept())
  # Streaming on another count: the documented error, the same on every host.
  errors = {_strip_process(r["json"]) for r in resized}
  assert len(errors) == 1
  (error,) = errors
  assert "cannot be re-split over another process count" in error
  assert "the states are from 2 processes, this job has 3" in error


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_hf_4x2_every_row_once_and_exact_resume_map_style_and_streaming(tmp_path):
  paths = write_files(str(tmp_path))
  outs = testing.values(
    testing.run_processes(
      hf_job, num_processes=4, devices_per_process=2, args=(paths, str(tmp_path)), timeout_s=200
    )
  )
  assert [o.pop("shard") for o in outs] == [[0, 2], [0, 2], [1, 2], [1, 2]]
  assert all(o == outs[0] for o in outs)
  check_job(outs[0], 4)
  # Under the mesh, 2 input shards of 4 rows a batch: every kept row once an epoch.
  assert Counter(real_ids(outs[0]["shared"], 2)) == Counter({i: 2 for i in kept()})


def test_collate_pads_ragged_columns_and_keeps_fixed_ones_uncopied():
  ids = np.arange(3)
  t = np.array([np.ones(2), np.ones(1), np.ones(3)], dtype=object)
  out = hugging_face.collate({"id": ids, "t": t}, ragged=["t"])
  assert out["id"] is ids
  assert out["t"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
  assert out["t_mask"].sum(axis=1).tolist() == [2, 1, 3]
  rows = [{"a": np.int32(1), "t": np.arange(2)}, {"a": np.int32(2), "t": np.arange(2)}]
  out = hugging_face.collate(rows, ragged=["t"])  # Equal lengths: still padded and masked.
  assert out["a"].tolist() == [1, 2] and out["t_mask"].all()
  assert "t_mask" not in hugging_face.collate(rows)
  with pytest.raises(ValueError, match="column 't' has rows of different shapes.*ragged_columns"):
    hugging_face.collate({"t": t})


def test_unbatched_dataset_passed_as_is_raises_the_documented_error_one_process():
  check_unbatched(unbatched_error())


def test_arrow_columns_are_views_of_arrow_buffers_where_the_type_allows():
  import pyarrow as pa

  table = pa.table(
    {
      "x": pa.array(np.arange(10, dtype=np.float32)),
      "fixed": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(30, dtype=np.int32)), 3),
      "ragged": pa.array([[i] * (i % 3) for i in range(10)], pa.list_(pa.int32())),
    }
  ).slice(2, 5)
  cols = hugging_face.arrow_columns(table)
  assert np.shares_memory(cols["x"], table.column("x").chunk(0).to_numpy())
  assert cols["fixed"].shape == (5, 3) and cols["fixed"][0].tolist() == [6, 7, 8]
  assert np.shares_memory(cols["fixed"], table.column("fixed").chunk(0).values.to_numpy())
  assert [r.tolist() for r in cols["ragged"]] == [[2, 2], [], [4], [5, 5], []]


def test_dataset_passed_as_is_resumes_by_position_and_streaming_through_state_dict():
  ds = datasets.Dataset.from_dict({"id": np.arange(32)})

  def read(source, state=None):
    with gjs.iter_jax_batches(source, batch_size=8) as it:
      if state is not None:
        it.set_state(state)
      head = [b["id"].tolist() for b in (next(it),)] if state is None else []
      return head, it.get_state(), [b["id"].tolist() for b in it]

  for source in (ds.batch(8), ds.to_iterable_dataset(num_shards=2).batch(8)):
    head, state, rest = read(source)
    assert head + rest == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    _, _, again = read(source, json.loads(json.dumps(state)))
    assert again == rest  # Resumed after the first batch.


def test_device_put_takes_an_hf_pipeline_and_resumes_it_exactly():
  ds = datasets.Dataset.from_dict(
    {"id": np.arange(30), "t": [[i] * (1 + i % 3) for i in range(30)]}
  )
  options = {
    "batch_size": 8,
    "paddings": 0,
    "mask_key": "mask",
    "pad_shapes": {"t": 1, "t_mask": 1},
  }

  def stream():
    return iter(gjs.device_put(gjs.hf_pipeline(ds, batch_size=8, shuffle=True), **options))

  def ids(it):
    return [int(i) for b in it for i, m in zip(b["id"], b["mask"], strict=True) if m]

  it = stream()
  head = ids([next(it)])
  state = json.loads(json.dumps(it.get_state()))
  rest = ids(it)
  assert sorted(head + rest) == list(range(30))
  it = stream()
  it.set_state(state)
  assert ids(it) == rest


def test_streaming_pipeline_resumed_then_reset_starts_over(tmp_path):
  paths = write_files(str(tmp_path))
  src = gjs.hf_pipeline(
    "json",
    data_files=paths["json"],
    streaming=True,
    batch_size=BATCH,
    shuffle=True,
    shuffle_buffer_size=8,
  )

  def stream():
    return gjs.iter_jax_batches(
      src, batch_size=8, pad_shapes=PAD_SHAPES, paddings=0, mask_key="mask"
    )

  def ids(it):
    return [b["id"].tolist() for b in it]

  with stream() as it:
    full = ids(it)
  with stream() as it:
    head = ids(next(it) for _ in range(3))
    state = json.loads(json.dumps(it.get_state()))
  with stream() as it:
    it.set_state(state)
    assert head + ids(it) == full
    it.reset()  # The data set keeps no state of the resume.
    assert ids(it) == full


def test_hf_pipeline_checks_its_arguments():
  ds = datasets.Dataset.from_dict({"id": np.arange(4)})
  with pytest.raises(ValueError, match="`dataset` must be a datasets.Dataset"):
    gjs.hf_pipeline([1, 2], batch_size=2)
  with pytest.raises(ValueError, match="`elastic=True` needs a map-style"):
    gjs.hf_pipeline(ds.to_iterable_dataset(), batch_size=2, elastic=True)
  with pytest.raises(ValueError, match="`num_epochs` must be"):
    gjs.hf_pipeline(ds, batch_size=2, num_epochs=0)


def test_a_streaming_source_closes_the_generator_it_reads():
  # A streaming dataset's generator holds its open shard files until it is
  # closed; `close()` closes it, not the garbage collector at some later time.
  ds = datasets.Dataset.from_dict({"id": np.arange(16)}).to_iterable_dataset(num_shards=2)
  source = hugging_face._Streaming(ds.batch(4))
  assert collate_ids(next(source)) == [0, 1, 2, 3]
  reading = source._it
  assert inspect.getgeneratorstate(reading) == inspect.GEN_SUSPENDED
  source.close()
  assert inspect.getgeneratorstate(reading) == inspect.GEN_CLOSED


def collate_ids(batch: dict[str, Any]) -> list[int]:
  return np.asarray(batch["id"]).tolist()


def test_map_fn_returns_the_row_in_streaming_as_in_map_style(tmp_path):
  # `IterableDataset.map` merges the returned row into the input row: a
  # streaming pipeline kept the columns `map_fn` left out (here a string
  # column, which then raised), where map-style and elastic yield its row.
  rows = [{"id": i, "text": f"t{i}"} for i in range(10)]
  path = str(tmp_path / "rows.jsonl")
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)

  def double(row):
    return {"id": row["id"], "twice": 2 * row["id"]}

  def read(src):
    with gjs.iter_jax_batches(src, batch_size=8, paddings=0, mask_key="mask") as it:
      return [{k: v.tolist() for k, v in b.items()} for b in it]

  generated = datasets.IterableDataset.from_generator(lambda: iter(rows))  # No features.
  map_style = read(gjs.hf_pipeline("json", data_files=path, batch_size=8, map_fn=double))
  assert set(map_style[0]) == {"id", "twice", "mask"}
  for ds in ("json", generated):
    kwargs = {"data_files": path, "streaming": True} if ds == "json" else {}
    assert read(gjs.hf_pipeline(ds, batch_size=8, map_fn=double, **kwargs)) == map_style
