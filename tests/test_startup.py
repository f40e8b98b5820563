"""`init_distributed`: joins the job's processes, or runs as one process where there is none."""

import os
import subprocess
import sys

import pytest

from grain_jax_sync import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alone(code: str) -> subprocess.CompletedProcess[str]:
  """Runs `code` in a fresh interpreter (JAX not started), outside any job."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  return subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )


def test_init_distributed_alone_warns_once_and_runs_as_one_process():
  proc = _alone(
    "import jax, grain_jax_sync as gjs\n"
    "print(gjs.init_distributed(), gjs.init_distributed(), jax.process_count())\n"
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == "False False 1\n"
  warning = (
    "grain_jax_sync: no multi-process job found (jax.distributed.initialize:"
    " coordinator_address should be defined); running as one process"
  )
  assert proc.stderr.count(warning) == 2  # Each call that found no job says so.


def test_init_distributed_raises_jaxs_error_for_a_misconfigured_job():
  proc = _alone(
    "import grain_jax_sync as gjs\n"
    "gjs.init_distributed(coordinator_address='127.0.0.1:1', num_processes=2, process_id=5)\n"
  )
  assert proc.returncode == 1
  assert "ValueError: process_id and num_processes must be nonnegative" in proc.stderr
  assert "running as one process" not in proc.stderr


def joined() -> tuple[bool, int]:
  """Runs in every process, after the simulator joined them."""
  import jax

  import grain_jax_sync as gjs

  return gjs.init_distributed(), jax.process_count()


@pytest.mark.multiprocess
def test_init_distributed_under_the_simulator_keeps_the_joined_processes():
  outcomes = testing.run_processes(joined, num_processes=2, timeout_s=120)
  assert testing.values(outcomes) == [(True, 2), (True, 2)]
  assert all("running as one process" not in o.log for o in outcomes)


def test_a_script_without_a_main_guard_fails_once_instead_of_starting_processes_without_end(
  tmp_path,
):
  # Each simulated process imports the scenario's file to find the function:
  # a file that starts its run at import would start it again in every
  # process. The run is refused in the processes, and the script ends.
  script = tmp_path / "unguarded.py"
  script.write_text(
    "from grain_jax_sync import testing\n"
    "def job():\n"
    "  return 1\n"
    "outs = testing.run_processes(job, num_processes=2, timeout_s=60)\n"
    "print('ERRORS', [(o.error_type, o.value) for o in outs])\n"
    "print('MESSAGE', outs[0].error_message)\n"
  )
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("GRAIN_JAX_SYNC_SIM_LOADING", None)
  out = subprocess.run(
    [sys.executable, str(script)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.count("ERRORS") == 1  # The parent's run only: no process started another.
  assert "ERRORS [('builtins.RuntimeError', None), ('builtins.RuntimeError', None)]" in out.stdout
  assert "starts its run when imported" in out.stdout
  assert 'if __name__ == "__main__":' in out.stdout
