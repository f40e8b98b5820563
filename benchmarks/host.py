"""Benchmarks of a real host: CPU beside a step, memory, an input-bound job.

Workloads that run inside simulated hosts (`grain_jax_sync.testing`), each
side by side with its peer in one run, written against the public API only
(`iter_jax_batches`, `device_put`), and the rows `benchmarks/run.py` prints
for them:

* `cpu_per_batch`: process CPU over all threads (``time.process_time``,
  which on Linux is the CPU of every thread of the process) per batch, beside
  a step of 0, 5 and 50 ms. The step is ``time.sleep`` after
  ``jax.block_until_ready(batch)``: it releases the GIL and burns no CPU, so
  that every CPU second counted is the input pipeline's (XLA's copies
  included). Compared: the bare ``make_array_from_process_local_data`` loop,
  `iter_jax_batches` with the default prefetch and with
  ``prefetch_batches=0``, and ``grain.experimental.device_put`` over the same
  batches. Trials interleaved, each starting at the next variant.
* `float_check`: the same CPU per batch for a float64 column with x64 off
  (range-checked by the reader, cast to float32 in the transfer) against the
  same pipeline of a float32 column, beside a 5 ms step; and the check
  alone (internal API).
* `memory_one`: peak RSS growth of one variant, 64 MB batches, 20 ms step;
  `benchmarks/run.py` runs each variant in its own process, interleaved.
* `input_bound`: a Grain `DataLoader` with 2 worker processes that decode
  every row in Python, a jitted step, steps per second of the bare loop over
  the loader, `iter_jax_batches` over the loader and `device_put` over the
  same pipeline as a `grain.IterDataset` with 2 worker processes.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from benchmarks import workloads

# -- CPU per batch beside a step ----------------------------------------------

# Batches left out of the CPU per batch at each end of a trial: the start
# (threads, the first reads, filling the buffers) and the end (draining them,
# the close) are not per-batch costs. More than any buffer compared here holds.
SKIP = 8


def _cpu_trial(
  make_iter: Callable[[], Iterator[Any]],
  step_s: float,
  *,
  window: tuple[int, int] | None = None,
  held: Any = None,
) -> tuple[float, float, int]:
  """(process CPU s, wall s, batches) of one drained iterator, over `window` if given.

  `window` ``(a, b)``: from the `a`-th batch received to the `b`-th, both in
  the steady state, where a training job spends its time: the buffers are
  as full at both ends, so the batches built in the window are the batches
  received in it. An iterator's start and end (threads, the first reads,
  the close) are one-off costs, which a per-batch figure over a short trial
  would spread over its few batches. `held`, if given, is called after each
  batch.
  """
  import jax

  a, b = window or (0, -1)
  it = make_iter()
  cpu0, wall0 = time.process_time(), time.perf_counter()
  cpu1 = wall1 = 0.0
  n = 0
  for batch in it:
    jax.block_until_ready(batch)
    del batch
    if held is not None:
      held()
    if step_s:
      time.sleep(step_s)
    n += 1
    if n == a:
      cpu0, wall0 = time.process_time(), time.perf_counter()
    if n == b:
      cpu1, wall1 = time.process_time(), time.perf_counter()
  if b < 0:
    cpu1, wall1, b = time.process_time(), time.perf_counter(), n
  close = getattr(it, "close", None)
  if callable(close):
    close()
  return cpu1 - cpu0, wall1 - wall0, b - a


def _no_read_ahead(data: Any) -> Any:
  """`data` (a list or a `grain.MapDataset`) as an IterDataset that reads nothing ahead.

  `to_iter_dataset()`'s default reads up to 500 elements ahead on 16
  threads: CPU and memory of the source, not of the `device_put` under test.
  """
  ds = grain.MapDataset.source(data) if isinstance(data, list) else data
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def _cpu_variants(data: list[dict[str, np.ndarray]], rows: int) -> dict[str, Callable[[], Any]]:
  import grain_jax_sync as gjs

  sharding = gjs.default_sharding()
  return {
    "bare": lambda: workloads._bare(data),  # noqa: SLF001 - the shared floor.
    "ours": lambda: gjs.iter_jax_batches(data, batch_size=rows),
    "ours_p0": lambda: gjs.iter_jax_batches(data, batch_size=rows, prefetch_batches=0),
    "grain": lambda: iter(grain.experimental.device_put(_no_read_ahead(data), sharding)),
  }


def _cpu_config(mb: float, step_s: float, n: int, trials: int) -> dict[str, Any]:
  rows = 256
  width = int(mb * 1e6) // rows
  rng = np.random.default_rng(0)
  distinct = [{"x": rng.integers(0, 255, (rows, width), dtype=np.uint8)} for _ in range(4)]
  data = [distinct[i % 4] for i in range(n)]
  variants = _cpu_variants(data, rows)
  keys = list(variants)
  for k in keys:  # Warm-up: compiles, thread pools, Grain's first batch.
    _cpu_trial(variants[k], 0.0)
  cpu: dict[str, list[float]] = {k: [] for k in keys}
  wall: dict[str, list[float]] = {k: [] for k in keys}
  for trial in range(trials):
    first = trial % len(keys)
    for k in keys[first:] + keys[:first]:
      c, w, got = _cpu_trial(variants[k], step_s, window=(SKIP, n - SKIP))
      assert got == n - 2 * SKIP, (k, got, n)
      cpu[k].append(c / got * 1e6)
      wall[k].append(w / got * 1e3)
  out: dict[str, Any] = {"n": n, "trials": trials}
  for k in keys:
    extra = [c - b for c, b in zip(cpu[k], cpu["bare"], strict=True)]
    out[k] = {
      "cpu_us": statistics.median(cpu[k]),
      "wall_ms": statistics.median(wall[k]),
      "extra_us": statistics.median(extra),
      "extra_lo": min(extra),
      "extra_hi": max(extra),
    }
  return out


def cpu_per_batch(
  *,
  sizes_mb: tuple[float, ...] = (0.8, 8.0, 32.0),
  steps_ms: tuple[float, ...] = (0.0, 5.0, 50.0),
  n: int = 0,
  trials: int = 7,
) -> dict[str, Any]:
  """Process CPU per batch for each (batch size, step); see the module doc.

  `n` batches per trial (4 distinct ones, cycled), of which `SKIP` at each
  end are not counted; 0 picks 100 beside a step up to 5 ms and 40 beside
  50 ms (2 s per trial).
  """
  out = {}
  for mb in sizes_mb:
    for step in steps_ms:
      count = n or (100 if step <= 5 else 40)
      out[f"{mb:g} MB, {step:g} ms"] = _cpu_config(mb, step / 1e3, count, trials)
  return out


def float_check(
  *, width: int = 256, n: int = 100, trials: int = 7, step_ms: float = 5.0
) -> dict[str, Any]:
  """Process CPU per batch of a float64 column with x64 off against the same pipeline of float32.

  The float64 column is range-checked by the reader (no finite value may
  become inf in float32: `reader.check_float_range`) and cast to float32 in
  the transfer; the float32 one is neither. Beside a `step_ms` step (sleep),
  trials interleaved, `SKIP` batches left out at each end. Also the check
  alone on one batch (the median of 200 calls; internal API), to tell it
  from the cast.
  """
  import jax

  import grain_jax_sync as gjs
  from grain_jax_sync._src import batches, build, reader

  assert not jax.config.read("jax_enable_x64")
  rows = 256
  rng = np.random.default_rng(0)
  f64 = [{"x": rng.normal(size=(rows, width)) * 1e3} for _ in range(4)]
  f32 = [{"x": b["x"].astype(np.float32)} for b in f64]
  variants = {
    k: (lambda d=d: gjs.iter_jax_batches([d[i % 4] for i in range(n)], batch_size=rows))
    for k, d in (("float32", f32), ("float64", f64))
  }
  for make in variants.values():  # Warm-up: compiles, thread pools.
    _cpu_trial(make, 0.0)
  cpu: dict[str, list[float]] = {k: [] for k in variants}
  for trial in range(trials):
    keys = list(variants)[trial % 2 :] + list(variants)[: trial % 2]
    for k in keys:
      c, _, got = _cpu_trial(variants[k], step_ms / 1e3, window=(SKIP, n - SKIP))
      cpu[k].append(c / got * 1e6)
  extra = [a - b for a, b in zip(cpu["float64"], cpu["float32"], strict=True)]
  hb = batches.validate(f64[0], process_index=0, batch_index=0)
  narrow = build.narrowing(hb.signature, dtypes=None)
  assert narrow, "the float64 column is not narrowed: is x64 on?"
  alone = []
  for _ in range(200):
    t0 = time.perf_counter()
    reader.check_float_range(hb, narrow, 0, 0)
    alone.append((time.perf_counter() - t0) * 1e6)
  return {
    "n": n,
    "trials": trials,
    "batch_bytes": f64[0]["x"].nbytes,
    "step_ms": step_ms,
    "float32_us": statistics.median(cpu["float32"]),
    "extra_us": statistics.median(extra),
    "extra_lo": min(extra),
    "extra_hi": max(extra),
    "check_us": statistics.median(alone),
  }


# -- memory ---------------------------------------------------------------------


def memory_one(*, variant: str, mb: int = 64, n: int = 24, step_s: float = 0.02) -> dict[str, Any]:
  """Peak RSS growth of one variant over `n` batches of `mb` MB (own process).

  The source is the same `grain.IterDataset` for every variant, making each
  batch as it is read and reading none ahead. Variants: "bare" (the loop over the dataset),
  "grain" (`grain.experimental.device_put(ds, sharding, cpu_buffer_size=4,
  device_buffer_size=2)`) and "ours" (`grain_jax_sync.device_put` with the
  same arguments).
  """
  import jax

  import grain_jax_sync as gjs

  rows = 64
  width = mb * (1 << 20) // (rows * 4)
  sharding = gjs.default_sharding()

  live = _Live()

  def make(i: int) -> dict[str, np.ndarray]:
    return {"x": live.track(np.full((rows, width), i, np.float32))}

  ds = _no_read_ahead(grain.MapDataset.range(n).map(make))  # Not 500 x 64 MB.
  jax.block_until_ready(jax.make_array_from_process_local_data(sharding, make(0)))  # Warm-up.
  live.peak = live.count
  makers: dict[str, Callable[[], Iterator[Any]]] = {
    "bare": lambda: workloads._bare(iter(ds)),  # noqa: SLF001 - the shared floor.
    "grain": lambda: iter(
      grain.experimental.device_put(ds, sharding, cpu_buffer_size=4, device_buffer_size=2)
    ),
    "ours": lambda: iter(gjs.device_put(ds, sharding, cpu_buffer_size=4, device_buffer_size=2)),
  }
  device = [0]

  def held() -> None:  # Global arrays alive as the consumer gets each batch.
    device[0] = max(device[0], len(jax.live_arrays()))

  growth = workloads._peak_rss_growth(  # noqa: SLF001 - the shared sampler.
    lambda: _cpu_trial(makers[variant], step_s, held=held)
  )
  return {
    "variant": variant,
    "growth": growth,
    "batch_bytes": rows * width * 4,
    "host_peak": live.peak,
    "device_peak": device[0],
  }


class _Live:
  """Counts the source's batches alive (made and not yet freed), and their peak."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self.count = 0
    self.peak = 0

  def track(self, x: np.ndarray) -> np.ndarray:
    with self._lock:
      self.count += 1
      self.peak = max(self.peak, self.count)
    weakref.finalize(x, self._freed)
    return x

  def _freed(self) -> None:
    with self._lock:
      self.count -= 1


