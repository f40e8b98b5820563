"""Mixtures and packing: threads and peak memory by source count, and throughput against one source.

``python -m benchmarks.mixture_bench``, in one process per measurement:

* ``--sources K``: the same records cut into `K` sources of a mixture, read
  through one thread prefetch; prints the most threads alive while reading
  and the process's peak resident memory.
* ``--throughput``: packed rows per second through `iter_jax_batches` of a
  3-source mixture and `pack_sequences`, and of the same records in the same
  order from one elastic source through the same packer (the same rows,
  checked), alternating in one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

RECORDS = 64_000
LENGTH = 64
BATCH = 32


def texts(k: int, n: int) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(k)
  return [
    {"tok": rng.integers(1, 30_000, size=int(rng.integers(4, 48)), dtype=np.int32)}
    for _ in range(n)
  ]


def _prefetched(ds: Any) -> Any:
  import grain

  import grain_jax_sync as gjs

  packed = gjs.pack_sequences(ds, length=LENGTH).batch(BATCH)
  return grain.experimental.ThreadPrefetchIterDataset(packed, prefetch_buffer_size=4)


def footprint(k: int, batches: int) -> dict[str, Any]:
  """The most threads alive and the peak memory while reading `batches` of a `k`-source mixture."""
  import grain_jax_sync as gjs

  sources = [texts(i, RECORDS // k) for i in range(k)]
  src = gjs.elastic_mixture(sources, list(range(1, k + 1)), _prefetched)
  threads = 0
  with gjs.iter_jax_batches(src, batch_size=BATCH) as it:
    for _, _b in zip(range(batches), it, strict=False):
      threads = max(threads, threading.active_count())
  peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  return {"sources": k, "threads": threads, "peak_rss_mib": round(peak_mib, 1)}


def _rate(src: Any, batches: int) -> float:
  import grain_jax_sync as gjs

  with gjs.iter_jax_batches(src, batch_size=BATCH) as it:
    next(it)
    start = time.perf_counter()
    for _, _b in zip(range(batches), it, strict=False):
      pass
    return batches * BATCH / (time.perf_counter() - start)


def throughput(batches: int, rounds: int) -> dict[str, Any]:
  """Packed rows/s of a 3-source mixture, and of its records in the same order from one source.

  Both go through the same transform (`pack_sequences` and `batch`), so they
  give the same rows; the rounds alternate, and the ratio is the median of
  each round's pair.
  """
  import grain_jax_sync as gjs

  sources = [texts(i, n) for i, n in enumerate((8_000, 16_000, 40_000))]

  def transform(ds: Any) -> Any:
    return gjs.pack_sequences(ds, length=LENGTH).batch(BATCH)

  mixed = gjs.elastic_mixture(sources, [1, 2, 5], transform, seed=0)
  # On one process the stream is the global rows in order: these records, in this order.
  records = [mixed.records[g] for g in range(RECORDS)]
  one = gjs.elastic_source(records, transform)
  mix_rates, one_rates = [], []
  for _ in range(rounds):
    mix_rates.append(_rate(mixed, batches))
    one_rates.append(_rate(one, batches))
  with (
    gjs.iter_jax_batches(mixed, batch_size=BATCH) as a,
    gjs.iter_jax_batches(one, batch_size=BATCH) as b,
  ):
    same = all(
      np.array_equal(x[k], y[k]) for _, x, y in zip(range(batches), a, b, strict=False) for k in x
    )
  return {
    "mixture_packed_rows_s": round(float(np.median(mix_rates))),
    "one_source_rows_s": round(float(np.median(one_rates))),
    "ratio": round(float(np.median(np.divide(mix_rates, one_rates))), 3),
    "round_ratios": [round(float(r), 2) for r in np.divide(mix_rates, one_rates)],
    "same_rows": same,
  }


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--sources", type=int)
  parser.add_argument("--throughput", action="store_true")
  parser.add_argument("--batches", type=int, default=200)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  if args.sources:
    print(json.dumps(footprint(args.sources, args.batches)))
  elif args.throughput:
    print(json.dumps(throughput(args.batches, args.rounds)))
  else:  # Each measurement in a fresh process: peak memory is per process.
    for k in (4, 64):
      cmd = [sys.executable, "-m", "benchmarks.mixture_bench", "--sources", str(k)]
      print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip())
    cmd = [sys.executable, "-m", "benchmarks.mixture_bench", "--throughput"]
    print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
  main()
