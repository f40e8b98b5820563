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

  def digest(self) -> dict[str, Any]:
    """What every host must agree on (compared in the first exchange)."""
    return plan_lib.settings_digest(
      {
        "batch_size": self.batch_size,
        "drop_last": self.drop_last,
        "paddings": _describe(self.paddings),
        "mask_key": self.mask_key,
        "dtypes": _describe(self.dtypes),
        "synchronize_lookahead": self.lookahead,
      }
    )

  def options(self, pinned: int | None = None) -> plan_lib.Options:
    """The options `plan.decide` takes.

    Args:
      pinned: Without `batch_size`: the full batch size derived from the
        first position (see `plan.pin`), once known (restored with a state).
    """
    derived = self.batch_size is None and pinned is not None
    return plan_lib.Options(
      batch_size=pinned if self.batch_size is None else self.batch_size,
      drop_last=self.drop_last,
      pad=self.paddings is not None,
      wait_for_last=True,
      derived=derived,
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
  """Checks a resume state before anything is touched.

  Args:
    state: What the user passed to `set_state`.
    settings: This iterator's settings.
    process_index: This process.
    process_count: The process count.

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
