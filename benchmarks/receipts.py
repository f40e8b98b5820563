"""Per-batch receipt times of input-bound feeds, on the chip (or CPU).

Where a mean per batch hides its shape: each feed's time from one batch to
the next, median over trials, and each trial's total after `SKIP` batches.
The pipeline and step are `accelerator.py`'s input-bound ones. Usage::

  python -m benchmarks.receipts --input-rows 256 --workers 0 --n 56 --trials 5 \
    --variants bare iter_jax_batches inline iter_p3
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import numpy as np

from benchmarks import accelerator as acc


def _one(make: Any, step: Any, state: Any, n: int) -> tuple[np.ndarray, Any, dict | None]:
  """One trial: receipt times (s from the first `next()`) and the last state, and the feed's stats."""
  import jax

  before = set(threading.enumerate())
  it = iter(make())
  start, stamps = time.perf_counter(), []
  for i, batch in enumerate(it):
    stamps.append(time.perf_counter() - start)
    state = step(state, batch)
    del batch
    if i == n - 1:
      break
  jax.block_until_ready(state)
  stamps.append(time.perf_counter() - start)
  stats = getattr(getattr(it, "_jax", it), "stats", None)
  figures = stats() if callable(stats) else None
  close = getattr(it, "close", None)
  if callable(close):
    close()
  del it
  acc._settle(before)
  return np.array(stamps), state, figures


def main(argv: list[str] | None = None) -> int:
  import jax
  import jax.numpy as jnp

  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--input-rows", type=int, default=256)
  parser.add_argument("--workers", type=int, default=0)
  parser.add_argument("--n", type=int, default=56, help="batches a trial")
  parser.add_argument("--trials", type=int, default=5)
  parser.add_argument("--variants", nargs="+", default=["bare", "iter_jax_batches"])
  args = parser.parse_args(argv)
  cfg = acc.FULL
  rows, sharding = args.input_rows, acc._sharding()
  probe = {"image": np.stack([acc.make_record(0, cfg["side"])["image"]] * rows)}
  step, params, step_s = acc.calibrated_step(
    cfg["input_step_ms"] / 1e3, probe, hidden=cfg["hidden"]
  )
  ds = acc.input_pipeline(
    rows, args.n + acc.TAIL, cfg["side"], workers=args.workers, threads=cfg["input_threads"]
  )
  feeds = acc._picked(acc._input_feeds(ds, sharding, rows, diagnose=True), args.variants)
  print(f"{rows} rows, {args.workers} workers, step {step_s * 1e3:.2f} ms", flush=True)
  held = {k: jax.tree.map(jnp.copy, params) for k in feeds}
  runs: dict[str, list[np.ndarray]] = {k: [] for k in feeds}
  for t in range(args.trials + 1):  # The first round warms up.
    for k, make in feeds.items():
      stamps, held[k], figures = _one(make, step, held[k], args.n)
      if t:
        runs[k].append(stamps)
        if figures:
          print(f"  {k} stats:", {f: v for f, v in figures.items() if f.endswith("_s")})
  for k, trials in runs.items():
    a = np.stack(trials)
    totals = (a[:, -1] - a[:, acc.SKIP]) * 1e3
    print(f"{k}: after batch {acc.SKIP}, ms a trial {statistics.median(totals):.1f}", end="")
    print(" (" + " ".join(f"{x:.0f}" for x in totals) + ")")
    print("  ms a batch:", " ".join(f"{x:.1f}" for x in np.median(np.diff(a, axis=1), 0) * 1e3))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
