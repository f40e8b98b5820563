"""Batches that are pytree nodes registered with `jax.tree_util` (run in simulated hosts)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import scenarios


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
  """A batch as a registered dataclass, with a static field and a None leaf."""

  x: np.ndarray
  extra: dict[str, Any]
  tag: str = dataclasses.field(default="train", metadata={"static": True})


def make(process: int, sizes: list[int], tag: str = "train") -> list[Batch]:
  out = []
  for b, n in enumerate(sizes):
    x = scenarios.rows_for(process, b, n).astype(np.int32)
    out.append(Batch(x, {"y": np.stack([x, -x], axis=1).astype(np.float32), "none": None}, tag))
  return out


def run(
  per_process_sizes: list[list[int]], kwargs: dict[str, Any], tags: list[str]
) -> dict[str, Any]:
  """iter_jax_batches over `Batch` batches; host p's static field is tags[p]."""
  import grain_jax_sync as gjs

  p = jax.process_index()
  with gjs.iter_jax_batches(make(p, per_process_sizes[p], tags[p]), **kwargs) as it:
    out = scenarios.consume(it)
  out["types"] = [type(b).__name__ for b in out["batches"]]
  out["tags"] = [b.tag for b in out["batches"]]
  out["batches"] = [{"x": b.x, "y": b.extra["y"], "none": b.extra["none"]} for b in out["batches"]]
  return out
