"""How soon every host learns of an ending, in batches and seconds, and what a wait costs (not a test).

Run from the repository root:

  python -m benchmarks.endings                        # print every table
  python -m benchmarks.endings --only stop_latency    # one table (repeat --only for more)
  python -m benchmarks.endings --write                # also append them to benchmarks/RESULTS.md

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

The seconds compare `time.time()` across the processes: they share one
machine's clock.
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


def _run(fn: Any, *args: Any, timeout_s: float = 600) -> list[Any]:
  return testing.values(
    testing.run_processes(
      fn, num_processes=2, devices_per_process=4, args=args, timeout_s=timeout_s
    )
  )


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
    closes = [_run(close_at_5, 400, prefetch) for _ in range(3)]
    got = [c[0]["got"] for c in closes]
    late = [round(c[0]["raised"] - c[1]["closed"], 2) for c in closes]
    out.append(
      f"| host 1 closes at batch 5 of 400 (50 ms step), prefetch {prefetch} |"
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

DECIDE_AHEAD_S = 1.0  # The default `decide_ahead_s`.
STOP_LENGTH = 400  # Batches per host: the stop, not exhaustion, ends every stream.
# Per step (s): the batches after which the request comes, alternately from
# host 0 and host 1. Fewer at slow steps: each costs A steps before it.
STOP_REQUESTS = {0.005: (3, 37, 101), 0.05: (3, 17, 40), 0.5: (3, 8), 2.0: (2, 3), 5.0: (2,)}
LEAVE_STEPS = (0.02, 2.0)


def bound_s(prefetch: int, step_s: float) -> float:
  """Issue 40's bound on a stop or a leaver, in seconds from the event."""
  return DECIDE_AHEAD_S + (prefetch + 1) * step_s + 1.0


def timed_stop(prefetch: int, step_s: float, after: int, asker: int) -> dict[str, Any]:
  """`asker` calls request_stop() in its loop after its batch `after`."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  it = gjs.iter_jax_batches(_data(p, STOP_LENGTH), batch_size=64, prefetch_batches=prefetch)
  got, asked = 0, None
  for _ in it:
    got += 1
    if p == asker and got == after:
      asked = time.time()
      it.request_stop()
    time.sleep(step_s)
  ended = time.time()
  by = it.stop_requested_by
  it.close()
  return {"got": got, "asked": asked, "ended": ended, "by": by}


def stop_latency(prefetch: int) -> list[dict[str, Any]]:
  """Every (step, request) of STOP_REQUESTS in sequence, in one launch."""
  return [
    timed_stop(prefetch, step_s, after, i % 2)
    for step_s, afters in STOP_REQUESTS.items()
    for i, after in enumerate(afters)
  ]


def stop_latency_rows(prefetches: list[int]) -> list[str]:
  out = []
  for prefetch in prefetches:
    runs = _run(stop_latency, prefetch, timeout_s=900)
    cases = [(s, a, i % 2) for s, afters in STOP_REQUESTS.items() for i, a in enumerate(afters)]
    for step_s, afters in STOP_REQUESTS.items():
      seconds, batches = [], []
      for k, (step, after, asker) in enumerate(cases):
        if step == step_s:
          seconds.append(max(o[k]["ended"] for o in runs) - runs[asker][k]["asked"])
          batches.append(runs[0][k]["got"] - after)
          assert all(o[k]["by"] == asker for o in runs), (step, after, [o[k] for o in runs])
      bound = bound_s(prefetch, step_s)
      out.append(
        f"| {step_s:g} s | {prefetch} | {', '.join(map(str, afters))} |"
        f" {max(seconds):.2f} ({', '.join(f'{x:.2f}' for x in seconds)}) |"
        f" {max(batches)} ({', '.join(map(str, batches))}) | {bound:.2f} |"
        f" {'yes' if max(seconds) <= bound else f'no, +{max(seconds) - bound:.2f} s'} |"
      )
  return out


class SourceFailed(Exception):
  pass


def _failing(p: int, fail: bool, received: Any, failed: list[float]) -> Any:
  """Raises at batch 5 once this host's consumer holds batches 0-4, where `fail`."""
  for i in range(STOP_LENGTH):
    if fail and i == 5:
      opened = received.wait(30.0)
      failed.extend([time.time(), opened])
      raise SourceFailed("the shard vanished")
    yield {"x": np.full(64, 1000 * p + i, np.int32)}


