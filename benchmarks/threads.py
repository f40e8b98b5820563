"""Where the CPU per batch goes, per thread: `host.cpu_per_batch_hosts`' pair, thread by thread.

Run from the repository root (Linux: it reads ``/proc/self/task``):

  python -m benchmarks.threads                 # 2 x 4, 0.8 MB, 20 ms step, 300 batches, 3 trials
  python -m benchmarks.threads --trials 5 --variants bare,ours,ours_p0,ours_d4,bare_thread
  python -m benchmarks.threads --trials 5 --variants bare,bare_again,bare_thread,ours

Per trial and host: the process CPU per batch of each variant over the bare
loop (paired within the trial, as `host.cpu_per_batch_hosts` pairs them),
then each thread's CPU per batch in us and, in brackets, the times it was
run per batch (woken, mostly; both from ``schedstat``) between batch
`host.SKIP` and `n - host.SKIP`: the library's threads by name, the
consumer's as ``main``, the others (XLA's, gRPC's) by their kernel name. A
thread that exits inside the window (the agreement and reading threads end
once the last position is decided) is counted up to its exit.
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time
from typing import Any

import numpy as np

from benchmarks import host, twin, workloads

_EXITED: dict[int, tuple[int, int, str]] = {}  # Native id: (CPU ns, times run, at exit; name).


def _cpu_ns(tid: int | str) -> tuple[int, int]:
  """A thread's CPU ns and the times it was run (woken or scheduled in: ``schedstat``)."""
  with open(f"/proc/self/task/{tid}/schedstat") as f:
    ns, _, slices = f.read().split()
  return int(ns), int(slices)


def _recorded(run: Any) -> Any:
  def wrapper(self: threading.Thread) -> None:
    try:
      run(self)
    finally:
      _EXITED[threading.get_native_id()] = (*_cpu_ns(threading.get_native_id()), self.name)

  return wrapper


def _snapshot() -> dict[int, tuple[int, int, str]]:
  """Every thread's (CPU ns, times run, name) now, the exited ones' as they left."""
  names = {t.native_id: t.name for t in threading.enumerate()}
  names[os.getpid()] = "main"
  out = dict(_EXITED)
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        comm = f.read().strip().rstrip("0123456789-_")
      out[int(tid)] = (*_cpu_ns(tid), names.get(int(tid), f"other: {comm}"))
    except OSError:  # Gone meanwhile.
      continue
  return out


def _trial(make: Any, step_s: float, n: int, counted: Any) -> tuple[float, Any, float]:
  """(process CPU us, {thread: (CPU us, times run)}, store calls) per batch, batch `SKIP` to `n - SKIP`."""
  import jax

  a, b = host.SKIP, n - host.SKIP
  before = after = {}
  cpu0 = cpu1 = calls0 = calls1 = 0.0
  for k, batch in enumerate(make(), 1):
    jax.block_until_ready(batch)
    del batch
    time.sleep(step_s)
    if k in (a, b):
      snap, cpu, calls = _snapshot(), time.process_time(), sum(counted.calls.values())
      before, cpu0, calls0 = (snap, cpu, calls) if k == a else (before, cpu0, calls0)
      after, cpu1, calls1 = (snap, cpu, calls) if k == b else (after, cpu1, calls1)
  per: dict[str, tuple[float, float]] = collections.defaultdict(lambda: (0.0, 0.0))
  for tid, (ns, runs, name) in after.items():
    ns0, runs0, _ = before.get(tid, (0, 0, name))
    us, times = per[name]
    per[name] = (us + (ns - ns0) / (b - a) / 1e3, times + (runs - runs0) / (b - a))
  return (cpu1 - cpu0) / (b - a) * 1e6, dict(per), (calls1 - calls0) / (b - a)


def per_thread(*, n: int = 300, trials: int = 3, variants: str = "bare,ours") -> list[Any]:
  """Each trial's {variant: (process CPU us, per-thread (us, times run), store calls)} here."""
  import jax
  from jax._src import distributed

  import grain_jax_sync as gjs

  threading.Thread.run = _recorded(threading.Thread.run)  # type: ignore[method-assign]
  jax.devices()  # The backend first: it takes the client as it is.
  # The twin's client wrapper at no added time: it counts this process's calls (process 0
  # also serves every peer's).
  counted = distributed.global_state.client = twin._Slowed(distributed.global_state.client, 0.0)  # noqa: SLF001
  rows, width = 256, int(0.8e6) // 256
  rng = np.random.default_rng(0)
  distinct = [{"x": rng.integers(0, 255, (rows, width), dtype=np.uint8)} for _ in range(4)]
  data = [distinct[i % 4] for i in range(n)]
  makers = host._cpu_variants(data, rows)  # noqa: SLF001
  # Rounds of the agreement 4 times further apart, as far as the read-ahead's bytes allow.
  makers["ours_d4"] = lambda: gjs.iter_jax_batches(data, batch_size=rows, decide_ahead_s=4.0)
  # The bare loop in a thread 2 batches ahead: the floor of any design with a build thread.
  makers["bare_thread"] = lambda: workloads._handed_over(data, keep=False, ahead=2)  # noqa: SLF001
  # The bare loop again: what the pairing within a trial reads for no difference at all.
  makers["bare_again"] = makers["bare"]
  keys = variants.split(",")
  for k in keys:  # Warm-up.
    _trial(makers[k], 0.0, n, counted)
  out = []
  for t in range(trials):
    order = keys[t % len(keys) :] + keys[: t % len(keys)]
    out.append({k: _trial(makers[k], 0.02, n, counted) for k in order})
  return out


def main() -> None:
  from grain_jax_sync import testing

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--n", type=int, default=300)
  parser.add_argument("--trials", type=int, default=3)
  parser.add_argument("--variants", default="bare,ours")
  kw = vars(parser.parse_args())
  res = testing.values(
    testing.run_processes(
      per_thread, num_processes=2, devices_per_process=4, kwargs=kw, timeout_s=1800
    )
  )
  for p, trials in enumerate(res):
    for t, trial in enumerate(trials):
      bare = trial["bare"][0]
      extra = "  ".join(f"{k} {c - bare:+.0f}" for k, (c, *_) in trial.items() if k != "bare")
      print(f"process {p} trial {t}: bare {bare:.0f} us; over it: {extra}")
      for k, (_, threads, calls) in trial.items():
        print(f"  {k:8s} store calls made {calls:.3f} a batch")
        top = sorted(threads.items(), key=lambda kv: -kv[1][0])
        print(
          f"  {k:8s}", "  ".join(f"{name}={us:.0f} ({r:.2f})" for name, (us, r) in top if us >= 1)
        )


if __name__ == "__main__":
  main()