# -- an input-bound job ------------------------------------------------------------

_WIDTH = 256  # Values per row.


def decode_row(record: bytes) -> dict[str, np.ndarray]:
  """Per-row Python work: JSON text -> a float32 row, and a Python loop over it."""
  values = json.loads(record)
  acc = 0
  for v in values:  # A stand-in for tokenizing or augmenting in Python.
    acc = (acc * 31 + v) % 1_000_003
  return {"x": np.asarray(values, np.float32), "h": np.int32(acc)}


class DecodeRow(grain.transforms.Map):
  """`decode_row` as a DataLoader operation (module level: the workers import it)."""

  def map(self, element: bytes) -> dict[str, np.ndarray]:
    return decode_row(element)


def _records(count: int) -> list[bytes]:
  rng = np.random.default_rng(0)
  return [json.dumps(rng.integers(0, 1000, _WIDTH).tolist()).encode() for _ in range(count)]


def _loader(records: list[bytes], rows: int, workers: int) -> Any:
  sampler = grain.samplers.IndexSampler(
    num_records=len(records),
    shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
    shuffle=False,
    num_epochs=1,
  )
  return grain.DataLoader(
    data_source=records,
    sampler=sampler,
    operations=[DecodeRow(), grain.transforms.Batch(rows, drop_remainder=True)],
    worker_count=workers,
  )


