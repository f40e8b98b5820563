"""The consumed cursor inside a Grain iterator's nested state (pure Python, no Grain).

The elastic source tags its stream's state (`TAG`, and `SLICE` in an
`mp_prefetch` worker); `find_position` finds the tags in whatever the user's
transform nests them in, and says whether the cursor they give is exact: the
records before it are exactly those of the batches delivered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

TAG = "grain_jax_sync_elastic_stream"
SLICE = "grain_jax_sync_elastic_slice"  # [start, step, sequential] of an mp_prefetch worker.
# The stream's state is {"next_index": .., "skip": tokens of its last record a resize says were
# delivered (absent: 0)}. A packer's own tag: {TAG: {"next_index": past its last read},
# "holes": its records in flight, "partial": [[hole, tokens delivered], ..]}.
PACKED = "grain_jax_sync_elastic_packed"
_INTERLEAVE = ("iterators_in_use_states", "iterators_in_use_indices")  # mp_prefetch's.
_PACKING = {"parent", "next_row", "counter"}  # Grain's FirstFit/BestFit packing's.
_NOT_ALONE = "its Grain state holds more than its parent's: packing, mixing"
Why = str | None  # Why a cursor is not exact (None: it is).


def _tags(state: Any, why: Why) -> list[tuple[Mapping[str, Any], Why]]:
  """Every tag inside a Grain state, with why its path keeps more than the cursor."""
  if isinstance(state, Mapping):
    if PACKED in state:  # Stands for its parent's state: the records in flight are named.
      return [(state[PACKED], why or state[PACKED].get("why"))]
    if TAG in state:
      return [(state, why or (None if set(state) <= {TAG, SLICE} else _NOT_ALONE))]
    if all(k in state for k in _INTERLEAVE):
      # mp_prefetch: each worker's state as of the last element it delivered;
      # the other fields say which worker is next (no records).
      why = why or (_NOT_ALONE if state.get("future_states") else None)
      values: Sequence[Any] = [v for v in state[_INTERLEAVE[0]] if v is not None]
      return [t for v in values for t in _tags(v, why)]
    if set(state) == _PACKING:
      # Packing keeps its parent's state at the start of the packed batch it is
      # emitting: the cursor once every row of it was delivered (next_row 0).
      row = state["next_row"]
      mid = (
        f"packing is within a packed batch (next_row={row}): some of its rows were"
        " delivered; a batch size that is a multiple of num_packing_bins ends one with"
        " every batch"
      )
      return _tags(state["parent"], why or (mid if row else None))
  values = _children(state)
  return [t for v in values for t in _tags(v, why or (None if len(values) == 1 else _NOT_ALONE))]


class Position(NamedTuple):
  """A state's stream cursor: index ``j`` is consumed when ``j < thresholds[j % W]`` and not a hole."""

  thresholds: tuple[int, ...]
  why: str | None  # Why it is not exact (None: it is).
  holes: list[int]  # A packer's records in flight, below the thresholds.
  partial: dict[int, int]  # Holes whose first tokens were delivered: how many.


def find_position(state: Any) -> Position | None:
  """The stream cursor of a Grain iterator's nested state, or None; `Position.why` says why it
  is not exact for a re-split (a state beside its parent's may hold records read past it)."""
  tags = _tags(state, None)
  if not tags:
    return None
  why = next((w for _, w in tags if w is not None), None)
  holes = sorted(int(j) for t, _ in tags for j in t.get("holes", ()))
  partial = {int(j): int(k) for t, _ in tags for j, k in t.get("partial", ())}
  return Position(*_thresholds(tags, why), holes, partial)


def find_skip(state: Any) -> int:
  """Tokens of the stream's last record delivered before a resize (its state's ``skip``)."""
  if isinstance(state, Mapping) and isinstance(state.get(TAG), Mapping):
    return int(state[TAG].get("skip", 0))
  return next((k for k in map(find_skip, _children(state)) if k), 0)


def _children(state: Any) -> Sequence[Any]:
  """A mapping's values, a list's or tuple's items; () for anything else."""
  if isinstance(state, Mapping):
    return list(state.values())
  return state if isinstance(state, (list, tuple)) else ()


def _thresholds(tags: list[tuple[Mapping[str, Any], Why]], why: Why) -> tuple[tuple[int, ...], Why]:
  """(stream thresholds, why not exact) of the tags of one state."""
  sliced = [(t[SLICE], int(t[TAG]["next_index"])) for t, _ in tags if SLICE in t]
  plain = [int(t[TAG]["next_index"]) for t, _ in tags if SLICE not in t]
  if not sliced:
    if len(plain) > 1 and any(plain):
      return (min(plain),), why or "it reads the stream more than once"
    return (max(plain),), why
  if any(seq for (_, _, seq), _ in sliced):
    return (0,), why or "mp_prefetch(sequential_slice=True) reads blocks of the stream"
  width = sliced[0][0][1]
  if len({start for (start, _, _), _ in sliced}) != len(sliced):
    return (0,), why or "two of its mp_prefetch workers read the same stride"
  thresholds = list(range(width))  # A worker not started yet: nothing read.
  for (start, step, _), k in sliced:
    if step != width or not 0 <= start < width:
      return (0,), why or "its mp_prefetch workers read the stream unevenly"
    thresholds[start] = start + k * width
  if any(plain):
    why = why or "it reads the stream outside its mp_prefetch workers"
  return tuple(thresholds), why
