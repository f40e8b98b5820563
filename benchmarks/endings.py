"""How soon every host learns of an ending, in batches and seconds, and what a wait costs (not a test).

Run from the repository root:

  python -m benchmarks.endings                        # print every table
  python -m benchmarks.endings --only stop_latency    # one table (repeat --only for more)
  python -m benchmarks.endings --write                # also replace their tables in benchmarks/RESULTS.md

Tables (`--only` names), 2 processes x 4 CPU devices, default settings unless
a row names one:

* `decided_ahead`: host 1 trains with a 20 ms step, host 0 with none; the
  most batches host 0 had received beyond host 1 at any moment (host 0
  receives only decided batches);
* `close`: host 1 closes after its batch 5 of a 400-batch stream (50 ms
  step); the batches host 0 received, and the seconds until it raised;
* `stuck`: host 1's source stalls for 10 s before its batch 8; the CPU of
  each host's longest `next()` (whole process), as a share of one core;
* `stop_latency`: one host calls `request_stop()` in its loop after its
  batch A, at steps of 5 ms to 5 s (a sleep), prefetch 0 and 2; per step,
  the worst over several A (the request falls at different points of a round)
  of the seconds from the request to every host's loop end, and the batches
  trained after the request, each against the bound
  ``decide_ahead_s + (prefetch_batches + 1) * step + 1 s`` (issue 40);
* `leavers`: host 1 closes its iterator after its batch 5, or its source
  raises at batch 5 (once its consumer holds batches 0-4: the job's batch 5,
  not the read-ahead's), at a 20 ms and a 2 s step; the seconds until
  host 0's loop raised, against the same bound.

The cases and the bound are benchmarks/timed_endings.py's, which
tests/test_stop.py asserts on: 8 rows a batch, `sync_timeout_s=60`. The
seconds compare `time.time()` across the processes: they share one
machine's clock.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import numpy as np

from benchmarks import results_file, timed_endings


def _stalling(p: int, n: int, at: int | None, stall_s: float) -> Any:
  for i, batch in enumerate(timed_endings.data(p, n)):
    if i == at:
      time.sleep(stall_s)
    yield batch


def lead(n: int, prefetch: int) -> dict[str, Any]:
  """Times at which this host received each batch (host 1 steps 20 ms)."""
  import jax

  p = jax.process_index()
  times = []
  with timed_endings.iterator(timed_endings.data(p, n), prefetch) as it:
    for _ in it:
      times.append(time.time())
      if p == 1:
        time.sleep(0.02)
  return {"times": times}


def stuck_peer(stall_s: float, prefetch: int) -> dict[str, Any]:
  """The CPU of the `next()` that waits longest (host 1's source stalls before its batch 8)."""
  import jax

  p = jax.process_index()
  it = timed_endings.iterator(_stalling(p, 12, 8 if p == 1 else None, stall_s), prefetch)
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
  return timed_endings.launch(fn, 2, 4, *args, timeout_s=900)


def _max_lead(times: list[list[float]]) -> int:
  """The most batches host 0 had received beyond host 1 at any of its receipts."""
  fast, slow = np.asarray(times[0]), np.asarray(times[1])
  return int(max(i + 1 - np.searchsorted(slow, t, side="right") for i, t in enumerate(fast)))


def decided_ahead_rows(prefetches: list[int]) -> list[str]:
  out = []
  for prefetch in prefetches:
    r = 10 + prefetch
    leads = [_max_lead([o["times"] for o in _run(lead, 300, prefetch)]) for _ in range(3)]
    out.append(
      f"| decided beyond the slowest consumer, prefetch {prefetch} (R = {r}) |"
      f" max {max(leads)} batches (3 runs: {leads}) |"
    )
  return out


def close_rows(prefetches: list[int]) -> list[str]:
  out = []
  for prefetch in prefetches:
    r = 10 + prefetch
    closes = [_run(timed_endings.leave_at_5, prefetch, "close", 0.05) for _ in range(3)]
    got = [len(c[0]["rows"]) for c in closes]
    late = [round(c[0]["ended"] - c[1]["left"], 2) for c in closes]
    out.append(
      f"| host 1 closes at batch 5 of {timed_endings.LENGTH} (50 ms step), prefetch {prefetch} |"
      f" host 0 received {got} batches, raised {late} s after the close (bound 5 + 2R ="
      f" {5 + 2 * r}) |"
    )
  return out


def stuck_rows(prefetches: list[int]) -> list[str]:
  out = []
  for prefetch in prefetches:
    stuck = _run(stuck_peer, 10.0, prefetch)
    out.append(
      f"| a peer stuck 10 s in its source, prefetch {prefetch} |"
      f" the longest wait in next(): process 0 {stuck[0]['wait_s']:.1f} s at"
      f" {100 * stuck[0]['cpu_share']:.2f}% of one core, process 1 (its source"
      f" stuck) {stuck[1]['wait_s']:.1f} s at {100 * stuck[1]['cpu_share']:.2f}% |"
    )
  return out


# -- endings in seconds (issue 40) ----------------------------------------------------

# Per step (s): the batches after which the request comes, alternately from
# host 0 and host 1. Fewer at slow steps: each costs A steps before it.
STOP_REQUESTS = {0.005: (3, 37, 101), 0.05: (3, 17, 40), 0.5: (3, 8), 2.0: (2, 3), 5.0: (2,)}
LEAVE_CASES = [(kind, step_s) for kind in ("close", "error") for step_s in (0.02, 2.0)]


def stop_latency_rows(prefetches: list[int]) -> list[str]:
  cases = [(s, a, i % 2) for s, afters in STOP_REQUESTS.items() for i, a in enumerate(afters)]
  out = []
  for prefetch in prefetches:
    runs = _run(timed_endings.timed_stops, prefetch, cases)
    for step_s, afters in STOP_REQUESTS.items():
      seconds, batches = [], []
      for k, case in enumerate(cases):
        if case[0] == step_s:
          late, after_request = timed_endings.stop_late([o[k] for o in runs], case)
          seconds.append(late)
          batches.append(after_request)
          assert all(o[k]["by"] == case[2] for o in runs), (case, [o[k] for o in runs])
      bound = timed_endings.bound(prefetch, step_s).seconds
      out.append(
        f"| {step_s:g} s | {prefetch} | {', '.join(map(str, afters))} |"
        f" {max(seconds):.2f} ({', '.join(f'{x:.2f}' for x in seconds)}) |"
        f" {max(batches)} ({', '.join(map(str, batches))}) | {bound:.2f} |"
        f" {'yes' if max(seconds) <= bound else f'no, +{max(seconds) - bound:.2f} s'} |"
      )
  return out


def leaver_rows(prefetches: list[int]) -> list[str]:
  del prefetches  # Default settings (prefetch_batches=2) only.
  runs = _run(timed_endings.leave_cases, 2, LEAVE_CASES)
  out = []
  for k, (kind, step_s) in enumerate(LEAVE_CASES):
    peer, leaver = runs[0][k], runs[1][k]
    took, bound = peer["ended"] - leaver["left"], timed_endings.bound(2, step_s).seconds
    error = peer["error"] or "none: ended normally"
    named = "naming process 1" if "process 1" in error else f"NOT naming it: {error}"
    kind_words = "closes after" if kind == "close" else "fails (its source) at"
    within = "within" if took <= bound else f"over by {took - bound:.2f} s"
    if kind == "error" and not leaver["opened"]:  # A blocked read held the decided batches.
      within += "; its source's read waited in vain for batch 4 to reach the job"
    out.append(
      f"| host 1 {kind_words} batch 5, {step_s * 1000:g} ms step, defaults |"
      f" host 0 raised {took:.2f} s after it ({named}), after {len(peer['rows'])} batches;"
      f" bound {bound:.2f} s: {within} |"
    )
  return out


TABLES = {
  "decided_ahead": decided_ahead_rows,
  "close": close_rows,
  "stuck": stuck_rows,
  "leavers": leaver_rows,
}
NAMES = [*TABLES, "stop_latency"]  # `--only` choices; each table's section of RESULTS.md:
SECTION = "benchmarks.endings {}"
STOP_HEADER = [
  "| step | prefetch | asked after batch | seconds from the request to every host's end, worst"
  " (each) | batches after the request, most (each) | bound (s) | within |",
  "|---|---|---|---|---|---|---|",
]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--write", action="store_true", help="replace their tables in benchmarks/RESULTS.md"
  )
  parser.add_argument("--only", action="append", choices=NAMES, help="run only these tables")
  args = parser.parse_args()
  only = args.only or NAMES
  tables = {
    name: ["| endings (2 x 4, defaults) | figure |", "|---|---|", *rows([0, 2])]
    for name, rows in TABLES.items()
    if name in only
  }
  if "stop_latency" in only:
    tables["stop_latency"] = [*STOP_HEADER, *stop_latency_rows([0, 2])]
  command = " ".join(
    ["python -m benchmarks.endings", *[f"--only {o}" for o in args.only or []]]
    + (["--write"] if args.write else [])
  )
  head = results_file.provenance(command)
  print("\n\n".join("\n".join(t) for t in tables.values()) + f"\n\n{head}")
  if args.write:  # Each table replaces its own section: RESULTS.md does not grow.
    for name, table in tables.items():
      results_file.write_section(SECTION.format(name), head + "\n" + "\n".join(table))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
