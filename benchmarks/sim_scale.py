"""A stop at thousands of hosts, on the simulated cluster.

Run from the repository root:

  python -m benchmarks.sim_scale --processes 1024,4096,16384

Every host runs the library's real agreement core
(`grain_jax_sync.testing.SimulatedCluster`: the real `KeyValueExchange` over
an in-memory store, a virtual clock). Each host has 12 batches and a 0.5 s
step, prefetch 2; the last host asks for a stop 0.25 s into the step after
its third batch. Prints one JSON object per N: ``latency_s`` (virtual seconds
from the request until every host's loop ended) against ``bound_s``, the
batches every host received, ``rounds`` (decisions process 0 posted),
``store_ops_per_round`` (every host's store calls per decision),
``decider_cpu_ms_per_round`` (process 0's core, its actions excluded) and
``wall_s`` (this machine's time for the whole run).
"""

from __future__ import annotations

import argparse
import json
import time

from grain_jax_sync import testing
from grain_jax_sync._src.agreement import decider

STEP_S, PREFETCH, AT, OFFSET_S = 0.5, 2, 3, 0.25


def run(n: int) -> dict[str, float | int | list[int]]:
  """One stop at `n` hosts; its figures."""
  spent = [0.0, 0]  # Process 0's core: CPU seconds, decisions posted.
  send = decider.Decider.send

  def timed(self, result, now):
    t0 = time.process_time()
    try:
      return send(self, result, now)
    finally:
      spent[0] += time.process_time() - t0
      spent[1] = self._seq

  decider.Decider.send = timed
  try:
    cluster = testing.SimulatedCluster(processes=n, prefetch_batches=PREFETCH)
    plans = [testing.HostPlan(batches=12, step_s=STEP_S)] * n
    plans[-1] = testing.HostPlan(batches=12, step_s=STEP_S, stop=(AT, OFFSET_S))
    t0 = time.perf_counter()
    out = cluster.run(plans)
    wall = time.perf_counter() - t0
  finally:
    decider.Decider.send = send
  asked = out[-1].received[AT - 1] + OFFSET_S
  rounds = max(1, spent[1])
  return {
    "processes": n,
    "latency_s": round(max(o.ended_at for o in out) - asked, 3),
    "bound_s": 1.0 + (PREFETCH + 1) * STEP_S + 1.0,
    "batches": sorted({o.batches for o in out}),
    "endings": sorted({o.ending for o in out}),
    "rounds": rounds,
    "store_ops_per_round": round(cluster.store_ops / rounds, 1),
    "decider_cpu_ms_per_round": round(1000 * spent[0] / rounds, 2),
    "wall_s": round(wall, 1),
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--processes", default="64,1024", help="comma-separated host counts")
  args = parser.parse_args(argv)
  for n in (int(x) for x in args.processes.split(",")):
    print(json.dumps(run(n)), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
