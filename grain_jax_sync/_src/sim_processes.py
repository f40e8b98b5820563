"""The simulator's processes: their environment, their start, their output, their end.

`grain_jax_sync.testing.run_processes` starts each process here, relays what
it writes (kept in a log file; with `echo`, also shown as it is written,
each line labelled ``[process i]``), and waits for every process within one
deadline or kills them all.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from grain_jax_sync._src import signal_at

# How long a process's output may stay open after the process exited. What
# it wrote itself is already in the pipe and is read in well under this,
# even on a loaded machine; only a child that it left running keeps the pipe
# open, and the run does not wait for such a child.
_OUTPUT_GRACE_S = 5.0
# One echoed line at a time, whichever process wrote it.
_ECHO_LOCK = threading.Lock()


def process_env(env: Mapping[str, str] | None, devices_per_process: int) -> dict[str, str]:
  """The environment of every process: ours, `env`, forced CPU devices, this package first."""
  base_env = dict(os.environ)
  base_env.pop(signal_at.ENV, None)  # Set per process, never inherited from a run above.
  base_env.update(env or {})
  base_env["XLA_FLAGS"] = (
    base_env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices_per_process}"
  ).strip()
  base_env["JAX_PLATFORMS"] = "cpu"
  base_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  base_env.setdefault("PYTHONUNBUFFERED", "1")
  pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  base_env["PYTHONPATH"] = os.pathsep.join(
    [pkg_root] + [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
  )
  return base_env


class Output:
  """What one process writes to stdout and stderr: kept in its log, echoed if asked.

  One thread per stream reads the pipe a line at a time (a blocking read)
  and appends it to the log file, in the order the lines arrive. With
  `echo`, each line is also printed, labelled ``[process i]``, to this
  process's stdout or stderr, whichever the line was written to.
  """

  def __init__(self, index: int, proc: subprocess.Popen[bytes], log_path: str, *, echo: bool):
    self.log_path = log_path
    self._log = open(log_path, "wb")  # noqa: SIM115 - closed by `finish`.
    self._lock = threading.Lock()
    self._prefix = f"[process {index}] "
    streams = ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
    self._threads = [
      threading.Thread(
        target=self._relay,
        args=(pipe, name if echo else None),
        name=f"grain_jax_sync.testing-{index}-{name}",
        daemon=True,
      )
      for pipe, name in streams
    ]
    for thread in self._threads:
      thread.start()

  def _relay(self, pipe: IO[bytes], sink: str | None) -> None:
    with pipe:
      for raw in iter(pipe.readline, b""):
        with self._lock:
          if self._log.closed:  # A child still writing after `finish`.
            return
          self._log.write(raw)
          self._log.flush()
        if sink is not None:
          line = raw.decode("utf-8", "replace").rstrip("\r\n")
          with _ECHO_LOCK:  # Looked up now: a test may have redirected it.
            print(self._prefix + line, file=getattr(sys, sink), flush=True)

  def finish(self) -> None:
    """Waits for the rest of the output (up to `_OUTPUT_GRACE_S`) and closes the log."""
    deadline = time.monotonic() + _OUTPUT_GRACE_S
    for thread in self._threads:
      thread.join(max(deadline - time.monotonic(), 0.0))
    with self._lock:
      self._log.close()


def start(
  index: int, job: dict[str, Any], workdir: str, env: dict[str, str], *, echo: bool
) -> tuple[subprocess.Popen[bytes], Output]:
  """Writes process `index`'s job file and starts it; returns the process and its output."""
  job_path = os.path.join(workdir, f"job_{index}.pkl")
  with open(job_path, "wb") as f:
    pickle.dump(job, f)
  proc = subprocess.Popen(
    [sys.executable, "-m", "grain_jax_sync._src.sim_worker", job_path],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    stdin=subprocess.DEVNULL,
    start_new_session=True,
  )
  return proc, Output(index, proc, os.path.join(workdir, f"log_{index}.txt"), echo=echo)


def tail(path: str, limit: int = 4000) -> str:
  """The last `limit` characters of the file `path` ("" if it cannot be read)."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError:
    return ""
  return data[-limit:].decode("utf-8", "replace")


def wait_or_kill(
  procs: Sequence[subprocess.Popen[bytes]], outputs: Sequence[Output], timeout_s: float
) -> None:
  """Waits for every process; past `timeout_s` kills them all and raises TimeoutError."""
  deadline = time.monotonic() + timeout_s
  timed_out = False
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
      timed_out = True
      break
  if timed_out:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        p.wait()
  for out in outputs:
    out.finish()
  if not timed_out:
    return
  tails = "\n".join(
    f"--- process {i} (exit {procs[i].returncode}) ---\n{tail(out.log_path, 2000)}"
    for i, out in enumerate(outputs)
  )
  raise TimeoutError(
    f"{len(procs)} processes did not finish within {timeout_s}s; all were killed.\n{tails}"
  )
