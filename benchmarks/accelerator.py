"""The library against an accelerator, TPU or GPU, in one process (not a test).

Run from the repository root on a machine with a TPU or a GPU:

  python -m benchmarks.accelerator                        # every section, a few minutes
  python -m benchmarks.accelerator --json out.json --trials 11
  python -m benchmarks.accelerator --sections input_bound --trials 9
  python -m benchmarks.accelerator --platform cpu --quick  # the same code on CPU, small

Where JAX finds no accelerator (its default backend is the CPU) it prints one
line saying so and exits 0, unless ``--platform cpu`` asks for the CPU. Every
figure is the median of `--trials` trials, the variants interleaved (each
trial starts at the next variant), each trial a fresh iterator whose first
`SKIP` batches (threads starting, buffers filling) are not timed, and over
worker processes also what their buffers hold. Sections:

* ``steady``: a bf16 MLP train step (jitted, the parameters donated) on
  uint8 image batches, with the step calibrated to a short and a long time;
  wall and process CPU (every thread) per batch of: ``resident`` (the batch
  already on the device: the step alone), ``bare`` (``jax.device_put`` of
  each NumPy batch, then the step), ``iter_jax_batches`` (default prefetch),
  ``inline`` (``prefetch_batches=0``), ``grain_device_put``
  (``grain.experimental.device_put``) and ``device_put``
  (``grain_jax_sync.device_put``), the last two over the same Grain
  ``IterDataset`` of the same batches.
* ``input_bound``: a Grain pipeline that makes each 64 x 64 x 3 record in
  NumPy and batches in Grain (``MapDataset.map(...).batch(...)``), read by
  Grain's threads or by worker processes (``mp_prefetch``), and a short
  step: the input is the bottleneck, at batches of about 3, 25 and 100 MB
  (``--input-rows``). Wall and CPU per batch of ``bare``
  (``jax.device_put`` of each Grain batch), ``iter_jax_batches``,
  ``grain_device_put`` and ``device_put``, and where each thread's CPU went
  (ours, the main thread, Grain's Python threads, native threads, threads
  that ended in the window), kernel CPU, page faults and context switches.
  ``--diagnose`` adds ``inline``, ``iter_p1`` and ``iter_p3`` (``prefetch_batches``),
  ``device_put_whole`` and ``iter_whole`` (every leaf one put, no pieces),
  ``device_put_si`` and ``grain_device_put_si`` (the interpreter's thread
  switch interval at 0.5 ms, not 5: whether threads waiting for the GIL, as
  Grain's worker readers do, hold the input up),
  ``device_put_b0`` (``device_buffer_size=0``)
  ``device_put`` with a batch less read (``_c3``), built (``_d1``) or
  both (``_c3d1``: what ``device_put(4, 2)`` held before it held Grain's
  counts), ``device_put_tp`` (the source read by Grain's prefetch thread
  of 4, as Grain's ``device_put`` reads it), ``device_put_es`` (only the
  source's state taken before its first read, as that thread's constructor
  does) and ``device_put_rt`` (only a reading thread, 4 ahead); ``--variants``
  keeps the ones named. A trial waits for the Grain threads it started to
  end before the next one starts.
* ``transfer``: no step; GB/s (1e9 bytes per second) of one blocking
  ``jax.device_put`` at a time (``put_1``), ``jax.device_put`` with 4 and
  16 puts in flight (``put_4``, ``put_16``), `iter_jax_batches` at the
  default prefetch (``build``), at ``prefetch_batches=8`` (``build_p8``) and
  inline (``build_inline``), and ``grain_device_put`` and ``device_put`` at
  their defaults over a Grain ``IterDataset``, the consumer waiting for each
  batch; and the
  host time of one ``jax.device_put`` call (``put_call_ms``: the part of
  a put that does not overlap).

With several local devices each batch spans all of them (one mesh axis).
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import functools
import gc
import json
import os
import platform as platform_lib
import queue
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

_GB = 1e9
# Batches of each trial left untimed: the iterator's threads starting and its
# buffers filling. More than any buffer compared here holds.
SKIP = 8
TAIL = 16  # Batches past an input-bound window (`_input_row`).
SECTIONS = ("steady", "input_bound", "transfer")
# The longest wait for one thread a trial left running (`_settle`): a Grain
# pool thread finishing one read. Beyond it the next trial starts anyway.
SETTLE_S = 60.0


# -- Timing --------------------------------------------------------------------


def _thread_groups() -> dict[int, str]:
  """This process's Python threads by native id: "ours", "main" or "python"."""
  groups = {}
  for t in threading.enumerate():
    if t.native_id is None:
      continue
    if t is threading.main_thread():
      groups[t.native_id] = "main"
    else:
      groups[t.native_id] = "ours" if t.name.startswith("grain_jax_sync") else "python"
  return groups


