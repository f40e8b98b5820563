"""A language model on a weighted mixture of three text sources, packed, stopped on 2 hosts, resumed on 3.

Three text sources (web, code, books) are written to local files, mixed
1:2:5 by `elastic_mixture`, tokenized (bytes) and packed by
`pack_sequences` into rows of 64 tokens with segment ids and positions.
Before the first step, every bucket's train step is compiled from
`batch_specs()` (packing has one shape: one bucket), and JAX's compile
events are counted in the loop: none. A tiny Flax NNX model learns the next
byte within each document. One Orbax `CheckpointManager` saves the model,
the optimizer, a per-document token count and every host's input position.

A SIGTERM to any host asks every host to stop at one same step
(`request_stop()`), where each saves. A restart with the same `--ckpt-dir`,
on any number of hosts, restores the latest checkpoint: the mixture's rows
not yet trained on (the packer's records in flight included) are re-split
over the new hosts. The token count checks that every document trained on
was trained on whole and once, across both runs.

On one machine: two simulated hosts with four CPU devices each, process 1
told to stop after its batch 3, then the restart on three hosts:

  python -m grain_jax_sync simulate examples/lm_mixture.py --processes 2 --devices 4 \\
    --signal 1:SIGTERM:3 --ckpt-dir /tmp/lm_ckpt
  python -m grain_jax_sync simulate examples/lm_mixture.py --processes 3 --devices 4 \\
    --ckpt-dir /tmp/lm_ckpt

On a Cloud TPU VM pod, unchanged, on every worker (`--ckpt-dir` a directory
every worker reaches, e.g. a gs:// bucket):

  gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$ZONE --worker=all \\
    --command="cd grain_jax_sync && python3 examples/lm_mixture.py --ckpt-dir=gs://$BUCKET/ckpt"

Every host prints one ``result: {...}`` line. Options: --help.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import grain_jax_sync as gjs

LENGTH = 64  # Tokens per packed row (the context length).
VOCAB = 257  # Bytes + 1; 0 pads.
WEIGHTS = (1, 2, 5)  # web : code : books.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def write_sources(directory: str, docs: int) -> list[str]:
  """Writes three text sources (`docs`, 2 x and 5 x as many lines); their paths."""
  rng = np.random.default_rng(0)
  words = ["grain", "jax", "host", "mesh", "batch", "token", "shard", "step", "state"]
  lines = {
    "web.txt": [" ".join(rng.choice(words, size=rng.integers(2, 8))) for _ in range(docs)],
    "code.txt": [f"def f{i}(x): return x * {i} + {i % 7}" for i in range(2 * docs)],
    "books.txt": [f"Chapter {i}. The {rng.choice(words)} was agreed." for i in range(5 * docs)],
  }
  paths = []
  for name, text in lines.items():
    paths.append(os.path.join(directory, name))
    with open(paths[-1], "w", encoding="utf-8") as f:
      f.write("\n".join(text) + "\n")
  return paths


def read_sources(paths: list[str]) -> list[list[tuple[int, str]]]:
  """Each file's lines as (document id, text): ids from 1, unique over the sources."""
  sources, first = [], 1
  for path in paths:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
    sources.append([(first + i, line) for i, line in enumerate(lines)])
    first += len(lines)
  return sources


def tokenize(record: tuple[int, str]) -> dict[str, np.ndarray]:
  """Bytes as tokens (1 .. 256), and the document id of each token."""
  doc, text = record
  # The whole document: `pack_sequences` splits a long one across rows.
  tok = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + 1
  return {"tok": tok, "doc": np.full(len(tok), doc, np.int32)}


def make_pipeline(sources: list, batch_size: int) -> gjs.JaxBatchIterator:
  """The mixture, tokenized and packed; the same on every job size."""

  def transform(ds):
    return gjs.pack_sequences(ds.map(tokenize), length=LENGTH).batch(batch_size)

  src = gjs.elastic_mixture(sources, WEIGHTS, transform, seed=0)
  return gjs.iter_jax_batches(src, batch_size=batch_size, paddings=0, mask_key="mask")


class TinyLM(nnx.Module):
  """Next byte from this byte and its position in the document."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.tok = nnx.Embed(VOCAB, dim, rngs=rngs)
    self.pos = nnx.Embed(LENGTH, dim, rngs=rngs)
    self.out = nnx.Linear(dim, VOCAB, rngs=rngs)

  def __call__(self, tok: jax.Array, pos: jax.Array) -> jax.Array:
    return self.out(jax.nn.relu(self.tok(tok) + self.pos(pos)))


def loss_fn(model: TinyLM, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean cross-entropy of each next token of the same document (segment ids)."""
  seg = batch["tok_segment_ids"]
  logits = model(batch["tok"][:, :-1], batch["tok_positions"][:, :-1])
  same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0) & batch["mask"][:, None]
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tok"][:, 1:])
  return jnp.sum(same * nll) / jnp.maximum(same.sum(), 1)


