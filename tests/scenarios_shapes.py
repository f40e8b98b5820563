"""Scenarios for shapes that vary (`pad_shapes`), run inside simulated hosts.

Every host's batches have their own sequence length at every position. Each
case returns this host's source batches as NumPy (read a second time, for the
test's expectation) and every output batch gathered to NumPy, so the test
rebuilds each global batch from every host's source and compares all values
and both masks.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import scenarios

BUCKETS = [8, 16, 32, 64]
PAD = -1
KW: dict[str, Any] = {
  "batch_size": 4,
  "paddings": PAD,
  "mask_key": "mask",
  "pad_shapes": {"tokens": 1, "feats": 1},
  "shape_buckets": {"tokens": BUCKETS},
  "shape_mask_keys": {"tokens": "tokens_mask", "feats": "feats_mask"},
  "synchronize_lookahead": 2,
}


def length(p: int, b: int) -> int:
  """This host's sequence length at batch `b`: 1 to 40, different on every host."""
  return 1 + (7 * p + 13 * b + 3 * p * b) % 40


def plain_batches(p: int, n: int | None = None) -> list[dict[str, np.ndarray]]:
  """Host `p`: 6 + p batches of 4 rows (the last of 3), each of its own length."""
  count = 6 + p if n is None else n
  out = []
  for b in range(count):
    rows = 3 if b == count - 1 else 4
    ln = length(p, b)
    tokens = (
      100000 * (p + 1) + 1000 * b + 50 * np.arange(rows)[:, None] + np.arange(ln) + 1
    ).astype(np.int32)
    feats = np.stack([tokens, -tokens], axis=-1).astype(np.float32)
    out.append({"tokens": tokens, "feats": feats, "label": np.arange(rows, dtype=np.int32) + b})
  return out


def _tf_source(p: int) -> Any:
  import tensorflow as tf

  def gen():
    for i in range(10 + 3 * p):
      ln = 1 + (5 * p + 3 * i) % 20
      yield np.arange(ln, dtype=np.int32) + 100000 * (p + 1) + 100 * i + 1

  ds = tf.data.Dataset.from_generator(gen, output_signature=tf.TensorSpec([None], tf.int32))
  ds = ds.map(lambda s: {"tokens": s, "label": tf.shape(s)[0]})
  return ds.padded_batch(4, padding_values={"tokens": 0, "label": 0})


def _pad_rows(items: list[np.ndarray]) -> dict[str, np.ndarray]:
  """A Grain `batch_fn`: pads each batch to its own longest sequence."""
  ln = max(len(x) for x in items)
  tokens = np.zeros((len(items), ln), np.int32)
  for r, x in enumerate(items):
    tokens[r, : len(x)] = x
  return {"tokens": tokens, "label": np.asarray([len(x) for x in items], np.int32)}


def grain_source(p: int) -> Any:
  import grain

  seqs = [
    np.arange(1 + (3 * p + 7 * i) % 30, dtype=np.int32) + 100000 * (p + 1) + 100 * i + 1
    for i in range(12 + 2 * p)
  ]
  return grain.MapDataset.source(seqs).batch(4, batch_fn=_pad_rows)


def _consume(it: Any, step: Any = None, limit: int | None = None) -> dict[str, Any]:
  return scenarios.consume(_Stepped(it, step), limit)


class _Stepped:
  """Iterates `it`, calling a jitted `step` on each batch (compile counting)."""

  def __init__(self, it: Any, step: Any):
    self._it = it
    self._step = step

  def __iter__(self):
    for batch in self._it:
      if self._step is not None:
        self._step(batch["tokens"], batch["tokens_mask"]).block_until_ready()
      yield batch


def _plain(p: int) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp

  import grain_jax_sync as gjs

  traces = []

  def body(t: Any, m: Any) -> Any:
    traces.append(t.shape)  # Python runs here once per trace: once per compile.
    return jnp.where(m, t, 0).sum()

  step = jax.jit(body)
  with gjs.iter_jax_batches(plain_batches(p), **KW) as it:
    out = _consume(it, step)
  out["src"] = plain_batches(p)
  out["compiled"] = len(traces)
  return out


def _resume(p: int) -> dict[str, Any]:
  import grain_jax_sync as gjs

  data = plain_batches(p)
  with gjs.iter_jax_batches(data, **KW) as it:
    full = _consume(it)
  with gjs.iter_jax_batches(data, **KW) as it:
    first = _consume(it, limit=3)
    state = json.loads(json.dumps(it.get_state()))
  with gjs.iter_jax_batches(data, **KW) as it:
    it.set_state(state)
    rest = _consume(it)
  other = dict(KW, shape_buckets={"tokens": [16, 64]})
  with gjs.iter_jax_batches(data, **other) as it:
    try:
      it.set_state(state)
      refused = None
    except ValueError as e:
      refused = str(e)
  return {"full": full, "first": first, "rest": rest, "refused": refused}


def _tf(p: int) -> dict[str, Any]:
  import grain_jax_sync as gjs

  kw = dict(KW, pad_shapes={"tokens": 1}, shape_mask_keys={"tokens": "tokens_mask"})
  with gjs.iter_jax_batches(_tf_source(p), **kw) as it:
    out = _consume(it)
  out["src"] = list(_tf_source(p).as_numpy_iterator())
  return out


def _grain(p: int) -> dict[str, Any]:
  import grain_jax_sync as gjs

  kw = dict(KW, pad_shapes={"tokens": 1}, shape_mask_keys={"tokens": "tokens_mask"})
  kw.pop("synchronize_lookahead")
  ds = gjs.device_put(grain_source(p).to_iter_dataset(), **kw)
  out = _consume(iter(ds))
  src = grain_source(p)
  out["src"] = [src[i] for i in range(len(src))]
  return out


def _above(p: int, n: int) -> dict[str, Any]:
  import grain_jax_sync as gjs

  data = plain_batches(p)
  if p == n - 1:  # The last host's batch 2 is longer than the last bucket.
    data[2] = {k: np.concatenate([v] * 20, axis=1) if v.ndim > 1 else v for k, v in data[2].items()}
  with gjs.iter_jax_batches(data, **KW) as it:
    return _consume(it)


def _other_dim(p: int, n: int) -> dict[str, Any]:
  """A dim that `pad_shapes` does not name still has to match."""
  import grain_jax_sync as gjs

  data = plain_batches(p)
  if p == n - 1:
    data = [dict(b, feats=np.concatenate([b["feats"]] * 2, axis=2)) for b in data]
  with gjs.iter_jax_batches(data, **KW) as it:
    return _consume(it)


def run_shapes(cases: list[str]) -> list[dict[str, Any]]:
  """Runs each case in turn on this host."""
  import jax

  p, n = jax.process_index(), jax.process_count()
  runs = {
    "plain": lambda: _plain(p),
    "resume": lambda: _resume(p),
    "tf": lambda: _tf(p),
    "grain": lambda: _grain(p),
    "above": lambda: _above(p, n),
    "other_dim": lambda: _other_dim(p, n),
  }
  return [runs[c]() for c in cases]
