"""The examples and the demo run as documented and produce the right numbers."""

import os
import subprocess
import sys

import pytest

from grain_jax_sync import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str) -> str:
  """Runs `python -m grain_jax_sync ARGS` from the repository root; its stdout."""
  return subprocess.run(
    [sys.executable, "-m", "grain_jax_sync", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=240,
    check=True,
  ).stdout


@pytest.mark.multiprocess
def test_train_masked_example_converges_identically_on_every_host():
  sys.path.insert(0, ROOT)
  from examples import train_masked

  outs = testing.values(
    testing.run_processes(train_masked.train, num_processes=2, devices_per_process=4, timeout_s=180)
  )
  # Host 1 has 130 examples = 9 batches of 16; host 0 has 100 = 7: the short
  # host gets masked dummies, so both run 9 steps per epoch.
  assert outs[0] == outs[1]
  assert outs[0]["steps"] == 20 * 9
  assert abs(outs[0]["w"] - 3) < 0.05 and abs(outs[0]["b"] - 1) < 0.05


@pytest.mark.multiprocess
def test_demo_command_prints_agreed_batches():
  out = _cli("demo")
  assert "every host yielded 3 batches; 27 of 27 records seen once each: True" in out
  assert (
    "batch 2: global (16,) features bfloat16; this host: 0 real + 8 padded rows; global mask sum 1"
    in out
  )


def test_doctor_reports_devices_and_extras(capsys):
  from grain_jax_sync import __main__ as cli

  assert cli.main(["doctor"]) == 0
  out = capsys.readouterr().out
  assert "processes 1 (this: 0), devices 8 (local 8)" in out
  assert "grain: installed" in out and "key-value store client: no" in out
  assert (
    "default mesh: 1-D 'data' axis over 8 devices; one slice: create_device_mesh"
    " (topology-aware order)\n  device ids in mesh order: [0, 1, 2, 3, 4, 5, 6, 7];"
    " slices: none reported\n" in out
  )
  assert "(from the default mesh): 8 data shards; process 0 feeds data shards" in out


@pytest.mark.multiprocess
def test_simulate_command_runs_a_function_in_every_process():
  out = _cli("simulate", "examples.train_masked:train", "-n", "2", "-d", "2")
  lines = [line for line in out.splitlines() if line.startswith("process ")]
  assert len(lines) == 2 and all(": ok; value={" in line for line in lines)
  assert lines[0].split("value=")[1] == lines[1].split("value=")[1]
