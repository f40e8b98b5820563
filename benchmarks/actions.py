"""The agreement's actions in a steady stream, per process: what each round costs the store.

Run from the repository root:

  python -m benchmarks.actions                # 2 x 4, 0.8 MB batches, 20 ms step, 500 batches
  python -m benchmarks.actions --prefetch 0 --show 30

Every action the core yields (`interpreter.carry`) is logged with its time
between batch `--n` / 5 * 2 and `--n` / 5 * 4 (the steady state, past the
horizon's growth at the start): the count per batch of each action type,
the decided runs' lengths, and the first `--show` actions of each process.
A decision round costs process 0 a `ReadChunks` and a `PostDecision`, and
every other process a `WaitDecision`: each a call of the coordination
service, which process 0 also serves.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any

import numpy as np


def steady_actions(*, n: int = 500, step_s: float = 0.02, prefetch: int = 2) -> dict[str, Any]:
  """This host's actions between batch 2n/5 and 4n/5: counts per batch, decided runs, the first ones."""
  import jax

  import grain_jax_sync as gjs
  from grain_jax_sync._src.agreement import interpreter

  log: list[tuple[float, Any]] = []
  carry = interpreter.carry

  def logged(action: Any, exchange: Any, world: Any) -> Any:
    log.append((time.monotonic(), action))
    return (yield from carry(action, exchange, world))

  interpreter.carry = logged
  rows, width = 256, int(0.8e6) // 256
  data = [np.zeros((rows, width), np.uint8) for _ in range(n)]
  received = []
  for batch in gjs.iter_jax_batches(data, batch_size=rows, prefetch_batches=prefetch):
    jax.block_until_ready(batch)
    del batch
    time.sleep(step_s)
    received.append(time.monotonic())
  interpreter.carry = carry
  a, b = 2 * n // 5, 4 * n // 5
  t0, t1 = received[a], received[b]
  steady = [(t, x) for t, x in log if t0 <= t <= t1]
  counts = collections.Counter(type(x).__name__ for _, x in steady)
  runs = [
    sum(s[2] for s in json.loads(x.text)["st"])
    for _, x in steady
    if type(x).__name__ == "PostDecision"
  ]
  return {
    "per_batch": {k: round(v / (b - a), 3) for k, v in counts.most_common()},
    "decided_runs": runs,
    "first": [(round(t - t0, 3), repr(x)[:100]) for t, x in steady],
  }


def main() -> None:
  from grain_jax_sync import testing

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--n", type=int, default=500)
  parser.add_argument("--prefetch", type=int, default=2)
  parser.add_argument("--show", type=int, default=0)
  args = parser.parse_args()
  kw = {"n": args.n, "prefetch": args.prefetch}
  res = testing.values(
    testing.run_processes(
      steady_actions, num_processes=2, devices_per_process=4, kwargs=kw, timeout_s=600
    )
  )
  for p, r in enumerate(res):
    print(f"process {p}: actions a batch {r['per_batch']}")
    if r["decided_runs"]:
      print(f"  decided runs (positions each): {r['decided_runs']}")
    for t, x in r["first"][: args.show]:
      print(f"  {t:8.3f} s  {x}")


if __name__ == "__main__":
  main()