def _dataset(records: list[bytes], rows: int, workers: int) -> Any:
  import jax

  ds = grain.MapDataset.source(records)[jax.process_index() :: jax.process_count()]
  ds = ds.map(decode_row).batch(rows, drop_remainder=True).to_iter_dataset()
  return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))


def _steps(make_iter: Callable[[], Iterator[Any]], step: Callable[[Any], Any]) -> tuple[float, int]:
  """(seconds, steps) after the first batch: the workers' start is not timed."""
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() > 1:  # Every host starts the trial together.
    multihost_utils.sync_global_devices("grain_jax_sync benchmarks.host trial")
  it = make_iter()
  start, n = 0.0, 0
  for batch in it:
    jax.block_until_ready(step(batch))
    if n == 0:
      start = time.perf_counter()
    n += 1
  elapsed = time.perf_counter() - start
  close = getattr(it, "close", None)
  if callable(close):
    close()
  return elapsed, n - 1


def input_bound(
  *, rows: int = 64, n: int = 60, trials: int = 5, workers: int = 2
) -> dict[str, Any]:
  """Steps per second of a jitted step fed by 2 Grain worker processes per host.

  Every host reads `n` batches of `rows` rows of its shard; each row is
  decoded from JSON in Python (`decode_row`). The step is a jitted
  (rows x 256) @ (256 x 256) matmul and tanh, waited on every step.
  """
  import jax
  import jax.numpy as jnp
  from absl import flags

  import grain_jax_sync as gjs

  if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags.
    flags.FLAGS.mark_as_parsed()
  records = _records(rows * n * jax.process_count())
  sharding = gjs.default_sharding()
  w = jnp.ones((_WIDTH, _WIDTH), jnp.float32) / _WIDTH
  step = jax.jit(lambda b: jnp.tanh(jnp.tanh(b["x"] @ w) @ w).sum())
  pc = jax.process_count()

  def bare() -> Iterator[Any]:
    for b in _loader(records, rows, workers):
      shapes = {k: (v.shape[0] * pc, *v.shape[1:]) for k, v in b.items()}
      yield jax.make_array_from_process_local_data(sharding, b, shapes)

  variants = {
    "bare": bare,
    "ours": lambda: gjs.iter_jax_batches(_loader(records, rows, workers), batch_size=rows),
    "device_put": lambda: iter(gjs.device_put(_dataset(records, rows, workers), sharding)),
  }
  keys = list(variants)
  rates: dict[str, list[float]] = {k: [] for k in keys}
  for trial in range(trials):
    first = trial % len(keys)
    for k in keys[first:] + keys[:first]:
      s, steps = _steps(variants[k], step)
      rates[k].append(steps / s)
  return {
    k: {"steps_s": statistics.median(v), "lo": min(v), "hi": max(v), "trials": trials}
    for k, v in rates.items()
  }


