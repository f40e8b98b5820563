"""A Flax text classifier on a Hugging Face data set: tokenized, variable-length, bucketed, masked.

The example writes its own text data set to local JSON-lines files (one copy
per host, as on a host's local disk), and reads it with `hf_pipeline`: each
host tokenizes its share of the rows (`map_fn`), a seeded shuffle each epoch,
token lists padded to a bucket every host agrees on (`pad_shapes`,
`shape_buckets`), padded rows masked. A bag-of-embeddings model (Flax NNX,
Optax) learns whether a sentence is positive.

A SIGTERM to any host asks every host to stop (`request_stop()`): every
stream ends at one step, and every host saves the model, the optimizer and its
input position there with Orbax. A restart with the same `--ckpt-dir`
resumes exactly: the same losses, bit for bit, as an uninterrupted run.

  python -m grain_jax_sync simulate examples/hf_text.py --signal 1:SIGTERM:4 --ckpt-dir /tmp/hf_ckpt
  python -m grain_jax_sync simulate examples/hf_text.py --ckpt-dir /tmp/hf_ckpt

Every host prints ``loss: {"step": s, "loss": l}`` after each step and one
``result: {...}`` line at the end. Options: --help.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import grain_jax_sync as gjs

WORDS = ["the", "film", "was", "a", "story", "plot", "and", "very", "quite", "acting"]
POSITIVE, NEGATIVE = ["good", "great", "fine"], ["bad", "dull", "poor"]
VOCAB = {w: i + 1 for i, w in enumerate(WORDS + POSITIVE + NEGATIVE)}  # 0 pads.
BUCKETS = [8, 16, 32]


def write_texts(path: str, n: int) -> None:
  """`n` sentences of 2 to 24 words, half of them positive, as JSON lines."""
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for i in range(n):
      label = i % 2
      words = list(rng.choice(WORDS, size=int(rng.integers(1, 24))))
      words.insert(
        int(rng.integers(0, len(words) + 1)), rng.choice(POSITIVE if label else NEGATIVE)
      )
      f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")


def tokenize(row: dict) -> dict:
  return {
    "tokens": np.array([VOCAB[w] for w in str(row["text"]).split()], np.int32),
    "label": row["label"],
  }


class BagOfWords(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(len(VOCAB) + 1, dim, rngs=rngs)
    self.out = nnx.Linear(dim, 2, rngs=rngs)

  def __call__(self, tokens: jax.Array, tokens_mask: jax.Array) -> jax.Array:
    m = tokens_mask[..., None].astype(jnp.float32)
    mean = jnp.sum(self.embed(tokens) * m, axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
    return self.out(mean)


@nnx.jit
def train_step(model: BagOfWords, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
  def loss_fn(model: BagOfWords) -> jax.Array:
    logits = model(batch["tokens"], batch["tokens_mask"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    rows = batch["mask"].astype(jnp.float32)  # Padded rows weigh 0.
    return jnp.sum(rows * nll) / jnp.maximum(rows.sum(), 1.0)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def on_every_device(module: nnx.Module) -> None:
  """Replicates `module`'s arrays over the job's devices (Orbax saves and restores them so)."""
  everywhere = jax.sharding.NamedSharding(gjs.default_mesh(), jax.sharding.PartitionSpec())
  state = nnx.state(module)
  nnx.update(
    module,
    jax.tree.map(
      lambda x: jax.make_array_from_callback(x.shape, everywhere, lambda i: np.asarray(x)[i]), state
    ),
  )


def batches(args: argparse.Namespace, path: str) -> gjs.JaxBatchIterator:
  src = gjs.hf_pipeline(
    "json",
    data_files=path,
    load_kwargs={"cache_dir": os.path.join(os.path.dirname(path), "cache")},
    batch_size=args.batch_size,
    map_fn=tokenize,
    ragged_columns=["tokens"],
    shuffle=True,
    seed=0,
    num_epochs=args.epochs,
  )
  return gjs.iter_jax_batches(
    src,
    batch_size=args.batch_size,
    paddings=0,
    mask_key="mask",
    pad_shapes={"tokens": 1, "tokens_mask": 1},
    shape_buckets={"tokens": BUCKETS, "tokens_mask": BUCKETS},
  )


def train(args: argparse.Namespace) -> dict:
  data_dir = os.path.join(args.ckpt_dir, "data")
  os.makedirs(data_dir, exist_ok=True)
  path = os.path.join(data_dir, f"texts_host{jax.process_index()}.jsonl")  # This host's disk.
  write_texts(path, args.examples)
  model = BagOfWords(args.dim, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(args.learning_rate), wrt=nnx.Param)
  on_every_device(model)
  on_every_device(optimizer)
  it, step = batches(args, path), 0
  signal.signal(signal.SIGTERM, lambda *_: it.request_stop())  # The handler only asks.
  with ocp.CheckpointManager(os.path.join(args.ckpt_dir, "ckpt")) as mngr:
    start = mngr.latest_step()
    if start is not None:
      restored = mngr.restore(
        start,
        args=ocp.args.Composite(
          model=ocp.args.StandardRestore(nnx.state(model)),
          opt=ocp.args.StandardRestore(nnx.state(optimizer)),
          data=gjs.checkpoint_restore(it),
        ),
      )
      nnx.update(model, restored["model"])
      nnx.update(optimizer, restored["opt"])
      step = start
    with it:
      for batch in it:
        loss = float(train_step(model, optimizer, batch))
        step += 1
        print(f"loss: {json.dumps({'step': step, 'loss': loss})}", flush=True)
      if it.stop_requested_by is not None:  # Every host is at this step: save it together.
        items = {"model": nnx.state(model), "opt": nnx.state(optimizer)}
        saves = {k: ocp.args.StandardSave(v) for k, v in items.items()}
        mngr.save(step, args=ocp.args.Composite(**saves, data=gjs.checkpoint_save(it)), force=True)
        mngr.wait_until_finished()
    return {"step": step, "resumed_from": start or 0, "stopped_by": it.stop_requested_by}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ckpt-dir", required=True, help="shared by every host")
  parser.add_argument("--examples", type=int, default=400)
  parser.add_argument("--batch-size", type=int, default=8, help="sentences per host per step")
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--dim", type=int, default=16)
  parser.add_argument("--learning-rate", type=float, default=0.05)
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  print("result:", json.dumps(train(args), sort_keys=True), flush=True)


if __name__ == "__main__":
  main()
