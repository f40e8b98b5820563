"""Optional dependencies (pyproject.toml extras): imported on first use through `require`."""

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
  """Imports `module`, or raises ImportError naming `needed_by` and the command that installs it.

  `extra`: the extra that installs it; default: its top-level package's in `EXTRA_OF`.
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
