"""Two simulators: N real JAX processes on loopback, and a simulated cluster in virtual time.

`SimulatedCluster` runs N hosts' real agreement cores over an in-memory
store with a virtual clock, in this process: a stop and preemption schedule
(`HostPlan`) on 64 virtual hosts takes milliseconds.

`run_processes` runs real processes, each with
``XLA_FLAGS=--xla_force_host_platform_device_count=D``, joined by
``jax.distributed.initialize`` on 127.0.0.1 with gloo CPU collectives: the
key-value store and the collectives are the real ones. A run past
``timeout_s`` is killed and raises ``TimeoutError``, so a hang fails a test.
A scenario is a module-level function, so that every process can import it::

  def scenario():
    import jax
    return jax.process_index(), jax.device_count()

  outcomes = grain_jax_sync.testing.run_processes(
      scenario, num_processes=2, devices_per_process=4)
  assert [o.value for o in outcomes] == [(0, 8), (1, 8)]
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import signal as signal_lib
import socket
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grain_jax_sync._src import signal_at as signal_at_lib
from grain_jax_sync._src import sim_processes, sim_worker
from grain_jax_sync._src.sim_cluster import HostOutcome, HostPlan, SimulatedCluster

__all__ = [
  "HostOutcome",
  "HostPlan",
  "ProcessOutcome",
  "SignalAt",
  "SimulatedCluster",
  "run_processes",
  "run_script",
  "values",
]


@dataclasses.dataclass(frozen=True)
class ProcessOutcome:
  """What one simulated host did.

  Attributes:
    process_index: ``jax.process_index()`` of the process.
    value: The scenario's return value, or None when it raised.
    error_type: Qualified name of the exception the scenario raised, if any.
    error_message: ``str()`` of that exception.
    traceback: Formatted traceback of that exception.
    exit_code: The interpreter's exit code (-9 for SIGKILL).
    elapsed_s: Seconds the scenario function ran (NaN if it never returned).
    log: The last 4,000 characters the process wrote to stdout and stderr,
      in the order written.
  """

  process_index: int
  value: Any = None
  error_type: str | None = None
  error_message: str | None = None
  traceback: str | None = None
  exit_code: int | None = None
  elapsed_s: float = float("nan")
  log: str = ""

  @property
  def ok(self) -> bool:
    """True when the scenario returned and the process exited with 0."""
    return self.error_type is None and self.exit_code == 0


@dataclasses.dataclass(frozen=True)
class SignalAt:
  """A signal that one process sends itself once it has received a given batch.

  Under `run_processes(signal_at=...)` (and ``simulate --signal``), the first
  iterator of `process` to reach position `after_batch`
  (``get_state()["batches"]``) sends `signal` to its own process right after
  that `next()`, once. A handler installed with ``signal.signal`` runs then;
  without one, the default action applies (SIGTERM: ``exit_code`` -15, unless
  JAX's preemption notifier took it after ``jax.distributed.initialize``). A
  handler that raises (SIGINT's KeyboardInterrupt) raises from that `next()`:
  batch `after_batch` is in the state but never returned.

  Attributes:
    process: The process index that gets the signal.
    after_batch: The position (>= 1) after which it is sent.
    signal: The signal number; SIGTERM by default.
  """

  process: int
  after_batch: int
  signal: int = signal_lib.SIGTERM


def _signal_env(signal_at: SignalAt | Sequence[SignalAt], num_processes: int) -> dict[int, str]:
  """Each signalled process's `signal_at` environment value; raises ValueError for a bad one."""
  wanted = [signal_at] if isinstance(signal_at, SignalAt) else list(signal_at)
  out: dict[int, str] = {}
  for w in wanted:
    if not isinstance(w, SignalAt) or not 0 <= w.process < num_processes or w.process in out:
      raise ValueError(
        f"`signal_at` must hold SignalAt values for distinct processes in"
        f" [0, {num_processes}), got {w!r}"
      )
    if w.after_batch < 1 or w.signal not in set(signal_lib.Signals):
      raise ValueError(f"`signal_at` needs after_batch >= 1 and a signal number, got {w!r}")
    out[w.process] = signal_at_lib.encode(w.after_batch, w.signal)
  return out


def _function_spec(fn: Callable[..., Any]) -> dict[str, str]:
  qualname = fn.__qualname__
  if "<locals>" in qualname or "<lambda>" in qualname:
    raise ValueError(
      f"`fn` must be a module-level function so that every process can import it, got {qualname!r}"
    )
  module = fn.__module__
  path = os.path.abspath(inspect.getfile(fn))
  if module in ("__main__", None) or module.startswith("__gjs"):
    return {"file": path, "qualname": qualname}
  # The directory that makes `module` importable by its dotted name.
  root = os.path.dirname(path)
  for _ in range(module.count(".")):
    root = os.path.dirname(root)
  return {"module": module, "root": root, "file": path, "qualname": qualname}


def run_processes(
  fn: Callable[..., Any],
  *,
  num_processes: int,
  devices_per_process: int = 1,
  args: Sequence[Any] = (),
  kwargs: Mapping[str, Any] | None = None,
  per_process_kwargs: Sequence[Mapping[str, Any]] | None = None,
  timeout_s: float = 120.0,
  heartbeat_timeout_s: int = 100,
  exit_barrier_timeout_s: float = 30.0,
  env: Mapping[str, str] | None = None,
  signal_at: SignalAt | Sequence[SignalAt] = (),
  echo: bool = False,
) -> list[ProcessOutcome]:
  """Runs ``fn(*args, **kwargs)`` in `num_processes` real JAX processes.

  On Linux the processes are forked from a server that imported JAX once
  (docs/testing.md); ``GRAIN_JAX_SYNC_SIM_FORK=0`` starts each fresh.

  Args:
    fn: A module-level function, imported in every process by module name or
      file path; run after ``jax.distributed.initialize`` (unless 1 process).
    num_processes: How many processes (simulated hosts) to start.
    devices_per_process: Forced CPU devices per process.
    args: Positional arguments for `fn`; must pickle.
    kwargs: Keyword arguments for `fn` in every process; must pickle.
    per_process_kwargs: Extra keyword arguments, one mapping per process,
      merged over `kwargs`.
    timeout_s: Wall-clock bound for the whole run; past it every process is
      killed and ``TimeoutError`` raised with each process's log tail.
    heartbeat_timeout_s: Passed to ``jax.distributed.initialize``.
    exit_barrier_timeout_s: How long each process waits for its peers at a
      barrier after `fn`, so that none tears down a collective a peer is in;
      0 skips it (a process killed mid-run holds its peers for the timeout).
    env: Extra environment variables for every process.
    signal_at: A `SignalAt` (or several, for distinct processes).
    echo: Also echo each process's output as written, each line labelled
      ``[process i]`` (as ``simulate`` does); ``ProcessOutcome.log`` keeps it.

  Returns:
    One ``ProcessOutcome`` per process, in process-index order.

  Raises:
    TimeoutError: When the run does not finish within `timeout_s`.
    ValueError: For bad arguments.
    RuntimeError: When called while a simulated process imports the file of
      a scenario (a script with no ``if __name__ == "__main__":`` guard).
  """
  if num_processes < 1:
    raise ValueError(f"`num_processes` must be >= 1, got {num_processes}")
  if devices_per_process < 1:
    raise ValueError(f"`devices_per_process` must be >= 1, got {devices_per_process}")
  if per_process_kwargs is not None and len(per_process_kwargs) != num_processes:
    raise ValueError(
      f"`per_process_kwargs` needs {num_processes} entries, got {len(per_process_kwargs)}"
    )
  loading = os.environ.get(sim_worker.LOADING_ENV)
  if loading is not None:
    raise RuntimeError(
      f"run_processes() was called while a simulated process imported {loading!r}"
      " to find the function to run: that file starts its run when imported, so"
      " every process would start it again. Put the file's top-level code under"
      ' `if __name__ == "__main__":`, as multiprocessing\'s spawn requires.'
    )
  signal_env = _signal_env(signal_at, num_processes)
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))  # A free port for the coordinator.
    port = s.getsockname()[1]
  job = {
    "fn": _function_spec(fn),
    "args": tuple(args),
    "num_processes": num_processes,
    "coordinator": f"127.0.0.1:{port}",
    "heartbeat_timeout_s": heartbeat_timeout_s,
    "exit_barrier_timeout_s": exit_barrier_timeout_s,
  }
  workdir = tempfile.mkdtemp(prefix="gjs_sim_")
  base_env = sim_processes.process_env(env, devices_per_process)
  processes = []
  for i in range(num_processes):
    kw = dict(kwargs or {})
    if per_process_kwargs is not None:
      kw.update(per_process_kwargs[i])
    proc_env = base_env if i not in signal_env else {**base_env, signal_at_lib.ENV: signal_env[i]}
    own = {**job, "kwargs": kw, "process_id": i}
    processes.append(sim_processes.Process(i, own, workdir, proc_env, echo=echo))
  sim_processes.wait_or_kill(processes, timeout_s)
  return [
    ProcessOutcome(
      process_index=i,
      exit_code=p.popen.returncode,
      log=sim_processes.tail(p.log_path),
      **p.result(),
    )
    for i, p in enumerate(processes)
  ]


