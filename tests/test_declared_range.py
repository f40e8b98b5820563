"""The declared dependency range is the tested one.

`.ci/oldest.sh` installs pinned versions and runs the smoke tests and the demo
there; these checks keep its pins equal to `pyproject.toml`'s lower bounds,
keep it called by `.ci/run` after the README's test command, and keep the
README stating the range. (The venv run itself is CI's, not pytest's: it
downloads and takes minutes.)
"""

import os
import re
import subprocess
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
  with open(os.path.join(ROOT, *parts)) as f:
    return f.read()


def _pins():
  (line,) = [x for x in _read(".ci", "oldest.sh").splitlines() if x.startswith("OLDEST=(")]
  return dict(spec.split("==") for spec in line[len("OLDEST=(") : -1].split())


def _lower_bounds():
  project = tomllib.loads(_read("pyproject.toml"))["project"]
  specs = list(project["dependencies"]) + list(project["optional-dependencies"]["grain"])
  out = {}
  for spec in specs:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", spec)
    assert m, f"{spec!r}: every core and [grain] requirement needs a plain lower bound"
    out[m.group(1)] = m.group(2)
  return out


def test_oldest_pins_are_the_declared_lower_bounds():
  pins, bounds = _pins(), _lower_bounds()
  assert sorted(pins) == sorted(bounds) == ["grain", "jax", "jaxlib", "ml_dtypes", "numpy"]
  for name, bound in bounds.items():
    # numpy>=2.0 is tested as 2.0.0: a pin may spell out the trailing zeros.
    assert pins[name] == bound or pins[name] == bound + ".0", (name, pins[name], bound)
  # Every extra that names grain uses the same bound.
  extras = tomllib.loads(_read("pyproject.toml"))["project"]["optional-dependencies"]
  for name, specs in extras.items():
    for spec in specs:
      if spec.startswith("grain>="):
        assert spec == f"grain>={bounds['grain']}", (name, spec)


def test_ci_runs_the_oldest_step_after_the_readme_command():
  readme = _read("README.md")
  command = re.search(r"Run the tests .*?```\n(.*?)\n```", readme, re.S).group(1)
  lines = [x for x in _read(".ci", "run").splitlines() if x and not x.startswith(("#", "set "))]
  assert lines.index(f"({command})") < lines.index("bash .ci/oldest.sh")


def test_ci_fails_and_stops_when_a_step_of_the_readme_command_fails(tmp_path):
  # `set -e` does not stop inside an && list: a lint failure once skipped the
  # tests and CI still passed. A `python3` that fails `ruff format --check`:
  # the run must fail, before the tests and the oldest-versions step.
  log = tmp_path / "calls"
  stub = tmp_path / "python3"
  stub.write_text(
    '#!/bin/sh\necho "$@" >> "$CALLS"\ncase "$*" in *"ruff format"*) exit 1;; esac\nexit 0\n'
  )
  stub.chmod(0o755)
  env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", CALLS=str(log))
  out = subprocess.run(
    ["bash", os.path.join(ROOT, ".ci", "run")], env=env, capture_output=True, timeout=60
  )
  calls = log.read_text()
  assert out.returncode != 0
  assert "-m ruff format --check ." in calls
  assert "pytest" not in calls and "venv" not in calls


def test_readme_states_the_tested_range():
  pins = _pins()
  text = " ".join(_read("README.md").split())
  assert f"jax/jaxlib {pins['jax']} to" in text
  assert f"Grain {pins['grain']} to" in text