def _one_thread_cpu(tid: str, tick: float) -> float | None:
  """CPU seconds of one thread: its scheduler's nanoseconds, else its ticks (Linux)."""
  try:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
      return int(f.read().split()[0]) / 1e9
  except (OSError, ValueError, IndexError):
    pass
  try:
    with open(f"/proc/self/task/{tid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except OSError:
    return None
  return (int(fields[11]) + int(fields[12])) / tick  # utime, stime.


def _thread_cpu() -> dict[int, float]:
  """CPU seconds of each live thread of this process, by native id (empty off Linux)."""
  tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
  try:
    tids = os.listdir("/proc/self/task")
  except OSError:
    return {}
  out = {}
  for tid in tids:
    cpu = _one_thread_cpu(tid, tick)
    if cpu is not None:
      out[int(tid)] = cpu
  return out


def _by_group(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
  """CPU seconds between two `_thread_cpu` samples, per thread group ("native": not Python)."""
  groups = _thread_groups()
  out = dict.fromkeys(("ours", "main", "python", "native"), 0.0)
  for tid, cpu in after.items():
    out[groups.get(tid, "native")] += cpu - before.get(tid, 0.0)
  return out


def _usage() -> tuple[float, float, int, int]:
  """This process's user and kernel CPU seconds, minor page faults and context switches."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime, r.ru_stime, r.ru_minflt, r.ru_nvcsw + r.ru_nivcsw


def _settle(before: set[threading.Thread]) -> float:
  """Waits for the Grain and library threads a trial started to end; seconds waited.

  A closed Grain `PrefetchDatasetIterator` cancels only the reads not yet
  started: the ones its pool is running finish after the close, in the next
  trial's time unless waited for here (its pool's threads then exit).
  """
  gc.collect()  # Iterators dropped but not closed (`bare`'s) are closed by their finalizers.
  start = time.perf_counter()
  for t in threading.enumerate():
    if t not in before and t.name.startswith("grain"):
      t.join(SETTLE_S)
  return time.perf_counter() - start


def _timed(
  batches: Iterable[Any], step: Callable[[Any, Any], Any], state: Any, n: int, skip: int = SKIP
) -> tuple[dict, Any]:
  """Wall, process CPU and per-group thread CPU per batch over `n` batches after `skip`;
  and the step's last state."""
  import jax

  before = set(threading.enumerate())
  it = iter(batches)
  start: tuple[float, float, dict[int, float], tuple[float, float, int, int]] | None = None
  for i, batch in enumerate(it):
    if i == skip:
      jax.block_until_ready(state)
      start = (time.perf_counter(), time.process_time(), _thread_cpu(), _usage())
    state = step(state, batch)
    del batch
    if i == skip + n - 1:
      break
  jax.block_until_ready(state)
  assert start is not None, "fewer batches than the skip"
  wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
  threads = _by_group(start[2], _thread_cpu())
  usage = [b - a for a, b in zip(start[3], _usage(), strict=True)]
  close = getattr(it, "close", None)
  if callable(close):
    close()
  del it, batches
  out = {"wall_ms": wall / n * 1e3, "cpu_ms": cpu / n * 1e3}
  out.update({f"cpu_{k}_ms": v / n * 1e3 for k, v in threads.items()})
  # Threads that ended within the window (their CPU is in the process's, in no group's).
  live = sum(threads[g] for g in ("ours", "main", "python", "native"))
  out["cpu_ended_ms"] = max(0.0, out["cpu_ms"] - live / n * 1e3)
  out["sys_ms"] = usage[1] / n * 1e3
  out["faults"] = usage[2] / n
  out["switches"] = usage[3] / n
  out["settle_ms"] = _settle(before) * 1e3
  return out, state


def _interleaved(variants: dict[str, Callable[[], dict]], trials: int) -> dict[str, dict]:
  """Median (and range) of each figure of each variant over interleaved trials."""
  for run in variants.values():  # Warm-up: compiles, first thread starts.
    run()
  runs: dict[str, list[dict]] = {k: [] for k in variants}
  keys = list(variants)
  for t in range(trials):
    for k in keys[t % len(keys) :] + keys[: t % len(keys)]:
      runs[k].append(variants[k]())
    print(f"    trial {t + 1}/{trials}", file=sys.stderr, flush=True)
  out = {}
  for k, rs in runs.items():
    out[k] = {f: statistics.median(r[f] for r in rs) for f in rs[0]}
    walls = [r["wall_ms"] for r in rs]
    out[k].update(wall_lo_ms=min(walls), wall_hi_ms=max(walls), trials=len(rs))
  return out


# -- The step --------------------------------------------------------------------


def _mlp(layers: int, hidden: int, width: int) -> tuple[Callable[[Any, Any], Any], Any]:
  """A jitted bf16 MLP train step over {"image": uint8} batches, and its parameters."""
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.key(0), 3)

  def init(k: Any, shape: tuple[int, int]) -> Any:
    return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(jnp.bfloat16)

  params = {
    "w_in": init(keys[0], (width, hidden)),
    "w": init(keys[1], (hidden, hidden)),
    "w_out": init(keys[2], (hidden, 10)),
  }

  def loss(p: Any, image: Any) -> Any:
    x = image.reshape(image.shape[0], -1).astype(jnp.bfloat16) / 255
    h = jax.nn.relu(x @ p["w_in"])
    h = jax.lax.fori_loop(0, layers, lambda _, h: jax.nn.relu(h @ p["w"]), h)
    return jnp.mean(jnp.square((h @ p["w_out"]).astype(jnp.float32)))

  def step(p: Any, batch: Any) -> Any:
    g = jax.grad(loss)(p, batch["image"])
    return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)

  return jax.jit(step, donate_argnums=0), params


