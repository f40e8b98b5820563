"""A missing extra raises ImportError naming the command that installs it.

Each case runs in a fresh interpreter whose listed modules are blocked
(``sys.modules[name] = None`` makes ``import name`` raise ImportError), calls a
public entry point that needs the extra, and prints the error it raised.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TFDS = "gjs.tfds_pipeline('mnist', split='train', batch_size=8, process_index=0, process_count=1)"

CASES = [
  pytest.param(
    ["grain"], "gjs.device_put([1, 2])", "grain", "grain_jax_sync.device_put", id="device_put"
  ),
  pytest.param(
    ["grain"],
    TFDS,
    "tfds",
    "tfds_pipeline(reader='data_source')",
    id="tfds_data_source",
    marks=pytest.mark.skipif(  # Grain missing beside an installed TFDS.
      importlib.util.find_spec("tensorflow_datasets") is None, reason="needs tensorflow_datasets"
    ),
  ),
  pytest.param(["tensorflow_datasets"], TFDS, "tfds", "grain_jax_sync.tfds_pipeline", id="tfds"),
  pytest.param(
    ["grain"],
    "gjs.checkpoint_save(gjs.iter_jax_batches([np.zeros(8)], batch_size=8))",
    "orbax",
    "grain_jax_sync checkpointing (Orbax)",
    id="checkpoint_save_without_grain",
  ),
  pytest.param(
    ["orbax"],
    "gjs.checkpoint_restore(gjs.iter_jax_batches([np.zeros(8)], batch_size=8))",
    "orbax",
    "grain_jax_sync checkpointing (Orbax)",
    id="checkpoint_restore_without_orbax",
  ),
]


def _run_blocked(blocked: list[str], call: str) -> subprocess.CompletedProcess:
  code = textwrap.dedent(
    f"""
    import sys
    for name in {blocked!r}:
      sys.modules[name] = None  # `import name` now raises ImportError.
    import numpy as np
    import grain_jax_sync as gjs
    try:
      {call}
    except ImportError as e:
      print("ImportError:", e)
    else:
      print("no error")
    """
  )
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )


@pytest.mark.parametrize(("blocked", "call", "extra", "needed_by"), CASES)
def test_missing_extra_raises_import_error_with_install_command(blocked, call, extra, needed_by):
  out = _run_blocked(blocked, call)
  assert out.returncode == 0, out.stderr[-3000:]
  line = out.stdout.strip()
  assert line.startswith(f"ImportError: {needed_by} needs the optional dependency"), line
  assert line.endswith(f"Install it with: pip install 'grain_jax_sync[{extra}]'"), line
