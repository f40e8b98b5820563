"""Train, evaluate, checkpoint and survive a preemption: Flax NNX + Optax + Orbax on TFDS.

Each epoch is its own stream (`tfds_pipeline` with that epoch's seed, one
iterator per epoch, as docs/epochs.md recommends), trained with a masked loss;
at each epoch's end every host evaluates the whole test split exactly (every
example counted once through the mask) and one Orbax `CheckpointManager`
saves the model, the optimizer and the next epoch's number.

A SIGTERM to any host (a spot VM's preemption, a scheduler) asks every host
to stop (`request_stop()` from the handler): every host's stream ends at one
same step, and each host saves the model, the optimizer and its input
position there, together (`force=True`). A restart with the same
`--ckpt-dir` restores the latest checkpoint and continues exactly where the
stopped run left off, mid-epoch included. When the data set is not prepared
on disk, TFDS's mock data stands in (offline; its test split holds the same
examples as its train split). Its images and labels are independent random
numbers, which no model can learn, so on mock data the example draws each
label into its image (two bright rows, through `tfds_pipeline`'s `map_fn`):
the loss falls and the evaluation's `correct` rises above the tenth of a guess.

On one machine, two simulated hosts with four CPU devices each, process 1
told to stop after its batch 5, then the restart:

  python -m grain_jax_sync simulate examples/train_flax_orbax.py --signal 1:SIGTERM:5 --ckpt-dir /tmp/ckpt
  python -m grain_jax_sync simulate examples/train_flax_orbax.py --ckpt-dir /tmp/ckpt

On a Cloud TPU VM pod, unchanged, on every worker (`--ckpt-dir` a directory
every worker reaches, e.g. a gs:// bucket):

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
    --command="cd grain_jax_sync && python3 examples/train_flax_orbax.py --ckpt-dir=gs://$BUCKET/ckpt"

Every host prints ``loss: {"step": s, "loss": l}`` after each step,
``eval: {...}`` after each epoch and one ``result: {...}`` line at the end.
Options: --help.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import grain_jax_sync as gjs


class MLP(nnx.Module):
  """A two-layer perceptron over flattened images."""

  def __init__(self, in_features: int, hidden: int, classes: int, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(in_features, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jax.nn.relu(self.hidden(x)))


def logits_and_mask(model: MLP, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  x = batch["image"].reshape(batch["image"].shape[0], -1) / 255.0
  return model(x), batch["mask"].astype(jnp.float32)


def masked_loss(model: MLP, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean cross-entropy over real rows; padded rows (mask False) weigh 0."""
  logits, mask = logits_and_mask(model, batch)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
  return jnp.sum(mask * nll) / jnp.maximum(mask.sum(), 1.0)


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
  loss, grads = nnx.value_and_grad(masked_loss)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def eval_step(model: MLP, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """The real rows of the global batch, and how many of them the model gets right."""
  logits, mask = logits_and_mask(model, batch)
  return mask.sum(), jnp.sum(mask * (jnp.argmax(logits, axis=-1) == batch["label"]))


class StopOnSignal:
  """Asks the running training iterator to stop when the signal comes.

  The handler only asks (`request_stop()` takes no lock and returns at
  once); every host's stream then ends at one same batch. A signal that
  comes between epochs, or too late to change an epoch's end, is passed on
  to the next epoch's iterator, so that every host stops there.
  """

  def __init__(self, signum: int = signal.SIGTERM):
    self.requested = False
    self._it: gjs.JaxBatchIterator | None = None
    # After gjs.init_distributed(): a handler installed before JAX's
    # preemption notifier would be replaced by it (docs/multihost.md).
    signal.signal(signum, self._handle)

  def _handle(self, signum: int, frame: object) -> None:
    self.requested = True
    if self._it is not None:
      self._it.request_stop()

  def watch(self, it: gjs.JaxBatchIterator) -> None:
    """Makes `it` the iterator a signal stops (at once, if one came already)."""
    self._it = it
    if self.requested:
      it.request_stop()  # A second request changes nothing.


def replicate(module: nnx.Module) -> None:
  """Places every array of `module` on every device of the job (Orbax saves and restores them so)."""
  replicated = jax.sharding.NamedSharding(gjs.default_mesh(), jax.sharding.PartitionSpec())
  state = jax.tree.map(
    lambda x: jax.make_array_from_callback(x.shape, replicated, lambda i, x=x: np.asarray(x)[i]),
    nnx.state(module),
  )
  nnx.update(module, state)


class Trainer:
  """The model, its optimizer and the checkpoints; one epoch at a time."""

  def __init__(self, args: argparse.Namespace, mngr: ocp.CheckpointManager):
    self.args, self.mngr = args, mngr
    self.model = MLP(28 * 28, args.hidden, 10, rngs=nnx.Rngs(0))  # The same on every host.
    self.optimizer = nnx.Optimizer(self.model, optax.adam(args.learning_rate), wrt=nnx.Param)
    replicate(self.model)
    replicate(self.optimizer)
    self.step, self.epoch = 0, 0

  def pipeline(self, split: str, seed: int) -> gjs.JaxBatchIterator:
    ds = gjs.tfds_pipeline(
      self.args.dataset,
      split=split,
      batch_size=self.args.batch_size,
      shuffle=split == "train",
      seed=seed,
      num_epochs=1,
      data_dir=self.args.data_dir,
      map_fn=label_drawn_in if self.args.mock else None,
    )
    options = {"paddings": 0, "mask_key": "mask", "dtypes": {"image": "float32"}}
    return gjs.iter_jax_batches(ds, batch_size=self.args.batch_size, **options)

  def _save_args(self, data: gjs.JaxBatchIterator | None) -> ocp.args.Composite:
    """Model, optimizer, where to go on from, and mid-epoch every host's input position."""
    meta = {"epoch": self.epoch, "step": self.step, "mid_epoch": data is not None}
    items = {
      "model": ocp.args.StandardSave(nnx.state(self.model)),
      "opt": ocp.args.StandardSave(nnx.state(self.optimizer)),
      "meta": ocp.args.JsonSave(meta),
    }
    if data is not None:
      items["data"] = gjs.checkpoint_save(data)  # One file per host.
    return ocp.args.Composite(**items)

  def _restore_args(self, data: gjs.JaxBatchIterator | None) -> ocp.args.Composite:
    """Into the current state: its shapes, dtypes and shardings; `data` restored in place."""
    items = {
      "model": ocp.args.StandardRestore(nnx.state(self.model)),
      "opt": ocp.args.StandardRestore(nnx.state(self.optimizer)),
    }
    if data is not None:
      items["data"] = gjs.checkpoint_restore(data)
    return ocp.args.Composite(**items)

  def save(self, data: gjs.JaxBatchIterator | None = None, *, force: bool = False) -> None:
    """Saves at `self.step` on every host (once per step: a step saved already is kept)."""
    if self.mngr.latest_step() != self.step:
      self.mngr.save(self.step, args=self._save_args(data), force=force)
    self.mngr.wait_until_finished()

  def restore(self) -> gjs.JaxBatchIterator | None:
    """Restores the latest checkpoint, if any; returns the epoch's iterator when it stopped mid-epoch."""
    step = self.mngr.latest_step()
    if step is None:
      return None
    meta = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    self.step, self.epoch = meta["step"], meta["epoch"]
    it = self.pipeline("train", seed=self.epoch) if meta["mid_epoch"] else None
    restored = self.mngr.restore(step, args=self._restore_args(it))
    nnx.update(self.model, restored["model"])
    nnx.update(self.optimizer, restored["opt"])
    print(f"restored: {json.dumps(meta, sort_keys=True)}", flush=True)
    return it

  def train_epoch(self, it: gjs.JaxBatchIterator, stopper: StopOnSignal) -> int | None:
    """Trains on the epoch's stream to its end; if a stop ended it, saves and returns who asked."""
    stopper.watch(it)
    with it:
      for batch in it:
        loss = float(train_step(self.model, self.optimizer, batch))  # Waits for the step.
        self.step += 1
        print(f"loss: {json.dumps({'step': self.step, 'loss': loss})}", flush=True)
      if it.stop_requested_by is None:
        return None
      # Every host is at the same batch: the model, the optimizer and every
      # host's input position belong to one step.
      self.save(it, force=True)
    return it.stop_requested_by

  def evaluate(self) -> dict[str, int]:
    """Exact: every test example counted once, whatever each host holds."""
    examples, correct = 0, 0
    with self.pipeline("test", seed=0) as it:
      for batch in it:
        rows, right = eval_step(self.model, batch)
        examples, correct = examples + int(rows), correct + int(right)
    return {"epoch": self.epoch, "examples": examples, "correct": correct}


def label_drawn_in(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Mock data only: the label `k` as two bright rows (4 + 2k, 5 + 2k) of its image."""
  image, k = example["image"].copy(), int(example["label"])
  image[4 + 2 * k : 6 + 2 * k] = 255
  return {**example, "image": image}


def data_on_disk(name: str, data_dir: str | None) -> bool:
  import tensorflow_datasets as tfds

  return tfds.builder(name, data_dir=data_dir).is_prepared()


def train(args: argparse.Namespace) -> dict[str, object]:
  """Trains to `args.epochs` epochs (or to a stop); returns numbers every host agrees on."""
  stopper = StopOnSignal(signal.SIGTERM)
  with ocp.CheckpointManager(args.ckpt_dir) as mngr:
    trainer = Trainer(args, mngr)
    it = trainer.restore()
    start = trainer.step
    while trainer.epoch < args.epochs:
      if it is None:  # Not resumed mid-epoch: the epoch's stream from its start.
        it = trainer.pipeline("train", seed=trainer.epoch)
      by = trainer.train_epoch(it, stopper)
      if by is not None:
        return {"stopped_by": by, "step": trainer.step, "resumed_from": start}
      it, trainer.epoch = None, trainer.epoch + 1
      print(f"eval: {json.dumps(trainer.evaluate(), sort_keys=True)}", flush=True)
      trainer.save()  # The epoch's end: the next epoch's number is the data state.
  return {"stopped_by": None, "step": trainer.step, "resumed_from": start}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ckpt-dir", required=True, help="shared by every host")
  parser.add_argument("--dataset", default="mnist")
  parser.add_argument("--data-dir", default=None)
  parser.add_argument("--batch-size", type=int, default=8, help="examples per host per step")
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--hidden", type=int, default=32)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument(
    "--mock-examples", type=int, default=0, help="use TFDS mock data of this size (0: if needed)"
  )
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  mock = contextlib.nullcontext()
  args.mock = bool(args.mock_examples) or not data_on_disk(args.dataset, args.data_dir)
  if args.mock:
    import tensorflow_datasets as tfds

    mock = tfds.testing.mock_data(
      num_examples=args.mock_examples or 256, policy=tfds.testing.MockPolicy.USE_CODE
    )
  with mock:
    result = train(args)
  print("result:", json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
  main()
