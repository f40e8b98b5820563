"""Exchange scale simulation: N clients of one real coordination service.

Run from the repository root:

  python -m benchmarks.exchange_scale --processes 64,256,1024 --json
  python -m benchmarks.exchange_scale --quick      # 16 and 64 clients, a few windows

One process starts the coordination service that `jax.distributed.initialize`
starts (`get_distributed_runtime_service`) and N clients of it
(`get_distributed_runtime_client`, connected in threads: connect is a
barrier), with no devices. Every client gets its own
`key_value.KeyValueExchange` (the real key layout, deletes and end count) and
the simulation drives the real agreement pieces over many windows of
`--lookahead` batch positions:

1. every process other than 0 posts its rows as one `messages.Chunk` (the
   follower's post, with its ack and, in the first one, its signature and
   settings digest);
2. process 0, the decider, reads every new chunk with one directory read,
   adds them to its `ledger.Ledger` (and their times to the
   `stats(all_hosts=True)` table), decides the window as `decider.Decider`
   does (`plan.decide` over `Ledger.window_reports`) and posts one
   `messages.Decision`;
3. every process other than 0 reads that decision, parses it, and deletes its
   chunks (a group at a time) as the follower does; process 0 deletes
   decisions every process has acknowledged.

The stage classes (`decider.Decider`, `follower.Follower`) are not run
themselves: one of them per client means 1,024 Python threads polling one
interpreter on a shared core, which would measure the GIL, not the store.
The client calls of steps 1 and 3 are spread over `--threads` worker threads
(the client releases the GIL during its RPC), so that the service sees
concurrent clients as it does in a job.

Prints one JSON object per N (``--json``) or a table: ``processes``,
``window_ms`` (median wall time from the first chunk post of a window until
every client holds its decision), ``store_ops_per_window`` and
``store_bytes_per_window`` (keys and values written plus keys and values read,
counted by a thin wrapper around each client), ``decide_ms`` (process 0's
ledger and `plan.decide` time per window), ``decider_ms`` (process 0's whole
time per window, its directory read and decision post included: the serial
part of a window in a job, where the other processes' work runs on their own
hosts), ``decider_cpu_ms`` (the CPU time of process 0's thread in it: its
Python, without the service's side of its store calls; steadier than
``decider_ms`` on a busy machine) and ``connect_s``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import statistics
import threading
import time
from typing import Any

import numpy as np

from grain_jax_sync._src import batches, job_stats, messages, trees
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import stats as stats_lib
from grain_jax_sync._src.agreement import common
from grain_jax_sync._src.agreement import ledger as ledger_lib
from grain_jax_sync._src.exchange import key_value
from grain_jax_sync._src.exchange import streams as exchange_streams

# Rows per batch in the simulated reports (any value: only the encoding length
# depends on it).
ROWS = 256
# A realistic first-report payload: the structure signature and settings digest.
SIGNATURE = batches.Signature.of(
  *trees.flatten(
    {"image": np.zeros((ROWS, 32, 32, 3), np.uint8), "label": np.zeros(ROWS, np.int32)}
  )
).to_json()
CONFIG = {"batch_size": ROWS, "drop_last": False, "paddings": None, "digest": "0" * 16}
# Generous service timeouts: 1,024 clients on 2 cores must not be declared dead.
TIMEOUT_S = 600


class CountingClient:
  """A thin wrapper around a store client that counts calls and bytes.

  Bytes are the keys and values sent plus the keys and values received.
  """

  def __init__(self, client: Any, totals: dict[str, int], lock: threading.Lock):
    self._c = client
    self._totals = totals
    self._lock = lock

  def _count(self, nbytes: int) -> None:
    with self._lock:
      self._totals["ops"] += 1
      self._totals["bytes"] += nbytes

  def key_value_set(self, key: str, value: str, *args: Any) -> None:
    self._count(len(key) + len(value))
    self._c.key_value_set(key, value, *args)

  def key_value_try_get(self, key: str) -> str:
    try:
      out = self._c.key_value_try_get(key)
    except Exception:
      self._count(len(key))
      raise
    self._count(len(key) + len(out))
    return out

  def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
    try:
      out = self._c.blocking_key_value_get(key, timeout_ms)
    except Exception:
      self._count(len(key))
      raise
    self._count(len(key) + len(out))
    return out

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    out = self._c.key_value_dir_get(prefix)
    self._count(len(prefix) + sum(len(k) + len(v) for k, v in out))
    return out

  def key_value_delete(self, key: str) -> None:
    self._count(len(key))
    self._c.key_value_delete(key)

  def key_value_increment(self, key: str, n: int) -> int:
    self._count(len(key) + 8)
    return self._c.key_value_increment(key, n)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _connect(n: int) -> tuple[Any, list[Any], float]:
  """A coordination service and `n` connected clients of it."""
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top

  addr = f"127.0.0.1:{_free_port()}"
  service = _jax.get_distributed_runtime_service(
    addr, n, heartbeat_timeout=TIMEOUT_S, cluster_register_timeout=TIMEOUT_S, shutdown_timeout=30
  )
  clients = [
    _jax.get_distributed_runtime_client(
      addr,
      i,
      rpc_timeout=TIMEOUT_S,
      init_timeout=TIMEOUT_S,
      heartbeat_timeout=TIMEOUT_S,
      shutdown_on_destruction=False,
    )
    for i in range(n)
  ]
  t0 = time.perf_counter()
  threads = [threading.Thread(target=c.connect, daemon=True) for c in clients]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return service, clients, time.perf_counter() - t0


def _shutdown(service: Any, clients: list[Any]) -> None:
  """Disconnects every client (a barrier, so in threads), then stops the service."""
  threads = [threading.Thread(target=c.shutdown, daemon=True) for c in clients]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  service.shutdown()


class _Follower:
  """The follower's side of one window: post rows, read the decision, delete."""

  def __init__(self, ex: key_value.KeyValueExchange, who: common.Identity):
    self.ex = ex
    self.who = who
    self.posted = 0
    self.seq = 0
    self.chunks: list[tuple[int, int]] = []

  def post(self, rows: tuple[int, ...]) -> None:
    first = self.posted == 0
    who = self.who
    report = messages.Report(
      process_index=who.process,
      rows=rows,
      signature=SIGNATURE if first else None,
      local_devices=who.devices,
      config=who.config if first else None,
      resume=who.resume if first else None,
    )
    # The stage times a follower adds for `stats(all_hosts=True)` (new each window).
    times = (0.001 * self.seq, 0.002 * self.posted, 0.0005 * self.seq, 0.0001 * self.posted)
    chunk = messages.Chunk(start=self.posted, ack=self.seq, report=report, times=times)
    self.chunks.append((self.ex.post_chunk(chunk.to_json()), self.posted))
    self.posted += len(rows)

  def follow(self, decided: int) -> int:
    """Reads decision `self.seq`; returns the positions it decides."""
    text = self.ex.try_decision(self.seq)
    while text is None:
      text = self.ex.wait_decision(self.seq)
    decision = messages.Decision.from_json(text)
    self.seq += 1
    done = decided + len(decision.steps)
    read = None
    while self.chunks and self.chunks[0][1] < done:
      read = self.chunks.pop(0)[0] + 1
    if read is not None:
      self.ex.delete_chunks(read)
    return len(decision.steps)