def _step_time(
  step: Callable[[Any, Any], Any], params: Any, batch: Any, n: int = 20
) -> tuple[float, Any]:
  """Seconds per step on a resident batch (after a compile), and the parameters after."""
  import jax

  params = jax.block_until_ready(step(params, batch))
  start = time.perf_counter()
  for _ in range(n):
    params = step(params, batch)
  jax.block_until_ready(params)
  return (time.perf_counter() - start) / n, params


def calibrated_step(
  target_s: float, batch: Any, *, hidden: int
) -> tuple[Callable[[Any, Any], Any], Any, float]:
  """A step of about `target_s` on `batch` (resident): (step, params, its seconds)."""
  import jax

  width = int(np.prod(batch["image"].shape[1:]))
  resident = jax.device_put(batch)
  probe = [(k, _step_time(*_mlp(k, hidden, width), resident)[0]) for k in (2, 18)]
  (k0, t0), (k1, t1) = probe
  per_layer = max((t1 - t0) / (k1 - k0), 1e-7)
  layers = max(1, round(k0 + (target_s - t0) / per_layer))
  step, params = _mlp(layers, hidden, width)
  seconds, params = _step_time(step, params, resident)
  return step, params, seconds


# -- Steady state with a real step ---------------------------------------------


def _images(rows: int, side: int, distinct: int = 4) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  shape = (rows, side, side, 3)
  return [
    {"image": rng.integers(0, 256, shape, dtype=np.uint8), "label": np.arange(rows, dtype=np.int32)}
    for _ in range(distinct)
  ]


def _cycle(data: list[Any], n: int) -> list[Any]:
  return [data[i % len(data)] for i in range(n)]


def _grain_source(batches: list[Any]) -> Any:
  """A Grain `IterDataset` of ready batches (read by one Grain thread)."""
  import grain

  return grain.MapDataset.source(batches).to_iter_dataset(
    grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)
  )


def _feeds(data: list[Any], grain_ds: Any, sharding: Any, rows: int) -> dict[str, Callable]:
  """Each way to feed a step from host batches: a function making an iterable."""
  import grain.experimental
  import jax

  import grain_jax_sync as gjs

  mesh = sharding.mesh
  return {
    "bare": lambda: (jax.device_put(b, sharding) for b in data),
    "iter_jax_batches": lambda: gjs.iter_jax_batches(data, batch_size=rows, mesh=mesh),
    "inline": lambda: gjs.iter_jax_batches(data, batch_size=rows, mesh=mesh, prefetch_batches=0),
    "grain_device_put": lambda: iter(grain.experimental.device_put(grain_ds, sharding)),
    "device_put": lambda: iter(gjs.device_put(grain_ds, sharding)),
  }