def run_script(
  path: str,
  argv: Sequence[str] = (),
  *,
  num_processes: int,
  devices_per_process: int = 1,
  timeout_s: float = 120.0,
  env: Mapping[str, str] | None = None,
  signal_at: SignalAt | Sequence[SignalAt] = (),
  echo: bool = False,
) -> list[ProcessOutcome]:
  """Runs the Python file `path` as ``__main__`` in `num_processes` processes.

  What ``python -m grain_jax_sync simulate path.py ARGS`` does: every process
  runs the script with ``sys.argv == [path, *argv]`` once
  ``jax.distributed.initialize`` joined them, so a script that starts with
  `grain_jax_sync.init_distributed()` runs unchanged here and on a real job.

  Args:
    path: A Python file.
    argv: Its command-line arguments.
    num_processes, devices_per_process, timeout_s, env, signal_at, echo: As
      in `run_processes`.

  Returns:
    One ``ProcessOutcome`` per process; its ``value`` is the script's stdout.

  Raises:
    TimeoutError: When the run does not finish within `timeout_s`.
    ValueError: If `path` is not a file.
  """
  if not os.path.isfile(path):
    raise ValueError(f"`path` must be a Python file, got {path!r}")
  return run_processes(
    sim_worker.run_as_main,
    num_processes=num_processes,
    devices_per_process=devices_per_process,
    args=(os.path.abspath(path), tuple(argv)),
    timeout_s=timeout_s,
    env=env,
    signal_at=signal_at,
    echo=echo,
  )


def values(outcomes: Sequence[ProcessOutcome]) -> list[Any]:
  """Returns each process's value; raises if any process failed."""
  bad = [o for o in outcomes if not o.ok]
  if bad:
    o = bad[0]
    raise AssertionError(
      f"process {o.process_index} failed (exit {o.exit_code}):"
      f" {o.error_type}: {o.error_message}\n{o.traceback or ''}\n{o.log}"
    )
  return [o.value for o in outcomes]
