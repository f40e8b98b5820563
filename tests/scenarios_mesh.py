"""Mesh scenarios that run inside simulated hosts (module level, importable).

One function per topology runs every case, so that each topology starts its
processes once. Rows encode their input shard: value = 1000 * shard + 10 *
batch + row (`scenarios.rows_for`), so processes that share a data shard feed
identical rows and a test can say which row landed where.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scenarios


def _devices_by_process() -> list[list[Any]]:
  import jax

  by: dict[int, list[Any]] = {}
  for d in jax.devices():
    by.setdefault(d.process_index, []).append(d)
  return [sorted(by[p], key=lambda d: d.id) for p in sorted(by)]


def _grid(shape: tuple[int, ...], pick: Any) -> np.ndarray:
  """An object array of `shape` whose entry at `index` is ``pick(*index)``."""
  out = np.empty(shape, dtype=object)
  for index in np.ndindex(*shape):
    out[index] = pick(*index)
  return out


def _run(
  kwargs: dict[str, Any],
  sizes: list[int],
  *,
  by_process: bool = False,
  differ_from: int | None = None,
) -> dict[str, Any]:
  """iter_jax_batches over this process's input shard; global rows and layout.

  With `by_process`, each process feeds rows of its own (wrong where
  processes share a data shard); with `differ_from`, from that batch on.
  """
  import jax

  import grain_jax_sync as gjs

  info = gjs.data_shard_info(
    kwargs.get("mesh") if "mesh" in kwargs else kwargs.get("sharding"),
    data_axes=kwargs.get("data_axes"),
  )
  shard = jax.process_index() if by_process else info.shard_index
  data = scenarios.make_batches(shard, sizes)
  if differ_from is not None:
    data[differ_from:] = scenarios.make_batches(jax.process_index(), sizes)[differ_from:]
  with gjs.iter_jax_batches(data, **kwargs) as it:
    out = scenarios.consume(it)
    out["spec"] = str(it.sharding.spec)
    out["mesh_shape"] = dict(it.sharding.mesh.shape)
    out["local_blocks"] = list(it.placement.local_blocks)
  out["info"] = tuple(info)
  out["process"] = jax.process_index()
  return out


def _without_store(fn: Any) -> Any:
  """Runs `fn` with no key-value client: the collective fallback (lockstep)."""
  from jax._src import distributed

  client = distributed.global_state.client
  distributed.global_state.client = None
  try:
    return fn()
  finally:
    distributed.global_state.client = client


def _error(fn: Any) -> str | None:
  try:
    fn()
  except ValueError as e:
    return str(e)
  return None


def _tfds_labels(**kwargs: Any) -> list[list[int]]:
  import tensorflow_datasets as tfds

  import grain_jax_sync as gjs

  with tfds.testing.mock_data(num_examples=13, policy=tfds.testing.MockPolicy.USE_CODE):
    ds = gjs.tfds_pipeline("mnist", split="train", batch_size=4, shuffle=True, seed=3, **kwargs)
    return [b["label"].tolist() for b in ds]


def cases_2x4() -> dict[str, Any]:
  """2 processes x 4 devices: model axis inside and across processes, and more."""
  import grain
  import jax

  import grain_jax_sync as gjs

  devs = _devices_by_process()
  # (data=4, model=2), model pairs inside a process: process p holds data 2p, 2p+1.
  inside = jax.sharding.Mesh(
    _grid((4, 2), lambda d, m: devs[d // 2][2 * (d % 2) + m]), ("data", "model")
  )
  # (data=4, model=2), model pairs across the processes: both hold every data shard.
  across = jax.sharding.Mesh(_grid((4, 2), lambda d, m: devs[m][d]), ("data", "model"))
  # Rows over ("y", "x") of an (x=2, y=4) mesh whose x is the process: each
  # process holds every other data shard, so its rows are not contiguous.
  strided = jax.sharding.Mesh(_grid((2, 4), lambda x, y: devs[x][y]), ("x", "y"))
  padded = {"batch_size": 8, "paddings": -1, "mask_key": "mask"}
  out: dict[str, Any] = {
    "inside": _run({"batch_size": 8, "mesh": inside}, [8, 8]),
    "across": _run({**padded, "mesh": across}, [8, 5]),
    "across_differ": _run({"batch_size": 8, "mesh": across}, [8, 8], by_process=True),
    # The same through the collective fallback (lockstep, no key-value store);
    # the first batch agrees (both load shard 0), the second differs.
    "across_differ_lockstep": _without_store(
      lambda: _run({"batch_size": 8, "mesh": across}, [8, 8], differ_from=1)
    ),
    # Both load shard 0, but process 1 has a batch more: a dummy on one
    # replica and rows on the other must raise, not make a global array
    # whose copies differ (with the key-value store, then in lockstep).
    "across_one_ends": _run({**padded, "mesh": across}, [8, 8] + [5] * jax.process_index()),
    "across_one_ends_lockstep": _without_store(
      lambda: _run({**padded, "mesh": across}, [8, 8] + [5] * jax.process_index())
    ),
    "strided": _run({"batch_size": 8, "mesh": strided, "data_axes": ("y", "x")}, [8]),
    "sharding": _run(
      {
        "batch_size": 8,
        "sharding": jax.sharding.NamedSharding(inside, jax.sharding.PartitionSpec("data", "model")),
      },
      [8],
    ),
    "spec_on_mesh": _run(
      {"batch_size": 8, "mesh": across, "sharding": jax.sharding.PartitionSpec("data")}, [8]
    ),
  }
  # Each process builds its own mesh: the same devices in another order, or
  # the rows over other axes of the same mesh.
  mine = inside if jax.process_index() == 0 else across
  out["mesh_order_differs"] = _run({"batch_size": 8, "mesh": mine}, [8, 8])
  out["mesh_order_differs_lockstep"] = _without_store(
    lambda: _run({"batch_size": 8, "mesh": mine}, [8, 8])
  )
  out["inside_not_divisible"] = _run({"batch_size": 8, "mesh": inside}, [8, 5])
  axes = "data" if jax.process_index() == 0 else ("data", "model")
  out["data_axes_differ"] = _run({"batch_size": 8, "mesh": inside, "data_axes": axes}, [8, 8])
  with jax.set_mesh(across):
    out["context_info"] = tuple(gjs.data_shard_info())
    out["context"] = _run({"batch_size": 8}, [8])
    with gjs.iter_jax_batches([], batch_size=8) as it:
      out["context_mesh_is_user_mesh"] = it.sharding.mesh == across
    out["tfds_across"] = _tfds_labels()  # The context mesh picks the input shard.
  out["tfds_inside"] = _tfds_labels(mesh=inside)
  info = gjs.data_shard_info(inside)
  ds = grain.MapDataset.source(scenarios.make_batches(info.shard_index, [8, 8])).to_iter_dataset()
  it = iter(gjs.device_put(ds, inside, cpu_buffer_size=0))
  out["device_put"] = {
    "batches": [scenarios.gather(b) for b in it],
    "spec": str(it.sharding.spec),
  }
  it.close()
  local = jax.sharding.Mesh(np.array(jax.local_devices()).reshape(2, 2), ("data", "model"))
  out["local_mesh_error"] = _error(lambda: gjs.iter_jax_batches([], batch_size=8, mesh=local))
  out["divisible_error"] = _error(
    lambda: gjs.iter_jax_batches([], batch_size=5, paddings=0, mesh=inside)
  )
  # Process 0 holds data shards 0, 1, 2 and process 1 holds 1, 2, 3: no layout.
  slots = [[0, 0], [0, 1], [0, 1], [1, 1]]
  taken = [0, 0]

  def pick(d: int, m: int) -> Any:
    p = slots[d][m]
    taken[p] += 1
    return devs[p][taken[p] - 1]

  overlapping = jax.sharding.Mesh(_grid((4, 2), pick), ("data", "model"))
  out["uneven_error"] = _error(lambda: gjs.iter_jax_batches([], batch_size=8, mesh=overlapping))
  # Columns over "model", which spans the processes: each would hold half.
  cols = jax.sharding.NamedSharding(across, jax.sharding.PartitionSpec("data", "model"))
  out["cols_across_error"] = _error(lambda: gjs.iter_jax_batches([], sharding=cols))
  # Columns split unevenly (process 0 holds 0, 1, 2 and process 1 holds 1, 2, 3),
  # found when the iterator is built, not at the first batch.
  taken[:] = [0, 0]
  odd = jax.sharding.Mesh(_grid((1, 4, 2), lambda _, d, m: pick(d, m)), ("data", "cols", "r"))
  out["cols_uneven_error"] = _error(
    lambda: gjs.iter_jax_batches(
      [], sharding=jax.sharding.NamedSharding(odd, jax.sharding.PartitionSpec("data", "cols"))
    )
  )
  out["shapes"] = _shapes(inside, across, strided)
  return out


def _shapes(inside: Any, across: Any, strided: Any) -> dict[str, Any]:
  """Ours next to JAX's own (private) local_to_global_shape."""
  import jax
  from jax._src.sharding_impls import local_to_global_shape as jax_l2g

  import grain_jax_sync as gjs

  named = jax.sharding.NamedSharding
  spec = jax.sharding.PartitionSpec
  cases = {
    "inside": ((8, 3), named(inside, spec("data"))),
    "across": ((8, 3), named(across, spec("data"))),
    "strided_rows": ((8, 3), named(strided, spec(("y", "x")))),
    "strided_2d": ((8, 4), named(strided, spec("y", "x"))),
  }
  out = {}
  for name, (shape, sharding) in cases.items():
    glob = gjs.local_to_global_shape(shape, sharding)
    out[name] = {
      "ours": glob,
      "jax": tuple(jax_l2g(sharding, shape)),
      "back": gjs.global_to_local_shape(glob, sharding),
    }
  return out


def cases_4x2() -> dict[str, Any]:
  """4 processes x 2 devices: rows over a 2-D tuple of data axes."""
  import jax

  devs = _devices_by_process()
  axes = ("replica", "fsdp", "model")
  # Model pairs across processes (0, 1) and (2, 3); rows over (replica, fsdp).
  across = jax.sharding.Mesh(_grid((2, 2, 2), lambda r, f, m: devs[2 * r + m][f]), axes)
  # Model pairs inside a process; rows over (fsdp, replica): shard order 0, 2, 1, 3.
  inside = jax.sharding.Mesh(_grid((2, 2, 2), lambda r, f, m: devs[2 * r + f][m]), axes)
  return {
    "across": _run({"batch_size": 4, "mesh": across, "data_axes": ("replica", "fsdp")}, [4, 4]),
    "inside": _run({"batch_size": 4, "mesh": inside, "data_axes": ("fsdp", "replica")}, [4]),
  }
