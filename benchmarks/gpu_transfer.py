"""Host-to-device transfer: the build stage against the hardware (not a test).

Run from the repository root on a machine with a CUDA device:

  python -m benchmarks.gpu_transfer                     # 8, 32, 128, 512 MB
  python -m benchmarks.gpu_transfer --sizes-mb 8 64 --json out.jsonl
  python -m benchmarks.gpu_transfer --platform cpu --sizes-mb 1   # the same code on CPU

Without a CUDA device it prints one line saying so and exits 0. For each
batch size, GB/s (1e9 bytes per second) of:

* ``raw``: the device's own copy bandwidth, host to device: ``cudaMemcpy``
  from a ``cudaMallocHost`` (pinned) buffer through the CUDA runtime that
  jax's CUDA plugin ships (``ctypes``). Where that library cannot be loaded
  (and on ``--platform cpu``) a NumPy copy of the same bytes stands in, and
  the row says which was measured.
* ``put_pinned``: ``jax.device_put`` of an array already in the
  ``pinned_host`` memory kind to the device's memory (where the device has
  that memory kind; otherwise the row is None).
* ``put_numpy``: ``jax.device_put`` of a (pageable) NumPy array.
* ``build``: `iter_jax_batches` over NumPy batches, default prefetch, no
  step; ``build_inline`` the same with ``prefetch_batches=0``.
* ``overlap``: `iter_jax_batches` feeding a jitted step calibrated to take
  about as long as one batch's transfer: wall per batch over
  ``max(step, transfer)`` (1.0 is a perfect overlap, ``serial`` is the
  figure with none).

Every figure is the median of `--trials` trials of `--n` batches each, the
variants interleaved; an iterator's figures leave out its first batch (the
threads' start). With several local devices the build stage spreads each
batch over all of them, and the `jax.device_put` rows use the first.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_GB = 1e9


def _cudart() -> Any | None:
  """The CUDA runtime library, or None."""
  names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
  try:  # The runtime that jax's CUDA wheels ship (nvidia-cuda-runtime-cu12).
    import nvidia.cuda_runtime  # type: ignore[import-not-found]

    for root in nvidia.cuda_runtime.__path__:
      names = sorted(glob.glob(os.path.join(root, "lib", "libcudart.so*"))) + names
  except ImportError:
    pass
  found = ctypes.util.find_library("cudart")
  for name in names + ([found] if found else []):
    try:
      return ctypes.CDLL(name)
    except OSError:
      continue
  return None


def _raw_cuda(nbytes: int, n: int, lib: Any) -> float:
  """Seconds per pinned host -> device `cudaMemcpy` of `nbytes` (median of n)."""
  host, dev = ctypes.c_void_p(), ctypes.c_void_p()
  if lib.cudaMallocHost(ctypes.byref(host), ctypes.c_size_t(nbytes)) != 0:
    raise RuntimeError("cudaMallocHost failed")
  try:
    if lib.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(nbytes)) != 0:
      raise RuntimeError("cudaMalloc failed")
    try:
      ctypes.memset(host, 1, nbytes)
      times = []
      for _ in range(n + 1):  # The first copy warms the path up.
        start = time.perf_counter()
        if lib.cudaMemcpy(dev, host, ctypes.c_size_t(nbytes), 1) != 0:  # HostToDevice.
          raise RuntimeError("cudaMemcpy failed")
        lib.cudaDeviceSynchronize()
        times.append(time.perf_counter() - start)
      return statistics.median(times[1:])
    finally:
      lib.cudaFree(dev)
  finally:
    lib.cudaFreeHost(host)


def _raw_numpy(nbytes: int, n: int) -> float:
  """Seconds per NumPy copy of `nbytes` (the stand-in on CPU)."""
  src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
  times = []
  for _ in range(n + 1):
    start = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - start)
  return statistics.median(times[1:])


def _batches(mb: float, n: int) -> list[dict[str, np.ndarray]]:
  rows = 256
  width = max(1, int(mb * 1e6) // rows)
  rng = np.random.default_rng(0)
  distinct = [{"x": rng.integers(0, 255, (rows, width), dtype=np.uint8)} for _ in range(2)]
  return [distinct[i % 2] for i in range(n)]


def _drain(make: Callable[[], Any], step: Callable[[Any], Any] | None = None) -> float:
  """Seconds per batch after the first (the iterator's start is not timed)."""
  import jax

  it = make()
  start, n = 0.0, 0
  for batch in it:
    jax.block_until_ready(step(batch) if step else batch)
    if n == 0:
      start = time.perf_counter()
    n += 1
  elapsed = time.perf_counter() - start
  close = getattr(it, "close", None)
  if callable(close):
    close()
  return elapsed / max(n - 1, 1)


def _puts(device: Any, data: list[dict[str, np.ndarray]]) -> dict[str, Callable[[], float]]:
  """Timed `jax.device_put` variants over the batches in `data` (seconds)."""
  import jax

  kinds = {m.kind for m in device.addressable_memories()}
  target = jax.sharding.SingleDeviceSharding(device)

  def timed(arrays: list[Any], sharding: Any) -> Callable[[], float]:
    def run() -> float:
      start = time.perf_counter()
      for a in arrays:
        jax.block_until_ready(jax.device_put(a, sharding))
      return (time.perf_counter() - start) / len(arrays)

    return run

  out = {"put_numpy": timed([b["x"] for b in data], target)}
  if "pinned_host" in kinds and "device" in kinds:
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    arrays = [jax.device_put(b["x"], pinned) for b in data[:2]]
    arrays = [arrays[i % len(arrays)] for i in range(len(data))]
    out["put_pinned"] = timed(arrays, target.with_memory_kind("device"))
  return out


def _step_for(seconds: float) -> Callable[[Any], Any]:
  """A jitted step that reads the batch and computes for about `seconds`."""
  import jax
  import jax.numpy as jnp

  w = jnp.ones((512, 512), jnp.float32) / 512

  def make(k: int) -> Callable[[Any], Any]:
    def body(_: int, m: Any) -> Any:
      return jnp.tanh(m @ w)

    return jax.jit(lambda b: jax.lax.fori_loop(0, k, body, w) + b["x"][0, 0].astype(jnp.float32))

  probe = make(64)
  x = {"x": jnp.zeros((1, 1), jnp.uint8)}
  jax.block_until_ready(probe(x))
  start = time.perf_counter()
  jax.block_until_ready(probe(x))
  per_iter = max((time.perf_counter() - start) / 64, 1e-7)
  return make(max(1, int(seconds / per_iter)))


def measure_size(mb: float, *, n: int, trials: int, platform: str) -> dict[str, Any]:
  """Every figure of one batch size (see the module docstring)."""
  import jax

  import grain_jax_sync as gjs

  device = jax.local_devices()[0]
  data = _batches(mb, n)
  nbytes = data[0]["x"].nbytes
  lib = _cudart() if platform == "cuda" else None
  raw_kind = "cudaMemcpy, pinned" if lib is not None else "numpy copy (stand-in)"
  raw_s = _raw_cuda(nbytes, n, lib) if lib is not None else _raw_numpy(nbytes, n)
  variants: dict[str, Callable[[], float]] = dict(_puts(device, data))
  variants["build"] = lambda: _drain(lambda: gjs.iter_jax_batches(data, batch_size=256))
  variants["build_inline"] = lambda: _drain(
    lambda: gjs.iter_jax_batches(data, batch_size=256, prefetch_batches=0)
  )
  for run in variants.values():  # Warm-up: compiles, thread start.
    run()
  times: dict[str, list[float]] = {k: [] for k in variants}
  keys = list(variants)
  for t in range(trials):
    for k in keys[t % len(keys) :] + keys[: t % len(keys)]:
      times[k].append(variants[k]())
  per_batch = {k: statistics.median(v) for k, v in times.items()}
  out: dict[str, Any] = {"mb": mb, "bytes": nbytes, "n": n, "trials": trials, "raw_kind": raw_kind}
  out["raw"] = nbytes / raw_s / _GB
  for k in ("put_numpy", "put_pinned", "build", "build_inline"):
    out[k] = nbytes / per_batch[k] / _GB if k in per_batch else None
  transfer_s = per_batch["build_inline"]
  step = _step_for(transfer_s)
  resident = jax.device_put(data[0])
  step_s = min(_drain(lambda: iter([resident] * n), step) for _ in range(2))
  fed = [_drain(lambda: gjs.iter_jax_batches(data, batch_size=256), step) for _ in range(trials)]
  ideal = max(step_s, transfer_s)
  out["step_ms"] = step_s * 1e3
  out["overlap"] = statistics.median(fed) / ideal
  out["serial"] = (step_s + transfer_s) / ideal
  return out


def _has_cuda() -> tuple[bool, str]:
  import jax

  try:
    devices = jax.devices("cuda")
  except RuntimeError as e:
    return False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
  return bool(devices), f"{len(devices)} CUDA device(s)"


def _line(r: dict[str, Any]) -> str:
  def gbs(k: str) -> str:
    return "n/a" if r[k] is None else f"{r[k]:6.2f}"

  return (
    f"{r['mb']:>6g} MB  raw {gbs('raw')} ({r['raw_kind']})  put_pinned {gbs('put_pinned')}"
    f"  put_numpy {gbs('put_numpy')}  build {gbs('build')}  build_inline {gbs('build_inline')}"
    f"  GB/s;  overlap {r['overlap']:.2f} (serial {r['serial']:.2f}, step {r['step_ms']:.1f} ms)"
  )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
  parser.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 32, 128, 512])
  parser.add_argument("--n", type=int, default=20, help="batches per trial")
  parser.add_argument("--trials", type=int, default=7)
  parser.add_argument("--json", metavar="PATH", help="also write one JSON line per size")
  args = parser.parse_args(argv)
  if args.platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  if args.platform == "cuda":
    ok, why = _has_cuda()
    if not ok:
      print(f"gpu_transfer: skipped, no CUDA device ({why}); jax {jax.__version__}")
      return 0
  print(f"gpu_transfer: {jax.devices()[0].device_kind} ({args.platform}), jax {jax.__version__}")
  results = []
  for mb in args.sizes_mb:
    r = measure_size(mb, n=args.n, trials=args.trials, platform=args.platform)
    results.append(r)
    print(_line(r), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      for r in results:
        f.write(json.dumps(r) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
