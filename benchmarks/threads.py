"""Where the CPU per batch goes, per thread: `host.cpu_per_batch_hosts`' pair, thread by thread.

Run from the repository root (Linux: it reads ``/proc/self/task``):

  python -m benchmarks.threads                 # 2 x 4, 0.8 MB, 20 ms step, 300 batches, 3 trials
  python -m benchmarks.threads --trials 5 --variants bare,ours,ours_p0

Per trial and host: the process CPU per batch of each variant over the bare
loop (paired within the trial, as `host.cpu_per_batch_hosts` pairs them),
then each thread's CPU per batch (``schedstat``, in ns) between batch
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

from benchmarks import host

_EXITED: dict[int, tuple[int, str]] = {}  # Native id: (CPU ns at exit, name).


def _cpu_ns(tid: int | str) -> int:
  with open(f"/proc/self/task/{tid}/schedstat") as f:
    return int(f.read().split()[0])


def _recorded(run: Any) -> Any:
  def wrapper(self: threading.Thread) -> None:
    try:
      run(self)
    finally:
      _EXITED[threading.get_native_id()] = (_cpu_ns(threading.get_native_id()), self.name)

  return wrapper


def _snapshot() -> dict[int, tuple[int, str]]:
  """Every thread's (CPU ns, name) now, the exited ones' as they left."""
  names = {t.native_id: t.name for t in threading.enumerate()}
  names[os.getpid()] = "main"
  out = dict(_EXITED)
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        comm = f.read().strip().rstrip("0123456789-_")
      out[int(tid)] = (_cpu_ns(tid), names.get(int(tid), f"other: {comm}"))
    except OSError:  # Gone meanwhile.
      continue
  return out


def _trial(make: Any, step_s: float, n: int) -> tuple[float, dict[str, float]]:
  """(process CPU us per batch, {thread: CPU us per batch}) between `SKIP` and `n - SKIP`."""
  import jax

  a, b = host.SKIP, n - host.SKIP
  before = after = {}
  cpu0 = cpu1 = 0.0
  for k, batch in enumerate(make(), 1):
    jax.block_until_ready(batch)
    del batch
    time.sleep(step_s)
    if k in (a, b):
      snap, cpu = _snapshot(), time.process_time()
      before, cpu0 = (snap, cpu) if k == a else (before, cpu0)
      after, cpu1 = (snap, cpu) if k == b else (after, cpu1)
  per: dict[str, float] = collections.Counter()
  for tid, (ns, name) in after.items():
    per[name] += (ns - before.get(tid, (0, name))[0]) / (b - a) / 1e3
  return (cpu1 - cpu0) / (b - a) * 1e6, dict(per)


def per_thread(*, n: int = 300, trials: int = 3, variants: str = "bare,ours") -> list[Any]:
  """Each trial's {variant: (process CPU us, per-thread us)} on this host."""
  threading.Thread.run = _recorded(threading.Thread.run)  # type: ignore[method-assign]
  rows, width = 256, int(0.8e6) // 256
  rng = np.random.default_rng(0)
  distinct = [{"x": rng.integers(0, 255, (rows, width), dtype=np.uint8)} for _ in range(4)]
  makers = host._cpu_variants([distinct[i % 4] for i in range(n)], rows)  # noqa: SLF001
  keys = variants.split(",")
  for k in keys:  # Warm-up.
    _trial(makers[k], 0.0, n)
  out = []
  for t in range(trials):
    order = keys[t % len(keys) :] + keys[: t % len(keys)]
    out.append({k: _trial(makers[k], 0.02, n) for k in order})
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
      extra = "  ".join(f"{k} {c - bare:+.0f}" for k, (c, _) in trial.items() if k != "bare")
      print(f"process {p} trial {t}: bare {bare:.0f} us; over it: {extra}")
      for k, (_, threads) in trial.items():
        top = sorted(threads.items(), key=lambda kv: -kv[1])
        print(f"  {k:8s}", "  ".join(f"{name}={us:.0f}" for name, us in top if us >= 1))


if __name__ == "__main__":
  main()
