"""Scenario functions that run inside simulated hosts (module level, importable).

Each returns plain Python/NumPy values that pickle back to the test. Rows encode
where they came from: value = 1000 * process + 10 * source batch + row, so a
test can say exactly which real row landed where.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def rows_for(process: int, batch: int, n: int) -> np.ndarray:
  return 1000 * process + 10 * batch + np.arange(n, dtype=np.int64)


def make_batches(
  process: int, sizes: list[int], *, extra: bool = True
) -> list[dict[str, np.ndarray]]:
  """Dict batches {"x": int32 ids, "y": float32 (n, 2)} with given row counts."""
  out = []
  for b, n in enumerate(sizes):
    x = rows_for(process, b, n).astype(np.int32)
    batch = {"x": x}
    if extra:
      batch["y"] = np.stack([x, -x], axis=1).astype(np.float32)
    out.append(batch)
  return out


def gather(tree: Any) -> Any:
  """Every leaf of a batch of global arrays as one host NumPy array."""
  import jax
  from jax.experimental import multihost_utils

  return jax.tree_util.tree_map(
    lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree
  )


def consume(it, limit: int | None = None) -> dict[str, Any]:
  """Drains `it`, gathering every batch; records the error if one is raised."""
  out: dict[str, Any] = {"batches": [], "error": None, "error_type": None}
  start = time.monotonic()
  try:
    for i, batch in enumerate(it):
      out["batches"].append(gather(batch))
      if limit is not None and i + 1 >= limit:
        break
  except Exception as e:  # noqa: BLE001 - returned to the test.
    out["error"] = str(e)
    out["error_type"] = type(e).__name__
  out["elapsed_s"] = time.monotonic() - start
  return out


def run_iter(
  per_process_sizes: list[list[int]],
  kwargs: dict[str, Any],
  *,
  limit: int | None = None,
  compat: bool = False,
) -> dict[str, Any]:
  """Runs iter_jax_batches (or jax_sync_generator) over `make_batches`."""
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  data = make_batches(p, per_process_sizes[p])
  if compat:
    it = gjs.jax_sync_generator(data, **kwargs)
  else:
    it = gjs.iter_jax_batches(data, **kwargs)
  result = consume(it, limit)
  if not compat:
    it.close()
  result["local_devices"] = jax.local_device_count()
  result["process_count"] = jax.process_count()
  return result


class FailingSource:
  """Yields `good` batches, then raises KeyError (a source failure)."""

  def __init__(self, batches, good: int):
    self._batches = batches
    self._good = good

  def __iter__(self):
    for i, b in enumerate(self._batches):
      if i == self._good:
        raise KeyError(f"record {i} is missing")
      yield b


def structured_batches(process: int, variant: str, n_batches: int = 2) -> list[Any]:
  """Batches whose structure depends on `variant` (per process)."""
  out = []
  for b in range(n_batches):
    x = rows_for(process, b, 4).astype(np.int32)
    if variant == "nested":
      out.append({"a": {"ids": x, "pair": (x * 2, x.astype(np.float32)[:, None])}, "b": [x + 1]})
    elif variant == "extra_column":
      out.append({"x": x, "extra": x})
    elif variant == "float":
      out.append({"x": x.astype(np.float32)})
    else:
      out.append({"x": x})
  return out


def run_structured(variant_by_process: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
  import jax

  import grain_jax_sync as gjs

  p = jax.process_index()
  data = structured_batches(p, variant_by_process[p])
  with gjs.iter_jax_batches(data, **kwargs) as it:
    return consume(it)


def run_cases(cases: dict[str, tuple[Any, tuple, dict[str, Any]]]) -> dict[str, Any]:
  """Runs every case, ``name: ((module, function name, its root), args, kwargs)``, in turn here.

  One launch for several scenarios of one topology: {name: fn(*args, **kwargs)}.
  Functions travel by name: the job is unpickled before the tests' folder is
  on `sys.path`.
  A case that raises is re-raised naming the case.
  """
  import importlib
  import sys

  out = {}
  for name, ((module, qualname, root), args, kwargs) in cases.items():
    if root not in sys.path:
      sys.path.append(root)
    fn = getattr(importlib.import_module(module), qualname)
    try:
      out[name] = fn(*args, **kwargs)
    except Exception as e:
      raise RuntimeError(f"case {name!r} raised {type(e).__name__}: {e}") from e
  return out
