"""Exact evaluation over an uneven split: every example counted once.

Evaluation must not drop the remainder or count an example twice. Here the
split is deliberately uneven (host p holds a share proportional to p + 1, as
with files of different sizes): the short hosts run out first and, with
`paddings`, yield masked dummy batches until the longest host is done, and
every host's last batch is padded. Summing ``mask * correct`` and ``mask``
over the global batches gives the exact accuracy, which every host checks
against a single-process count of the whole split (NumPy, no JAX).

Integer features and weights make the logits exact, so the two counts must be
equal, not close.

On one machine, two simulated hosts with four CPU devices each:

  python -m grain_jax_sync simulate examples/exact_eval.py --processes 2 --devices 4

On a Cloud TPU VM pod, unchanged, on every worker:

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
    --command="cd grain_jax_sync && python3 examples/exact_eval.py"
"""

from __future__ import annotations

import argparse
import json

import grain
import jax
import jax.numpy as jnp
import numpy as np

import grain_jax_sync as gjs

FEATURES, CLASSES = 16, 4


def dataset(num_examples: int) -> dict[str, np.ndarray]:
  """The whole split, the same on every host: integer features and labels."""
  rng = np.random.default_rng(0)
  x = rng.integers(-8, 9, size=(num_examples, FEATURES), dtype=np.int32)
  teacher = rng.integers(-3, 4, size=(FEATURES, CLASSES), dtype=np.int32)
  noise = rng.integers(0, CLASSES, size=num_examples)
  flip = rng.random(num_examples) < 0.2
  y = np.where(flip, noise, np.argmax(x @ teacher, axis=1)).astype(np.int32)
  return {"id": np.arange(num_examples, dtype=np.int32), "x": x, "y": y}


def host_range(num_examples: int, process: int, count: int) -> tuple[int, int]:
  """Host p's contiguous share, proportional to p + 1 (deliberately uneven)."""
  weights = np.arange(1, count + 1)
  bounds = np.concatenate([[0], np.cumsum(weights)]) * num_examples // weights.sum()
  return int(bounds[process]), int(bounds[process + 1])


def model_weights() -> np.ndarray:
  """The model under evaluation: fixed integer weights, the same everywhere."""
  return np.random.default_rng(1).integers(-3, 4, size=(FEATURES, CLASSES), dtype=np.int32)


@jax.jit
def eval_step(w: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Counts over real rows only: padded and dummy rows have mask False."""
  mask = batch["mask"]
  correct = jnp.argmax(batch["x"] @ w, axis=1) == batch["y"]
  return {
    "examples": jnp.sum(mask),
    "correct": jnp.sum(mask & correct),
    "id_sum": jnp.sum(jnp.where(mask, batch["id"], 0)),
  }


def evaluate(num_examples: int, batch_size: int) -> dict[str, int]:
  data = dataset(num_examples)
  lo, hi = host_range(num_examples, jax.process_index(), jax.process_count())
  host = grain.MapDataset.source([{k: v[i] for k, v in data.items()} for i in range(lo, hi)])
  totals = {"examples": 0, "correct": 0, "id_sum": 0, "batches": 0}
  w = model_weights()
  with gjs.iter_jax_batches(
    host.batch(batch_size), batch_size=batch_size, paddings=0, mask_key="mask"
  ) as it:
    for batch in it:
      for k, v in eval_step(w, batch).items():
        totals[k] += int(v)
      totals["batches"] += 1
  totals["host_examples"] = hi - lo
  return totals


def single_process_count(num_examples: int) -> dict[str, int]:
  """The same evaluation in one process over the whole split, in NumPy."""
  data = dataset(num_examples)
  correct = np.argmax(data["x"] @ model_weights(), axis=1) == data["y"]
  return {
    "examples": num_examples,
    "correct": int(correct.sum()),
    "id_sum": int(data["id"].sum()),
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--examples", type=int, default=1001, help="size of the split")
  parser.add_argument("--batch-size", type=int, default=64, help="examples per host per batch")
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  got = evaluate(args.examples, args.batch_size)
  want = single_process_count(args.examples)
  exact = all(got[k] == want[k] for k in want)
  print(f"accuracy {got['correct']}/{got['examples']} = {got['correct'] / got['examples']:.4f}")
  print("result:", json.dumps({**got, "exact": exact}, sort_keys=True))
  if not exact:
    raise SystemExit(f"the distributed count {got} differs from the single-process count {want}")


if __name__ == "__main__":
  main()
