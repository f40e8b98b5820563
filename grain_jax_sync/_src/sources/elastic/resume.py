"""Resume states across job sizes: every old process's state -> this process's state.

On another count, or with another `batch_size` or new mixture weights, an
elastic source re-splits what the old job left (`split.resume`); any other
source refuses another count. Pure Python.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from grain_jax_sync._src.sources.elastic import split
from grain_jax_sync._src.sources.elastic import state as state_lib
from grain_jax_sync._src.sources.elastic.split import EpochShares, resume
from grain_jax_sync._src.sources.elastic.stream import ElasticIterator

NOT_ELASTIC = (
  "{what} cannot be re-split over another process count ({reason}); build the"
  " pipeline with grain_jax_sync.elastic_source(records, transform) to resume it"
  " on any number of processes"
)


def _listed(states: Sequence[Any]) -> list[Mapping[str, Any]]:
  """`states` checked as one job's, in process order."""
  if not states:
    raise ValueError("`state` is an empty list; expected every old process's get_state()")
  for i, s in enumerate(states):
    if not isinstance(s, Mapping):
      raise ValueError(f"`state[{i}]` must be a dict from get_state(), got {type(s).__name__}")
    if (s.get("process_index"), s.get("process_count")) != (i, len(states)):
      raise ValueError(
        f"`state[{i}]` was taken by process {s.get('process_index')!r} of"
        f" {s.get('process_count')!r}; pass every old process's state, in process order"
        f" (process {i} of {len(states)} here)"
      )
  for key in ("batches", "settings", "version", "batch_size"):
    values = [s.get(key) for s in states]
    if any(v != values[0] for v in values):
      raise ValueError(
        f"the old processes' states differ in {key!r} ({values[0]!r:.60} in process 0,"
        f" {next(v for v in values if v != values[0])!r:.60} in another): they must be"
        " taken at the same batch of one job"
      )
  return list(states)


def for_this_process(
  source: Any,
  state: Any,
  *,
  process_index: int,
  process_count: int,
  settings: Mapping[str, Any] | None = None,
) -> Any:
  """The state this process restores, from `state` as given to `set_state`.

  `state` is one state, or every old process's in process order: this
  process's own, or an elastic source's re-split where the process count,
  the mixture's weights or the `batch_size` of `settings` (the iterator's
  digest) differ. ValueError if the list is not one job's, or cannot be re-split.
  """
  is_elastic = isinstance(source, ElasticIterator)
  if isinstance(state, Mapping):
    if is_elastic:
      _check_one(state, process_count, settings)
    return state
  if not isinstance(state, (list, tuple)):
    return state  # `check_state` names what it got.
  states = _listed(state)
  if not is_elastic:
    if len(states) == process_count:
      return states[process_index]
    raise ValueError(
      NOT_ELASTIC.format(
        what=source.description,
        reason=f"the states are from {len(states)} processes, this job has {process_count}",
      )
    )
  why = []  # What a re-split is for.
  if len(states) != process_count:
    why.append("over another process count")
  if _rebatched(states, settings):
    states = [{**s, "settings": settings} for s in states]
    why.append("to change `batch_size`")
  if source.spec.mixture is not None and (switched := _switched(source, states)) is not None:
    states = switched
    why.append("to take new weights")
  if not why:
    return states[process_index]
  return _resplit(source, states, process_index, process_count, " and ".join(why))


def _check_one(state: Mapping[str, Any], count: int, settings: Mapping[str, Any] | None) -> None:
  """Refuses one state of an elastic source where the list of every old process's is needed."""
  old = state.get("process_count")
  if isinstance(old, int) and old != count:
    raise ValueError(
      f"`state` is one process's state of a job of {old} processes; on {count}"
      " processes an elastic iterator restores from the list of every old process's"
      " state, in process order"
    )
  if _rebatched([state], settings):
    raise ValueError(
      "`state` was saved with another `batch_size`; an elastic iterator changes its"
      " batch size from the list of every old process's state, in process order"
    )


def _rebatched(states: Sequence[Mapping[str, Any]], settings: Mapping[str, Any] | None) -> bool:
  """Whether the old job's settings differ from `settings` in `batch_size` alone."""
  saved = states[0].get("settings")
  if settings is None or not isinstance(saved, Mapping):
    return False
  other = ("batch_size", "synchronize_lookahead")
  rest = [{k: v for k, v in d.items() if k not in other} for d in (saved, settings)]
  return rest[0] == rest[1] and saved.get("batch_size") != settings.get("batch_size")


def _thresholds(source: Mapping[str, Any], i: int, position: int, length: int) -> tuple[int, ...]:
  """A state's stream thresholds: its mp_prefetch workers' (``strided``), or its position."""
  strided = source.get("strided")
  if strided is None:
    return (position,)
  if (
    not isinstance(strided, list)
    or not strided
    or not all(isinstance(t, int) and 0 <= t <= length + len(strided) for t in strided)
    or min(min(strided), length) != position
  ):
    raise ValueError(
      f"`state[{i}]['source']['strided']` must list each mp_prefetch worker's threshold"
      f" (ints >= 0, the least equal to 'position' {position}), got {strided!r:.100}"
    )
  return tuple(strided)


