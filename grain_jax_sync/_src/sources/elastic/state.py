"""A process's elastic state as JSON: its split history and its cursor, checked on restore.

`export` writes the job's split, the consumed stream position (each
`mp_prefetch` worker's threshold, a packer's holes) and Grain's own state for
a resume on the same count; `check_source_state` reads one back, naming the
field that does not fit. Pure Python and NumPy.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_jax_sync._src.sources.elastic.source import ElasticSource
from grain_jax_sync._src.sources.elastic.split import Cursor, EpochShares, Holes, Range, Resize

FORMAT = "grain_jax_sync.elastic/1"


# -- the split history, compactly --------------------------------------------------


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
  """A resize's cursors: packed ints, or (strided) each cursor's width and all thresholds.

  With `Holes`: ``{"cursors": the row of their stops, "holes": each cursor's holes}``, and
  ``"offsets"``: each cursor's holes' tokens delivered, where a long record was split.
  """
  if any(isinstance(c, Holes) for c in row):
    stops = [c.stop if isinstance(c, Holes) else c for c in row]
    holes = [pack_ints(c.holes if isinstance(c, Holes) else ()) for c in row]
    out: dict[str, Any] = {"cursors": _row_to_json(stops), "holes": holes}
    if any(isinstance(c, Holes) and c.offsets for c in row):
      out["offsets"] = [pack_ints(c.offsets if isinstance(c, Holes) else ()) for c in row]
    return out
  if all(isinstance(c, int) for c in row):
    return pack_ints([int(c) for c in row])  # type: ignore[arg-type]  # ints, checked above.
  cursors = [(c,) if isinstance(c, int) else tuple(c) for c in row]  # type: ignore[arg-type]  # No holes here.
  return {
    "widths": pack_ints([len(c) for c in cursors]),
    "strided": pack_ints([t for c in cursors for t in c]),
  }


def _row_from_json(value: Any) -> tuple[Cursor, ...]:
  """The inverse of `_row_to_json`."""
  if not isinstance(value, Mapping):
    return unpack_ints(value)
  if "holes" in value:
    stops, holes = _row_from_json(value["cursors"]), [unpack_ints(h) for h in value["holes"]]
    offsets = [unpack_ints(k) for k in value.get("offsets", [[]] * len(holes))]
    if any(k and len(k) != len(h) for h, k in zip(holes, offsets, strict=True)):
      raise ValueError(f"holes {holes!r:.60} and their offsets {offsets!r:.60} differ in length")
    return tuple(
      Holes(c, h, k) if h else c  # type: ignore[arg-type]  # A stop is an int.
      for c, h, k in zip(stops, holes, offsets, strict=True)
    )
  widths, flat = unpack_ints(value["widths"]), unpack_ints(value["strided"])
  if any(w < 1 for w in widths) or sum(widths) != len(flat):
    raise ValueError(f"{len(flat)} strided thresholds for widths {widths[:8]}..")
  bounds = itertools.pairwise([0, *itertools.accumulate(widths)])
  return tuple(flat[a] if b - a == 1 else tuple(flat[a:b]) for a, b in bounds)


def splits_to_json(splits: Sequence[tuple[int, Sequence[Resize]]]) -> list[Any]:
  """Per-epoch split histories (`EpochShares.splits`) as JSON."""
  return [[e, [[n, _row_to_json(c)] for n, c in h]] for e, h in splits]


def splits_from_json(value: Any) -> tuple[tuple[int, tuple[Resize, ...]], ...]:
  """The inverse of `splits_to_json`; raises `ValueError` on anything else."""
  try:
    return tuple((int(e), tuple((int(n), _row_from_json(c)) for n, c in h)) for e, h in value)
  except (TypeError, ValueError, KeyError, zlib.error) as e:
    raise ValueError(f"`splits` is not a split history ({e})") from e


# -- a process's state ---------------------------------------------------------------


def export(
  shares: EpochShares,
  consumed: int | tuple[int, ...],
  grain_state: Any,
  spec: ElasticSource,
  *,
  why_not: str | None = None,
  holes: Sequence[int] = (),
  partial: Mapping[int, int] | None = None,
) -> dict:
  """A process's JSON source state, with stream thresholds (or a position) `consumed`, and
  why the cursor cannot be re-split (`why_not`), holes and `partial` (`cursor.Position`)."""
  thresholds = (consumed,) if isinstance(consumed, int) else tuple(consumed)
  position = min(min(thresholds), shares.length)
  epoch, cursor = shares.cursor(position)
  out = {
    "format": FORMAT,
    "num_records": shares.num_records,
    "shuffle": spec.shuffle,
    "seed": spec.seed,
    "num_epochs": shares.num_epochs,
    "process_count": shares.count,
    "process_index": shares.index,
    "first_epoch": shares.first_epoch,
    "splits": splits_to_json(shares.splits),
    "position": position,
    "epoch": epoch,
    "cursor": cursor,
    "resplittable": why_not is None,
    "grain": grain_state,
  }
  if spec.mixture is not None:
    out.update(mixture_fields(spec.mixture))
  if len(thresholds) > 1:
    out["strided"] = [int(t) for t in thresholds]
  if holes:
    out["holes"] = pack_ints(sorted(holes))
  if partial:
    out["partial"] = [[int(j), int(k)] for j, k in sorted(partial.items())]
  if why_not is not None:
    out["why_not_resplittable"] = why_not
  return out


def mixture_fields(mixture: Any) -> dict[str, Any]:
  """A mixture's fields in a state: its key, and its runs of weights if a resume changed them."""
  out: dict[str, Any] = {"mixture": mixture.key}
  if mixture.history:
    out["mixture_runs"] = [
      [pack_ints([x for r in kept for x in r]), list(p)] for kept, p in mixture.history
    ]
  return out


def runs_from_json(value: Any) -> list[tuple[tuple[Range, ...], tuple[int, ...]]] | None:
  """A state's ``mixture_runs``: each run's kept global row ranges and proportions (None: none);
  a run's first entry was a row before 0.6 (it kept every row below it)."""
  if value is None:
    return None
  try:
    out = []
    for kept, p in value:
      if isinstance(kept, int) and not isinstance(kept, bool):
        ranges: tuple[Range, ...] = ((0, kept),) if kept else ()
      else:
        flat = unpack_ints(kept)
        ranges = tuple(zip(flat[::2], flat[1::2], strict=True))
        if any(a >= b for a, b in ranges) or list(flat) != sorted(flat):
          raise ValueError(f"kept rows {flat[:8]} are not sorted ranges")
      out.append((ranges, tuple(int(x) for x in p)))
  except (TypeError, ValueError, zlib.error) as e:
    raise ValueError(
      f"`state['source']['mixture_runs']` is not [[kept rows, proportions], ..] ({e})"
    ) from e
  return out


def mixture_spec(state: Mapping[str, Any], spec: ElasticSource) -> ElasticSource:
  """`spec` with the runs of weights a mixture's `state` was read with (`Mixture.history`)."""
  if spec.mixture is None:
    return spec
  mixture = spec.mixture.restored(runs_from_json(state.get("mixture_runs")))
  if mixture == spec.mixture:
    return spec
  return dataclasses.replace(spec, mixture=mixture, records=spec.records.remixed(mixture))


def _field(state: Mapping[str, Any], key: str, kind: type = int) -> Any:
  if key not in state:
    raise ValueError(f"`state['source']` has no {key!r} field; expected an elastic source's state")
  value = state[key]
  if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
    raise ValueError(f"`state['source'][{key!r}]` must be an int >= 0, got {value!r:.100}")
  if kind is bool and not isinstance(value, bool):
    raise ValueError(f"`state['source'][{key!r}]` must be a bool, got {value!r:.100}")
  return value


def check_source_state(
  state: Any, spec: ElasticSource, num_records: int
) -> tuple[EpochShares, int, Any]:
  """(shares, stream index, Grain state or None) of an exported state, or a ValueError naming
  the field that is missing, ill-typed or differs from `spec`'s (an epoch past `num_epochs`)."""
  if not isinstance(state, Mapping) or state.get("format") != FORMAT:
    raise ValueError(
      f"`state['source']` is not an elastic source's state (no 'format': {FORMAT!r});"
      " was it saved from another source?"
    )
  for key, now in (("num_records", num_records), ("shuffle", spec.shuffle), ("seed", spec.seed)):
    saved = _field(state, key, bool if key == "shuffle" else int)
    if saved != now:
      raise ValueError(
        f"`state['source'][{key!r}]` is {saved!r}, but this elastic source has {key}={now!r};"
        " restore with the records and options the state was saved with"
      )
  mixture = None if spec.mixture is None else spec.mixture.key
  if state.get("mixture") != mixture:
    raise ValueError(
      f"`state['source']['mixture']` (the proportions, sizes and shuffling) is"
      f" {state.get('mixture')!r:.100}, but this source's is {mixture!r:.100}; resume a"
      " mixture with the sources and weights it was saved with (new weights: from the"
      " list of every old process's state)"
    )
  mixture_spec(state, spec)  # Checks the weights' runs.
  epoch = _field(state, "epoch")
  if spec.num_epochs is not None and epoch >= spec.num_epochs:
    raise ValueError(
      f"`state['source']['epoch']` is {epoch}, but this elastic source has"
      f" num_epochs={spec.num_epochs}"
    )
  count = _field(state, "process_count")
  index = _field(state, "process_index")
  if count < 1 or index >= count:
    raise ValueError(f"`state['source']` names process {index} of {count}")
  shares = EpochShares(
    num_records,
    spec.num_epochs,
    _field(state, "first_epoch"),
    splits_from_json(state.get("splits", [])),
    count,
    index,
  )
  position = _field(state, "position")
  if position > shares.length:
    raise ValueError(
      f"`state['source']['position']` is {position}, past this process's {shares.length} records"
    )
  return shares, position, state.get("grain")