def _sharding() -> Any:
  import jax

  mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("data",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def steady(cfg: dict, *, trials: int, n: int, report: Callable[[dict], None]) -> list[dict]:
  """The `steady` section: one row per (batch, step) configuration, each `report`ed when made."""
  import jax

  sharding = _sharding()
  out = []
  for rows, target_ms in cfg["steady"]:
    distinct = _images(rows, cfg["side"])
    data = _cycle(distinct, SKIP + n)
    step, params, step_s = calibrated_step(target_ms / 1e3, distinct[0], hidden=cfg["hidden"])
    resident = [jax.device_put(b, sharding) for b in distinct]
    feeds: dict[str, Callable] = {"resident": functools.partial(_cycle, resident, SKIP + n)}
    feeds.update(_feeds(data, _grain_source(data), sharding, rows))
    figures = _interleaved({k: _trial(make, step, params, n) for k, make in feeds.items()}, trials)
    mb = distinct[0]["image"].nbytes / 1e6
    out.append({"rows": rows, "mb": mb, "step_ms": step_s * 1e3, "variants": figures})
    report(out[-1])
  return out


def _trial(
  make: Callable[[], Iterable[Any]], step: Callable, params: Any, n: int, skip: int = SKIP
) -> Callable:
  """One trial of a feed; the step's parameters go from trial to trial (they are donated)."""
  import jax
  import jax.numpy as jnp

  held = [jax.tree.map(jnp.copy, params)]  # Each feed its own: a step donates them.

  def run() -> dict:
    figures, held[0] = _timed(make(), step, held[0], n, skip)
    return figures

  return run


# -- An input-bound Grain pipeline ---------------------------------------------


_POOL: dict[int, np.ndarray] = {}


def make_record(index: int, side: int = 64) -> dict[str, Any]:
  """One record as a decoder hands it over: a fresh image, one of 16 made once, flipped on odd indices.

  Module level, so that worker processes can pickle it; each process makes its own 16.
  """
  pool = _POOL.get(side)
  if pool is None:
    pool = _POOL[side] = np.random.default_rng(0).integers(0, 256, (16, side, side, 3), np.uint8)
  image = pool[index % 16]
  image = np.ascontiguousarray(image[:, ::-1]) if index % 2 else image.copy()
  return {"image": image, "label": np.int32(index % 10)}


class _Record:
  """`make_record` at a side (picklable for worker processes)."""

  def __init__(self, side: int):
    self.side = side

  def __call__(self, index: int) -> dict[str, Any]:
    return make_record(index, self.side)


def input_pipeline(rows: int, batches: int, side: int, *, workers: int, threads: int) -> Any:
  """The Grain `IterDataset`: records made per index, batched in Grain; `workers` processes."""
  import grain

  ds = grain.MapDataset.range(rows * batches).map(_Record(side)).batch(rows, drop_remainder=True)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=threads))
  if workers:
    from absl import flags

    if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags.
      flags.FLAGS.mark_as_parsed()
    opts = grain.MultiprocessingOptions(num_workers=workers)
    it = it.mp_prefetch(opts, worker_init_fn=_workers_on_cpu)
  return it


def _workers_on_cpu(index: int, count: int) -> None:
  """A Grain worker's JAX stays off the accelerator, which the parent holds."""
  del index, count
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  jax.config.update("jax_platforms", "cpu")