def leave_at_5(kind: str, step_s: float) -> dict[str, Any]:
  """Host 1 closes after its batch 5 (`kind` "close") or its source fails at batch 5 ("error")."""
  import threading

  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  received, left, error = threading.Event(), [], None
  it = gjs.iter_jax_batches(_failing(p, p == 1 and kind == "error", received, left), batch_size=64)
  got = 0
  try:
    for _ in it:
      got += 1
      if p == 1 and got == 5:
        received.set()
        if kind == "close":
          left.append(time.time())
          break
      time.sleep(step_s)
  except (RuntimeError, SourceFailed) as e:
    error = f"{type(e).__name__}: {e}"
  ended = time.time()
  it.close()
  left_s, opened = (left + [None, None])[:2]
  return {"got": got, "left": left_s, "opened": opened, "ended": ended, "error": error}


def leavers() -> list[dict[str, Any]]:
  return [leave_at_5(kind, step_s) for kind in ("close", "error") for step_s in LEAVE_STEPS]


def leaver_rows(prefetches: list[int]) -> list[str]:
  del prefetches  # Default settings (prefetch_batches=2) only.
  runs = _run(leavers, timeout_s=900)
  cases = [(kind, step_s) for kind in ("close", "error") for step_s in LEAVE_STEPS]
  out = []
  for k, (kind, step_s) in enumerate(cases):
    peer, leaver = runs[0][k], runs[1][k]
    took, bound = peer["ended"] - leaver["left"], bound_s(2, step_s)
    error = peer["error"] or "none: ended normally"
    named = "naming process 1" if "process 1" in error else f"NOT naming it: {error}"
    kind_words = "closes after" if kind == "close" else "fails (its source) at"
    within = "within" if took <= bound else f"over by {took - bound:.2f} s"
    if kind == "error" and not leaver["opened"]:  # A blocked read held the decided batches.
      within += "; its source's read waited 30 s in vain for batch 4 to reach the job"
    out.append(
      f"| host 1 {kind_words} batch 5, {step_s * 1000:g} ms step, defaults |"
      f" host 0 raised {took:.2f} s after it ({named}), after {peer['got']} batches;"
      f" bound {bound:.2f} s: {within} |"
    )
  return out


TABLES = {
  "decided_ahead": decided_ahead_rows,
  "close": close_rows,
  "stuck": stuck_rows,
  "leavers": leaver_rows,
}
STOP_HEADER = [
  "| step | prefetch | asked after batch | seconds from the request to every host's end, worst"
  " (each) | batches after the request, most (each) | bound (s) | within |",
  "|---|---|---|---|---|---|---|",
]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--write", action="store_true", help="append to benchmarks/RESULTS.md")
  parser.add_argument(
    "--only", action="append", choices=[*TABLES, "stop_latency"], help="run only these tables"
  )
  args = parser.parse_args()
  only = args.only or [*TABLES, "stop_latency"]
  tables = []
  main_rows = [row for name in TABLES if name in only for row in TABLES[name]([0, 2])]
  if main_rows:
    tables.append(["| endings (2 x 4, defaults) | figure |", "|---|---|", *main_rows])
  if "stop_latency" in only:
    tables.append([*STOP_HEADER, *stop_latency_rows([0, 2])])
  text = "\n\n".join("\n".join(t) for t in tables)
  print(text)
  if args.write:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python -m benchmarks.endings", *[f"--only {o}" for o in args.only or []]])
    with open(os.path.join(_ROOT, "benchmarks", "RESULTS.md"), "a") as f:
      f.write(f"\n## Endings ({stamp}, `{command} --write`)\n\n{text}\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
