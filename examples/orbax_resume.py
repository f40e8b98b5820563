"""Checkpoint with Orbax mid-epoch and resume: the stream continues exactly.

The model state and every host's input position are saved together after
`--save-at` steps of an epoch (one JSON file per host, through Grain's
handler). A fresh pipeline and model then restore that step and finish the
epoch. The example checks that the batches after the restore are exactly the
batches an uninterrupted run yields from that step on, and that the final
model state is the same.

The hosts hold different numbers of records and shuffle them (a Grain
`MapDataset`), so the resumed stream includes padded and dummy batches.

On one machine, two simulated hosts with four CPU devices each:

  python -m grain_jax_sync simulate examples/orbax_resume.py --processes 2 --devices 4

On a Cloud TPU VM pod, unchanged, on every worker (`--checkpoint-dir` must be
a directory every worker reaches, e.g. a gs:// bucket):

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
    --command="cd grain_jax_sync && python3 examples/orbax_resume.py --checkpoint-dir=gs://$BUCKET/ckpt"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

import grain_jax_sync as gjs


def make_pipeline(records: int, batch_size: int) -> gjs.JaxBatchIterator:
  """This host's shuffled records (host p: records + 13p), agreed batches."""
  p = jax.process_index()
  start = sum(records + 13 * q for q in range(p))
  ids = np.arange(start, start + records + 13 * p, dtype=np.int32)
  ds = grain.MapDataset.source(ids).shuffle(seed=p).map(lambda i: {"ids": i}).batch(batch_size)
  return gjs.iter_jax_batches(ds, batch_size=batch_size, paddings=-1, mask_key="mask")


@jax.jit
def train_step(state: dict[str, jax.Array], batch: dict[str, jax.Array]):
  """A stand-in model: a running, order-sensitive digest of the real rows."""
  ids = jnp.where(batch["mask"], batch["ids"], 0).astype(jnp.float32)
  digest = state["digest"] * 0.5 + jnp.sum(ids * jnp.arange(1, ids.shape[0] + 1))
  return {"digest": digest, "step": state["step"] + 1}, jnp.sort(ids)


def run(it: gjs.JaxBatchIterator, state: dict, steps: int | None = None):
  """Trains up to `steps` steps (None: to the end); returns state and batches."""
  seen = []
  for batch in it:
    state, ids = train_step(state, batch)
    seen.append(np.asarray(multihost_utils.process_allgather(ids, tiled=True)).tolist())
    if steps is not None and len(seen) == steps:
      break
  return state, seen


def initial_state() -> dict[str, jax.Array]:
  """The model state, replicated over every device of every host.

  Committed global arrays, so that Orbax restores them with this sharding.
  """
  replicated = jax.sharding.NamedSharding(gjs.default_sharding().mesh, jax.sharding.PartitionSpec())
  values = {"digest": np.float32(0), "step": np.int32(0)}
  return {
    k: jax.make_array_from_callback((), replicated, lambda _, v=v: np.asarray(v))
    for k, v in values.items()
  }


def shared_checkpoint_dir() -> str:
  """A fresh directory name that every host agrees on (one machine only)."""
  token = int(multihost_utils.broadcast_one_to_all(np.int32(os.getpid())))
  return os.path.join(tempfile.gettempdir(), f"gjs_orbax_resume_{token}")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--records", type=int, default=50, help="records on host 0")
  parser.add_argument("--batch-size", type=int, default=8, help="rows per host per batch")
  parser.add_argument("--save-at", type=int, default=3, help="save after this many steps")
  parser.add_argument("--checkpoint-dir", default=None, help="shared by every host")
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  ckpt_dir = args.checkpoint_dir or shared_checkpoint_dir()
  fresh = initial_state()

  # The uninterrupted run.
  with make_pipeline(args.records, args.batch_size) as it:
    full_state, full = run(it, fresh)

  # Train `save_at` steps, save the model and the input position together.
  with ocp.CheckpointManager(ckpt_dir) as mngr, make_pipeline(args.records, args.batch_size) as it:
    state, _ = run(it, fresh, steps=args.save_at)
    mngr.save(
      args.save_at,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=gjs.checkpoint_save(it)),
    )
    mngr.wait_until_finished()

  # A restart: a fresh pipeline and model, restored in place, then the rest.
  with ocp.CheckpointManager(ckpt_dir) as mngr, make_pipeline(args.records, args.batch_size) as it:
    step = mngr.latest_step()
    restored = mngr.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(fresh), data=gjs.checkpoint_restore(it)
      ),
    )
    state, rest = run(it, restored["state"])

  multihost_utils.sync_global_devices("orbax_resume_example_done")
  if args.checkpoint_dir is None and jax.process_index() == 0:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
  result = {
    "batches": len(full),
    "restored_step": step,
    "resumed_equals_uninterrupted": rest == full[step:],
    "same_final_state": float(state["digest"]) == float(full_state["digest"])
    and int(state["step"]) == int(full_state["step"]),
  }
  print("result:", json.dumps(result, sort_keys=True))


if __name__ == "__main__":
  main()