def make_step(graphdef: nnx.GraphDef):
  """The train step on (model and optimizer state, per-document token count, batch)."""

  def step(state: nnx.State, seen: jax.Array, batch: dict[str, jax.Array]):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    real = (batch["tok_segment_ids"] > 0) & batch["mask"][:, None]
    seen = seen.at[batch["doc"]].add(real.astype(jnp.int32))
    return nnx.state((model, optimizer)), seen, loss

  return jax.jit(step)


def replicated(tree):
  """`tree`'s arrays on every device of the job (Orbax saves and restores them so)."""
  sharding = jax.sharding.NamedSharding(gjs.default_mesh(), jax.sharding.PartitionSpec())
  return jax.tree.map(
    lambda x: jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: np.asarray(x)[i]),
    tree,
  )


def train(args: argparse.Namespace, sources: list) -> dict[str, object]:
  """Trains to `args.steps` (or to a stop), resuming from the latest checkpoint; the result."""
  model = TinyLM(args.dim, rngs=nnx.Rngs(0))  # The same on every host.
  optimizer = nnx.Optimizer(model, optax.adam(args.learning_rate), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  state = replicated(state)
  seen = replicated(np.zeros(sum(map(len, sources)) + 1, np.int32))
  with ocp.CheckpointManager(args.ckpt_dir) as mngr, make_pipeline(sources, args.batch_size) as it:
    step = start = mngr.latest_step() or 0
    if start:  # On any number of hosts: the rows not trained on are re-split.
      restored = mngr.restore(
        start,
        args=ocp.args.Composite(
          train=ocp.args.StandardRestore({"state": state, "seen": seen}),
          data=gjs.checkpoint_restore(it),
        ),
      )
      state, seen = restored["train"]["state"], restored["train"]["seen"]
    signal.signal(signal.SIGTERM, lambda *_: it.request_stop())  # Every host stops at one step.
    specs = it.batch_specs()  # One per bucket; packing has one.
    compiled = [make_step(graphdef).lower(state, seen, s).compile() for s in specs]
    compiles: list[str] = []
    listen = lambda name, *_, **__: compiles.append(name) if name == COMPILE_EVENT else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listen)
    losses = []
    try:
      for batch in it:
        state, seen, loss = compiled[0](state, seen, batch)
        losses.append(float(loss))
        step += 1
        if step == args.steps:
          break
    finally:
      jax.monitoring.unregister_event_duration_listener(listen)
    saved = ocp.args.StandardSave({"state": state, "seen": seen})
    mngr.save(step, args=ocp.args.Composite(train=saved, data=gjs.checkpoint_save(it)), force=True)
    mngr.wait_until_finished()
    stopped_by = it.stop_requested_by
    shares = [s["share"] for s in it.stats()["sources"]]
  counts = np.asarray(seen.addressable_data(0))
  lengths = np.array([0] + [len(tokenize(r)["tok"]) for s in sources for r in s])
  ids = np.cumsum([0] + [len(s) for s in sources])
  return {
    "processes": jax.process_count(),
    "resumed_from": start,
    "step": step,
    "stopped_by": stopped_by,
    "specs": [list(s["tok"].shape) for s in specs],
    "compiles_in_loop": len(compiles),
    "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)] if losses else [],
    # Across every run so far: a document's tokens all once, or none of them.
    "documents_whole_once": bool(np.all((counts == 0) | (counts == lengths))),
    "documents_per_source": [int(np.sum(counts[a + 1 : b + 1] > 0)) for a, b in zip(ids, ids[1:])],
    "shares_this_host": [round(x, 3) for x in shares],
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ckpt-dir", required=True, help="shared by every host")
  parser.add_argument("--docs", type=int, default=200, help="web documents (code 2x, books 5x)")
  parser.add_argument("--steps", type=int, default=40, help="steps in all, across restarts")
  parser.add_argument("--batch-size", type=int, default=4, help="packed rows per host per step")
  parser.add_argument("--dim", type=int, default=32)
  parser.add_argument("--learning-rate", type=float, default=1e-2)
  args = parser.parse_args(argv)
  gjs.init_distributed()  # Joins the job's processes; alone, one process.
  with tempfile.TemporaryDirectory() as local:  # Each host writes and reads its own copy.
    sources = read_sources(write_sources(local, args.docs))
  result = train(args, sources)
  print("result:", json.dumps(result, sort_keys=True), flush=True)


if __name__ == "__main__":
  main()
