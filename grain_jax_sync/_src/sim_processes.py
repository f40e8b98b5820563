"""The processes of `testing.run_processes`: their environment, start, output and end.

On Linux a process is forked from a fork server (`sim_worker.serve`, one per
environment) that imported JAX and this package already. Where the server
cannot start or answer, and with ``GRAIN_JAX_SYNC_SIM_FORK=0``, each process
is a fresh interpreter.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from grain_jax_sync._src import signal_at, sim_worker

logger = logging.getLogger(__name__)

# How long a process's output may stay open after it exited: only a child it
# left running keeps the pipe open, and the run does not wait for that child.
_OUTPUT_GRACE_S = 5.0
# One echoed line at a time, whichever process wrote it.
_ECHO_LOCK = threading.Lock()
# Each process's program (`sim_worker`), and the fork server's with ``--serve``.
_WORKER = (sys.executable, "-m", "grain_jax_sync._src.sim_worker")
# "0": every process a fresh interpreter, not forked from the server.
FORK_ENV = "GRAIN_JAX_SYNC_SIM_FORK"
# What may differ between the processes a server forks: read again in the
# child (`signal_at`; XLA's flags at its backend), or by no import (pytest's).
_PER_PROCESS = (signal_at.ENV, "XLA_FLAGS", "PYTEST_CURRENT_TEST")
# The fork servers kept, one per environment, the least recently used closed.
_SERVERS_KEPT = 4
# How long a server may take to fork a child (its own start included); past it, a fresh one.
_FORK_TIMEOUT_S = 120.0


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
  """One simulated host: its job file, its interpreter, its output (a thread per pipe) and its result."""

  def __init__(
    self, index: int, job: dict[str, Any], workdir: str, env: dict[str, str], *, echo: bool
  ):
    self._result_path = os.path.join(workdir, f"result_{index}.pkl")
    job_path = os.path.join(workdir, f"job_{index}.pkl")
    with open(job_path, "wb") as f:
      pickle.dump({**job, "result": self._result_path}, f)
    self.popen = start(job_path, env)
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


def start(job_path: str, env: dict[str, str]) -> subprocess.Popen[bytes] | Forked:
  """Starts ``python -m grain_jax_sync._src.sim_worker JOB``: forked from a server, or fresh."""
  if sys.platform.startswith("linux") and os.environ.get(FORK_ENV, "1") != "0":
    key = _key(env)
    if key not in _FAILED:
      try:
        return _server(key).start(job_path, env)
      except (OSError, TimeoutError) as e:
        _FAILED.add(key)  # This environment's processes start fresh from now on.
        logger.warning("grain_jax_sync.testing: the fork server failed (%r); starting fresh", e)
  return subprocess.Popen(
    [*_WORKER, job_path],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    stdin=subprocess.DEVNULL,
    start_new_session=True,
  )


class Forked:
  """A process forked by the server: what `Process` uses of `subprocess.Popen`."""

  def __init__(self, status: socket.socket, stdout: IO[bytes], stderr: IO[bytes]):
    self.stdout, self.stderr = stdout, stderr
    self.returncode: int | None = None
    self._status = status
    try:
      self.pid = self._receive(_FORK_TIMEOUT_S)
    except BaseException:
      for f in (stdout, stderr, status):
        f.close()
      raise

  def _receive(self, timeout_s: float | None) -> int:
    self._status.settimeout(timeout_s)
    data = self._status.recv(sim_worker.STATUS.size)
    if not data:
      raise ConnectionResetError("the fork server exited")
    return sim_worker.STATUS.unpack(data)[0]

  def poll(self) -> int | None:
    if self.returncode is None:
      with contextlib.suppress(BlockingIOError, TimeoutError):
        self._exited(0)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if self.returncode is None:
      try:
        self._exited(timeout)
      except TimeoutError:
        raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0) from None
    assert self.returncode is not None
    return self.returncode

  def _exited(self, timeout_s: float | None) -> None:
    try:
      self.returncode = self._receive(timeout_s)
    except ConnectionError:  # The server died: whatever the child does, it is not waited for.
      self.returncode = -signal.SIGKILL
    self._status.close()


class _Server:
  """One fork server (`sim_worker.serve`), started with `env`; exits when this process does."""

  def __init__(self, env: Mapping[str, str]):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with theirs:
      self.popen = subprocess.Popen(
        [*_WORKER, "--serve", str(theirs.fileno())],
        env=dict(env),
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
      )
    self._control = ours

  def start(self, job_path: str, env: dict[str, str]) -> Forked:
    request = pickle.dumps((job_path, os.getcwd(), env))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      socket.send_fds(self._control, [request], [out_w, err_w, theirs.fileno()])
    except BaseException:
      for fd in (out_r, err_r):
        os.close(fd)
      status.close()
      raise
    finally:
      os.close(out_w)
      os.close(err_w)
      theirs.close()
    return Forked(status, open(out_r, "rb"), open(err_r, "rb"))  # noqa: SIM115 - `Process` reads them.

  def close(self) -> None:
    self._control.close()  # The server exits; its children run on.
    with contextlib.suppress(subprocess.TimeoutExpired):
      self.popen.wait(1.0)


_Key = tuple[tuple[str, str], ...]
_SERVERS: collections.OrderedDict[_Key, _Server] = collections.OrderedDict()
_SERVERS_LOCK = threading.Lock()
_FAILED: set[_Key] = set()


@atexit.register
def _close_servers() -> None:
  """At exit, each server exits now, not when the last holder of its socket (a fork of ours) exits."""
  while _SERVERS:
    _SERVERS.popitem()[1].close()


def _key(env: Mapping[str, str]) -> _Key:
  """What a fork server's processes share: the environment but `_PER_PROCESS`, the interpreter."""
  own = sorted((k, v) for k, v in env.items() if k not in _PER_PROCESS)
  return (("", sys.executable), *own)


def _server(key: _Key) -> _Server:
  """The fork server for `key` (started now if there is none); raises OSError if it will not start."""
  with _SERVERS_LOCK:
    server = _SERVERS.pop(key, None)
    if server is None or server.popen.poll() is not None:
      server = _Server(dict(key[1:]))
    _SERVERS[key] = server
    while len(_SERVERS) > _SERVERS_KEPT:
      _SERVERS.popitem(last=False)[1].close()
  return server


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