def _input_feeds(ds: Any, sharding: Any, rows: int, *, diagnose: bool) -> dict[str, Callable]:
  import grain.experimental
  import jax

  import grain_jax_sync as gjs
  from grain_jax_sync._src.sources.grain import grain_class

  mesh = sharding.mesh
  feeds = {
    "bare": lambda: (jax.device_put(b, sharding) for b in ds),
    "iter_jax_batches": lambda: gjs.iter_jax_batches(ds, batch_size=rows, mesh=mesh),
    "grain_device_put": lambda: iter(grain.experimental.device_put(ds, sharding)),
    "device_put": lambda: iter(gjs.device_put(ds, sharding)),
  }
  if diagnose:  # Where the difference goes: fewer threads of ours, or more batches held.
    feeds["inline"] = lambda: gjs.iter_jax_batches(
      ds, batch_size=rows, mesh=mesh, prefetch_batches=0
    )
    feeds["device_put_b0"] = lambda: iter(gjs.device_put(ds, sharding, device_buffer_size=0))
    for k in (1, 3):
      feeds[f"iter_p{k}"] = functools.partial(
        gjs.iter_jax_batches, ds, batch_size=rows, mesh=mesh, prefetch_batches=k
      )
    # Every leaf as one put (no pieces): what crossing in pieces costs here.
    feeds["device_put_whole"] = functools.partial(_whole, lambda: gjs.device_put(ds, sharding))
    for name in ("device_put", "grain_device_put"):
      feeds[f"{name}_si"] = functools.partial(_switching, feeds[name], SWITCH_S)
    feeds["iter_whole"] = functools.partial(
      _whole, lambda: gjs.iter_jax_batches(ds, batch_size=rows, mesh=mesh)
    )
    # Each stage holds what Grain's does (its buffer and its thread's element
    # in hand): ours with one less read, built, or both, as before it did.
    for name, kwargs in (("c3", {"cpu_buffer_size": 3}), ("d1", {"device_buffer_size": 1})):
      feeds[f"device_put_{name}"] = functools.partial(_device_put, ds, sharding, **kwargs)
    feeds["device_put_c3d1"] = functools.partial(
      _device_put, ds, sharding, cpu_buffer_size=3, device_buffer_size=1
    )
    # Read from the source by Grain's prefetch thread, as Grain's `device_put`
    # reads it, not by ours: whether the reading thread is the difference.
    # Grain's thread takes the source's state before its first read; `_es`
    # does only that, `_rt` only reads in a thread of its own (4 ahead).
    probe = grain_class(_ProbeDataset, "IterDataset")
    early, own = (grain_class(k, "DatasetIterator") for k in (_EarlyState, _OwnThread))
    feeds["device_put_es"] = functools.partial(_device_put, probe(ds, early), sharding)
    feeds["device_put_rt"] = functools.partial(
      _device_put, probe(ds, own), sharding, cpu_buffer_size=0
    )
    feeds["device_put_tp"] = functools.partial(
      _device_put,
      grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=4),
      sharding,
      cpu_buffer_size=0,
    )
  return feeds


class _EarlyState:
  """An iterator whose state is taken before its first read (`_ProbeDataset`)."""

  def __init__(self, it: Any):
    super().__init__()  # Grain's `DatasetIterator`, the other base.
    self._it = it
    it.get_state()

  def __next__(self) -> Any:
    return next(self._it)

  def get_state(self) -> Any:
    return self._it.get_state()

  def set_state(self, state: Any) -> None:
    self._it.set_state(state)

  def close(self) -> None:
    self._it.close()


class _OwnThread:
  """An iterator read 4 ahead in a thread of its own, started by the first read (`_ProbeDataset`)."""

  def __init__(self, it: Any):
    super().__init__()
    self._it, self._state, self._stop = it, None, threading.Event()
    self._q: queue.Queue[Any] = queue.Queue(4)
    self._thread: threading.Thread | None = None

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        x = next(self._it)
        self._q.put((x, copy.deepcopy(self._it.get_state()), None))
    except BaseException as e:  # noqa: BLE001 - to the consumer.
      self._q.put((None, None, e))

  def __next__(self) -> Any:
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, daemon=True, name="grain-probe")
      self._thread.start()
    x, self._state, e = self._q.get()
    if e is not None:
      raise e
    return x

  def get_state(self) -> Any:
    return self._state

  def set_state(self, state: Any) -> None:
    raise NotImplementedError

  def close(self) -> None:
    self._stop.set()
    while not self._q.empty():
      self._q.get_nowait()
    self._it.close()


class _ProbeDataset:
  """`parent` read through iterators of class `kind` (a Grain `IterDataset` by `grain_class`)."""

  def __init__(self, parent: Any, kind: type):
    super().__init__(parent)
    self._kind = kind

  def __iter__(self) -> Any:
    return self._kind(iter(self._parent))


SWITCH_S = 0.0005  # `_switching`'s interval (the interpreter's default: 0.005).


