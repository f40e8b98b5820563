"""A masked training loop over uneven per-host shards.

Host p holds 100 + 30p examples of y = 3x + 1, so the short host gets padded
and masked dummy batches; the loss weighs only real rows (the mask), and every
host ends with the same parameters.

On one machine, two simulated hosts with four CPU devices each:

  python -m grain_jax_sync simulate examples/train_masked.py --processes 2 --devices 4

On a Cloud TPU VM pod, unchanged, on every worker (on a GPU cluster, run it on
every node; `jax.distributed.initialize()` finds SLURM or Open MPI itself):

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
    --command="cd grain_jax_sync && python3 examples/train_masked.py"
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import grain_jax_sync as gjs


def host_shard(process: int, batch_size: int) -> list[dict[str, np.ndarray]]:
  """Host p holds 100 + 30 * p examples of y = 3x + 1 (uneven on purpose)."""
  rng = np.random.default_rng(process)
  n = 100 + 30 * process
  x = rng.normal(size=(n, 1)).astype(np.float32)
  y = (3 * x + 1).astype(np.float32)
  return [{"x": x[i : i + batch_size], "y": y[i : i + batch_size]} for i in range(0, n, batch_size)]


@jax.jit
def sgd_step(params, batch):
  def loss_fn(p):
    err = (batch["x"] @ p["w"] + p["b"] - batch["y"])[:, 0]
    m = batch["mask"].astype(jnp.float32)
    return jnp.sum(m * err**2) / jnp.maximum(m.sum(), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss


def train(epochs: int = 20, batch_size: int = 16) -> dict[str, float]:
  params = {"w": jnp.zeros((1, 1)), "b": jnp.zeros((1,))}
  shard = host_shard(jax.process_index(), batch_size)
  steps = 0
  for _ in range(epochs):
    with gjs.iter_jax_batches(shard, batch_size=batch_size, paddings=0.0, mask_key="mask") as it:
      for batch in it:
        params, loss = sgd_step(params, batch)
        # Wait for the step, as a loop that logs its loss does. On CPU devices
        # with gloo, letting hundreds of collective steps queue up under async
        # dispatch can stall XLA's CPU collectives (seen with plain
        # make_array_from_process_local_data + jit, no grain_jax_sync).
        loss.block_until_ready()
        steps += 1
  return {
    "w": float(params["w"][0, 0]),
    "b": float(params["b"][0]),
    "loss": float(loss),
    "steps": steps,
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--batch-size", type=int, default=16, help="examples per host per step")
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  print("result:", json.dumps(train(args.epochs, args.batch_size), sort_keys=True))


if __name__ == "__main__":
  main()