# -- driver and rows (run in benchmarks/run.py's process) -----------------------


def cpu_per_batch_hosts(*, n: int = 300, trials: int = 7) -> dict[str, Any]:
  """`cpu_per_batch` on each of several hosts, 0.8 MB batches beside a 20 ms step.

  6 s per trial: the agreement's horizon is the consumer's last
  `decide_ahead_s` (1 s), measured as it runs, so the first second of a
  stream decides in smaller rounds; a job's steady state is the rest.
  """
  return cpu_per_batch(sizes_mb=(0.8,), steps_ms=(20.0,), n=n, trials=trials)


NAMES = ("cpu_per_batch", "cpu_per_batch_hosts", "float_check", "memory_peers", "input_bound")


def run(names: list[str], quick: bool) -> dict[str, Any]:
  """Runs the named host benchmarks, each in its own simulated host(s)."""
  from grain_jax_sync import testing

  out: dict[str, Any] = {}
  if "cpu_per_batch" in names:
    kw = {"n": 2 * SKIP + 4, "trials": 1} if quick else {}
    out["cpu_per_batch"] = testing.values(
      testing.run_processes(
        cpu_per_batch, num_processes=1, devices_per_process=8, kwargs=kw, timeout_s=1800
      )
    )[0]
  if "cpu_per_batch_hosts" in names:
    kw = {"n": 2 * SKIP + 4, "trials": 1} if quick else {}
    out["cpu_per_batch_hosts"] = testing.values(
      testing.run_processes(
        cpu_per_batch_hosts, num_processes=2, devices_per_process=4, kwargs=kw, timeout_s=1800
      )
    )
  if "float_check" in names:
    kw = {"n": 2 * SKIP + 20, "trials": 3} if quick else {}
    out["float_check"] = testing.values(
      testing.run_processes(
        float_check, num_processes=1, devices_per_process=8, kwargs=kw, timeout_s=600
      )
    )[0]
  if "memory_peers" in names:
    runs, kw = (1, {"n": 8}) if quick else (3, {})
    growth: dict[str, list[float]] = {}
    for _ in range(runs):  # Each variant in its own process, interleaved.
      for variant in ("bare", "grain", "ours"):
        (r,) = testing.values(
          testing.run_processes(
            memory_one,
            num_processes=1,
            devices_per_process=8,
            kwargs={"variant": variant, **kw},
            timeout_s=600,
          )
        )
        growth.setdefault(variant, []).append(r["growth"] / r["batch_bytes"])
        growth.setdefault(f"{variant}_held", []).append((r["host_peak"], r["device_peak"]))
    out["memory_peers"] = growth
  if "input_bound" in names:
    kw = {"n": 12, "trials": 1} if quick else {}
    out["input_bound"] = testing.values(
      testing.run_processes(
        input_bound, num_processes=2, devices_per_process=4, kwargs=kw, timeout_s=1800
      )
    )
  return out