def _switching(make: Callable[[], Iterable[Any]], interval_s: float) -> Iterator[Any]:
  """`make()`'s batches with `sys.setswitchinterval(interval_s)` while they are read."""
  before = sys.getswitchinterval()
  sys.setswitchinterval(interval_s)
  try:
    yield from make()
  finally:
    sys.setswitchinterval(before)


def _whole(make: Callable[[], Iterable[Any]]) -> Iterator[Any]:
  """`make()`'s batches with every leaf crossing as one put (`transfer.PIECES` 1 while it runs)."""
  from grain_jax_sync._src import transfer

  pieces, transfer.PIECES = transfer.PIECES, 1
  try:
    yield from make()
  finally:
    transfer.PIECES = pieces


def _device_put(ds: Any, sharding: Any, **kwargs: Any) -> Iterator[Any]:
  import grain_jax_sync as gjs

  return iter(gjs.device_put(ds, sharding, **kwargs))


def _picked(feeds: dict[str, Callable], names: list[str] | None) -> dict[str, Callable]:
  """The feeds named (all where `names` is None), in their own order; ValueError for an unknown one."""
  if names is None:
    return feeds
  unknown = sorted(set(names) - set(feeds))
  if unknown:
    raise ValueError(f"`--variants`: no variant {unknown} here; the variants are {sorted(feeds)}")
  return {k: v for k, v in feeds.items() if k in names}


def input_bound(
  cfg: dict,
  *,
  trials: int,
  n: int,
  workers: Iterable[int],
  report: Callable[[dict], None],
  diagnose: bool = False,
) -> list[dict]:
  """The `input_bound` section: one row per batch size and reading mode (threads, processes)."""
  out = []
  for rows in cfg["input_rows"]:
    for w in workers:
      out.append(_input_row(cfg, rows, w, trials=trials, n=n, diagnose=diagnose))
      report(out[-1])
  return out


def _input_row(cfg: dict, rows: int, w: int, *, trials: int, n: int, diagnose: bool) -> dict:
  """One `input_bound` row: `rows` a batch, read by Grain's threads (`w` 0) or `w` processes."""
  side = cfg["side"]
  sharding = _sharding()
  first = make_record(0, side)
  probe = {"image": np.stack([first["image"]] * rows)}
  step, params, step_s = calibrated_step(cfg["input_step_ms"] / 1e3, probe, hidden=cfg["hidden"])
  # Whole batches' records for 0.2 s: one batch may take less than a coarse `process_time` tick.
  start, wall, made = time.process_time(), time.perf_counter(), 0
  while made == 0 or time.perf_counter() - wall < 0.2:
    for i in range(rows):
      make_record(i, side)
    made += 1
  record_ms = (time.process_time() - start) * 1e3 / made
  # Grain's `device_put` takes its source's state before the first read, so
  # Grain starts each worker once the one before has made a batch; the first
  # fills its buffers meanwhile (`threads` batches read ahead, one in its
  # queue, one in its reading thread). Those are left untimed too, or they
  # feed the window.
  skip = SKIP + w * (cfg["input_threads"] + 2)
  # Data past the window by more than any variant reads ahead: the end of
  # the data (workers stopping, the last reads) falls outside every timing.
  ds = input_pipeline(rows, skip + n + TAIL, side, workers=w, threads=cfg["input_threads"])
  feeds = _picked(_input_feeds(ds, sharding, rows, diagnose=diagnose), cfg.get("variants"))
  return {
    "workers": w,
    "threads": cfg["input_threads"],
    "rows": rows,
    "mb": probe["image"].nbytes / 1e6,
    "step_ms": step_s * 1e3,
    "records_cpu_ms": record_ms,  # Making one batch's records, in one thread.
    "skip": skip,
    "variants": _interleaved(
      {k: _trial(m, step, params, n, skip) for k, m in feeds.items()}, trials
    ),
  }


# -- Transfer without a step ---------------------------------------------------


def _put_window(arrays: list[np.ndarray], sharding: Any, k: int) -> dict:
  """`jax.device_put` with at most `k` in flight; seconds per put, and per call."""
  import jax

  pending: collections.deque[Any] = collections.deque()
  calls = 0.0
  start = time.perf_counter()
  for a in arrays:
    t = time.perf_counter()
    pending.append(jax.device_put(a, sharding))
    calls += time.perf_counter() - t
    if len(pending) >= k:
      jax.block_until_ready(pending.popleft())
  jax.block_until_ready(list(pending))
  return {"wall_ms": (time.perf_counter() - start) / len(arrays) * 1e3, "call_ms": calls * 1e3}


