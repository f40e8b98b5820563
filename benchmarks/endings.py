"""How soon every host learns of an ending, and what a wait costs (not a test).

Run from the repository root:

  python -m benchmarks.endings            # print the rows
  python -m benchmarks.endings --write    # also append them to benchmarks/RESULTS.md

Rows, 2 processes x 4 CPU devices, default settings (R =
`synchronize_lookahead + prefetch_batches` = 12):

* decided beyond the slowest consumer: host 1 trains with a 20 ms step,
  host 0 with none; the most batches host 0 had received beyond host 1 at
  any moment (host 0 receives only decided batches);
* a peer's close: host 1 closes after its batch 5 of a 400-batch stream
  (50 ms step); the batches host 0 received, and the seconds until it raised;
* a stuck peer: host 1's source stalls for 10 s before its batch 8; the CPU
  of each host's longest `next()` (whole process), as a share of one core.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import time
from typing import Any

import numpy as np

from grain_jax_sync import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(p: int, n: int, stall_at: int | None = None, stall_s: float = 0.0) -> Any:
  for i in range(n):
    if i == stall_at:
      time.sleep(stall_s)
    yield {"x": np.full(64, 1000 * p + i, np.int32)}


def lead(n: int, prefetch: int) -> dict[str, Any]:
  """Times at which this host received each batch (host 1 steps 20 ms)."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  times = []
  with gjs.iter_jax_batches(_data(p, n), batch_size=64, prefetch_batches=prefetch) as it:
    for _ in it:
      times.append(time.time())
      if p == 1:
        time.sleep(0.02)
  return {"times": times}


def close_at_5(n: int, prefetch: int) -> dict[str, Any]:
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  got, raised_s, closed_at = 0, None, None
  it = gjs.iter_jax_batches(_data(p, n), batch_size=64, prefetch_batches=prefetch)
  try:
    for _ in it:
      got += 1
      if p == 1 and got == 5:
        closed_at = time.time()
        it.close()
        break
      time.sleep(0.05)
  except RuntimeError:
    raised_s = time.time()
  it.close()
  return {"got": got, "raised": raised_s, "closed": closed_at}


def stuck_peer(stall_s: float, prefetch: int) -> dict[str, Any]:
  """The CPU of the `next()` that waits longest (host 1's source stalls before its batch 8)."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  data = _data(p, 12, stall_at=8 if p == 1 else None, stall_s=stall_s)
  it = gjs.iter_jax_batches(data, batch_size=64, prefetch_batches=prefetch)
  calls = []
  while True:
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    if next(it, None) is None:
      break
    cpu1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    used = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    calls.append((t1 - t0, used))
  it.close()
  wait_s, used = max(calls)
  return {"cpu_share": used / wait_s, "wait_s": wait_s}


def _run(fn: Any, *args: Any) -> list[Any]:
  return testing.values(
    testing.run_processes(fn, num_processes=2, devices_per_process=4, args=args, timeout_s=600)
  )


def _max_lead(times: list[list[float]]) -> int:
  """The most batches host 0 had received beyond host 1 at any of its receipts."""
  fast, slow = np.asarray(times[0]), np.asarray(times[1])
  return int(max(i + 1 - np.searchsorted(slow, t, side="right") for i, t in enumerate(fast)))


def rows(prefetches: list[int]) -> list[str]:
  out = []
  for prefetch in prefetches:
    r = 10 + prefetch
    leads = [_max_lead([o["times"] for o in _run(lead, 300, prefetch)]) for _ in range(3)]
    out.append(
      f"| decided beyond the slowest consumer, prefetch {prefetch} (R = {r}) |"
      f" max {max(leads)} batches (3 runs: {leads}) |"
    )
    closes = [_run(close_at_5, 400, prefetch) for _ in range(3)]
    got = [c[0]["got"] for c in closes]
    late = [round(c[0]["raised"] - c[1]["closed"], 2) for c in closes]
    out.append(
      f"| host 1 closes at batch 5 of 400 (50 ms step), prefetch {prefetch} |"
      f" host 0 received {got} batches, raised {late} s after the close (bound 5 + 2R ="
      f" {5 + 2 * r}) |"
    )
    stuck = _run(stuck_peer, 10.0, prefetch)
    out.append(
      f"| a peer stuck 10 s in its source, prefetch {prefetch} |"
      f" the longest wait in next(): process 0 {stuck[0]['wait_s']:.1f} s at"
      f" {100 * stuck[0]['cpu_share']:.2f}% of one core, process 1 (its source"
      f" stuck) {stuck[1]['wait_s']:.1f} s at {100 * stuck[1]['cpu_share']:.2f}% |"
    )
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
  args = parser.parse_args()
  lines = ["| endings (2 x 4, defaults) | figure |", "|---|---|", *rows([0, 2])]
  table = "\n".join(lines)
  print(table)
  if args.write:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    with open(os.path.join(_ROOT, "benchmarks", "RESULTS.md"), "a") as f:
      f.write(f"\n## Endings ({stamp}, `python -m benchmarks.endings --write`)\n\n{table}\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
