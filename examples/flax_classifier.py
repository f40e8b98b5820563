"""A Flax (NNX) + Optax classifier trained on a TFDS data set from every host.

Each host reads its own contiguous part of the split (`tfds_pipeline`:
ArrayRecord through Grain, no TensorFlow in the loop), `iter_jax_batches` turns
the per-host batches into global `jax.Array`s that every host agrees on (the
host whose part is one example shorter gets a padded batch, masked out of the
loss), and NNX + Optax train an MLP on them. When the data set is not prepared
on disk, TFDS's mock data stands in (offline). Its images and labels are
independent random numbers, which no model can learn, so on mock data the
example draws each label into its image (two bright rows, through
`tfds_pipeline`'s `map_fn`). It prints the loss of the first step and of the
last (a uniform guess over the 10 classes scores ln 10 = 2.30) and the
accuracy over every step.

On one machine, two simulated hosts with four CPU devices each:

  python -m grain_jax_sync simulate examples/flax_classifier.py --processes 2 --devices 4

On a Cloud TPU VM pod, unchanged, on every worker (the data prepared once with
``tfds build mnist --file_format=array_record`` into a directory every worker
reads, passed as --data-dir):

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
    --command="cd grain_jax_sync && python3 examples/flax_classifier.py --data-dir=$DATA_DIR"

Options (batch size, epochs, mock data size): --help.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import grain_jax_sync as gjs


class MLP(nnx.Module):
  """A two-layer perceptron over flattened images."""

  def __init__(self, in_features: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(in_features, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jax.nn.relu(self.hidden(x)))


def masked_loss(model: MLP, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """Mean cross-entropy over real rows; padded rows (mask False) weigh 0."""
  x = batch["image"].reshape(batch["image"].shape[0], -1) / 255.0
  logits = model(x)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
  mask = batch["mask"].astype(jnp.float32)
  correct = jnp.sum(mask * (jnp.argmax(logits, axis=-1) == batch["label"]))
  return jnp.sum(mask * nll) / jnp.maximum(mask.sum(), 1.0), correct


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]):
  (loss, correct), grads = nnx.value_and_grad(masked_loss, has_aux=True)(model, batch)
  optimizer.update(model, grads)
  return loss, correct, batch["mask"].sum()


def label_drawn_in(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Mock data only: the label `k` as two bright rows (4 + 2k, 5 + 2k) of its image."""
  image, k = example["image"].copy(), int(example["label"])
  image[4 + 2 * k : 6 + 2 * k] = 255
  return {**example, "image": image}


def data_on_disk(name: str, data_dir: str | None) -> bool:
  import tensorflow_datasets as tfds

  return tfds.builder(name, data_dir=data_dir).is_prepared()


def train(args: argparse.Namespace) -> dict[str, object]:
  """Trains for `args.epochs` passes; returns numbers every host agrees on."""
  import tensorflow_datasets as tfds

  mock = contextlib.nullcontext()
  mocked = bool(args.mock_examples) or not data_on_disk(args.dataset, args.data_dir)
  if mocked:
    mock = tfds.testing.mock_data(
      num_examples=args.mock_examples or 1024, policy=tfds.testing.MockPolicy.USE_CODE
    )
  model = MLP(28 * 28, args.hidden, 10, rngs=nnx.Rngs(0))  # Same seed: same params everywhere.
  optimizer = nnx.Optimizer(model, optax.adam(args.learning_rate), wrt=nnx.Param)
  steps, examples, correct, losses = 0, 0, 0, []
  with mock:
    ds = gjs.tfds_pipeline(
      args.dataset,
      split="train",
      batch_size=args.batch_size,
      shuffle=True,
      seed=0,
      num_epochs=args.epochs,
      data_dir=args.data_dir,
      map_fn=label_drawn_in if mocked else None,
    )
    with gjs.iter_jax_batches(
      ds, batch_size=args.batch_size, paddings=0, mask_key="mask", dtypes={"image": "float32"}
    ) as it:
      for batch in it:
        loss_a, correct_a, rows_a = train_step(model, optimizer, batch)
        steps += 1
        examples += int(rows_a)
        correct += int(correct_a)
        losses.append(round(float(loss_a), 4))
  return {
    "steps": steps,
    "examples": examples,
    "train_accuracy": correct / examples,
    "loss_first_last": [losses[0], losses[-1]],
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="mnist")
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--batch-size", type=int, default=32, help="examples per host per step")
  parser.add_argument("--epochs", type=int, default=1)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument(
    "--mock-examples", type=int, default=0, help="use TFDS mock data of this size (0: if needed)"
  )
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  print("result:", json.dumps(train(args), sort_keys=True))


if __name__ == "__main__":
  main()
