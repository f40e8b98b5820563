"""Shapes that vary (`pad_shapes`): tokens computed per real token, and the option's cost.

Runs inside simulated hosts (`benchmarks.workloads.suite`). Each host's
batches have skewed (log-normal) lengths up to `MAX_LEN` (`skewed_batches`);
a host batch is padded to its own longest row (as `tf.data` `padded_batch`
does). Three ways to feed a
step with fixed shapes per compile are compared by the tokens the step
computes over the real tokens:

* pad to the maximum: every batch at `MAX_LEN` (counted, not run);
* `pad_shapes` with `shape_buckets`: the agreed length rounded up to a bucket;
* `pad_shapes` alone: the agreed maximum (one shape per distinct length).

And the agreement's per-batch cost with the option on and off, on the same
equal-length batches (the option's sizes ride in the reports).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_LEN = 1024
BUCKETS = [64, 128, 256, 512, 1024]


def skewed_batches(rows: int, n: int, *, seed: int) -> tuple[list[dict[str, np.ndarray]], int]:
  """`n` length-grouped batches of `rows` token rows; the real token count.

  Each batch's length class is log-normal (median 64, a tail to `MAX_LEN`),
  as a source that groups by length (`tf.data` `bucket_by_sequence_length`,
  a Grain length-sorted batch) gives; its rows have lengths between half of
  it and it, and the batch is padded to its own longest row.
  """
  rng = np.random.default_rng(seed)
  out, real = [], 0
  for _ in range(n):
    top = int(min(MAX_LEN, max(2, np.ceil(rng.lognormal(np.log(64), 0.9)))))
    lengths = rng.integers(top // 2, top + 1, size=rows)
    tokens = np.zeros((rows, int(lengths.max())), np.int32)
    for r, ln in enumerate(lengths):
      tokens[r, :ln] = 1
    real += int(lengths.sum())
    out.append({"tokens": tokens})
  return out, real


def _computed(make: Any) -> tuple[int, int]:
  """Tokens the step computes (global elements) and distinct global shapes."""
  total, shapes = 0, set()
  with make() as it:
    for batch in it:
      shapes.add(batch["tokens"].shape)
      total += int(np.prod(batch["tokens"].shape))
  return total, len(shapes)


def varying_lengths(*, rows: int = 64, n: int = 200, trials: int = 5) -> dict[str, Any]:
  """Tokens computed / real tokens, and per-batch cost with `pad_shapes` on and off."""
  import jax
  from jax.experimental import multihost_utils

  import grain_jax_sync as gjs
  from benchmarks import workloads

  data, real = skewed_batches(rows, n, seed=jax.process_index())
  real = int(np.asarray(multihost_utils.process_allgather(np.asarray(real))).sum())
  kw = {"batch_size": rows, "paddings": 0, "mask_key": None, "pad_shapes": {"tokens": 1}}
  bucketed, bucket_shapes = _computed(
    lambda: gjs.iter_jax_batches(data, **kw, shape_buckets={"tokens": BUCKETS})
  )
  agreed, agreed_shapes = _computed(lambda: gjs.iter_jax_batches(data, **kw))
  to_max = n * rows * jax.process_count() * MAX_LEN
  equal = [{"tokens": np.ones((rows, 128), np.int32)} for _ in range(n)]
  times = workloads._median_times(  # noqa: SLF001 - the suite's own timer.
    {
      "off": lambda: gjs.iter_jax_batches(equal, batch_size=rows, paddings=0, mask_key=None),
      "on": lambda: gjs.iter_jax_batches(equal, **kw),
    },
    trials,
  )
  return {
    "real": real,
    "to_max": to_max,
    "bucketed": bucketed,
    "bucket_shapes": bucket_shapes,
    "agreed": agreed,
    "agreed_shapes": agreed_shapes,
    "times": times,
  }
