"""Cost of exact tf.data resume: per-batch snapshot time and state size.

Run from the repository root (a few seconds; one process, no JAX devices):

  python -m benchmarks.tf_data_snapshot

For each shuffle buffer it reads batches through `TfDataSource` (what
`iter_jax_batches` does with a `tf.data.Dataset`) with and without a snapshot
after every batch, then times `export_state` (bytes + base64) and a restore.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

READS = 40  # Timed reads per figure; the median is reported.
WARMUP = 10  # Reads before timing (fills the shuffle buffer).


def _pipeline(buffer: int, width: int):
  import tensorflow as tf

  ds = tf.data.Dataset.range(1_000_000)
  if width:  # Incompressible bytes, like image pixels.

    def image(i):
      noise = tf.random.stateless_uniform([width], seed=[i, 0], maxval=256, dtype=tf.int32)
      return {"id": i, "x": tf.cast(noise, tf.uint8)}

    ds = ds.map(image)
  else:
    ds = ds.map(lambda i: {"id": i})
  return ds.shuffle(buffer, seed=7).batch(8).prefetch(2)


def _median_ms(fn, n: int) -> float:
  times = []
  for _ in range(n):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def measure(buffer: int, width: int) -> dict[str, float]:
  from grain_jax_sync._src.sources import tf_data

  plain = tf_data.TfDataSource(_pipeline(buffer, width), state_every=None)
  for _ in range(WARMUP):
    next(plain)
  read_ms = _median_ms(lambda: next(plain), READS)
  src = tf_data.TfDataSource(_pipeline(buffer, width))
  for _ in range(WARMUP):
    next(src)
  n = READS if buffer < 1000 else READS // 4
  both_ms = _median_ms(lambda: (next(src), src.get_state()), n)
  snap = src.get_state()
  start = time.perf_counter()
  state = tf_data.tf_state.export(snap, limit=None)
  export_ms = (time.perf_counter() - start) * 1e3
  fresh = tf_data.TfDataSource(_pipeline(buffer, width))
  start = time.perf_counter()
  fresh.set_state(state)
  restore_ms = (time.perf_counter() - start) * 1e3
  return {
    "read_ms": read_ms,
    "snapshot_ms": both_ms - read_ms,
    "state_bytes": tf_data.tf_state.exported_size(state),
    "export_ms": export_ms,
    "restore_ms": restore_ms,
  }


def main() -> None:
  print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
  print("| shuffle buffer | element | read / batch | snapshot / batch | state | export | restore |")
  print("|---|---|---|---|---|---|---|")
  for buffer, width in [(40, 0), (10_000, 0), (1_000, 784), (10_000, 784)]:
    m = measure(buffer, width)
    element = "int64 id" if not width else f"id + {width} B"
    print(
      f"| {buffer:,} | {element} | {m['read_ms']:.2f} ms | {m['snapshot_ms']:.2f} ms"
      f" | {m['state_bytes'] / 1e3:,.0f} kB | {m['export_ms']:.0f} ms | {m['restore_ms']:.0f} ms |"
    )


if __name__ == "__main__":
  main()
