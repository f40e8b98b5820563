"""What each process of `grain_jax_sync.testing.run_processes` runs.

``python -m grain_jax_sync._src.sim_worker JOB`` joins its peers (gloo CPU
collectives), runs the scenario and writes what it returned or raised.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pickle
import sys
import time
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any

_SRC_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _from_scenario(tb: types.TracebackType | None) -> types.TracebackType | None:
  """`tb` from the scenario's first frame on: without this worker's and runpy's frames."""
  while tb is not None and tb.tb_frame.f_code.co_filename.startswith((_SRC_DIR, "<frozen runpy>")):
    tb = tb.tb_next
  return tb


LOADING_ENV = "GRAIN_JAX_SYNC_SIM_LOADING"


def load_scenario(spec: Mapping[str, str]) -> Callable[..., Any]:
  """Imports the scenario function named by `spec`, by module name or else by file path."""
  # `testing.run_processes` refuses to start processes while this is set: a
  # script that starts its run at import would start it again in every
  # process, and so on without end.
  os.environ[LOADING_ENV] = spec.get("file") or spec.get("module", "")
  try:
    obj = _import(spec)
  finally:
    os.environ.pop(LOADING_ENV, None)
  for part in spec["qualname"].split("."):
    obj = getattr(obj, part)
  return obj


def _import(spec: Mapping[str, str]) -> Any:
  if "module" in spec:
    if spec["root"] not in sys.path:
      sys.path.insert(0, spec["root"])
    with contextlib.suppress(ImportError):
      return importlib.import_module(spec["module"])
  return import_file(spec["file"])


def import_file(path: str) -> types.ModuleType:
  """Imports the Python file `path` under a ``__gjs_scenario_`` name (one per file name)."""
  name = "__gjs_scenario_" + os.path.splitext(os.path.basename(path))[0]
  module_spec = importlib.util.spec_from_file_location(name, path)
  assert module_spec is not None and module_spec.loader is not None
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[name] = module
  module_spec.loader.exec_module(module)
  return module


def run_job(job_path: str) -> None:
  """Runs the job in `job_path`, writes its outcome, waits for its peers and exits."""
  with open(job_path, "rb") as f:
    job = pickle.load(f)
  payload: dict[str, Any] = {}
  try:
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_platforms", "cpu")
    if job["num_processes"] > 1:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(
        coordinator_address=job["coordinator"],
        num_processes=job["num_processes"],
        process_id=job["process_id"],
        initialization_timeout=60,
        heartbeat_timeout_seconds=job["heartbeat_timeout_s"],
      )
    fn = load_scenario(job["fn"])
    start = time.monotonic()
    try:
      payload["value"] = fn(*job["args"], **job["kwargs"])
    finally:
      payload["elapsed_s"] = time.monotonic() - start
  except BaseException as e:  # noqa: BLE001 - reported to the parent.
    payload["value"] = None
    payload["error_type"] = f"{type(e).__module__}.{type(e).__qualname__}"
    payload["error_message"] = str(e)
    tb = _from_scenario(e.__traceback__) or e.__traceback__
    payload["traceback"] = "".join(traceback.format_exception(type(e), e, tb))
  try:
    data = pickle.dumps(payload)
  except Exception:  # noqa: BLE001 - an unpicklable value.
    data = pickle.dumps({**payload, "value": repr(payload.get("value"))})
  with open(job["result"] + ".tmp", "wb") as f:
    f.write(data)
  os.replace(job["result"] + ".tmp", job["result"])
  sys.stdout.flush()
  sys.stderr.flush()
  if job["num_processes"] > 1 and job["exit_barrier_timeout_s"] > 0:
    # Leave together: a process that exits while a peer is still inside a gloo
    # collective resets the peer's connection, and process 0 hosts the
    # coordination service that the others need until they shut down.
    with contextlib.suppress(Exception):  # A peer died: nothing to wait for.
      from jax._src import distributed  # pylint: disable=g-import-not-at-top

      client = distributed.global_state.client
      assert client is not None
      client.wait_at_barrier(
        "grain_jax_sync.testing/exit", int(job["exit_barrier_timeout_s"] * 1000)
      )
      jax.distributed.shutdown()
  # Otherwise skip jax.distributed's shutdown barrier: a peer that failed or
  # was killed would hold every other process there for the shutdown timeout.
  os._exit(0)


if __name__ == "__main__":
  run_job(sys.argv[1])
