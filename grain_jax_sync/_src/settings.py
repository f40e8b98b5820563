"""The iterator's settings, their digest, and the resume state's checks.

Pure Python and NumPy; no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_jax_sync._src import plan as plan_lib

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

  def options(self) -> plan_lib.Options:
    return plan_lib.Options(
      batch_size=self.batch_size, drop_last=self.drop_last, pad=self.paddings is not None
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
  value = state[key]
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"`state[{key!r}]` must be an int >= {minimum}, got {value!r:.100}")
  return int(value)


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
  for key, now in (("process_count", process_count), ("process_index", process_index)):
    if _int_field(state, key) != now:
      raise ValueError(
        f"`state` was taken with {key}={state[key]}, but this process has"
        f" {key}={now}; each process must restore its own state with the"
        " same process count"
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
