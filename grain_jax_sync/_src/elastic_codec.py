"""The elastic split history as compact JSON, for a state (`sources.elastic`).

A resize's cursors are ints (a short list as is, a long one as base64 of
zlib'd deltas), or, strided, each cursor's width and all its thresholds.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from grain_jax_sync._src.elastic_split import Cursor, Resize


def pack_ints(values: Sequence[int]) -> Any:
  """Ints for a state: a short list as is, a long one as base64 of zlib'd deltas."""
  if len(values) <= 16:
    return [int(v) for v in values]
  a = np.asarray(values, dtype=np.int64)
  deltas = np.diff(a, prepend=np.int64(0))
  return "z:" + base64.b64encode(zlib.compress(deltas.astype("<i8").tobytes(), 9)).decode()


def unpack_ints(packed: Any) -> tuple[int, ...]:
  """The inverse of `pack_ints`."""
  if isinstance(packed, str) and packed.startswith("z:"):
    raw = zlib.decompress(base64.b64decode(packed[2:]))
    return tuple(int(v) for v in np.cumsum(np.frombuffer(raw, dtype="<i8")))
  if not isinstance(packed, list) or not all(isinstance(v, int) for v in packed):
    raise ValueError(f"expected a list of ints, got {packed!r:.100}")
  return tuple(packed)


def _row_to_json(row: Sequence[Cursor]) -> Any:
  """A resize's cursors: packed ints, or (strided) each cursor's width and all thresholds."""
  if all(isinstance(c, int) for c in row):
    return pack_ints([int(c) for c in row])  # type: ignore[arg-type]  # ints, checked above.
  cursors = [(c,) if isinstance(c, int) else tuple(c) for c in row]
  return {
    "widths": pack_ints([len(c) for c in cursors]),
    "strided": pack_ints([t for c in cursors for t in c]),
  }


def _row_from_json(value: Any) -> tuple[Cursor, ...]:
  """The inverse of `_row_to_json`."""
  if not isinstance(value, Mapping):
    return unpack_ints(value)
  widths, flat = unpack_ints(value["widths"]), unpack_ints(value["strided"])
  if any(w < 1 for w in widths) or sum(widths) != len(flat):
    raise ValueError(f"{len(flat)} strided thresholds for widths {widths[:8]}..")
  out: list[Cursor] = []
  at = 0
  for w in widths:
    out.append(flat[at] if w == 1 else tuple(flat[at : at + w]))
    at += w
  return tuple(out)


def splits_to_json(splits: Sequence[tuple[int, Sequence[Resize]]]) -> list[Any]:
  """Per-epoch split histories (`Layout.splits`) as JSON."""
  return [[e, [[n, _row_to_json(c)] for n, c in h]] for e, h in splits]


def splits_from_json(value: Any) -> tuple[tuple[int, tuple[Resize, ...]], ...]:
  """The inverse of `splits_to_json`; raises `ValueError` on anything else."""
  try:
    return tuple((int(e), tuple((int(n), _row_from_json(c)) for n, c in h)) for e, h in value)
  except (TypeError, ValueError, KeyError, zlib.error) as e:
    raise ValueError(f"`splits` is not a split history ({e})") from e
