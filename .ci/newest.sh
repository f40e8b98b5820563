#!/usr/bin/env bash
# CI: the newest versions the index offers. A throw-away venv on the newest
# Python here (pyenv's; JAX 0.11 and later need 3.12 or newer) with this
# tree and its [grain,orbax] extras, so the newest jax/jaxlib, Grain, numpy,
# ml_dtypes and Orbax that resolve; TensorFlow, TFDS and Hugging Face
# datasets are left out to keep the install short (their tests skip). Then
# mypy, the demo and the single-process tests (one pytest process: .ci/run
# starts this beside the suite, which has a worker per core). About 2.5
# minutes of one core with a warm pip cache.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
pyenv_root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
newest="$(ls "$pyenv_root/versions" | grep -E '^3\.[0-9]+\.[0-9]+$' | sort -V | tail -1)"
case "$newest" in 3.1[2-9].*) ;; *) echo "no Python 3.12+ under $pyenv_root (found: '$newest')"; exit 1 ;; esac
. .ci/venv.sh
new_venv "$pyenv_root/versions/$newest/bin/python"
"$py" -m pip install -q "$work/src[grain,orbax]" mypy "pytest>=8" "pytest-timeout>=2.3" \
  "hypothesis>=6.100" "psutil>=5.9"
"$py" -m pip check
# The newest release the index offers for this Python is the one installed
# (a Python the newest JAX does not support would get an older one).
for name in jax grain numpy; do
  offered="$("$py" -m pip index versions "$name" 2>/dev/null | sed -n '1s/.*(\(.*\))/\1/p')"
  got="$("$py" -c "from importlib.metadata import version; print(version('$name'))")"
  [ "$got" = "$offered" ] || { echo "$name: installed $got, the index offers $offered"; exit 1; }
done
"$py" - <<'PY'
import platform
from importlib.metadata import version

names = ["jax", "jaxlib", "grain", "numpy", "ml_dtypes", "orbax-checkpoint", "mypy"]
print(f"newest versions: Python {platform.python_version()},", ", ".join(f"{n} {version(n)}" for n in names))
PY
cd "$work/src"  # The tree's copy: mypy's cache and the tests' files stay out of the checkout.
"$py" -m mypy -p grain_jax_sync
demo="$(cd "$work" && "$py" -m grain_jax_sync demo)"  # The installed wheel, outside the tree.
echo "$demo"
grep -q "27 of 27 records seen once each: True" <<<"$demo"
"$py" -m pytest -q -p no:cacheprovider -m "not multiprocess and not venv"
