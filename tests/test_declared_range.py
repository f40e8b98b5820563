"""The declared dependency range is the tested one.

`.ci/oldest.sh` installs pinned versions and runs the smoke tests and the demo
there; these checks keep its pins equal to `pyproject.toml`'s lower bounds,
run `.ci/run` (its commands stubbed) to see that it runs the README's test
command with the oldest and newest steps (`.ci/newest.sh`) beside it (any
failing fails CI), and keep the README stating the range.
(The venv run itself is CI's, not pytest's: it downloads and takes minutes.)
"""

import os
import re
import shlex
import shutil
import subprocess
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BESIDE = ["bash .ci/oldest.sh", "bash .ci/newest.sh"]  # .ci/run's steps beside the suite.


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


def _run_ci(tmp_path, failing: str = "") -> tuple[int, list[str]]:
  """Runs `.ci/run` with `python3` and `bash` stubbed; returns its exit code and their calls.

  Each stub records its arguments and succeeds, except a `python3` call that
  contains `failing` (when given).
  """
  log = tmp_path / "calls"
  stub = '#!/bin/sh\necho "$(basename "$0") $*" >> "$CALLS"\n'
  if failing:
    stub += f'case "$*" in *"{failing}"*) exit 1;; esac\n'
  for name in ("python3", "bash"):
    (tmp_path / name).write_text(stub + "exit 0\n")
    (tmp_path / name).chmod(0o755)
  env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", CALLS=str(log))
  out = subprocess.run(
    [shutil.which("bash"), os.path.join(ROOT, ".ci", "run")],
    env=env, capture_output=True, timeout=60,
  )  # fmt: skip
  return out.returncode, log.read_text().splitlines() if log.exists() else []


def test_ci_runs_the_readme_command_and_the_oldest_and_newest_steps_beside_it(tmp_path):
  readme = _read("README.md")
  command = re.search(r"Run the tests .*?```\n(.*?)\n```", readme, re.S).group(1)
  steps = [" ".join(shlex.split(step)) for step in command.split("&&")]
  code, calls = _run_ci(tmp_path)
  assert code == 0
  # The oldest and newest versions' steps run beside the README's command, in the background.
  assert sorted(calls) == sorted([*steps, *BESIDE])
  assert [c for c in calls if c not in BESIDE] == steps


def test_ci_fails_and_stops_when_a_step_of_the_readme_command_fails(tmp_path):
  # `set -e` does not stop inside an && list: a lint failure once skipped the
  # tests and CI still passed. A `python3` that fails `ruff format --check`:
  # the run must fail, before the tests.
  code, calls = _run_ci(tmp_path, failing="ruff format")
  assert code != 0
  assert [c for c in calls if c not in BESIDE][-1] == "python3 -m ruff format --check ."
  assert not [c for c in calls if "pytest" in c]


@pytest.mark.parametrize("step", ["oldest", "newest"])
def test_ci_fails_when_a_step_beside_a_passing_suite_fails(tmp_path, step):
  code, calls = _run_ci(tmp_path, failing=f".ci/{step}.sh")
  assert code != 0
  assert any("pytest" in c for c in calls)
  assert sorted(c for c in calls if c in BESIDE) == sorted(BESIDE)


def test_readme_states_the_tested_range():
  pins = _pins()
  text = " ".join(_read("README.md").split())
  assert f"jax/jaxlib {pins['jax']} to" in text
  assert f"Grain {pins['grain']} to" in text
  # The Pythons the classifiers declare are the ones CI tests (.ci/run's and .ci/newest.sh's).
  classifiers = tomllib.loads(_read("pyproject.toml"))["project"]["classifiers"]
  pythons = [c.rsplit(" ", 1)[1] for c in classifiers if re.search(r"Python :: 3\.\d+$", c)]
  assert pythons and f"Python {' and '.join(pythons)}." in text, pythons
