"""The iterator's settings, their digest, and the resume state's checks.

Pure Python and NumPy; no JAX.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import shapes as shapes_lib

logger = logging.getLogger(__name__)

# 2 adds "settings" (the digest) to the state; 1 is still read.
STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)


@dataclasses.dataclass(frozen=True)
class Settings:
  """The iterator's options, validated."""

  batch_size: int | None
  drop_last: bool
  paddings: Any
  mask_key: str | None
  dtypes: Any
  synchronize: bool
  lookahead: int
  prefetch: int
  sync_timeout_s: float
  name: str | None
  # Batches read but not yet built, at most (None: the agreement's default
  # bound, `agreement.read_ahead_limit`); `device_put`'s `cpu_buffer_size`.
  read_ahead: int | None = None
  # `pad_shapes`, `shape_buckets`, `shape_mask_keys` (`shapes.make`); None: off.
  shapes: shapes_lib.Shapes | None = None

  def digest(self) -> dict[str, Any]:
    """What every host must agree on (compared in the first exchange)."""
    digest = {
      "batch_size": self.batch_size,
      "drop_last": self.drop_last,
      "paddings": _describe(self.paddings),
      "mask_key": self.mask_key,
      "dtypes": _describe(self.dtypes),
      "synchronize_lookahead": self.lookahead,
    }
    if self.shapes is not None:  # Only when set: states saved without it still resume.
      digest["pad_shapes"] = self.shapes.describe()
    return plan_lib.settings_digest(digest)

  def options(self, batch_size: int | None = None) -> plan_lib.Options:
    """The options `plan.decide` takes.

    Args:
      batch_size: The agreed full batch size, where known (`plan.pin`:
        given, or derived from the first position and restored with a
        state); `self.batch_size` when given.
    """
    derived = self.batch_size is None and batch_size is not None
    return plan_lib.Options(
      batch_size=batch_size if self.batch_size is None else self.batch_size,
      drop_last=self.drop_last,
      pad=self.paddings is not None,
      wait_for_last=True,
      derived=derived,
      shapes=self.shapes,
    )


class _Unset:
  """The default of `mask_key`: not given (an explicit None silences the warning)."""

  def __repr__(self) -> str:
    return "UNSET"


UNSET: Any = _Unset()


def warn_if_unmasked(paddings: Any, mask_key: Any) -> str | None:
  """Logs one warning if `paddings` is given and `mask_key` was left unset.

  Args:
    paddings: The `paddings` argument.
    mask_key: The `mask_key` argument, `UNSET` if not given.

  Returns:
    `mask_key` with `UNSET` resolved to None.
  """
  if mask_key is UNSET:
    if paddings is not None:
      logger.warning(
        "grain_jax_sync: `paddings` is set but `mask_key` is not, so padded"
        " rows and dummy batches are indistinguishable from real rows (a loss"
        ' or an eval metric counts them). Pass `mask_key="mask"` to get a'
        " boolean mask column, or `mask_key=None` to silence this warning"
      )
    return None
  return mask_key


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
  value = state[key]
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"`state[{key!r}]` must be an int >= {minimum}, got {value!r:.100}")
  return int(value)


def pinned_batch_size(state: Mapping[str, Any]) -> int | None:
  """The derived full batch size saved with `state` (optional key), or None."""
  if "batch_size" not in state:
    return None
  return _int_field(state, "batch_size", minimum=1)


def check_state(
  state: Any, *, settings: Settings, process_index: int, process_count: int
) -> tuple[int, Any]:
  """Checks `state` (from `set_state`) against this process and `settings`, touching nothing.

  Returns:
    (output batches before the resume point, the source's state).

  Raises:
    ValueError: Naming the field that is missing, ill-typed or different.
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
    current = settings.digest()
    if dict(saved) != current:
      keys = sorted(set(saved) | set(current))
      diffs = [
        f"{k}: {saved.get(k)!r} vs {current.get(k)!r}"
        for k in keys
        if saved.get(k) != current.get(k)
      ]
      raise ValueError(
        f"`state` was saved by an iterator with other settings ({'; '.join(diffs)},"
        " saved vs now); build the iterator with the settings it was saved with"
      )
  return batches, state["source"]


def _positive(arg: str, value: Any, *, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(f"`{arg}` must be {kind}, got {value!r}")
  return int(value)


def make(
  *,
  batch_size: int | None,
  drop_last: bool,
  paddings: Any,
  mask_key: Any,
  dtypes: Any,
  synchronize_batches: bool,
  synchronize_lookahead: int,
  prefetch_batches: int,
  sync_timeout_s: float,
  name: str | None,
  read_ahead: int | None = None,
  pad_shapes: Any = None,
  shape_buckets: Any = None,
  shape_mask_keys: Any = None,
  process_count: int = 1,
) -> Settings:
  """Checks the options of `iter_jax_batches`, `device_put` and `jax_sync_generator`, once.

  Touches no store and starts no thread.

  Raises:
    ValueError: Naming the argument and the value.
  """
  mask_key = warn_if_unmasked(paddings, mask_key)
  if mask_key is not None and not isinstance(mask_key, str):
    raise ValueError(f"`mask_key` must be a str or None, got {mask_key!r}")
  if not (isinstance(sync_timeout_s, (int, float)) and sync_timeout_s > 0):
    raise ValueError(f"`sync_timeout_s` must be > 0, got {sync_timeout_s!r}")
  return Settings(
    batch_size=None if batch_size is None else _positive("batch_size", batch_size),
    drop_last=bool(drop_last),
    paddings=paddings,
    mask_key=mask_key,
    dtypes=dtypes,
    synchronize=bool(synchronize_batches),
    lookahead=_positive("synchronize_lookahead", synchronize_lookahead),
    prefetch=_positive("prefetch_batches", prefetch_batches, minimum=0),
    sync_timeout_s=float(sync_timeout_s),
    name=name,
    read_ahead=None if read_ahead is None else _positive("read_ahead", read_ahead, minimum=0),
    shapes=shapes_lib.make(
      pad_shapes,
      shape_buckets,
      shape_mask_keys,
      paddings,
      synchronized=bool(synchronize_batches) or process_count == 1,
    ),
  )


def check_divisible(settings: Settings, shards: int, describe: str) -> None:
  """With `paddings`, `batch_size` must split evenly over this process's data shards.

  The one place a given `batch_size` is checked; a derived one is checked by
  `plan.pin` when the agreement decides it.
  """
  size = settings.batch_size
  if settings.paddings is not None and size is not None and size % shards:
    raise ValueError(
      f"`batch_size` must be divisible by {describe} when `paddings` is given, got {size}"
    )
