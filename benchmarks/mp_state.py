"""A Grain `mp_prefetch` read, with and without its state taken before the first read.

Not a test. Runs anywhere (no accelerator):

  python -m benchmarks.mp_state
  python -m benchmarks.mp_state --workers 2 --trials 4 --n 150

Grain's `device_put` reads through a `ThreadPrefetchIterDataset`, whose
constructor takes its source's state; a Grain 0.2.18 `mp_prefetch` iterator
whose state is taken before its first read makes its worker iterators in the
caller, unstarted, and runs another way. Wall per batch after 10 untimed, the
modes interleaved: ``plain`` (read as a training loop reads it), ``state``
(`get_state()` first) and ``thread`` (through `ThreadPrefetchIterDataset(ds,
4)`). The library reads as ``plain`` does (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import grain
import numpy as np

MODES = ("plain", "state", "thread")


class Record:
  """A 32 x 32 x 3 uint8 image made in NumPy, with its index (picklable for the workers)."""

  def __call__(self, i: int) -> dict[str, np.ndarray]:
    image = np.random.default_rng(i).integers(0, 256, (32, 32, 3), np.uint8)
    return {"image": image.astype(np.float32).astype(np.uint8), "index": np.int32(i)}


def per_batch_ms(mode: str, workers: int, n: int) -> float:
  """Wall ms per batch of 64 records over `n` batches, after 10 untimed."""
  ds: Any = grain.MapDataset.range(1 << 20).map(Record()).batch(64).to_iter_dataset()
  ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  if mode == "thread":
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=4)
  it = iter(ds)
  if mode == "state":
    it.get_state()
  for _ in range(10):
    next(it)
  start = time.perf_counter()
  for _ in range(n):
    next(it)
  wall = time.perf_counter() - start
  it.close()
  return wall / n * 1e3


def main() -> None:
  from absl import flags

  flags.FLAGS.mark_as_parsed()  # Grain's workers read absl flags.
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--trials", type=int, default=4)
  parser.add_argument("--n", type=int, default=150)
  args = parser.parse_args()
  times: dict[str, list[float]] = {m: [] for m in MODES}
  for trial in range(args.trials):
    for mode in MODES if trial % 2 == 0 else MODES[::-1]:
      times[mode].append(per_batch_ms(mode, args.workers, args.n))
  print(f"mp_state: grain {grain.__version__}, {args.workers} workers, {args.n} batches a trial")
  for mode, ms in times.items():
    print(f"  {mode:6s} {np.median(ms):7.2f} ms a batch ({min(ms):.2f}..{max(ms):.2f})")


if __name__ == "__main__":
  main()