def _drain(it: Iterator[Any], n: int) -> dict:
  """Wall per batch of an iterator, the consumer waiting for each batch, after `SKIP`."""
  import jax

  start = 0.0
  for i, batch in enumerate(it):
    jax.block_until_ready(batch)
    if i == SKIP - 1:
      start = time.perf_counter()
    if i == SKIP + n - 1:
      break
  wall = time.perf_counter() - start
  close = getattr(it, "close", None)
  if callable(close):
    close()
  return {"wall_ms": wall / n * 1e3}


def _transfer_variants(data: list[dict], sharding: Any, n: int) -> dict[str, Callable]:
  import grain.experimental

  import grain_jax_sync as gjs

  arrays = [b["x"] for b in data[SKIP : SKIP + n]]
  mesh, rows = sharding.mesh, data[0]["x"].shape[0]
  grain_ds = _grain_source(data)

  def build(prefetch: int) -> Callable[[], dict]:
    return lambda: _drain(
      gjs.iter_jax_batches(data, batch_size=rows, mesh=mesh, prefetch_batches=prefetch), n
    )

  return {
    "put_1": lambda: _put_window(arrays, sharding, 1),
    "put_4": lambda: _put_window(arrays, sharding, 4),
    "put_16": lambda: _put_window(arrays, sharding, 16),
    "build": build(2),
    "build_p8": build(8),
    "build_inline": build(0),
    "grain_device_put": lambda: _drain(iter(grain.experimental.device_put(grain_ds, sharding)), n),
    "device_put": lambda: _drain(iter(gjs.device_put(grain_ds, sharding)), n),
  }


def transfer(cfg: dict, *, trials: int, report: Callable[[dict], None]) -> list[dict]:
  """The `transfer` section: one row per batch size."""
  sharding = _sharding()
  rows = 256
  out = []
  for mb in cfg["transfer_mb"]:
    width = max(1, int(mb * 1e6) // rows)
    n = max(8, min(32, int(2e9 / (mb * 1e6))))
    rng = np.random.default_rng(0)
    distinct = [{"x": rng.integers(0, 256, (rows, width), dtype=np.uint8)} for _ in range(2)]
    data = _cycle(distinct, SKIP + n)
    figures = _interleaved(_transfer_variants(data, sharding, n), trials)
    nbytes = distinct[0]["x"].nbytes
    row: dict[str, Any] = {"mb": mb, "bytes": nbytes, "n": n}
    for k, f in figures.items():
      row[k] = nbytes / (f["wall_ms"] / 1e3) / _GB
      row[f"{k}_range"] = [nbytes / (f[e] / 1e3) / _GB for e in ("wall_hi_ms", "wall_lo_ms")]
    row["trials"] = trials
    row["put_call_ms"] = figures["put_16"]["call_ms"] / n
    out.append(row)
    report(row)
  return out


# -- The command ---------------------------------------------------------------

FULL = {
  "side": 64,
  "hidden": 1024,
  # (rows, step ms): 3.1 MB batches at a 1 and a 3 ms step, 12.6 MB at 20 ms.
  "steady": [(256, 1.0), (256, 3.0), (1024, 20.0)],
  # 64 x 64 x 3 uint8 records: 3.1, 25.2 and 100.7 MB batches.
  "input_rows": [256, 2048, 8192],
  "input_step_ms": 3.0,
  "input_threads": 16,
  "transfer_mb": [8, 32, 128, 512],
}
QUICK = {
  "side": 8,
  "hidden": 32,
  "steady": [(32, 1.0)],
  "input_rows": [32],
  "input_step_ms": 1.0,
  "input_threads": 2,
  "transfer_mb": [0.25],
}


def _accelerator() -> tuple[bool, str]:
  import jax

  backend = jax.default_backend()
  devices = jax.local_devices()
  return backend != "cpu", f"{len(devices)} x {devices[0].device_kind} ({backend})"


def _meta(args: argparse.Namespace, where: str) -> dict:
  import grain
  import jax

  return {
    "devices": where,
    "jax": jax.__version__,
    "grain": getattr(grain, "__version__", "?"),
    "python": platform_lib.python_version(),
    "cpus": os.cpu_count(),
    "command": "python -m benchmarks.accelerator " + " ".join(args.argv),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "trials": args.trials,
    "skip": SKIP,
  }


def _print_variants(title: str, variants: dict) -> None:
  print(title)
  for k, f in variants.items():
    groups = ("ours", "main", "python", "native", "ended")
    threads = " ".join(f"{g} {f[f'cpu_{g}_ms']:.2f}" for g in groups)
    print(
      f"  {k:17s} wall {f['wall_ms']:8.3f} ms ({f['wall_lo_ms']:.3f}..{f['wall_hi_ms']:.3f},"
      f" {f['trials']} trials)"
      f"  cpu {f['cpu_ms']:7.2f} ms  [{threads}]  sys {f['sys_ms']:.2f} ms,"
      f" {f['faults']:.0f} faults, {f['switches']:.0f} switches",
      flush=True,
    )


def _print_transfer(r: dict) -> None:
  keys = [k for k in r if f"{k}_range" in r]
  figures = "  ".join(
    f"{k} {r[k]:6.2f} ({r[f'{k}_range'][0]:.2f}..{r[f'{k}_range'][1]:.2f})" for k in keys
  )
  print(
    f"{r['mb']:>6g} MB, {r['trials']} trials:  {figures} GB/s;  put call {r['put_call_ms']:.2f} ms",
    flush=True,
  )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--platform", choices=("auto", "cpu"), default="auto")
  parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
  parser.add_argument("--trials", type=int, default=9)
  parser.add_argument("--n", type=int, default=48, help="timed batches per trial")
  parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="0: Grain's threads")
  parser.add_argument("--input-rows", type=int, nargs="+", help="input_bound: rows a batch")
  parser.add_argument("--transfer-mb", type=float, nargs="+", help="transfer: MB a batch")
  parser.add_argument(
    "--diagnose",
    action="store_true",
    help="input_bound: also inline, device_buffer_size=0, and device_put holding Grain's counts",
  )
  parser.add_argument("--variants", nargs="+", help="input_bound: only these variants")
  parser.add_argument("--quick", action="store_true", help="small sizes (the tests' CPU run)")
  parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
  args = parser.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  return args


