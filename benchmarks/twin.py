"""The calibrated twin: one table of schedules, run as real processes and on the simulated cluster.

Run from the repository root:

  python -m benchmarks.twin                 # every row, 3 real runs each
  python -m benchmarks.twin --rows stop_2,pace_20ms_p2 --runs 1
  python -m benchmarks.twin --sim-only      # the simulated side alone (milliseconds)

A row is a list of `grain_jax_sync.testing.HostPlan`s and the cluster's
settings. The real side runs it with `testing.run_processes` (1 CPU device
per process, `jax.distributed` on 127.0.0.1), `jax.distributed`'s key-value
client slowed by `store_s` per call (the store's round trip), each host's
source reading `read_s` a batch and its loop stepping `step_s`, then a jitted
sum over the global batch: a collective, which holds the hosts together as a
training step's reduction does (rows with a close or a kill step on their own, as a real
job's peers would otherwise hang in the collective). The simulated side runs
the same plans on `testing.SimulatedCluster(store_s=...)`.

Compared per row: each host's batches and ending, the seconds from the
ending's cause (a stop's request, a close, a kill, a source error) until
every host's loop saw it ("reach"), and host 0's mean seconds per batch
after batch 10 ("per batch"). Real figures are the median of the runs, with
the spread of batches and reach across them.

Each real run says how it kept to the schedule (``ran``: its steps' and its
store calls' time past the plan, and the cores its processes used). A run
whose store calls took over 15% longer than `store_s` (a loaded machine) is
left out; where every run did, the row says ``agree: null`` rather than
blame either side.

Every figure is compared with the simulator run at the schedule the real
runs kept (``kept_*``; ``sim_*`` is the simulator at the plan): each step as
long as the real steps' own time (``ran.own_step_s``: per step, the host that
entered the collective last, which waited for no peer) and each store call
as long as the real calls (``ran.store_call_s``: a local store's too, where
the plan says 0), and each read as long as the real reading thread's
(``ran.own_read_s``: the source's reads that came back to back, as the
reading thread read them for a refill).
Inline the horizon is the positions consumed in the last `decide_ahead_s`,
so a step a millisecond or two longer decides fewer positions a round, and
a round's store calls come around more often: a small excess grows. After a
kill the survivor receives what the killed host had posted, and a post
carries the reads at hand: a reading thread of 0.2 ms a read has 16 of 19
asked, one of no time all 19 (75 batches against the real job's 69-75).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from grain_jax_sync import testing

H = testing.HostPlan
# The twin's tolerance (issue 58): times within 15%; also how far a real run may
# run past its schedule (steps, store calls) and still be compared.
TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class Row:
  """One schedule: its hosts' plans and the cluster's settings."""

  name: str
  plans: tuple[testing.HostPlan, ...]
  prefetch: int = 2
  store_s: float = 0.0
  collective: bool = True
  sync_timeout_s: float = 60.0

  @property
  def hosts(self) -> int:
    return len(self.plans)


def _stop_row(name: str, n: int, step_s: float, prefetch: int = 2, store_s: float = 0.0) -> Row:
  """Host n-1 calls `request_stop()` 0.3 s into the step after its batch 4 (issue 58)."""
  plans = [H(batches=400, step_s=step_s)] * (n - 1)
  plans.append(H(batches=400, step_s=step_s, stop=(4, 0.3)))
  return Row(name, tuple(plans), prefetch=prefetch, store_s=store_s)


def _pace_row(store_s: float, prefetch: int, n: int = 2) -> Row:
  name = f"pace_{round(store_s * 1000)}ms_p{prefetch}" + (f"_{n}" if n != 2 else "")
  return Row(name, (H(batches=120, step_s=0.02),) * n, prefetch=prefetch, store_s=store_s)


def _slow_row(prefetch: int) -> Row:
  """Host 1 reads for 1.5 s beside a 1 s step; host 0 asks a stop 0.25 s into the step after its batch 3.

  Not at the batch's instant: there the real job's reach is a race (a stop
  and a read at one instant), 1.0 or 1.5 s at prefetch 2 in about even runs.
  """
  plans = (H(batches=40, step_s=1.0, stop=(3, 0.25)), H(batches=40, step_s=1.0, read_s=1.5))
  return Row(f"slow_reader_p{prefetch}", plans, prefetch=prefetch)


def rows() -> list[Row]:
  """The table: stops at 2 to 32 hosts, closes, a kill, a stall, an error, store round trips."""
  out = [_pace_row(s, p) for s in (0.0, 0.02, 0.05) for p in (0, 2)]
  out += [_pace_row(0.05, 2, 8)]  # More than one peer: each wait reads every peer's posts.
  out += [
    _stop_row("stop_2", 2, 0.5),
    _stop_row("stop_2_p0", 2, 0.5, prefetch=0),
    _stop_row("stop_4", 4, 0.5),
    _stop_row("stop_8", 8, 0.5),
    _stop_row("stop_16", 16, 0.5),
    _stop_row("stop_32", 32, 0.5),
    _stop_row("stop_4_20ms", 4, 0.5, store_s=0.02),
    _stop_row("stop_2_50ms_p0", 2, 0.5, prefetch=0, store_s=0.05),
    _stop_row("stop_2_step1s", 2, 1.0),
    _stop_row("stop_2_step2s", 2, 2.0),
    _slow_row(0),
    _slow_row(2),
    Row(
      "close_2",
      (H(batches=400, step_s=0.05), H(batches=400, step_s=0.05, close_at=5)),
      collective=False,
    ),
    # Closed once every position is decided, before the end: the peer is told at the end.
    Row(
      "close_end_2",
      (H(batches=40, step_s=0.05), H(batches=40, step_s=0.05, close_at=38)),
      collective=False,
    ),
    Row(
      "kill_2",
      (H(batches=4000, step_s=0.05), H(batches=4000, step_s=0.05, kill_at=2.0)),
      collective=False,
    ),
    Row("error_2", (H(batches=40, step_s=0.05), H(batches=40, step_s=0.05, error_at=5))),
    Row(
      "stall_stop_2",
      (H(batches=400, step_s=0.05, stop=(6, 0.0)), H(batches=400, step_s=0.05, stall=(8, 5.0))),
    ),
  ]
  return out


# -- the real side: runs in every process ------------------------------------------------


class _Slowed:
  """`jax.distributed`'s key-value client, each call's result `store_s` late (its round trip)."""

  def __init__(self, client: Any, store_s: float):
    self._client, self._store_s = client, store_s
    self.calls: dict[str, int] = {}  # Per method: calls made.
    self.extra: list[float] = []  # Per call but blocking reads: seconds beyond `store_s`.

  def __getattr__(self, name: str) -> Any:
    attr = getattr(self._client, name)
    if not callable(attr):
      return attr

    def call(*args: Any, **kwargs: Any) -> Any:
      self.calls[name] = self.calls.get(name, 0) + 1
      t0 = time.monotonic()
      try:
        return attr(*args, **kwargs)
      finally:
        time.sleep(self._store_s)
        if name != "blocking_key_value_get":  # Its wait is not the store's.
          self.extra.append(time.monotonic() - t0 - self._store_s)

    return call


def _source(
  p: int, plan: testing.HostPlan, times: list[float] | None = None
) -> Iterator[dict[str, np.ndarray]]:
  for b in range(plan.batches):
    read_s = plan.stall[1] if plan.stall is not None and plan.stall[0] == b else plan.read_s
    time.sleep(read_s)
    if times is not None:
      times.append(time.monotonic())
    if b == plan.error_at:
      raise OSError(f"process {p}'s source failed at batch {b}")
    yield {"x": np.full(plan.rows, 1000 * p + b, np.int32)}


def real_host(row: Row) -> dict[str, Any]:
  """One host of `row`: what it received, when, and how it ended (absolute `time.time()`)."""
  import jax
  import jax.numpy as jnp
  from jax._src import distributed

  import grain_jax_sync as gjs

  p = jax.process_index()
  plan = row.plans[p]
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  total = jax.jit(lambda b: jnp.sum(b["x"]))
  warm = jax.make_array_from_process_local_data(sharding, np.zeros(plan.rows, np.int32))
  total({"x": warm}).block_until_ready()  # Compiled before the clock starts.
  client = distributed.global_state.client
  client.wait_at_barrier("twin/start", 120_000)
  t0 = time.time()
  out: dict[str, Any] = {"t0": t0, "received": [], "asked": None, "event": None, "by": None}
  if plan.kill_at is not None:
    threading.Timer(plan.kill_at, lambda: os.kill(os.getpid(), 9)).start()
  slowed = distributed.global_state.client = _Slowed(client, row.store_s)
  cpu0 = time.process_time()  # Every thread of this process: the library's, JAX's, gRPC's.
  reads: list[float] = []  # When the source handed each batch to the reading thread.
  try:
    it = gjs.iter_jax_batches(
      _source(p, plan, reads),
      batch_size=plan.rows,
      mesh=mesh,
      prefetch_batches=row.prefetch,
      sync_timeout_s=row.sync_timeout_s,
    )
    out.update(_loop(it, plan, row, total))
  finally:
    distributed.global_state.client = client
  out["cpu_s"] = time.process_time() - cpu0
  out["calls"] = slowed.calls
  out["extra_s"] = sorted(slowed.extra)
  # Reads back to back (a refill's, under 5 ms apart): the reading thread's own time a read.
  gaps = [g for g in (b - a - plan.read_s for a, b in zip(reads, reads[1:])) if g < 5e-3]
  out["own_read_s"] = statistics.median(gaps) if gaps else 0.0
  return out


def _loop(it: Any, plan: testing.HostPlan, row: Row, total: Any) -> dict[str, Any]:
  received: list[float] = []
  steps: list[float] = []  # Each step as it ran: from a batch to the next `next()`.
  out: dict[str, Any] = {"received": received, "asked": None, "event": None, "steps": steps}
  ending = "end"

  def stop() -> None:
    out["asked"] = time.time()
    it.request_stop()

  try:
    while plan.close_at != len(received):
      if received:
        steps.append(time.time() - received[-1])
      batch = next(it)
      received.append(time.time())
      if plan.stop is not None and plan.stop[0] == len(received):
        threading.Timer(plan.stop[1], stop).start()
      # A step of `step_s`, its reduction across hosts last (as a training step's): it ends
      # `step_s` after the last host entered it, as `SimulatedCluster(collective_steps=True)`.
      time.sleep(max(0.0, received[-1] + plan.step_s - time.time()))
      if row.collective:
        total(batch).block_until_ready()
    ending = "closed"
    out["event"] = time.time()
    it.close()
  except StopIteration:
    out["by"] = it.stop_requested_by
  except Exception as e:  # noqa: BLE001 - the ending, whatever its type.
    ending = type(e).__name__
  out["ended_at"] = time.time()
  out["ending"] = ending
  if ending == "end":
    it.close()
  return out


def run_real(row: Row) -> list[dict[str, Any]]:
  """One real run of `row`: each host's record, times relative to the run's start."""
  outcomes = testing.run_processes(
    real_host,
    num_processes=row.hosts,
    args=(row,),
    timeout_s=120,
    exit_barrier_timeout_s=0 if any(p.kill_at is not None for p in row.plans) else 30.0,
  )
  started = [o.value["t0"] for o in outcomes if isinstance(o.value, dict)]
  if not started:
    raise RuntimeError(
      f"no process of {row.name} returned: {[(o.exit_code, o.log) for o in outcomes]}"
    )
  t0 = min(started)
  hosts = []
  for p, o in enumerate(outcomes):
    if o.value is None:  # Killed.
      kill_at = row.plans[p].kill_at
      hosts.append(
        {
          "received": [],
          "ending": "killed" if kill_at else o.error_type,
          "ended_at": kill_at or float("nan"),
          "asked": None,
          "event": None,
        }
      )
      continue
    v = dict(o.value)
    shift = lambda t: None if t is None else t - t0  # noqa: E731
    v["received"] = [t - t0 for t in v["received"]]
    for k in ("asked", "event", "ended_at"):
      v[k] = shift(v[k])
    hosts.append(v)
  return hosts


# -- the simulated side -----------------------------------------------------------------


def run_sim(row: Row) -> list[dict[str, Any]]:
  cluster = testing.SimulatedCluster(
    processes=row.hosts,
    prefetch_batches=row.prefetch,
    store_s=row.store_s,
    sync_timeout_s=row.sync_timeout_s,
    collective_steps=row.collective,
  )
  out = cluster.run(list(row.plans))
  hosts = []
  for o, plan in zip(out, row.plans, strict=True):
    asked = None
    if plan.stop is not None and len(o.received) >= plan.stop[0]:
      asked = o.received[plan.stop[0] - 1] + plan.stop[1]
    event = o.ended_at if o.ending == "closed" else None
    hosts.append(
      {
        "received": o.received,
        "ending": o.ending,
        "ended_at": o.ended_at,
        "asked": asked,
        "event": event,
      }
    )
  return hosts


# -- the comparison ---------------------------------------------------------------------


def summary(row: Row, hosts: list[dict[str, Any]]) -> dict[str, Any]:
  """Batches, endings, reach and per-batch time of one run of `row`."""
  batches = [len(h["received"]) for h in hosts]
  endings = sorted({h["ending"] for h in hosts})
  ended = [h["ended_at"] for h in hosts if h["ending"] != "killed"]
  cause = None
  for h, plan in zip(hosts, row.plans, strict=True):
    if h["asked"] is not None:
      cause = h["asked"]
    elif h["event"] is not None:
      cause = h["event"]
    elif plan.kill_at is not None:
      cause = plan.kill_at
    elif plan.error_at is not None:
      cause = h["ended_at"]
  reach = None if cause is None else max(ended) - cause
  r = hosts[0]["received"]
  per_batch = (r[-1] - r[10]) / (len(r) - 11) if len(r) > 20 else None
  out = {"batches": batches, "endings": endings, "reach": reach, "per_batch": per_batch}
  if any("steps" in h for h in hosts):  # A real run: how it kept to the schedule.
    out["ran"] = _ran(row, hosts, max(ended))
  return out


def _ran(row: Row, hosts: list[dict[str, Any]], wall_s: float) -> dict[str, float]:
  """How a real run kept to `row`'s schedule: its steps and store calls, its CPU.

  ``step``: its steps' time over the plan's, less 1 (a collective step waits
  for every peer's batch, and for a process the machine has not run yet);
  ``store``: each store call's mean time beyond `store_s`, over `store_s`;
  ``cores``: the CPU every process used, over the run's wall time (this
  machine has `os.cpu_count()`).
  """
  ran, planned, extra = 0.0, 0.0, []
  for h, plan in zip(hosts, row.plans, strict=True):
    ran += sum(h.get("steps", ()))
    planned += len(h.get("steps", ())) * plan.step_s
    extra += h.get("extra_s", [])
  steps = [h["steps"] for h in hosts if h.get("steps")]
  n = min((len(x) for x in steps), default=0)
  own = [min(x[k] for x in steps) for k in range(10, n)]
  return {
    "step": ran / planned - 1 if planned else 0.0,
    # Per step after batch 10, the shortest host's: the step's own time over the plan.
    "own_step_s": statistics.mean(own) - row.plans[0].step_s if own else 0.0,
    "store": statistics.mean(extra) / row.store_s if extra and row.store_s else 0.0,
    "store_call_s": row.store_s + (statistics.mean(extra) if extra else 0.0),
    "own_read_s": statistics.median([h["own_read_s"] for h in hosts if "own_read_s" in h] or [0]),
    "cores": sum(h.get("cpu_s", 0.0) for h in hosts) / wall_s,
  }


def _kept(run: dict[str, Any]) -> bool:
  """Whether a real run's store kept to its round trip, within the twin's 15%.

  A slower store is another schedule than the simulator's (this machine's
  load: the client's and the coordinator's threads wait for a core). A step
  past its plan is not left out: a collective step waits for the peers'
  batches too, which is the agreement's part, and the simulator's.
  """
  ran = run.get("ran")
  return ran is None or ran["store"] <= TOLERANCE


def as_kept(row: Row, real: list[dict[str, Any]]) -> dict[str, Any]:
  """The simulated run at the schedule the real runs kept (their medians, on every host): each
  step as long as its own time (`_ran`'s ``own_step_s``), each store call and read as theirs."""
  ran = [r["ran"] for r in real if "ran" in r]
  if not ran:
    return summary(row, run_sim(row))
  own = max(0.0, statistics.median(x.get("own_step_s", 0.0) for x in ran))
  store_s = statistics.median(x.get("store_call_s", row.store_s) for x in ran)
  read = statistics.median(x.get("own_read_s", 0.0) for x in ran)
  plans = tuple(
    dataclasses.replace(p, step_s=p.step_s + own, read_s=p.read_s + read) for p in row.plans
  )
  kept = dataclasses.replace(row, plans=plans, store_s=max(row.store_s, store_s))
  return summary(kept, run_sim(kept))


def compare(row: Row, real: list[dict[str, Any]], sim: dict[str, Any]) -> dict[str, Any]:
  """The row's real runs against its simulated run, and whether they agree (issue 58).

  Only the real runs whose store kept to its round trip count (`_kept`).
  Where none did, `agree` is None and `ran` says by how much they missed it.
  """
  kept = [r for r in real if _kept(r)]
  if not kept:
    ran = [r["ran"] for r in real]
    return {
      "row": row.name,
      "hosts": row.hosts,
      "agree": None,
      "ran": {k: round(max(x[k] for x in ran), 2) for k in ("step", "store", "cores")},
      "cpus": os.cpu_count(),
    }
  real = kept
  at = as_kept(row, real)  # What is compared: the simulator at the real runs' schedule.
  counts = [max(r["batches"]) for r in real]
  reaches = [r["reach"] for r in real if r["reach"] is not None]
  paces = [r["per_batch"] for r in real if r["per_batch"] is not None]
  out: dict[str, Any] = {
    "row": row.name,
    "hosts": row.hosts,
    "real_batches": sorted(set(counts)),
    "sim_batches": max(sim["batches"]),
    "kept_batches": max(at["batches"]),
    "real_endings": sorted({e for r in real for e in r["endings"]}),
    "sim_endings": sim["endings"],
  }
  ok = out["real_endings"] == at["endings"]
  # Within the real runs' own spread, or within one of it (issue 58).
  ok = ok and min(counts) - 1 <= max(at["batches"]) <= max(counts) + 1
  if reaches:
    real_reach = statistics.median(reaches)
    out["real_reach"] = [round(min(reaches), 2), round(real_reach, 2), round(max(reaches), 2)]
    out["sim_reach"] = None if sim["reach"] is None else round(sim["reach"], 2)
    out["kept_reach"] = None if at["reach"] is None else round(at["reach"], 2)
    # Off by the distance to the real runs' own range (a race decides a batch more or less).
    sim_reach = at["reach"] or 0.0
    off = max(0.0, min(reaches) - sim_reach, sim_reach - max(reaches))
    ok = ok and (off <= 0.2 or off <= TOLERANCE * real_reach)
  if paces:
    real_pace = statistics.median(paces)
    out["real_per_batch"] = round(real_pace, 4)
    out["sim_per_batch"] = None if sim["per_batch"] is None else round(sim["per_batch"], 4)
    pace = at["per_batch"]
    out["kept_per_batch"] = None if pace is None else round(pace, 4)
    ok = ok and pace is not None and abs(pace / real_pace - 1) <= TOLERANCE
  out["agree"] = ok
  ran = [r["ran"] for r in real if "ran" in r]
  if ran:  # The kept runs' worst: steps and store calls past the plan, cores used.
    out["ran"] = {k: round(max(x[k] for x in ran), 2) for k in ("step", "store", "cores")}
    out["ran"]["own_step_ms"] = round(max(x.get("own_step_s", 0.0) for x in ran) * 1e3, 2)
    out["ran"]["store_call_ms"] = round(max(x.get("store_call_s", 0.0) for x in ran) * 1e3, 2)
    out["ran"]["own_read_ms"] = round(max(x.get("own_read_s", 0.0) for x in ran) * 1e3, 3)
  return out


def _real_run(row: Row) -> dict[str, Any]:
  """One real run's summary; a run in which no process returned (a loaded machine) runs again."""
  try:
    return summary(row, run_real(row))
  except RuntimeError:
    return summary(row, run_real(row))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
  parser.add_argument("--runs", type=int, default=3, help="real runs per row")
  parser.add_argument("--sim-only", action="store_true")
  parser.add_argument("--save", help="also write the real runs' summaries to this JSON file")
  parser.add_argument("--load", help="the real runs' summaries from this file (no process runs)")
  args = parser.parse_args(argv)
  chosen = [r for r in rows() if not args.rows or r.name in args.rows.split(",")]
  saved: dict[str, Any] = {}
  if args.load:
    with open(args.load) as f:
      saved = json.load(f)
  for row in chosen:
    sim = summary(row, run_sim(row))
    if args.sim_only or (args.load and row.name not in saved):
      print(json.dumps({"row": row.name, **sim}, default=lambda x: round(x, 3)), flush=True)
      continue
    load = os.getloadavg()[0]
    if row.name not in saved:
      saved[row.name] = {"load": load, "runs": [_real_run(row) for _ in range(args.runs)]}
      if args.save:
        with open(args.save, "w") as f:
          json.dump(saved, f)
    real = saved[row.name]
    print(
      json.dumps({**compare(row, real["runs"], sim), "load": round(real["load"], 1)}), flush=True
    )
  return 0


if __name__ == "__main__":
  from benchmarks import twin  # The processes import the scenario and rows by module name.

  raise SystemExit(twin.main())
