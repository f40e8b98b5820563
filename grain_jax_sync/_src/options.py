"""The options: one frozen value, made and checked once; its digest; the state check.

The digest of the options every host must share goes into the first exchange
and into each resume state, which `check_state` checks. Pure Python and NumPy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np

from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import shapes as shapes_lib

logger = logging.getLogger(__name__)

# 2 adds "settings" (the digest of the options) to the state; 1 is still read.
STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)


class _Unset:
  """The default of `mask_key`: not given (an explicit None silences the warning)."""

  def __repr__(self) -> str:
    return "UNSET"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """The options of `iter_jax_batches`, `device_put` and `jax_sync_generator`, checked.

  Each is the keyword argument of its name, with `iter_jax_batches`'s
  default (`device_put` and `jax_sync_generator` say where theirs differ).

  Attributes:
    batch_size: Rows per process per batch that padding fills to and
      `drop_last` compares with; batches larger than it pass through when
      every process has one of the same size. None (the default): the
      largest host batch of the first position, agreed across processes
      (and saved with the state); a short batch that is not its host's last
      then raises naming both sizes. Without `paddings` and `drop_last`
      every batch keeps its size (host batches must be equal).
    drop_last: Stop when any process runs out; drop a short last batch on
      every process (a short batch mid-stream raises, naming both sizes).
      Default False.
    paddings: Fill value for padded rows and dummy batches: a scalar or a dict
      of column name (or prefix) to scalar. None (the default) disables
      padding. A value must be one of its column's output dtype (as it lands
      on the device: int64 is int32 with x64 off): -1 for uint8, 0.5 for an
      integer, 1e6 for float16, True for a number column or a string raise a
      `ValueError` naming the column.
    mask_key: If set, dict batches get a boolean ``(rows,)`` column of that
      name: True for real rows, False for padding and dummy batches. Left
      unset (the default) with `paddings`, one warning is logged that padded
      rows look real; pass None to silence it.
    dtypes: Output dtype: one dtype or a dict of column name to dtype (None,
      the default: the input's). Narrowing casts run on the host before the
      transfer, widening casts on the device after it; either way the values
      are `jax.Array.astype`'s (float to integer saturates, NaN becomes 0;
      integer to integer wraps).
    synchronize_batches: Agree across processes (a single process never
      exchanges anything). Default True.
    synchronize_lookahead: At most this many batches decided ahead of this
      host's consumer (None, the default: no cap in batches; the agreement
      decides `decide_ahead_s` ahead, within 64 MiB of read batches). The
      collective fallback agrees in windows of this many (10 when None).
    decide_ahead_s: How far ahead of the slowest consumer the agreement
      decides, in seconds of its own consumption, measured as the job runs
      (default 1.0). An ending (`request_stop()`, a close, an error) reaches
      every host within about ``decide_ahead_s + (prefetch_batches + 1)``
      steps + 1 s; the store is called about twice per `decide_ahead_s`
      whatever the step time (docs/guarantees.md, Endings).
    prefetch_batches: Batches prepared ahead in a background thread (0: none;
      default 2).
    sync_timeout_s: Seconds (default 600) to wait for a live peer (one whose
      liveness beat goes on: a slow source, a long checkpoint save or
      compile) before every process raises `PeerTimeoutError` naming it. A
      dead peer (no beat for 8 s) is named within about 10 s whatever this is.
    name: Names the exchange keys; needed only when processes do not create
      their iterators in the same order. Iterators of one name are counted
      (a new one each epoch is fine): every process creates as many. Default None.
    pad_shapes: The dims (>= 1) whose sizes may differ across hosts and
      batches: a dict of column name (or prefix) to a dim or a tuple of dims
      (``{"tokens": 1}``), or a dim (tuple) for a bare-array batch. At each
      batch every host pads them with `paddings` (required) to the largest
      size on any host. Everything else still must match. See docs/shapes.md.
      None (the default): every dim must match. Held, with `shape_buckets`
      and `shape_mask_keys`, as one `shapes.Shapes`.
    shape_buckets: Per column of `pad_shapes`, ascending sizes
      (``{"tokens": [128, 256, 512]}``): the agreed size is rounded up to the
      next one (so a jitted step sees at most that many shapes); a size above
      the last raises the same ValueError on every host.
    shape_mask_keys: Per column of `pad_shapes`, the key of a boolean element
      mask added to dict batches (``{"tokens": "tokens_mask"}``), shaped like
      the padded leaf up to its last named dim: True for real elements, False
      for padded elements and for padded and dummy rows.
    read_ahead: Not an option of `iter_jax_batches`: `device_put`'s bound on
      batches read but not yet built, ``cpu_buffer_size + 1`` as Grain's
      holds (None: the agreement's own bound, `agreement.read_ahead_limit`).
  """

  batch_size: int | None = None
  drop_last: bool = False
  paddings: Any = None
  mask_key: str | None = None  # `make` turns a `mask_key` left unset into None.
  dtypes: Any = None
  synchronize_batches: bool = True
  synchronize_lookahead: int | None = None
  decide_ahead_s: float = 1.0
  prefetch_batches: int = 2
  sync_timeout_s: float = 600.0
  name: str | None = None
  pad_shapes: shapes_lib.Shapes | None = None
  read_ahead: int | None = None

  def digest(self) -> dict[str, Any]:
    """What every host must agree on (compared in the first exchange), JSON-stable."""
    digest = {
      "batch_size": self.batch_size,
      "drop_last": self.drop_last,
      "paddings": _describe(self.paddings),
      "mask_key": self.mask_key,
      "dtypes": _describe(self.dtypes),
    }
    if self.synchronize_lookahead is not None:  # Set: the collective fallback's window.
      digest["synchronize_lookahead"] = self.synchronize_lookahead
    if self.pad_shapes is not None:  # Only when set: states saved without it still resume.
      digest["pad_shapes"] = self.pad_shapes.describe()
    return json.loads(json.dumps(digest, sort_keys=True, default=repr))

  def rules(self, batch_size: int | None = None) -> plan_lib.Rules:
    """The rules `plan.decide` applies, given the agreed `batch_size` where known (`plan.pin`)."""
    return plan_lib.Rules(
      batch_size=batch_size if self.batch_size is None else self.batch_size,
      drop_last=self.drop_last,
      pad=self.paddings is not None,
      wait_for_last=True,
      derived=self.batch_size is None and batch_size is not None,
      shapes=self.pad_shapes,
    )


class CommonKeywords(TypedDict, total=False):
  """The options `device_put` takes by keyword, for type checkers (`Options` documents them)."""

  batch_size: int | None
  drop_last: bool
  paddings: Any
  mask_key: str | None
  dtypes: Any
  synchronize_batches: bool
  synchronize_lookahead: int | None
  decide_ahead_s: float
  sync_timeout_s: float
  name: str | None
  pad_shapes: Any
  shape_buckets: Any
  shape_mask_keys: Any


class Keywords(CommonKeywords, total=False):
  """The options `iter_jax_batches` takes: `device_put`'s and `prefetch_batches`."""

  prefetch_batches: int


def make(
  function: str, keywords: Mapping[str, Any], *, process_count: int, **fixed: Any
) -> Options:
  """Makes and checks the options of entry point `function` from its `keywords`, once.

  Touches no store and starts no thread; an option not given takes its `Options`
  default. `fixed`: options `function` sets itself, which a caller may not pass.
  A keyword that is no option raises TypeError, as Python words it.
  """
  for key in keywords:
    if key not in Keywords.__optional_keys__ or key in fixed:
      raise TypeError(f"{function}() got an unexpected keyword argument {key!r}")
  unset = {"mask_key": UNSET, "shape_buckets": None, "shape_mask_keys": None}
  given = {**dataclasses.asdict(Options()), **unset, **keywords, **fixed}
  paddings, mask_key = given["paddings"], given["mask_key"]
  if mask_key is UNSET:
    if paddings is not None:
      logger.warning(
        "grain_jax_sync: `paddings` is set but `mask_key` is not, so padded"
        " rows and dummy batches are indistinguishable from real rows (a loss"
        ' or an eval metric counts them). Pass `mask_key="mask"` to get a'
        " boolean mask column, or `mask_key=None` to silence this warning"
      )
    mask_key = None
  for arg, value in (("mask_key", mask_key), ("name", given["name"])):
    if value is not None and not isinstance(value, str):
      raise ValueError(f"`{arg}` must be a str or None, got {value!r:.100}")
  sync_timeout_s = checked_seconds("sync_timeout_s", given["sync_timeout_s"], zero=False)
  decide_ahead_s = checked_seconds("decide_ahead_s", given["decide_ahead_s"])
  synchronize_batches = checked_bool("synchronize_batches", given["synchronize_batches"])
  return Options(
    batch_size=checked_int_or_none("batch_size", given["batch_size"]),
    drop_last=checked_bool("drop_last", given["drop_last"]),
    paddings=paddings,
    mask_key=mask_key,
    dtypes=given["dtypes"],
    synchronize_batches=synchronize_batches,
    synchronize_lookahead=checked_int_or_none(
      "synchronize_lookahead", given["synchronize_lookahead"]
    ),
    decide_ahead_s=decide_ahead_s,
    prefetch_batches=checked_int("prefetch_batches", given["prefetch_batches"], minimum=0),
    sync_timeout_s=sync_timeout_s,
    name=given["name"],
    read_ahead=checked_int_or_none("read_ahead", given["read_ahead"], minimum=0),
    pad_shapes=shapes_lib.make(
      given["pad_shapes"],
      given["shape_buckets"],
      given["shape_mask_keys"],
      paddings,
      synchronized=synchronize_batches or process_count == 1,
    ),
  )


def _describe(x: Any) -> Any:
  if x is None:
    return None
  if isinstance(x, Mapping):
    return {str(k): _describe(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
  if isinstance(x, (np.generic, np.ndarray)):
    # A NumPy value, not a dtype: np.dtype(np.float32(1)) is float32, which
    # would hide different padding values.
    return repr(np.asarray(x).tolist())
  try:
    return np.dtype(x).name
  except TypeError:
    return repr(x)


def _int_field(state: Mapping[str, Any], key: str, *, minimum: int = 0) -> int:
  if key not in state:
    raise ValueError(
      f"`state` has no {key!r} field; expected a dict from JaxBatchIterator.get_state()"
    )
  return checked_int(f"state[{key!r}]", state[key], minimum=minimum)


def check_state(
  state: Any, *, options: Options, process_index: int, process_count: int
) -> tuple[Any, int, int | None]:
  """Checks `state` against this process and `options`, touching nothing.

  Returns (the source's state, output batches before the resume point, the
  derived batch size saved with it or None); a ValueError names the field
  that is missing, ill-typed or different.
  """
  if not isinstance(state, Mapping):
    raise ValueError(
      f"`state` must be a dict from JaxBatchIterator.get_state(), got a {type(state).__name__}"
    )
  version = state.get("version")
  if version not in _READABLE_VERSIONS:
    raise ValueError(
      f"`state['version']` is {version!r:.50}; this library reads state versions"
      f" {list(_READABLE_VERSIONS)} (a state from another version of grain_jax_sync?)"
    )
  batches = _int_field(state, "batches")
  if _int_field(state, "process_count") != process_count:
    # Elastic sources turn another count's states into this one's before this check.
    raise ValueError(
      f"`state` was taken with process_count={state['process_count']}, but this"
      f" process has process_count={process_count}: this source cannot be re-split"
      " over another process count; each process must restore its own state with the"
      " same process count, or build the pipeline with"
      " grain_jax_sync.elastic_source(records, transform) to resume on any count"
    )
  if _int_field(state, "process_index") != process_index:
    raise ValueError(
      f"`state` was taken with process_index={state['process_index']}, but this process"
      f" has process_index={process_index}; each process must restore its own state"
      " (or pass the list of every process's state)"
    )
  if "source" not in state:
    raise ValueError("`state` has no 'source' field; expected a dict from get_state()")
  if version >= 2:
    saved = state.get("settings")
    if not isinstance(saved, Mapping):
      raise ValueError(f"`state['settings']` must be a dict, got {saved!r:.100}")
    # How far ahead hosts decide never changes the stream: a state saved at
    # another `synchronize_lookahead` resumes.
    saved = {k: v for k, v in saved.items() if k != "synchronize_lookahead"}
    current = {k: v for k, v in options.digest().items() if k != "synchronize_lookahead"}
    if saved != current:
      diffs = plan_lib.settings_diff(saved, current)
      raise ValueError(
        f"`state` was saved by an iterator with other settings ({'; '.join(diffs.values())},"
        " saved vs now); build the iterator with the settings it was saved with"
      )
  pinned = _int_field(state, "batch_size", minimum=1) if "batch_size" in state else None
  return state["source"], batches, pinned


def checked_int(arg: str, value: Any, *, minimum: int = 1, also: str = "") -> int:
  """`value` as an int, or a ValueError naming `arg` if it is no int >= `minimum` (or `also`)."""
  if not shapes_lib.is_int(value) or value < minimum:
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(f"`{arg}` must be {kind}{also}, got {value!r:.100}")
  return int(value)


def finite_number(value: Any) -> float | None:
  """`value` as a float if it is a finite real number (NumPy's, 0-d arrays), else None (bools)."""
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    return None
  try:
    out = float(value)
  except (OverflowError, TypeError, ValueError):
    return None
  return out if math.isfinite(out) else None


def checked_seconds(arg: str, value: Any, *, zero: bool = True) -> float:
  """`value` as a float, or a ValueError naming `arg` if it is no finite number >= 0 (> 0 unless `zero`)."""
  out = finite_number(value)
  if out is None or out < 0 or (out == 0 and not zero):
    raise ValueError(
      f"`{arg}` must be a finite number of seconds {'>=' if zero else '>'} 0, got {value!r:.100}"
    )
  return out


def checked_bool(arg: str, value: Any) -> bool:
  """`value` as a bool, or a TypeError naming `arg` if it is no bool (NumPy's too): never a truthy cast."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"`{arg}` must be True or False, got {value!r:.100}")
  return bool(value)


def checked_int_or_none(
  arg: str, value: Any, *, minimum: int = 1, none: str = "None"
) -> int | None:
  """None, or `value` checked by `checked_int`; the message allows `none` too."""
  return None if value is None else checked_int(arg, value, minimum=minimum, also=f" or {none}")
