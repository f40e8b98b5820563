"""A Grain `mp_prefetch` read, with and without its state taken before the first read.

Not a test. Runs anywhere (no accelerator):

  python -m benchmarks.mp_state
  python -m benchmarks.mp_state --workers 4 --read-ahead 500   # Grain's default read-ahead

Grain's `device_put` reads through a `ThreadPrefetchIterDataset`, whose
constructor takes its source's state; a Grain 0.2.18 `mp_prefetch` iterator
whose state is taken before its first read makes its worker iterators in the
caller, unstarted: each worker starts once the one before has made a batch.
The start (seconds to the first batch and to the end of the untimed
batches), then wall per batch once the workers' buffers are past, the
modes interleaved: ``plain`` (read as a training loop reads it), ``state``
(`get_state()` first), ``thread`` (through `ThreadPrefetchIterDataset(ds,
4)`) and ``device_put`` (`grain_jax_sync.device_put` to the default sharding,
JAX on the CPU). `iter_jax_batches` reads as ``plain`` does; `device_put`
takes the state first, as Grain's does (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import grain
import numpy as np

MODES = ("plain", "state", "thread", "device_put")


class Record:
  """A 32 x 32 x 3 uint8 image made in NumPy, with its index (picklable for the workers)."""

  def __call__(self, i: int) -> dict[str, np.ndarray]:
    image = np.random.default_rng(i).integers(0, 256, (32, 32, 3), np.uint8)
    return {"image": image.astype(np.float32).astype(np.uint8), "index": np.int32(i)}


def one_trial(mode: str, workers: int, n: int, read_ahead: int, skip: int) -> tuple[float, ...]:
  """Seconds to the first batch and to batch `skip` (the start), then wall ms a batch over `n`."""
  read = grain.ReadOptions(prefetch_buffer_size=read_ahead)
  ds: Any = grain.MapDataset.range(1 << 20).map(Record()).batch(64).to_iter_dataset(read)
  ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  if mode == "thread":
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=4)
  elif mode == "device_put":
    import grain_jax_sync as gjs

    ds = gjs.device_put(ds, gjs.default_sharding())
  begin = time.perf_counter()
  it = iter(ds)
  if mode == "state":
    it.get_state()
  next(it)
  first = time.perf_counter() - begin
  for _ in range(skip - 1):
    next(it)
  start = time.perf_counter()
  for _ in range(n):
    next(it)
  wall = time.perf_counter() - start
  it.close()
  return first, start - begin, wall / n * 1e3


def main() -> None:
  from absl import flags

  flags.FLAGS.mark_as_parsed()  # Grain's workers read absl flags.
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--trials", type=int, default=4)
  parser.add_argument("--n", type=int, default=400)
  parser.add_argument(
    "--read-ahead",
    type=int,
    default=16,
    help="batches each worker reads ahead (Grain's default: 500)",
  )
  parser.add_argument(
    "--skip", type=int, help="untimed batches (default: what the workers hold, and 10)"
  )
  args = parser.parse_args()
  skip = args.skip if args.skip is not None else 10 + args.workers * (args.read_ahead + 2)
  times: dict[str, list[tuple[float, ...]]] = {m: [] for m in MODES}
  for trial in range(args.trials):
    for mode in MODES if trial % 2 == 0 else MODES[::-1]:
      times[mode].append(one_trial(mode, args.workers, args.n, args.read_ahead, skip))
  print(
    f"mp_state: grain {grain.__version__}, {args.workers} workers reading {args.read_ahead} ahead,"
    f" {args.n} batches a trial after {skip}"
  )
  for mode, rows in times.items():
    first, begun, ms = (np.asarray(c) for c in zip(*rows, strict=True))
    print(
      f"  {mode:10s} first batch {np.median(first):5.2f} s, batch {skip} at {np.median(begun):5.2f} s;"
      f" then {np.median(ms):6.2f} ms a batch ({ms.min():.2f}..{ms.max():.2f})"
    )


if __name__ == "__main__":
  main()
