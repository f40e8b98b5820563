"""Resume states across job sizes: every old process's state -> this process's state.

A list of every old process's state on the same process count gives this
process's own; on another count an elastic source re-splits what the old job
left (`split.resume`) and any other source refuses. Pure Python.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

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


def for_this_process(source: Any, state: Any, *, process_index: int, process_count: int) -> Any:
  """The state this process restores, from `state` as given to `set_state`.

  `state` is one state, or every old process's in process order: this
  process's own, or for an elastic source on another count, one re-split
  from the old job's. ValueError if the list is not one job's, or the source
  cannot be re-split over another count.
  """
  is_elastic = isinstance(source, ElasticIterator)
  if isinstance(state, Mapping):
    old = state.get("process_count")
    if is_elastic and isinstance(old, int) and old != process_count:
      raise ValueError(
        f"`state` is one process's state of a job of {old} processes; on {process_count}"
        " processes an elastic iterator restores from the list of every old process's"
        " state, in process order"
      )
    return state
  if not isinstance(state, (list, tuple)):
    return state  # `check_state` names what it got.
  states = _listed(state)
  if is_elastic and source.spec.mixture is not None:
    states = _switched(source, states)
  if len(states) == process_count:
    return states[process_index]
  if not is_elastic:
    raise ValueError(
      NOT_ELASTIC.format(
        what=source.description,
        reason=f"the states are from {len(states)} processes, this job has {process_count}",
      )
    )
  return _resplit(source, states, process_index, process_count)


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


def _switched(source: ElasticIterator, states: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """`states` with the mixture's weights switched to `source`'s from row g*: the first global
  row past every old process's consumed cursor (the same on every host and process count)."""
  new, saved = source.spec.mixture, [s.get("source", {}) for s in states]
  if not all(isinstance(s, Mapping) for s in saved):
    return states  # `check_source_state` names it.
  key = saved[0].get("mixture")
  if (
    key == new.key
    or not isinstance(key, list)
    or key[1:] != new.key[1:]
    or len(key[0]) != len(new.proportions)
  ):
    return states  # The same weights, or `check_source_state` names what differs.
  top = 0
  for i, s in enumerate(saved):
    if s.get("resplittable") is False:
      raise ValueError(
        f"`state[{i}]['source']` cannot take new weights: its cursor is not exact"
        f" ({s.get('why_not_resplittable')}); resume it with the weights it was saved with"
      )
    old, position, _ = state_lib.check_source_state(
      {**s, "mixture": new.key, "mixture_runs": None}, source.spec, source.num_records
    )
    end = min(max(_thresholds(s, i, position, old.length)), old.length)
    if end:
      epoch, pos = old.locate(end - 1)
      top = max(top, epoch * old.num_records + pos + 1)
  was = dataclasses.replace(new, proportions=tuple(key[0])).restored(saved[0].get("mixture_runs"))
  fields = state_lib.mixture_fields(was.switched(top, new.proportions))
  return [
    {**s, "source": {**{k: v for k, v in s["source"].items() if k != "mixture_runs"}, **fields}}
    for s in states
  ]


def _resplit(
  source: ElasticIterator, states: list[Mapping[str, Any]], p: int, count: int
) -> dict[str, Any]:
  olds: list[EpochShares] = []
  cursors: list[tuple[int, ...]] = []
  holes: list[tuple[int, ...]] = []
  for i, s in enumerate(states):
    if "source" not in s:
      raise ValueError(f"`state[{i}]` has no 'source' field; expected a dict from get_state()")
    old, position, _ = state_lib.check_source_state(s["source"], source.spec, source.num_records)
    if s["source"].get("resplittable") is False:
      why = s["source"].get("why_not_resplittable", "packing, mixing")
      raise ValueError(
        f"`state[{i}]['source']` cannot be re-split over another process count: its"
        f" cursor is not exact ({why}), so the records the transform read may not all be"
        " in the batches delivered. Resume it on the same process count, or re-split a"
        " transform of map, filter, batch and mp_prefetch"
      )
    if old.count != len(states) or old.index != i:
      raise ValueError(f"`state[{i}]['source']` is process {old.index} of {old.count}'s")
    if i and (old.first_epoch, old.splits) != (olds[0].first_epoch, olds[0].splits):
      raise ValueError(
        f"`state[{i}]['source']` has another split history than process 0's: the states"
        " are not from one job"
      )
    olds.append(old)
    cursors.append(_thresholds(s["source"], i, position, old.length))
    try:  # A packer's records in flight.
      mine = state_lib.unpack_ints(s["source"].get("holes", []))
    except (ValueError, TypeError, zlib.error) as e:
      raise ValueError(f"`state[{i}]['source']['holes']` is not a list of ints ({e})") from e
    if not all(0 <= j < position for j in mine):
      raise ValueError(
        f"`state[{i}]['source']['holes']` must be stream indices below 'position' {position},"
        f" got {mine[:8]}"
      )
    holes.append(mine)
  first, splits = resume(olds, cursors, holes)
  new = EpochShares(olds[0].num_records, olds[0].num_epochs, first, splits, count, p)
  return {
    **states[0],
    "process_index": p,
    "process_count": count,
    "source": state_lib.export(
      new, 0, None, state_lib.mixture_spec(states[0]["source"], source.spec)
    ),
  }
