"""What one store call costs in process CPU, by how long the processes idled before it.

Run from the repository root:

  python -m benchmarks.store_calls              # 2 processes, gaps of 0.02-1 s, 10 calls each
  python -m benchmarks.store_calls --gaps 0.02 0.5 --burst 1 4 --rounds 3

Process 1 calls the `jax.distributed` key-value store (a `key_value_set` of
800 bytes, `--burst` of them back to back) once per gap; process 0 serves it
(the coordination service lives there, as in every job) and only sleeps.
Each row is the process CPU a gap, with the calls, over the same gaps without
them, in us per burst, measured in turn within each round: what a round of
the agreement costs each side beyond the heartbeat and XLA's own threads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def per_burst(*, gaps: list[float], burst: list[int], rounds: int, n: int) -> dict[str, Any]:
  """{"gap/burst": [us per burst over idle, per round]} in this process."""
  import jax
  from jax._src import distributed

  client = distributed.global_state.client
  caller = jax.process_index() == 1
  out: dict[str, list[float]] = {}
  for r in range(rounds):
    for gap in gaps:
      cpu: dict[int, float] = {}
      for k in [0, *burst]:  # 0: the same gaps, idle.
        tag = f"{r}/{gap}/{k}"
        client.wait_at_barrier(f"store_calls/a/{tag}", 60_000)
        c0 = time.process_time()
        for i in range(n):
          time.sleep(gap)
          for j in range(k if caller else 0):
            client.key_value_set(f"store_calls/{tag}/{i}/{j}", "x" * 800)
        cpu[k] = (time.process_time() - c0) / n * 1e6
        client.wait_at_barrier(f"store_calls/b/{tag}", 60_000)
      for k in burst:
        out.setdefault(f"{gap:g} s/{k}", []).append(cpu[k] - cpu[0])
  return out


def main() -> None:
  from grain_jax_sync import testing

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gaps", type=float, nargs="+", default=[0.02, 0.1, 0.3, 1.0])
  parser.add_argument("--burst", type=int, nargs="+", default=[1, 4])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--n", type=int, default=10)
  kw = vars(parser.parse_args())
  res = testing.values(
    testing.run_processes(
      per_burst, num_processes=2, devices_per_process=1, kwargs=kw, timeout_s=1800
    )
  )
  print("process CPU a burst of calls over idle, us (median of rounds; each round)")
  print(f"{'gap/calls':>12}  {'process 1 (calls)':>28}  {'process 0 (serves)':>28}")
  for key in res[0]:
    cells = []
    for p in (1, 0):
      runs = res[p][key]
      cells.append(f"{statistics.median(runs):6.0f} ({', '.join(f'{v:.0f}' for v in runs)})")
    print(f"{key:>12}  {cells[0]:>28}  {cells[1]:>28}")


if __name__ == "__main__":
  main()