class _Old(NamedTuple):
  """What an old process consumed (`split.resume` takes each field, every process's)."""

  shares: EpochShares
  thresholds: tuple[int, ...]
  holes: tuple[int, ...]
  partial: dict[int, int]  # Holes whose first tokens were delivered: how many.


def _olds(source: ElasticIterator, states: Sequence[Mapping[str, Any]], why: str) -> list[_Old]:
  """Every old process's `_Old`, checked against `source` and process 0's split history."""
  out: list[_Old] = []
  for i, s in enumerate(states):
    if "source" not in s:
      raise ValueError(f"`state[{i}]` has no 'source' field; expected a dict from get_state()")
    old, position, _ = state_lib.check_source_state(s["source"], source.spec, source.num_records)
    if s["source"].get("resplittable") is False:
      reason = s["source"].get("why_not_resplittable", "packing, mixing")
      raise ValueError(
        f"`state[{i}]['source']` cannot be re-split {why}: its cursor is not exact"
        f" ({reason}), so the records the transform read may not all be in the batches"
        " delivered. Resume it on the same process count with the same settings and"
        " weights, or re-split a transform of map, filter, batch and mp_prefetch"
      )
    if old.count != len(states) or old.index != i:
      raise ValueError(f"`state[{i}]['source']` is process {old.index} of {old.count}'s")
    if out and (old.first_epoch, old.splits) != (out[0].shares.first_epoch, out[0].shares.splits):
      raise ValueError(
        f"`state[{i}]['source']` has another split history than process 0's: the states"
        " are not from one job"
      )
    try:  # A packer's records in flight, and the tokens delivered of split ones.
      holes = state_lib.unpack_ints(s["source"].get("holes", []))
      partial = {int(j): int(k) for j, k in s["source"].get("partial", [])}
    except (ValueError, TypeError, zlib.error) as e:
      raise ValueError(f"`state[{i}]['source']['holes']` is not a list of ints ({e})") from e
    if not all(0 <= j < position for j in holes) or not set(partial) <= set(holes):
      raise ValueError(
        f"`state[{i}]['source']['holes']` must be stream indices below 'position' {position}"
        f" (and 'partial' some of them), got {holes[:8]}"
      )
    thresholds = _thresholds(s["source"], i, position, old.length)
    out.append(_Old(old, thresholds, holes, partial))
  return out


def _switched(
  source: ElasticIterator, states: list[Mapping[str, Any]]
) -> list[Mapping[str, Any]] | None:
  """`states` with the mixture's weights switched to `source`'s for every global row not
  consumed (nor partly delivered), or None if the weights are the same."""
  new, saved = source.spec.mixture, [s.get("source", {}) for s in states]
  if not all(isinstance(s, Mapping) for s in saved):
    return None  # `check_source_state` names it.
  key = saved[0].get("mixture")
  if (
    key == new.key
    or not isinstance(key, list)
    or key[1:] != new.key[1:]
    or len(key[0]) != len(new.proportions)
  ):
    return None  # The same weights, or `check_source_state` names what differs.
  patched = [
    {**s, "source": {**s["source"], "mixture": new.key, "mixture_runs": None}} for s in states
  ]
  olds = _olds(source, patched, "to take new weights")
  was = dataclasses.replace(new, proportions=tuple(key[0]))
  was = was.restored(state_lib.runs_from_json(saved[0].get("mixture_runs")))
  fields = state_lib.mixture_fields(was.switched(_kept(olds), new.proportions))
  return [
    {**s, "source": {**{k: v for k, v in s["source"].items() if k != "mixture_runs"}, **fields}}
    for s in states
  ]


def _kept(olds: list[_Old]) -> list[tuple[int, int]]:
  """The global rows (of a mixture) the old job consumed, or some job delivered in part, as ranges."""
  first, splits = resume(*zip(*olds, strict=True))
  length = olds[0].shares.num_records
  kept: list[tuple[int, int]] = [(0, first * length)] if first else []
  for epoch, history in splits:
    left = split.shares(length, history, 1)[0]  # What the old job left of the epoch.
    at = 0
    for a, b in [*left, (length, length)]:
      if a > at:
        kept.append((epoch * length + at, epoch * length + a))
      at = b
    # Partly delivered by any job of the history, the old one's holes included: a record
    # an earlier job left in part and the old job did not reach keeps its source too.
    kept.extend(
      (epoch * length + pos, epoch * length + pos + 1) for pos in split.partial(length, history)
    )
  out: list[tuple[int, int]] = []
  for a, b in sorted(kept):
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(b, out[-1][1]))
    else:
      out.append((a, b))
  return out


def _resplit(
  source: ElasticIterator, states: list[Mapping[str, Any]], p: int, count: int, why: str
) -> dict[str, Any]:
  olds = _olds(source, states, why)
  first, splits = resume(*zip(*olds, strict=True))
  new = EpochShares(olds[0].shares.num_records, olds[0].shares.num_epochs, first, splits, count, p)
  return {
    **states[0],
    "process_index": p,
    "process_count": count,
    "source": state_lib.export(
      new, 0, None, state_lib.mixture_spec(states[0]["source"], source.spec)
    ),
  }