def _print_steady(r: dict) -> None:
  _print_variants(f"steady: {r['mb']:.1f} MB, step {r['step_ms']:.2f} ms", r["variants"])


def _print_input_bound(r: dict) -> None:
  how = f"{r['workers']} worker processes" if r["workers"] else f"{r['threads']} threads"
  how += f", {r['skip']} untimed"
  title = f"input_bound: {r['mb']:.1f} MB ({r['rows']} rows), {how}, step {r['step_ms']:.2f} ms"
  _print_variants(f"{title}, records {r['records_cpu_ms']:.1f} ms CPU", r["variants"])


def run(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
  """Every section asked for, into `results`; prints each row as it comes, saves each section."""
  cfg = dict(QUICK if args.quick else FULL)
  cfg["input_rows"] = args.input_rows or cfg["input_rows"]
  cfg["variants"] = args.variants
  cfg["transfer_mb"] = args.transfer_mb or cfg["transfer_mb"]
  if "steady" in args.sections:
    results["steady"] = steady(cfg, trials=args.trials, n=args.n, report=_print_steady)
    save()
  if "input_bound" in args.sections:
    results["input_bound"] = input_bound(
      cfg,
      trials=args.trials,
      n=args.n,
      workers=args.workers,
      report=_print_input_bound,
      diagnose=args.diagnose,
    )
    save()
  if "transfer" in args.sections:
    results["transfer"] = transfer(cfg, trials=args.trials, report=_print_transfer)
    save()


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  found, where = _accelerator()
  if not found and args.platform != "cpu":
    print(f"accelerator: skipped, no accelerator found ({where}); jax {jax.__version__}")
    return 0
  meta = _meta(args, where)
  print(f"accelerator: {where}, jax {meta['jax']}, grain {meta['grain']}, {meta['cpus']} CPUs")
  results: dict[str, Any] = {"meta": meta}

  def save() -> None:  # After each section: a run cut short keeps what it measured.
    if args.json:
      with open(args.json, "w") as f:
        json.dump(results, f, indent=1)

  run(args, results, save)
  return 0


if __name__ == "__main__":
  sys.exit(main())
