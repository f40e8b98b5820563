"""One 25 MB leaf put to the first device: memory NumPy allocated against shared memory, whole and in 4 pieces.

Not a test. Run on a machine with an accelerator (on CPU devices a put is no
copy and the figures say nothing):

  python -m benchmarks.mapped_put

Wall and process CPU per put, 3 puts in flight, over fresh buffers made
before the clock starts: ``owned`` (NumPy's allocation, pages touched),
``shm`` (shared memory written through the same mapping), ``mapped`` (as a
Grain worker process hands a batch over: written through one mapping, read
through a fresh one, whose pages the put touches first). `transfer.pieces`
sends a leaf NumPy did not allocate whole because of the ``mapped`` rows.
"""

from __future__ import annotations

import time
from multiprocessing import shared_memory

import jax
import numpy as np

SHAPE = (2048, 64, 64, 3)
NBYTES = int(np.prod(SHAPE))


def owned() -> tuple[np.ndarray]:
  return (np.random.default_rng(0).integers(0, 256, SHAPE, np.uint8),)


def shm() -> tuple:
  mem = shared_memory.SharedMemory(create=True, size=NBYTES)
  a = np.ndarray(SHAPE, np.uint8, buffer=mem.buf)
  a[:] = 7
  return a, mem


def mapped() -> tuple:
  mem = shared_memory.SharedMemory(create=True, size=NBYTES)
  np.ndarray(SHAPE, np.uint8, buffer=mem.buf)[:] = 7
  other = shared_memory.SharedMemory(mem.name)
  return np.ndarray(SHAPE, np.uint8, buffer=other.buf), mem, other


def put(a: np.ndarray, k: int, device: jax.Device) -> list:
  n = a.shape[0] // k
  return jax.device_put([a[i * n : (i + 1) * n] for i in range(k)], device)


def run(make, k: int, device: jax.Device, puts: int = 24) -> tuple[float, float]:
  """(wall ms, CPU ms) per put of `puts` fresh buffers in `k` pieces, 3 in flight."""
  made = [make() for _ in range(puts)]
  t0, c0 = time.perf_counter(), time.process_time()
  flight: list = []
  for item in made:
    flight.append(put(item[0], k, device))
    if len(flight) > 3:
      jax.block_until_ready(flight.pop(0))
  jax.block_until_ready(flight)
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  mems = [m for item in made for m in item[1:]]
  del made, flight, item
  for m in reversed(mems):
    m.close()
  for m in {m.name: m for m in mems}.values():  # One segment may have two mappings.
    m.unlink()
  return wall / puts * 1e3, cpu / puts * 1e3


def main() -> None:
  device = jax.devices()[0]
  print(f"mapped_put: {device.device_kind} ({device.platform}), jax {jax.__version__}")
  for rep in range(2):
    for name, make in (("owned", owned), ("shm", shm), ("mapped", mapped)):
      for k in (1, 4):
        wall, cpu = run(make, k, device)
        print(f"  {rep} {name:6s} {k} put(s): wall {wall:6.2f} ms  cpu {cpu:7.2f} ms a 25 MB leaf")


if __name__ == "__main__":
  main()
