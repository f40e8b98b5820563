"""What `simulate` runs: a script as ``__main__`` (`run_as_main`, in every process), or ``module:function``."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any

from grain_jax_sync._src import sim_worker


class _Tee(io.TextIOBase):
  """Writes to the process's stdout and keeps a copy."""

  def __init__(self, stream: Any):
    self._stream = stream
    self.copy = io.StringIO()

  def write(self, text: str) -> int:
    self.copy.write(text)
    return self._stream.write(text)

  def flush(self) -> None:
    self._stream.flush()


def run_as_main(path: str, argv: Sequence[str]) -> str:
  """Runs the file `path` (absolute) as ``__main__`` with `argv`; returns what it printed.

  A non-zero exit status raises RuntimeError.
  """
  tee = _Tee(sys.stdout)
  old_argv = sys.argv
  sys.argv = [path, *argv]
  sys.path.insert(0, os.path.dirname(path))
  try:
    with contextlib.redirect_stdout(tee):
      runpy.run_path(path, run_name="__main__")
  except SystemExit as e:
    if e.code not in (None, 0):
      raise RuntimeError(f"{path} exited with status {e.code!r}") from e
  finally:
    sys.argv = old_argv
  return tee.copy.getvalue()


def resolve_function(target: str) -> Callable[..., Any]:
  """The module-level function that ``module:function`` or ``path/to/file.py:function`` names.

  A file is imported under a ``__gjs`` module name, so that `run_processes`
  imports it by path in every process.
  """
  module, sep, name = target.rpartition(":")
  if not sep or not module or not name:
    raise ValueError(
      f"`target` must be 'file.py', 'file.py:function' or 'module:function', got {target!r}"
    )
  if module.endswith(".py"):
    if not os.path.isfile(module):
      raise ValueError(f"`target` {target!r} names the file {module!r}, which does not exist")
    path = os.path.abspath(module)
    sys.path.insert(0, os.path.dirname(path))
    mod: Any = sim_worker.import_file(path)
  else:
    mod = importlib.import_module(module)
  fn = getattr(mod, name, None)
  if not callable(fn):
    raise ValueError(f"`target` {target!r}: {module} has no function {name!r}")
  return fn
