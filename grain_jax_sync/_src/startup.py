"""Joining the job's processes: `init_distributed`, or one process when there is no job."""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import jax

logger = logging.getLogger(__name__)

# What `jax.distributed.initialize()` raises when it finds no cluster (no
# TPU pod, SLURM, Open MPI, ... and no coordinator address given).
_NO_JOB = "coordinator_address should be defined"

# Where JAX's cluster detection lives: a Cloud TPU VM is recognised there, and
# its metadata server is asked for the job (`jax/_src/clusters/`).
_DETECTION = os.path.join("jax", "_src", "clusters", "")

_NO_METADATA = (
  "grain_jax_sync.init_distributed: JAX found a Cloud TPU VM, but its cluster detection could"
  " not read the TPU's metadata server ({error}), so it cannot tell which job this process"
  " belongs to. It does not guess: on a pod, one process alone would train on its own share."
  " On a multi-host job, pass the job to `init_distributed(coordinator_address='HOST:PORT',"
  " num_processes=N, process_id=I)` (the same on every host but `process_id`)."
  " Where this machine is the whole job, run it as one process:"
  " `init_distributed(cluster_detection_method='deactivate')`"
)


def init_distributed(**kwargs: Any) -> bool:
  """Joins this job's processes, or runs as one process where there is no job.

  Calls ``jax.distributed.initialize(**kwargs)`` unless it was called
  already (as ``simulate`` and `grain_jax_sync.testing` do). Where JAX finds
  no multi-process job (``python train.py`` on a workstation), it logs one
  warning and the program goes on as one process. So one script runs alone,
  under ``simulate`` and on every host of a TPU pod, SLURM or Open MPI job.
  Call it first, before any JAX computation.

  Args:
    **kwargs: Passed to ``jax.distributed.initialize`` (e.g.
      ``heartbeat_timeout_seconds=300``, or a `coordinator_address`).

  Returns:
    True if `jax.distributed` is initialized (several processes, or one
    that a cluster started), False if this runs as a lone process.

  Raises:
    RuntimeError: From ``jax.distributed.initialize`` (e.g. JAX has already
      computed something); and where JAX finds a Cloud TPU VM but cannot reach
      its metadata server (a container or a sandbox without network), saying
      what to pass (`coordinator_address`, `num_processes`, `process_id`) or
      how to run as one process: never a silent single-process run on a pod.
    ValueError: From ``jax.distributed.initialize``, for a cluster found
      but misconfigured.

  Example:

    >>> import grain_jax_sync as gjs
    >>> gjs.init_distributed()  # First, before any JAX computation.
    >>> it = gjs.iter_jax_batches(my_shard, batch_size=32, paddings=0, mask_key="mask")
  """
  if jax.distributed.is_initialized():
    return True
  try:
    jax.distributed.initialize(**kwargs)
  except OSError as e:  # A `requests` ConnectionError or timeout is one; so is a socket's.
    frames = traceback.extract_tb(e.__traceback__)
    if not any(_DETECTION in os.path.normpath(f.filename) for f in frames):
      raise  # Not a failed connection inside JAX's cluster detection.
    first = str(e).splitlines()[0][:300] if str(e) else ""
    raise RuntimeError(_NO_METADATA.format(error=f"{type(e).__name__}: {first}")) from e
  except ValueError as e:
    if _NO_JOB not in str(e):
      raise
    logger.warning(
      "grain_jax_sync: no multi-process job found (jax.distributed.initialize: %s);"
      " running as one process",
      str(e).rstrip("."),
    )
    return False
  return True
