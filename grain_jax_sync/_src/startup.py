"""Joining the job's processes: `init_distributed`, or one process when there is no job."""

from __future__ import annotations

import logging
from typing import Any

import jax

logger = logging.getLogger(__name__)

# What `jax.distributed.initialize()` raises when it finds no cluster (no
# TPU pod, SLURM, Open MPI, ... and no coordinator address given).
_NO_JOB = "coordinator_address should be defined"


def init_distributed(**kwargs: Any) -> bool:
  """Joins this job's processes, or runs as one process where there is no job.

  Calls ``jax.distributed.initialize(**kwargs)`` unless it was called
  already (as ``python -m grain_jax_sync simulate`` and
  `grain_jax_sync.testing` do). Where JAX finds no multi-process job (a
  script run as ``python train.py`` on a workstation), it logs one warning
  and returns False: the program goes on as one process. So one script runs
  alone, under ``simulate`` and on every host of a TPU pod, SLURM or Open
  MPI job. Call it first, before any JAX computation.

  Args:
    **kwargs: Passed to ``jax.distributed.initialize`` (for example
      ``heartbeat_timeout_seconds=300``, or a `coordinator_address` where
      JAX cannot find it).

  Returns:
    True if `jax.distributed` is initialized (several processes, or one
    that a cluster started), False if this runs as a lone process.

  Raises:
    RuntimeError: From ``jax.distributed.initialize``, e.g. when JAX has
      already computed something in this process.
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