class _Decider:
  """Process 0's side: one directory read, the ledger, `plan.decide`, one post."""

  def __init__(self, ex: key_value.KeyValueExchange, who: common.Identity):
    self.ex = ex
    self.n = ex.process_count
    self.led = ledger_lib.Ledger(self.n)
    self.led.set_own(0, signature=SIGNATURE, devices=1, config=CONFIG, resume=0)
    self.rules = plan_lib.Rules(batch_size=ROWS, drop_last=False, pad=False)
    self.j = 0
    self.seq = 0
    self.acked = 0
    self.who = who
    # `stats(all_hosts=True)`'s table, fed as `decider.Decider` feeds it.
    own = dict.fromkeys(stats_lib.FIELDS, 0)
    self.job = job_stats.JobTable(lambda: dict(own, source_s=0.001 * self.seq))
    self.job.attach(0, self.n)

  def decide(self, rows: tuple[int, ...]) -> tuple[float, float, float]:
    """Decides the window once every chunk is in.

    Returns:
      The ledger and `plan.decide` seconds, and process 0's whole time for the
      window (store calls included): the serial part of a window in a job.
    """
    start = time.perf_counter()
    start_cpu = time.thread_time()
    for r in rows:
      self.led.add_rows(0, r)
    cpu = 0.0
    while True:
      items = self.ex.read_chunks()
      t0 = time.perf_counter()
      news = []
      for _, text in items:
        p, times = self.led.add_json(text)
        if times is not None:
          news.append((p, times))
      if items:
        self.job.add_times(news)
        self.job.check_stragglers(time.monotonic())
      size = self.led.window(self.j)
      cpu += time.perf_counter() - t0
      if size >= len(rows):
        break
    t0 = time.perf_counter()
    # As `decider.Decider._plan` does.
    reports = self.led.window_reports(self.j, size, with_config=self.j == 0)
    plan = plan_lib.decide(reports, self.rules, position=self.j)
    self.job.decided(plan.steps)
    self.job.check_stragglers(time.monotonic())
    table = self.job.rows_to_send(final=plan.end != messages.Outcome.CONTINUE, now=time.monotonic())
    sig = SIGNATURE if self.j == 0 else None
    decision = messages.Decision(self.j, plan.steps, plan.end, plan.error, sig, table=table)
    text = decision.to_json()
    cpu += time.perf_counter() - t0
    self.ex.post_decision(self.seq, text)
    self.seq += 1
    self.j += len(plan.steps)
    self.led.forget(self.j)
    acked = min(self.led.ack(p) for p in range(1, self.n)) if self.n > 1 else self.seq
    if acked > self.acked:
      self.ex.delete_decisions(acked)
      self.acked = acked
    return cpu, time.perf_counter() - start, time.thread_time() - start_cpu


