"""`init_distributed`: joins the job's processes, or runs as one process where there is none."""

import os
import subprocess
import sys

import pytest

from grain_jax_sync import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alone(code: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
  """Runs `code` in a fresh interpreter (JAX not started), outside any job."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **env_vars)
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


# JAX's own Cloud TPU detection, on this CPU: JAX_FORCE_TPU_INIT makes JAX
# take this host for a Cloud TPU VM, TPU_WORKER_HOSTNAMES for a worker of a
# pod (its GKE form), and the metadata server it then asks for the job is a
# closed port, as on a TPU VM in a container or a sandbox without network.
_TPU_NO_METADATA = {
  "JAX_FORCE_TPU_INIT": "1",
  "TPU_WORKER_HOSTNAMES": "worker-0,worker-1",
  "GCE_METADATA_IP": "127.0.0.1:1",
}


def test_init_distributed_on_a_tpu_without_its_metadata_server_raises_what_to_pass():
  pytest.importorskip("requests")  # JAX reads the metadata server with it (jax[tpu] installs it).
  proc = _alone(
    "import jax, grain_jax_sync as gjs\n"
    "try:\n"
    "  gjs.init_distributed()\n"
    "except RuntimeError as e:\n"
    "  print('RAISED', type(e.__cause__).__module__, e, jax.distributed.is_initialized())\n",
    **_TPU_NO_METADATA,
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("RAISED requests.exceptions "), proc.stdout
  for words in (
    "JAX found a Cloud TPU VM, but its cluster detection could not read the TPU's metadata server",
    "ConnectionError",
    "coordinator_address='HOST:PORT', num_processes=N, process_id=I",
    "init_distributed(cluster_detection_method='deactivate')",
  ):
    assert words in proc.stdout
  assert proc.stdout.rstrip().endswith("False")  # Not joined, and
  assert "running as one process" not in proc.stderr  # never alone in silence.


def test_init_distributed_on_a_tpu_without_its_metadata_server_runs_alone_as_the_error_says():
  proc = _alone(
    "import jax, grain_jax_sync as gjs\n"
    "print(gjs.init_distributed(cluster_detection_method='deactivate'), jax.process_count())\n",
    **_TPU_NO_METADATA,
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == "False 1\n"
  assert "running as one process" in proc.stderr


def test_init_distributed_on_a_tpu_passes_a_given_job_past_the_metadata_server():
  # With the job given, JAX asks the metadata server nothing: JAX's own
  # check of the arguments is what the caller sees.
  proc = _alone(
    "import grain_jax_sync as gjs\n"
    "gjs.init_distributed(coordinator_address='127.0.0.1:1', num_processes=2, process_id=5)\n",
    **_TPU_NO_METADATA,
  )
  assert proc.returncode == 1
  assert "ValueError: process_id and num_processes must be nonnegative" in proc.stderr
  assert "metadata server" not in proc.stderr


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