def _us(r: dict[str, Any]) -> str:
  return f"{r['extra_us']:+.0f} us ({r['extra_lo']:+.0f}..{r['extra_hi']:+.0f})"


def rows(res: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
  """The RESULTS.md rows of the host benchmarks in `res` (from `run`)."""
  out = []
  for cfg, r in res.get("cpu_per_batch", {}).items():
    step = float(cfg.split(", ")[1].split()[0])
    out.append(
      (
        "CPU per batch beside a step: process CPU over the bare loop",
        f"1 proc x 8 dev, 256-row uint8 batches of {cfg} step (sleep);"
        f" {r['n']} batches x {r['trials']} trials, counted between batch {SKIP} and"
        f" {r['n'] - SKIP}; bare loop {r['bare']['cpu_us']:.0f} us",
        f"{_us(r['ours'])}; prefetch_batches=0: {_us(r['ours_p0'])}",
        f"`grain.experimental.device_put`: {_us(r['grain'])}",
        "<= Grain's" if step else "-",
      )
    )
  for p, per_host in enumerate(res.get("cpu_per_batch_hosts", [])):
    for cfg, r in per_host.items():
      out.append(
        (
          "CPU per batch beside a step, 2 hosts: process CPU over the bare loop",
          f"2 proc x 4 dev, process {p}, 256-row uint8 batches of {cfg} step (sleep);"
          f" {r['n']} batches x {r['trials']} trials, counted between batch {SKIP} and"
          f" {r['n'] - SKIP}; bare loop {r['bare']['cpu_us']:.0f} us",
          f"{_us(r['ours'])}; prefetch_batches=0: {_us(r['ours_p0'])}",
          f"`grain.experimental.device_put`: {_us(r['grain'])}",
          "<= +300 us (process 0), <= +200 us (process 1)",
        )
      )
  fc = res.get("float_check")
  if fc:
    out.append(
      (
        "float range check: process CPU per batch, a float64 column with x64 off over float32",
        f"1 proc x 8 dev, 256-row batches of one {fc['batch_bytes'] / 2**20:.2f} MiB float64"
        f" column (checked, then cast to float32 in the transfer) vs the same pipeline of"
        f" its float32 copy; {fc['step_ms']:g} ms step (sleep); {fc['n']} batches x"
        f" {fc['trials']} trials; float32: {fc['float32_us']:.0f} us",
        f"{_us(fc)}; the check alone: {fc['check_us']:.0f} us per batch",
        "-",
        "-",
      )
    )
  mem = res.get("memory_peers")
  if mem:

    def runs(k: str) -> str:
      held = max(h for h, _ in mem[f"{k}_held"]), max(d for _, d in mem[f"{k}_held"])
      return (
        f"{statistics.median(mem[k]):.2f} ({', '.join(f'{g:.2f}' for g in mem[k])});"
        f" held at most {held[0]} source batches, {held[1]} global arrays"
      )

    out.append(
      (
        "memory: peak RSS growth (batches), `device_put(cpu_buffer_size=4, device_buffer_size=2)`",
        "1 proc x 8 dev, 64 MB batches, 20 ms step, each variant in its own process;"
        f" median of {len(mem['ours'])} run(s) each (the runs); held: source batches"
        " alive at their peak, and `jax.live_arrays()` at the consumer's batches",
        runs("ours"),
        f"`grain.experimental.device_put`: {runs('grain')}; bare loop: {runs('bare')}",
        "<= Grain's",
      )
    )
  ib = res.get("input_bound")
  if ib:

    def worst(k: str) -> dict[str, Any]:
      return min((h[k] for h in ib), key=lambda r: r["steps_s"])

    def rate(k: str) -> str:
      r = worst(k)
      return f"{r['steps_s']:.1f} steps/s ({r['lo']:.1f}..{r['hi']:.1f})"

    bare = worst("bare")["steps_s"]
    out.append(
      (
        "input-bound job: steps per second",
        "2 proc x 4 dev, Grain `DataLoader` with 2 workers per host decoding each row"
        f" in Python, jitted step; {worst('ours')['trials']} trials, slowest host",
        f"{rate('ours')} = {worst('ours')['steps_s'] / bare:.2f} of bare;"
        f" `device_put` (same pipeline as an IterDataset, 2 workers): {rate('device_put')}",
        f"bare loop over the loader: {rate('bare')}",
        ">= 0.95 of bare",
      )
    )
  return out
