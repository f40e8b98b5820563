"""A clean virtual environment with only the core wheel installed.

The wheel is built from this checkout and installed with ``--no-deps`` into a
real venv (no system site packages) beside jax, jaxlib, numpy and ml_dtypes
at the versions installed here. The venv is made without pip and filled by
this interpreter's pip (``pip --python``), without compiling to bytecode
(``--no-compile``): the same packages, without the CPU that ensurepip and
compiling every module of jax and jaxlib take. Grain, TensorFlow, TFDS and Orbax are
absent: the package must import and work on a plain iterable, and each entry
point that needs an extra must say which one. Marked ``venv`` (it builds the
wheel and downloads the core dependencies, about 1.5 minutes): deselect with
``-m "not venv"``.
"""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("jax", "jaxlib", "numpy", "ml_dtypes")


def _run(*cmd: str, cwd: str, timeout: float = 400) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env.update(JAX_PLATFORMS="cpu", PIP_DISABLE_PIP_VERSION_CHECK="1")
  proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, (
    f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  )
  return proc.stdout


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> str:
  tmp = tmp_path_factory.mktemp("clean_venv")
  _run(
    sys.executable,
    "-m",
    "pip",
    "wheel",
    "-q",
    "--no-deps",
    "-w",
    str(tmp / "wheel"),
    ROOT,
    cwd=str(tmp),
  )
  (wheel,) = (tmp / "wheel").iterdir()
  _run(sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv"), cwd=str(tmp))
  python = str(tmp / "venv" / "bin" / "python")
  install = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile"]
  pins = [f"{name}=={importlib.metadata.version(name)}" for name in CORE]
  try:
    _run(*install, *pins, cwd=str(tmp))
  except AssertionError as e:  # Third-party downloads only; our wheel must install.
    pytest.skip(f"could not install {pins} from the package index: {str(e)[-500:]}")
  _run(*install, "--no-deps", str(wheel), cwd=str(tmp))
  return python


def _check(python: str, code: str) -> str:
  return _run(python, "-c", code, cwd=os.path.dirname(python))


def test_core_wheel_imports_and_iterates_without_any_extra(venv_python):
  out = _check(
    venv_python,
    "import importlib.util, sys\n"
    "import numpy as np\n"
    "import grain_jax_sync as gjs\n"
    "assert 'site-packages' in gjs.__file__, gjs.__file__\n"
    "missing = [m for m in ('grain', 'tensorflow', 'tensorflow_datasets', 'orbax')"
    " if importlib.util.find_spec(m) is None]\n"
    "batches = [{'x': np.arange(8)}, {'x': np.arange(5)}]\n"
    "with gjs.iter_jax_batches(batches, batch_size=8, paddings=-1, mask_key='mask') as it:\n"
    "  rows = [np.asarray(b['x']).tolist() for b in it]\n"
    "print(missing, rows, [m for m in ('grain', 'tensorflow') if m in sys.modules])\n",
  )
  assert out.strip() == (
    "['grain', 'tensorflow', 'tensorflow_datasets', 'orbax']"
    " [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, -1, -1, -1]] []"
  )


def test_each_entry_point_that_needs_an_extra_names_it(venv_python):
  out = _check(
    venv_python,
    "import numpy as np\n"
    "import grain_jax_sync as gjs\n"
    "it = gjs.iter_jax_batches([np.arange(8)], batch_size=8)\n"
    "cases = {\n"
    "  'device_put': ('grain', lambda: gjs.device_put([])),\n"
    "  'tfds_pipeline': ('tfds', lambda: gjs.tfds_pipeline('mnist', split='train', batch_size=8)),\n"
    "  'checkpoint_save': ('orbax', lambda: gjs.checkpoint_save(it)),\n"
    "  'checkpoint_restore': ('orbax', lambda: gjs.checkpoint_restore(it)),\n"
    "}\n"
    "for name, (extra, call) in cases.items():\n"
    "  try:\n"
    "    call()\n"
    "  except ImportError as e:\n"
    "    ok = f'grain_jax_sync[{extra}]' in str(e)\n"
    "    print(name, 'ok' if ok else f'ImportError without the extra: {e}')\n"
    "  except Exception as e:\n"
    "    print(name, f'{type(e).__name__}: {e}')\n"
    "  else:\n"
    "    print(name, 'no error')\n",
  )
  assert out.splitlines() == [
    "device_put ok",
    "tfds_pipeline ok",
    "checkpoint_save ok",
    "checkpoint_restore ok",
  ], out


def test_mypy_finds_the_installed_package_typed(venv_python, tmp_path):
  """py.typed: mypy reads the installed wheel's annotations instead of Any."""
  user = tmp_path / "user.py"
  user.write_text(
    "import numpy as np\n"
    "import grain_jax_sync as gjs\n"
    "from grain_jax_sync import testing\n"
    "it = gjs.iter_jax_batches([np.zeros(8)], batch_size=8)\n"
    "reveal_type(it)\n"
    "reveal_type(it.get_state())\n"
    "reveal_type(testing.run_processes(print, num_processes=1))\n"
  )
  # jax and jaxlib unread (their names are Any): the check is this package's
  # marker and annotations, and reading jax is most of mypy's time.
  config = tmp_path / "mypy.ini"
  config.write_text(
    "[mypy]\n[mypy-jax.*]\nfollow_imports = skip\n[mypy-jaxlib.*]\nfollow_imports = skip\n"
  )
  proc = subprocess.run(
    [sys.executable, "-m", "mypy", "--config-file", str(config), "--python-executable",
     venv_python, "--no-incremental", "--follow-imports=silent", str(user)],
    cwd=tmp_path, capture_output=True, text=True, timeout=300,
    env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")},
  )  # fmt: skip
  out = proc.stdout
  assert "missing library stubs or py.typed marker" not in out, out
  assert 'Revealed type is "grain_jax_sync._src.iterator.JaxBatchIterator"' in out, out
  # mypy 1.x writes builtins.dict, 2.x dict.
  assert re.search(r'Revealed type is "(builtins\.)?dict\[(builtins\.)?str, Any\]"', out), out
  assert re.search(
    r'Revealed type is "(builtins\.)?list\[grain_jax_sync\.testing\.ProcessOutcome\]"', out
  ), out