def simulate(n: int, *, windows: int, lookahead: int, threads: int) -> dict[str, Any]:
  """Runs `windows` windows with `n` clients; returns the figures for `n`."""
  service, raw, connect_s = _connect(n)
  totals = {"ops": 0, "bytes": 0}
  lock = threading.Lock()
  ns = f"{exchange_streams.KEY_ROOT}/scale{n}"
  exchanges = [
    key_value.KeyValueExchange(
      CountingClient(c, totals, lock), ns, process_index=i, process_count=n
    )
    for i, c in enumerate(raw)
  ]
  whos = [common.Identity(process=i, devices=1, config=CONFIG, resume=0) for i in range(n)]
  decider = _Decider(exchanges[0], whos[0])
  followers = [_Follower(ex, who) for ex, who in zip(exchanges[1:], whos[1:], strict=True)]
  rows = (ROWS,) * lookahead
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
  times, ops, nbytes, cpu, serial, serial_cpu = [], [], [], [], [], []
  try:
    for w in range(windows):
      ops0, bytes0 = totals["ops"], totals["bytes"]
      t0 = time.perf_counter()
      list(pool.map(lambda f: f.post(rows), followers))
      decide_s, decider_s, decider_cpu_s = decider.decide(rows)
      decided = decider.j - lookahead
      got = list(pool.map(lambda f: f.follow(decided), followers))  # noqa: B023
      elapsed = time.perf_counter() - t0
      assert all(g == lookahead for g in got), (w, set(got))
      if w > 0:  # The first window carries signatures and settings: a warm-up.
        times.append(elapsed)
        cpu.append(decide_s)
        serial.append(decider_s)
        serial_cpu.append(decider_cpu_s)
        ops.append(totals["ops"] - ops0)
        nbytes.append(totals["bytes"] - bytes0)
    for ex in exchanges:
      ex.end()
  finally:
    pool.shutdown()
    _shutdown(service, raw)
  return {
    "processes": n,
    "window_ms": round(statistics.median(times) * 1e3, 2),
    "store_ops_per_window": round(statistics.mean(ops), 1),
    "store_bytes_per_window": round(statistics.mean(nbytes)),
    "decide_ms": round(statistics.median(cpu) * 1e3, 2),
    "decider_ms": round(statistics.median(serial) * 1e3, 2),
    "decider_cpu_ms": round(statistics.median(serial_cpu) * 1e3, 2),
    "connect_s": round(connect_s, 2),
    "windows": windows - 1,
    "lookahead": lookahead,
    "threads": threads,
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--processes", default="64,256,1024", help="comma-separated client counts")
  parser.add_argument("--windows", type=int, default=21, help="windows per count (first: warm-up)")
  parser.add_argument("--lookahead", type=int, default=10, help="positions per window")
  parser.add_argument("--threads", type=int, default=16, help="worker threads for the clients")
  parser.add_argument("--json", action="store_true", help="one JSON object per line")
  parser.add_argument("--quick", action="store_true", help="16 and 64 clients, 6 windows")
  args = parser.parse_args(argv)
  counts = [16, 64] if args.quick else [int(x) for x in args.processes.split(",")]
  windows = 6 if args.quick else args.windows
  results = []
  for n in counts:
    res = simulate(n, windows=windows, lookahead=args.lookahead, threads=args.threads)
    results.append(res)
    if args.json:
      print(json.dumps(res), flush=True)
    else:
      print(
        f"{n:>6} processes: window {res['window_ms']:8.2f} ms, "
        f"{res['store_ops_per_window']:8.1f} store ops, "
        f"{res['store_bytes_per_window']:>9} bytes per window "
        f"(decider {res['decider_ms']:.2f} ms, of which decide {res['decide_ms']:.2f} ms;"
        f" connect {res['connect_s']:.2f} s)",
        flush=True,
      )
  if len(results) > 1 and not args.json:
    a, b = results[0], results[-1]
    print(
      f"{a['processes']} -> {b['processes']} processes:"
      f" window_ms x{b['window_ms'] / a['window_ms']:.1f},"
      f" store_bytes_per_window x{b['store_bytes_per_window'] / a['store_bytes_per_window']:.1f}"
    )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
