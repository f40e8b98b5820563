"""The simulator's `signal_at`: a process signals itself once it received batch k.

`run_processes(signal_at=...)` sets `ENV` in one process's environment, read
at import; its iterators compare each delivered position with `AFTER_BATCH`
(-1 elsewhere), and the first to deliver batch k calls `send`, once.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping

logger = logging.getLogger(__name__)

ENV = "GRAIN_JAX_SYNC_SIGNAL_AT"


def encode(after_batch: int, signum: int) -> str:
  """The value of `ENV` for a signal `signum` after batch `after_batch` (checked by `testing`)."""
  return f"{int(after_batch)}:{int(signum)}"


AFTER_BATCH, _SIGNUM = -1, 0


def arm(environ: Mapping[str, str]) -> None:
  """Reads `ENV` (unset: no signal) from `environ`: at import, and again in a forked process."""
  global AFTER_BATCH, _SIGNUM
  batch, _, signum = (environ.get(ENV) or "-1:0").partition(":")
  AFTER_BATCH, _SIGNUM = int(batch), int(signum)


arm(os.environ)


def send() -> None:
  """Sends this process its signal, once: called after batch `AFTER_BATCH` was delivered."""
  global AFTER_BATCH
  at, AFTER_BATCH = AFTER_BATCH, -1
  logger.warning(
    "grain_jax_sync: testing signal_at: sending %s to this process after batch %d",
    signal.Signals(_SIGNUM).name,
    at,
  )
  os.kill(os.getpid(), _SIGNUM)
