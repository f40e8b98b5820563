"""Benchmark workloads; they run inside simulated hosts (`grain_jax_sync.testing`).

Every function is module level so that `run_processes` can import it in each
process, and returns plain numbers. Figures are turned into ratios by
`benchmarks/run.py`; within one function the compared variants run
interleaved, several times, and the median is kept, so that a noisy machine
moves both sides alike.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from benchmarks import reference

# -- helpers -----------------------------------------------------------------


def images(rows: int, n: int, *, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """`n` CIFAR-like batches: uint8 (rows, 32, 32, 3) images and int32 labels."""
  rng = np.random.default_rng(seed)
  return [
    {
      "image": rng.integers(0, 255, (rows, 32, 32, 3), dtype=np.uint8),
      "label": rng.integers(0, 10, (rows,), dtype=np.int32),
    }
    for _ in range(n)
  ]


def columns(rows: int, n: int, ncols: int) -> list[dict[str, np.ndarray]]:
  base = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)
  return [{f"c{c:02d}": base + c for c in range(ncols)} for _ in range(n)]


def _block(tree: Any) -> None:
  import jax

  jax.block_until_ready(tree)


def _timed(make_iter: Callable[[], Iterator[Any]], *, step_s: float = 0.0) -> tuple[float, int]:
  import jax

  from grain_jax_sync._src.exchange import key_value

  client = key_value.distributed_client()
  if jax.process_count() > 1 and client is not None:
    _timed.count = getattr(_timed, "count", 0) + 1
    client.wait_at_barrier(f"bench/start/{_timed.count}", 120_000)
  start = time.perf_counter()
  n = 0
  it = make_iter()
  for batch in it:
    _block(batch)
    if step_s:
      time.sleep(step_s)
    n += 1
  elapsed = time.perf_counter() - start
  close = getattr(it, "close", None)
  if callable(close):
    close()
  return elapsed, n


def _median_times(variants: dict[str, Callable[[], Iterator[Any]]], trials: int) -> dict[str, Any]:
  """Median time per variant; trial t starts at variant t (mod their count).

  Rotated, so that no variant always runs first (after the previous
  workload's garbage, or right after the peers' barrier) or always after
  the same one.
  """
  times: dict[str, list[float]] = {k: [] for k in variants}
  counts: dict[str, int] = {}
  keys = list(variants)
  for trial in range(trials):
    first = trial % len(keys)
    for k in keys[first:] + keys[:first]:
      elapsed, n = _timed(variants[k])
      times[k].append(elapsed)
      counts[k] = n
  return {k: {"s": statistics.median(v), "batches": counts[k]} for k, v in times.items()}


def _bare(batches: Iterable[dict[str, np.ndarray]]) -> Iterator[dict[str, Any]]:
  """The floor: one `make_array_from_process_local_data` call per batch, nothing else."""
  import jax

  from grain_jax_sync import default_sharding

  sharding = default_sharding()
  pc = jax.process_count()
  for b in batches:
    shapes = {k: (v.shape[0] * pc, *v.shape[1:]) for k, v in b.items()}
    yield jax.make_array_from_process_local_data(sharding, b, shapes)


# -- workloads ---------------------------------------------------------------


def overhead(*, rows: int = 256, n: int = 300, trials: int = 9) -> dict[str, Any]:
  """1 process: iter_jax_batches vs a bare make_array loop vs the reference."""
  import grain_jax_sync as gjs

  data = images(rows, n)
  _timed(lambda: _bare(data))  # Warm-up (compiles nothing, but fills caches).
  return _median_times(
    {
      "bare": lambda: _bare(data),
      "ours": lambda: gjs.iter_jax_batches(data, batch_size=rows),
      "ours_p0": lambda: gjs.iter_jax_batches(data, batch_size=rows, prefetch_batches=0),
      "reference": lambda: reference.reference_sync_generator(data, False, batch_size=rows),
    },
    trials,
  )


def prefetch_sizes(
  *, sizes_mb: tuple[float, ...] = (0.8, 8.0, 32.0), n: int = 40, trials: int = 11
) -> dict[str, Any]:
  """1 process, no training step: default prefetch vs inline (`prefetch_batches=0`).

  uint8 batches of 256 rows and about `sizes_mb` MB each; 4 distinct batches
  cycled to at least `n` and to about 160 MB per trial (200 batches at 0.8 MB:
  a trial of 40 small batches lasts 20 ms, where one scheduler hiccup moves
  the figure by 10%), so that the source holds little memory. 11 trials (7
  before 2026-12-01): at 32 MB both loops are bound by XLA's copies, which
  use both cores (6.2 ms of CPU per 3.9 ms batch, prefetch or inline alike),
  and the median of 7 moved between 0.82 and 1.01 from run to run.
  """
  import grain_jax_sync as gjs

  rows = 256
  out = {}
  for mb in sizes_mb:
    width = int(mb * 1e6) // rows
    rng = np.random.default_rng(0)
    distinct = [{"x": rng.integers(0, 255, (rows, width), dtype=np.uint8)} for _ in range(4)]
    data = [distinct[i % 4] for i in range(max(n, int(160 / mb)))]
    _timed(lambda: gjs.iter_jax_batches(data, batch_size=rows))  # noqa: B023 - warm-up.
    out[f"{mb:g} MB"] = _median_times(
      {
        "prefetch": lambda: gjs.iter_jax_batches(data, batch_size=rows),  # noqa: B023
        "inline": lambda: gjs.iter_jax_batches(data, batch_size=rows, prefetch_batches=0),  # noqa: B023
      },
      trials,
    )
  return out


def agreement(
  *, rows: int = 64, n: int = 2000, ref_n: int = 400, short: int = 10, trials: int = 5
) -> dict[str, Any]:
  """Synchronized vs unsynchronized throughput, default settings.

  Ours over `n` batches per trial (about 0.7 s), so that the throughput is
  the stream's, not the iterator's start and end; those are timed apart, over
  `short` batches. The reference model over `ref_n` (its lookahead-1 variant
  takes about 5 ms per batch).
  """
  import grain_jax_sync as gjs

  data, few, ref_data = images(rows, n), images(rows, short), images(rows, ref_n)
  ref = reference.reference_sync_generator
  _timed(lambda: ref(ref_data, False, batch_size=rows, synchronize_batches=True))  # Warm-up.
  return _median_times(
    {
      "ours_sync": lambda: gjs.iter_jax_batches(data, batch_size=rows),
      "ours_nosync": lambda: gjs.iter_jax_batches(data, batch_size=rows, synchronize_batches=False),
      "ours_sync_short": lambda: gjs.iter_jax_batches(few, batch_size=rows),
      "ours_nosync_short": lambda: gjs.iter_jax_batches(
        few, batch_size=rows, synchronize_batches=False
      ),
      "ref_sync10": lambda: ref(ref_data, False, batch_size=rows, synchronize_batches=True),
      "ref_sync1": lambda: ref(
        ref_data, False, batch_size=rows, synchronize_batches=True, synchronize_lookahead=1
      ),
      "ref_nosync": lambda: ref(ref_data, False, batch_size=rows),
    },
    trials,
  )


def _slow(data: list[Any], load_s: float) -> Iterator[Any]:
  for b in data:
    time.sleep(load_s)
    yield b


def overlap(*, n: int = 50, configs: tuple[tuple[float, float], ...] = ()) -> dict[str, Any]:
  """wall / (n * max(step, load)) for a sleeping source and a sleeping step."""
  import grain_jax_sync as gjs

  configs = configs or ((0.02, 0.02), (0.04, 0.02), (0.02, 0.04))
  data = images(64, n)
  out = {}
  for step_s, load_s in configs:
    ideal = n * max(step_s, load_s)
    t_ours, _ = _timed(
      lambda: gjs.iter_jax_batches(_slow(data, load_s), batch_size=64),  # noqa: B023
      step_s=step_s,
    )
    t_ref, _ = _timed(
      lambda: reference.reference_sync_generator(  # noqa: B023
        _slow(data, load_s),  # noqa: B023
        False,
        batch_size=64,
        synchronize_batches=True,
      ),
      step_s=step_s,
    )
    out[f"S={step_s * 1e3:.0f}ms L={load_s * 1e3:.0f}ms"] = {
      "ours": t_ours / ideal,
      "reference": t_ref / ideal,
    }
  return out


def grain_device_put(*, rows: int = 256, n: int = 200, trials: int = 7) -> dict[str, Any]:
  """The same Grain pipeline through grain.experimental.device_put and ours."""
  import grain
  import jax

  import grain_jax_sync as gjs

  data = images(rows, 1)[0]

  def pipeline() -> Any:
    ds = grain.MapDataset.range(rows * n).map(
      lambda i: {"image": data["image"][i % rows], "label": data["label"][i % rows]}
    )
    return ds.batch(rows, drop_remainder=True).to_iter_dataset()

  sharding = gjs.default_sharding()
  # Warm up both (Grain's first batch pays thread start-up).
  for _ in zip(range(3), grain.experimental.device_put(pipeline(), sharding), strict=False):
    pass
  del jax
  return _median_times(
    {
      "grain": lambda: iter(grain.experimental.device_put(pipeline(), sharding)),
      "ours": lambda: gjs.iter_jax_batches(pipeline(), batch_size=rows),
    },
    trials,
  )


def elastic(*, rows: int = 64, n: int = 100, trials: int = 5) -> dict[str, Any]:
  """The same record pipeline through `elastic_source` and today's `MapDataset` path.

  Today: each process slices its records (``ds[p::P]``), then
  ``to_iter_dataset().batch(rows)``; elastic: `elastic_source` over all the
  records with the same transform (no resize).
  """
  import grain
  import jax

  import grain_jax_sync as gjs

  data = images(rows, 1)[0]
  p, count = jax.process_index(), jax.process_count()

  def records() -> Any:
    return grain.MapDataset.range(rows * n * count).map(
      lambda i: {"image": data["image"][i % rows], "label": data["label"][i % rows]}
    )

  def today() -> Any:
    ds = records()[p::count].to_iter_dataset().batch(rows)
    return gjs.iter_jax_batches(ds, batch_size=rows)

  def elastic_path() -> Any:
    src = gjs.elastic_source(records(), lambda ds: ds.batch(rows))
    return gjs.iter_jax_batches(src, batch_size=rows)

  for make in (today, elastic_path):  # Warm up both (thread start-up, compilation).
    _timed(make)
  return _median_times({"today": today, "elastic": elastic_path}, trials)


def hf_map_style(*, rows: int = 1024, n: int = 60, trials: int = 5) -> dict[str, Any]:
  """A map-style Hugging Face `Dataset` through `hf_pipeline` vs the bare `Dataset.iter` loop.

  Each host's own in-memory Arrow table of ``rows * n`` rows (an int64 id, a
  fixed-length (1024,) int32 token list, a float32: 4 MiB a 1024-row batch).
  The bare loop: ``ds.with_format("numpy").iter(batch_size=rows)`` and one
  `make_array_from_process_local_data` per batch; ours: `iter_jax_batches`
  over ``hf_pipeline(ds, batch_size=rows)`` (this host's rows:
  ``process_index=0, process_count=1``), which reads the same Arrow slices
  as views (`hugging_face.arrow_columns`).
  """
  import datasets

  import grain_jax_sync as gjs

  features = datasets.Features(
    {
      "id": datasets.Value("int64"),
      "tokens": datasets.List(datasets.Value("int32"), length=1024),
      "x": datasets.Value("float32"),
    }
  )
  total = rows * n
  ds = datasets.Dataset.from_dict(
    {
      "id": np.arange(total),
      "tokens": np.arange(total * 1024, dtype=np.int32).reshape(total, 1024) % 50_000,
      "x": np.linspace(0, 1, total, dtype=np.float32),
    },
    features=features,
  ).with_format("numpy")

  def bare() -> Iterator[Any]:
    return _bare(ds.iter(batch_size=rows))

  def ours() -> Any:
    src = gjs.hf_pipeline(ds, batch_size=rows, process_index=0, process_count=1)
    return gjs.iter_jax_batches(src, batch_size=rows)

  for make in (bare, ours):  # Warm up both.
    _timed(make)
  return {**_median_times({"bare": bare, "ours": ours}, trials), "rows": rows}


def dtype_bytes(*, rows: int = 256, n: int = 100, trials: int = 5) -> dict[str, Any]:
  """float32 -> bfloat16: bytes handed to the transfer per batch, and time."""
  import jax
  import ml_dtypes

  import grain_jax_sync as gjs

  data = [{"x": np.ones((rows, 1024), np.float32)} for _ in range(n)]
  sent = {"bytes": 0}
  # The two ways a host batch reaches the devices: one process's build puts
  # it with `jax.device_put` (what `make_array_from_process_local_data` does
  # there, which calls JAX's own `device_put`, not this attribute).
  real_make, real_put = jax.make_array_from_process_local_data, jax.device_put

  def counted(real: Callable[..., Any], local: Any) -> Callable[..., Any]:
    sent["bytes"] += sum(np.asarray(x).nbytes for x in jax.tree.leaves(local))
    return real

  def counting_make(sharding: Any, local: Any, *args: Any, **kwargs: Any) -> Any:
    return counted(real_make, local)(sharding, local, *args, **kwargs)

  def counting_put(local: Any, *args: Any, **kwargs: Any) -> Any:
    return counted(real_put, local)(local, *args, **kwargs)

  out: dict[str, Any] = {}
  jax.make_array_from_process_local_data, jax.device_put = counting_make, counting_put
  try:
    for name, make in (
      ("policy", lambda: gjs.iter_jax_batches(data, batch_size=rows, dtypes=ml_dtypes.bfloat16)),
      (
        "after",
        lambda: reference.reference_sync_generator(
          data, False, batch_size=rows, dtypes=ml_dtypes.bfloat16
        ),
      ),
    ):
      sent["bytes"] = 0
      _, count = _timed(make)
      out[f"{name}_bytes_per_batch"] = sent["bytes"] / count
  finally:
    jax.make_array_from_process_local_data, jax.device_put = real_make, real_put
  out.update(
    _median_times(
      {
        "policy": lambda: gjs.iter_jax_batches(data, batch_size=rows, dtypes=ml_dtypes.bfloat16),
        "after": lambda: reference.reference_sync_generator(
          data, False, batch_size=rows, dtypes=ml_dtypes.bfloat16
        ),
      },
      trials,
    )
  )
  return out


def per_batch(*, rows: int = 64, n: int = 300, trials: int = 3) -> dict[str, Any]:
  """Per-batch cost, synchronized, default settings (for process scaling)."""
  import grain_jax_sync as gjs

  data = images(rows, n)
  return _median_times(
    {
      "ours": lambda: gjs.iter_jax_batches(data, batch_size=rows),
      "bare": lambda: _bare(data),
    },
    trials,
  )


def column_scaling(*, rows: int = 64, n: int = 100, trials: int = 15) -> dict[str, Any]:
  """Per-batch cost vs a bare loop for 1 to 64 columns, 1 process.

  15 trials: at 64 columns a trial of either loop takes 6 to 13 ms per batch
  on the 2-core machine, so that a median of 5 moved by 0.1 between runs
  (25 interleaved trials, 2026-12-01: bare 8.56 ms, ours 8.68, 0.99).
  """
  import grain_jax_sync as gjs

  out = {}
  for ncols in (1, 4, 16, 64):
    data = columns(rows, n, ncols)
    out[ncols] = _median_times(
      {
        "bare": lambda: _bare(data),  # noqa: B023
        "ours": lambda: gjs.iter_jax_batches(data, batch_size=rows),  # noqa: B023
        "ours_p0": lambda: gjs.iter_jax_batches(data, batch_size=rows, prefetch_batches=0),  # noqa: B023
      },
      trials,
    )
  return out


def _handed_over(
  batches: list[dict[str, np.ndarray]], keep: bool, ahead: int | None = None
) -> Iterator[Any]:
  """The bare loop in a thread, each batch handed to the consumer over a queue; no library code.

  With `keep`, every batch stays referenced until the end, so that no
  `jax.Array` is freed in the consumer's thread while the thread builds.
  With `ahead`, the thread builds at most that many batches ahead (the
  floor of any design with a build thread, `benchmarks.threads`).
  """
  import queue

  handed: Any = queue.SimpleQueue() if ahead is None else queue.Queue(ahead)
  kept: list[Any] = []

  def produce() -> None:
    for b in _bare(batches):
      handed.put(b)
    handed.put(None)

  t = threading.Thread(target=produce, name="bench-handover", daemon=True)
  t.start()
  while (b := handed.get()) is not None:
    if keep:
      kept.append(b)
    yield b
  t.join()


def cross_thread_free(
  *, rows: int = 64, n: int = 300, ncols: int = 64, trials: int = 7
) -> dict[str, Any]:
  """What a hand-off between two threads costs, with no library code and no step.

  The bare loop inline; the same loop in a thread handing each batch over a
  queue, the consumer dropping it as it takes the next (as a training loop
  does); the same, the consumer keeping every batch (nothing freed in its
  thread); and `grain.experimental.device_put` over the same list. Each
  `jax.Array` freed by the consumer releases the GIL once per device buffer
  while the other thread builds, releasing it once per buffer too: the two
  threads hand the GIL back and forth (counted here: voluntary context
  switches per batch, over all threads). Beside a step, the build thread
  waits on a full buffer while the consumer frees, and this does not happen.
  """
  import resource

  import grain

  import grain_jax_sync as gjs

  data = columns(rows, n, ncols)
  sharding = gjs.default_sharding()
  variants = {
    "inline": lambda: _bare(data),
    "thread_free": lambda: _handed_over(data, keep=False),
    "thread_keep": lambda: _handed_over(data, keep=True),
    "grain": lambda: iter(
      grain.experimental.device_put(
        grain.MapDataset.source(data).to_iter_dataset(
          grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        ),
        sharding,
      )
    ),
  }
  switches: dict[str, list[float]] = {k: [] for k in variants}

  def counted(k: str) -> Callable[[], Iterator[Any]]:
    def run() -> Iterator[Any]:
      before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
      yield from variants[k]()
      switches[k].append((resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before) / n)

    return run

  out = _median_times({k: counted(k) for k in variants}, trials)
  for k in variants:
    out[k]["switches"] = statistics.median(switches[k])
  return out


def _rss() -> int:
  import psutil

  return psutil.Process(os.getpid()).memory_info().rss


def _high_water() -> int | None:
  """The kernel's peak RSS of this process since its last reset (VmHWM), in bytes; None if unknown."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _reset_high_water() -> bool:
  """Resets VmHWM to the current RSS (Linux: ``5`` into clear_refs); whether it could."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    return False
  return _high_water() is not None


def _peak_rss_growth(fn: Callable[[], None]) -> int:
  """Peak RSS during `fn` over the RSS before it.

  Exact where the kernel keeps the high-water mark and lets it be reset
  (Linux); else sampled every 2 ms, which can miss a short peak.
  """
  gc.collect()
  base = _rss()
  if _reset_high_water():
    fn()
    return max(_high_water() or 0, _rss()) - base
  peak = [base]
  stop = threading.Event()

  def sample() -> None:
    while not stop.is_set():
      peak[0] = max(peak[0], _rss())
      time.sleep(0.002)

  t = threading.Thread(target=sample, daemon=True)
  t.start()
  try:
    fn()
  finally:
    stop.set()
    t.join()
  peak[0] = max(peak[0], _rss())
  return peak[0] - base


def _drain(make: Callable[[], Iterator[Any]], collect: bool) -> None:
  """Drains one iterator beside a 5 ms step, with `gc.collect()` after each step if `collect`."""
  it = make()
  for batch in it:
    _block(batch)
    time.sleep(0.005)  # A short step, so that read-ahead has time to fill.
    del batch
    if collect:
      gc.collect()
  close = getattr(it, "close", None)
  if callable(close):
    close()


def memory(*, mb: int = 64, n: int = 24) -> dict[str, Any]:
  """Peak RSS growth per host while streaming `n` batches of `mb` MB.

  Measured twice per side: as is, and with `gc.collect()` after every step,
  which frees batches that are only held by reference cycles (see the
  closing note in benchmarks/RESULTS.md), so that the second figure is what
  the iterator itself holds.
  """
  import grain_jax_sync as gjs

  rows = 64
  width = mb * (1 << 20) // (rows * 4)

  def gen() -> Iterator[dict[str, np.ndarray]]:
    for i in range(n):
      yield {"x": np.full((rows, width), i, np.float32)}

  def ours() -> Iterator[Any]:
    return gjs.iter_jax_batches(gen(), batch_size=rows)

  def ref() -> Iterator[Any]:
    return reference.reference_sync_generator(
      gen(), False, batch_size=rows, synchronize_batches=True
    )

  out: dict[str, Any] = {"batch_bytes": rows * width * 4}
  for collect in (True, False):
    for name, make in (("ours", ours), ("reference", ref)):
      gc.collect()
      key = f"{name}_collected" if collect else name
      out[key] = _peak_rss_growth(lambda: _drain(make, collect))  # noqa: B023
  return out


def suite(names: list[str], kwargs: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
  """Runs the named workloads in this process, in order."""
  from benchmarks import shapes_bench

  kwargs = kwargs or {}
  found = {**globals(), "varying_lengths": shapes_bench.varying_lengths}
  return {name: found[name](**kwargs.get(name, {})) for name in names}
