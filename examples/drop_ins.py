"""Swapping out `grain.experimental.device_put` and MaxText's loader.

Two common ways to feed a multi-host job, and the one-line change that makes
every host agree on the number and shape of batches:

* ``grain.experimental.device_put(ds, sharding)``, with a sharding over every
  host, needs the same (global) batch on every host; nothing makes hosts agree
  on the number of batches. ``grain_jax_sync.device_put(ds, sharding,
  batch_size=..., paddings=..., mask_key=...)`` takes the same first arguments
  and each host's own rows (here its own records), and yields global arrays.
* MaxText's ``MultiHostDataLoadIterator(dataloader, global_mesh)`` builds
  global arrays sharded as ``NamedSharding(mesh, PartitionSpec(mesh.axis_names))``
  but hangs or fails in the next collective when one host has a batch more.
  ``grain_jax_sync.iter_jax_batches(dataloader, sharding=...)`` is the
  replacement; checkpoint it with ``grain_jax_sync.checkpoint_save(it)``
  where MaxText saves ``grain.checkpoint.CheckpointSave(it.local_iterator)``.

The hosts here hold different numbers of records (host p: 40 + 25p), so the
last batches of the short host are padded and masked. Both replacements are
run over the same per-host data and yield the same global batches.

On one machine, two simulated hosts with four CPU devices each:

  python -m grain_jax_sync simulate examples/drop_ins.py --processes 2 --devices 4

On a Cloud TPU VM pod, unchanged, on every worker:

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
    --command="cd grain_jax_sync && python3 examples/drop_ins.py"
"""

from __future__ import annotations

import argparse
import json

import grain
import jax
import jax.numpy as jnp
import numpy as np

import grain_jax_sync as gjs


def host_records(records_per_host: int) -> list[dict[str, np.ndarray]]:
  """This host's records: ids unique across hosts, host p holds 40 + 25p."""
  p = jax.process_index()
  start = sum(records_per_host + 25 * q for q in range(p))
  return [
    {"id": np.int32(i), "tokens": np.full((8,), i % 97, np.int32)}
    for i in range(start, start + records_per_host + 25 * p)
  ]


def global_mesh() -> jax.sharding.Mesh:
  """A 2-D mesh like MaxText's ("data", "fsdp"); 1-D on an odd device count."""
  n = jax.device_count()
  fsdp = 2 if n % 2 == 0 else 1
  return jax.make_mesh((n // fsdp, fsdp), ("data", "fsdp"))


@jax.jit
def summarize(batch: dict[str, jax.Array]) -> jax.Array:
  """Real rows and the sum of their ids: the same on every host."""
  return jnp.stack([batch["mask"].sum(), jnp.where(batch["mask"], batch["id"], 0).sum()])


def via_device_put(records: list, mesh: jax.sharding.Mesh, batch_size: int) -> list:
  ds = grain.MapDataset.source(records).batch(batch_size).to_iter_dataset()
  # Before: ds = grain.experimental.device_put(ds, sharding, cpu_buffer_size=4,
  #                                            device_buffer_size=2)
  ds = gjs.device_put(
    ds, mesh, cpu_buffer_size=4, device_buffer_size=2,
    batch_size=batch_size, paddings=0, mask_key="mask",
  )  # fmt: skip
  it = iter(ds)
  out = [summarize(batch).tolist() for batch in it]
  it.close()
  return out


def via_maxtext_style_loader(records: list, mesh: jax.sharding.Mesh, batch_size: int):
  dataloader = grain.DataLoader(
    data_source=records,
    sampler=grain.samplers.IndexSampler(
      num_records=len(records), shard_options=grain.sharding.NoSharding(), num_epochs=1
    ),
    operations=[grain.transforms.Batch(batch_size)],
    worker_count=0,
  )
  # Before: data_iterator = MultiHostDataLoadIterator(dataloader, global_mesh)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
  data_iterator = gjs.iter_jax_batches(
    dataloader, sharding=sharding, batch_size=batch_size, paddings=0, mask_key="mask"
  )
  with data_iterator:
    out = [summarize(batch).tolist() for batch in data_iterator]
    # Before: ckpt_args["iter"] = grain.checkpoint.CheckpointSave(data_iterator.local_iterator)
    # After:  ckpt_args["iter"] = gjs.checkpoint_save(data_iterator)  (needs Orbax)
    state = data_iterator.get_state()  # What that checkpoint holds for this host.
  return out, state


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--records", type=int, default=40, help="records on host 0")
  parser.add_argument("--batch-size", type=int, default=16, help="rows per host per batch")
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  mesh = global_mesh()
  records = host_records(args.records)
  a = via_device_put(records, mesh, args.batch_size)
  b, state = via_maxtext_style_loader(records, mesh, args.batch_size)
  total = sum(args.records + 25 * q for q in range(jax.process_count()))
  result = {
    "batches": len(a),
    "same_batches": a == b,
    "real_rows": int(sum(r for r, _ in a)),
    "records": total,
    "every_record_once": sum(s for _, s in a) == total * (total - 1) // 2,
    "state_batches": state["batches"],
  }
  print("result:", json.dumps(result, sort_keys=True))


if __name__ == "__main__":
  main()
