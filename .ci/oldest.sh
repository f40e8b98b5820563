#!/usr/bin/env bash
# CI: the oldest declared dependencies (pyproject.toml's lower bounds).
# Makes a throw-away venv with jax/jaxlib, grain, numpy and ml_dtypes at
# those bounds, installs the package (a wheel of this tree, not editable)
# into it, and runs the multi-process smoke tests and the demo against the
# installed package. About 3 minutes on the 2-core CI machine with a warm
# pip cache. Called by .ci/run after the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# The lower bounds in pyproject.toml (tests/test_declared_range.py checks).
OLDEST=(jax==0.7.2 jaxlib==0.7.2 grain==0.2.15 numpy==2.0.0 ml_dtypes==0.5.0)
. .ci/venv.sh
new_venv python3
"$py" -m pip install -q "${OLDEST[@]}" "pytest>=8" "pytest-timeout>=2.3" "psutil>=5.9"
"$py" -m pip install -q --no-deps "$work/src"
"$py" -m pip check
"$py" - "${OLDEST[@]}" <<'PY'
import sys
from importlib.metadata import version

want = dict(spec.split("==") for spec in sys.argv[1:])
got = {name: version(name) for name in want}
assert got == want, (got, want)
print("oldest declared versions:", ", ".join(f"{k} {v}" for k, v in got.items()))
PY
cd "$work"  # Outside the checkout: the installed package is the one imported.
"$py" -m grain_jax_sync demo
"$py" -m pytest -q -p no:cacheprovider -c "$root/pyproject.toml" --rootdir "$root" \
  "$root/tests/test_smoke.py" \
  "$root/tests/test_sources_grain.py::test_grain_sources_two_processes_every_example_once_and_resume_exactly" \
  "$root/tests/test_device_put.py::test_device_put_two_processes_every_example_once_resumes_and_checkpoints_through_grain" \
  "$root/tests/test_endings.py::test_sixty_iterators_broken_off_early_leave_no_key_on_any_host"
"$py" -c "import grain_jax_sync, sys; assert grain_jax_sync.__file__.startswith('$work/venv'), grain_jax_sync.__file__"
