"""Preempted on N hosts, resumed on M hosts: every example is trained on exactly once.

A job trains `--save-at` steps over an `elastic_source` (a filter drops about a
third of the records, then batches), saves the model and every host's input
position with Orbax, and stops, as a preempted job does. A second job, on
another number of hosts, restores both and trains to the end of the epoch:
the records the first job had not consumed are re-split over the new hosts.
The model counts how often it saw each record (a jitted step), so the second
job checks that every kept record was trained on exactly once.

On one machine, two simulated hosts, then three:

  python -m grain_jax_sync simulate examples/elastic_resume.py --processes 2 --devices 2 \\
    --phase save --checkpoint-dir /tmp/elastic_ckpt
  python -m grain_jax_sync simulate examples/elastic_resume.py --processes 3 --devices 2 \\
    --phase resume --checkpoint-dir /tmp/elastic_ckpt

On a Cloud TPU pod, the same two commands with ``python3 examples/elastic_resume.py``
on every worker (`--checkpoint-dir` a gs:// directory every worker reaches).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import grain_jax_sync as gjs


def keep(record: dict) -> bool:
  return int(record["id"]) % 3 != 1  # Stands in for "too long", "bad language", ...


def make_pipeline(records: int, batch_size: int) -> gjs.JaxBatchIterator:
  """The same on every job: the library splits the records over its hosts."""
  data = [{"id": np.int32(i), "x": np.float32(i % 7)} for i in range(records)]
  src = gjs.elastic_source(
    data, lambda ds: ds.filter(keep).batch(batch_size), shuffle=True, seed=42
  )
  return gjs.iter_jax_batches(src, batch_size=batch_size, paddings=0, mask_key="mask")


def initial_state(records: int) -> dict[str, jax.Array]:
  """The model state, replicated over every device (Orbax restores it on any mesh)."""
  replicated = jax.sharding.NamedSharding(gjs.default_sharding().mesh, jax.sharding.PartitionSpec())
  values = {"w": np.float32(0), "seen": np.zeros(records, np.int32)}
  return {
    k: jax.make_array_from_callback(v.shape, replicated, lambda i, v=v: np.asarray(v)[i])
    for k, v in values.items()
  }


@jax.jit
def train_step(state: dict[str, jax.Array], batch: dict[str, jax.Array]):
  """A stand-in model: fits w to mean(x) on the real rows, and counts each record seen."""
  mask = batch["mask"].astype(jnp.float32)
  grad = jnp.sum(mask * (state["w"] - batch["x"])) / jnp.maximum(jnp.sum(mask), 1.0)
  seen = state["seen"].at[batch["id"]].add(batch["mask"].astype(jnp.int32))
  return {"w": state["w"] - 0.1 * grad, "seen": seen}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--phase", choices=["save", "resume"], required=True)
  parser.add_argument("--checkpoint-dir", required=True, help="shared by every host")
  parser.add_argument("--records", type=int, default=240)
  parser.add_argument("--batch-size", type=int, default=8, help="rows per host per batch")
  parser.add_argument("--save-at", type=int, default=3, help="steps before the preemption")
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  state = initial_state(args.records)
  steps = 0
  with (
    ocp.CheckpointManager(args.checkpoint_dir) as mngr,
    make_pipeline(args.records, args.batch_size) as it,
  ):
    if args.phase == "resume":  # Another job size: the data state is re-split.
      step = mngr.latest_step()
      restored = mngr.restore(
        step,
        args=ocp.args.Composite(
          model=ocp.args.StandardRestore(state), data=gjs.checkpoint_restore(it)
        ),
      )
      state, steps = restored["model"], step
    for batch in it:
      state = train_step(state, batch)
      steps += 1
      if args.phase == "save" and steps == args.save_at:
        break
    if args.phase == "save":  # Preempted here: save and stop.
      mngr.save(
        steps,
        args=ocp.args.Composite(model=ocp.args.StandardSave(state), data=gjs.checkpoint_save(it)),
      )
      mngr.wait_until_finished()
  seen = np.asarray(state["seen"].addressable_data(0))
  kept = np.array([keep({"id": i}) for i in range(args.records)])
  result = {
    "phase": args.phase,
    "processes": jax.process_count(),
    "steps": steps,
    "trained_examples": int(seen.sum()),
    "kept_examples": int(kept.sum()),
    # After the resume: every kept record once, the filtered ones never.
    "exactly_once": bool(np.all(seen[kept] == 1) and np.all(seen[~kept] == 0))
    if args.phase == "resume"
    else None,
    "w": round(float(state["w"].addressable_data(0)), 4),
  }
  print("result:", json.dumps(result, sort_keys=True))


if __name__ == "__main__":
  main()
