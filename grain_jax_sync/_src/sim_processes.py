"""The simulator's processes: their environment, their start, their output, their end.

`grain_jax_sync.testing.run_processes` starts each process here and waits for
every one within one deadline or kills them all.
"""

from __future__ import annotations

import contextlib
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


class Process:
  """One simulated host: its job file, its interpreter, its output and its result.

  One thread per stream appends each line, as it arrives, to the log file;
  with `echo`, also to this process's stdout or stderr, labelled ``[process i]``.
  """

  def __init__(
    self, index: int, job: dict[str, Any], workdir: str, env: dict[str, str], *, echo: bool
  ):
    self._result_path = os.path.join(workdir, f"result_{index}.pkl")
    job_path = os.path.join(workdir, f"job_{index}.pkl")
    with open(job_path, "wb") as f:
      pickle.dump({**job, "result": self._result_path}, f)
    self.popen = subprocess.Popen(
      [sys.executable, "-m", "grain_jax_sync._src.sim_worker", job_path],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      stdin=subprocess.DEVNULL,
      start_new_session=True,
    )
    self.log_path = os.path.join(workdir, f"log_{index}.txt")
    self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by `finish`.
    self._lock = threading.Lock()
    self._prefix = f"[process {index}] "
    self._threads = []
    for pipe, name in ((self.popen.stdout, "stdout"), (self.popen.stderr, "stderr")):
      thread = threading.Thread(
        target=self._relay,
        args=(pipe, name if echo else None),
        name=f"grain_jax_sync.testing-{index}-{name}",
        daemon=True,
      )
      thread.start()
      self._threads.append(thread)

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

  def kill(self) -> None:
    """Kills the process's session, if it still runs, and reaps it."""
    if self.popen.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self.popen.pid, signal.SIGKILL)
      self.popen.wait()

  def drain(self) -> None:
    """Waits for the rest of the output (up to `_OUTPUT_GRACE_S`) and closes the log."""
    deadline = time.monotonic() + _OUTPUT_GRACE_S
    for thread in self._threads:
      thread.join(max(deadline - time.monotonic(), 0.0))
    with self._lock:
      self._log.close()

  def result(self) -> dict[str, Any]:
    """What the worker wrote of the scenario's outcome ({} if it wrote nothing)."""
    if not os.path.exists(self._result_path):
      return {}
    with open(self._result_path, "rb") as f:
      return pickle.load(f)


def tail(path: str, limit: int = 4000) -> str:
  """The last `limit` characters of the file `path` ("" if it cannot be read)."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError:
    return ""
  return data[-limit:].decode("utf-8", "replace")


def wait_or_kill(processes: Sequence[Process], timeout_s: float) -> None:
  """Waits for every process; past `timeout_s` kills them all and raises TimeoutError."""
  deadline = time.monotonic() + timeout_s
  timed_out = False
  try:
    for p in processes:
      p.popen.wait(timeout=max(deadline - time.monotonic(), 0.01))
  except subprocess.TimeoutExpired:
    timed_out = True
    for p in processes:
      p.kill()
  for p in processes:
    p.drain()
  if timed_out:
    tails = "\n".join(
      f"--- process {i} (exit {p.popen.returncode}) ---\n{tail(p.log_path, 2000)}"
      for i, p in enumerate(processes)
    )
    raise TimeoutError(
      f"{len(processes)} processes did not finish within {timeout_s}s; all were killed.\n{tails}"
    )
