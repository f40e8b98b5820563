"""Grain sources. Imported only when a Grain object is passed."""

from __future__ import annotations

from typing import Any

from grain_jax_sync._src.sources import base


def open_grain(source: Any) -> base.SourceIterator | None:
  """Adapts a Grain object, or returns None to use the generic path."""
  del source
  return None
