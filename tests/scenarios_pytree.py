"""Batches that are pytree nodes registered with `jax.tree_util` (for tests in one process or many)."""

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
