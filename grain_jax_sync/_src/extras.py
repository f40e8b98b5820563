"""Optional dependencies: imported on first use, with the install command on failure.

Every entry point that needs an extra (pyproject.toml) imports it through
`require`, so that a missing one raises an `ImportError` naming the entry
point and the command that installs it, not a bare ``No module named ...``.
"""

from __future__ import annotations

import importlib
import types

# The extra that provides each optional top-level module.
EXTRA_OF = {
  "grain": "grain",
  "tensorflow": "tf",
  "tensorflow_datasets": "tfds",
  "array_record": "tfds",
  "orbax": "orbax",
  "datasets": "hf",
}


def install_command(extra: str) -> str:
  return f"pip install 'grain_jax_sync[{extra}]'"


def require(module: str, *, needed_by: str, extra: str | None = None) -> types.ModuleType:
  """Imports `module`, or raises ImportError naming the command that installs it.

  Args:
    module: The module to import, e.g. ``"grain"`` or ``"grain.checkpoint"``.
    needed_by: The entry point that needs it, for the message (e.g.
      ``"grain_jax_sync.device_put"``).
    extra: The extra that installs it; default: looked up from the
      module's top-level package in `EXTRA_OF`.

  Raises:
    ImportError: If `module` (or one of its own dependencies) cannot be
      imported; chained to the original error.
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    extra = extra or EXTRA_OF.get(module.split(".")[0], "all")
    missing = getattr(e, "name", None) or module
    raise ImportError(
      f"{needed_by} needs the optional dependency {missing!r}, which could not"
      f" be imported ({e}). Install it with: {install_command(extra)}",
      name=missing,
    ) from e
