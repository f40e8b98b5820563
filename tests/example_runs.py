"""Several example runs one after the other in one `simulate` launch (tests/test_examples.py).

  python -m grain_jax_sync simulate tests/example_runs.py [--signal 1:SIGTERM:5] -- \\
    "stopped examples/train_flax_orbax.py --ckpt-dir /tmp/a" "full examples/..." ...

Each argument is one run: a label, a Python file and that file's arguments
(shell words). In every process, before each run, it prints ``run: LABEL``;
the file's own lines follow. A file with a ``main(argv)`` (every example) is
imported once and its `main` called with the run's arguments, as its
``if __name__ == "__main__": main()`` does; any other file (the README's
example) runs as ``__main__``. The launch's ``--signal`` reaches the first
run whose iterator delivers that batch, so a launch holds at most one
signalled run, first. A run that raises ends the launch there: the runs
after it print nothing, and the test names each of them.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import shlex
import sys
from typing import Any

_MODULES: dict[str, Any] = {}


def _module(path: str) -> Any:
  """The file at `path` imported once (under a name of its own), or None without a `main`."""
  if path not in _MODULES:
    name = "example_runs_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[path] = module
  return _MODULES[path]


def run(label: str, path: str, argv: list[str]) -> None:
  print(f"run: {label}", flush=True)
  with open(path, encoding="utf-8") as f:
    has_main = "\ndef main(argv" in f.read()
  if has_main:
    _module(path).main(argv)
    return
  old_argv, sys.argv = sys.argv, [path, *argv]
  try:
    runpy.run_path(path, run_name="__main__")
  finally:
    sys.argv = old_argv


def main(argv: list[str]) -> None:
  for spec in argv:
    label, path, *args = shlex.split(spec)
    run(label, path, args)
  sys.stdout.flush()


if __name__ == "__main__":
  main(sys.argv[1:])
