"""A stop at thousands of hosts, on the simulated cluster.

Run from the repository root:

  python -m benchmarks.sim_scale --processes 1024,4096,16384
  python -m benchmarks.sim_scale --bounds     # the stop's latency at every step, 8 hosts
  python -m benchmarks.sim_scale --pace --processes 1024   # a 50 ms store beside a 20 ms step

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

With ``--pace``: every host has 120 batches and a 20 ms step, prefetch 2,
and each store call's result comes 50 ms late (issue 58's store latency at
scale). Prints host 0's seconds per batch in steps: after batch 10
(``steps_per_batch``, the target is 1.25 or less), over batches 10 to 30
(the horizon's ramp) and after batch 60.
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
  init = decider.Decider.__init__

  def timed_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    send = self.send

    def timed(result, now):
      t0 = time.process_time()
      try:
        return send(result, now)
      finally:
        spent[0] += time.process_time() - t0
        spent[1] = self._seq

    self.send = timed

  decider.Decider.__init__ = timed_init
  try:
    cluster = testing.SimulatedCluster(processes=n, prefetch_batches=PREFETCH)
    plans = [testing.HostPlan(batches=12, step_s=STEP_S)] * n
    plans[-1] = testing.HostPlan(batches=12, step_s=STEP_S, stop=(AT, OFFSET_S))
    t0 = time.perf_counter()
    out = cluster.run(plans)
    wall = time.perf_counter() - t0
  finally:
    decider.Decider.__init__ = init
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


def pace(n: int, store_s: float = 0.05, step_s: float = 0.02) -> dict[str, float | int]:
  """`n` hosts, 120 batches each, a `step_s` step beside a `store_s` store: host 0's pace."""
  cluster = testing.SimulatedCluster(processes=n, prefetch_batches=PREFETCH, store_s=store_s)
  t0 = time.perf_counter()
  out = cluster.run([testing.HostPlan(batches=120, step_s=step_s)] * n)
  wall = time.perf_counter() - t0
  r = out[0].received

  def steps(first: int, last: int) -> float:
    return round((r[last] - r[first]) / (last - first) / step_s, 3)

  return {
    "processes": n,
    "store_s": store_s,
    "step_s": step_s,
    "steps_per_batch": steps(10, len(r) - 1),
    "batches_10_30": steps(10, 30),
    "after_60": steps(60, len(r) - 1),
    "wall_s": round(wall, 1),
  }


def bounds(n: int = 8) -> None:
  """Prints, per prefetch and step, the worst stop latency over requests at batches 1 to 6."""
  print("| prefetch | step | worst latency (s) | bound (s) | worst / bound | runs |")
  print("|---|---|---|---|---|---|")
  for prefetch in (0, 2):
    for step in (0.005, 0.05, 0.5, 2.0, 5.0, 10.0):
      worst, runs = 0.0, 0
      for at in range(1, 7):
        for offset in (0.0, 0.3, 0.9):
          plans = [testing.HostPlan(batches=40, step_s=step)] * n
          plans[-1] = testing.HostPlan(batches=40, step_s=step, stop=(at, offset * step))
          out = testing.SimulatedCluster(processes=n, prefetch_batches=prefetch).run(plans)
          assert len({o.batches for o in out}) == 1, "not one batch everywhere"
          asked = out[-1].received[at - 1] + offset * step
          worst, runs = max(worst, max(o.ended_at for o in out) - asked), runs + 1
      bound = 1.0 + (prefetch + 1) * step + 1.0
      print(
        f"| {prefetch} | {step:g} s | {worst:.3f} | {bound:.3f} | {worst / bound:.2f} | {runs} |"
      )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--processes", default="64,1024", help="comma-separated host counts")
  parser.add_argument("--bounds", action="store_true", help="the stop's latency table instead")
  parser.add_argument("--pace", action="store_true", help="a 50 ms store's pace instead")
  args = parser.parse_args(argv)
  if args.bounds:
    bounds()
    return 0
  for n in (int(x) for x in args.processes.split(",")):
    print(json.dumps(pace(n) if args.pace else run(n)), flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
