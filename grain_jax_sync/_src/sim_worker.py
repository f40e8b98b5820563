"""What each process of `grain_jax_sync.testing.run_processes` runs.

``python -m grain_jax_sync._src.sim_worker JOB`` joins its peers (gloo CPU
collectives), runs the scenario and writes what it returned or raised. With
``--serve FD``, the fork server: it imports JAX and this package once, then
forks a child per job sent on the socket `FD`, which runs `run_job`. What
`simulate` runs: a script as ``__main__`` (`run_as_main`), or ``module:function``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import pickle
import runpy
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
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
  # script that starts its run at import would start it in every process, without end.
  os.environ[LOADING_ENV] = spec.get("file") or spec.get("module", "")
  obj: Any = None
  try:
    if "module" in spec:
      if spec["root"] not in sys.path:
        sys.path.insert(0, spec["root"])
      with contextlib.suppress(ImportError):
        obj = importlib.import_module(spec["module"])
    obj = obj or import_file(spec["file"])
  finally:
    os.environ.pop(LOADING_ENV, None)
  for part in spec["qualname"].split("."):
    obj = getattr(obj, part)
  return obj


def import_file(path: str) -> types.ModuleType:
  """Imports the Python file `path` under a ``__gjs_scenario_`` name (one per file name)."""
  name = "__gjs_scenario_" + os.path.splitext(os.path.basename(path))[0]
  module_spec = importlib.util.spec_from_file_location(name, path)
  assert module_spec is not None and module_spec.loader is not None
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[name] = module
  module_spec.loader.exec_module(module)
  return module


class _Tee(io.TextIOBase):
  """Writes to the process's stdout and keeps a copy."""

  def __init__(self, stream: Any):
    self._stream = stream
    self.copy = io.StringIO()

  def write(self, text: str) -> int:
    self.copy.write(text)
    return self._stream.write(text)

  def flush(self) -> None:
    self._stream.flush()


def run_as_main(path: str, argv: Sequence[str]) -> str:
  """Runs the file `path` (absolute) as ``__main__`` with `argv`; returns what it printed.

  A non-zero exit status raises RuntimeError.
  """
  tee = _Tee(sys.stdout)
  old_argv = sys.argv
  sys.argv = [path, *argv]
  sys.path.insert(0, os.path.dirname(path))
  try:
    with contextlib.redirect_stdout(tee):
      runpy.run_path(path, run_name="__main__")
  except SystemExit as e:
    if e.code not in (None, 0):
      raise RuntimeError(f"{path} exited with status {e.code!r}") from e
  finally:
    sys.argv = old_argv
  return tee.copy.getvalue()


def resolve_function(target: str) -> Callable[..., Any]:
  """The module-level function that ``module:function`` or ``path/to/file.py:function`` names.

  A file is imported under a ``__gjs`` module name, so that `run_processes`
  imports it by path in every process.
  """
  module, sep, name = target.rpartition(":")
  if not sep or not module or not name:
    raise ValueError(
      f"`target` must be 'file.py', 'file.py:function' or 'module:function', got {target!r}"
    )
  if module.endswith(".py"):
    if not os.path.isfile(module):
      raise ValueError(f"`target` {target!r} names the file {module!r}, which does not exist")
    path = os.path.abspath(module)
    sys.path.insert(0, os.path.dirname(path))
    mod: Any = import_file(path)
  else:
    mod = importlib.import_module(module)
  fn = getattr(mod, name, None)
  if not callable(fn):
    raise ValueError(f"`target` {target!r}: {module} has no function {name!r}")
  return fn


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
    # Leave together: one that exits resets a peer's gloo collective, and
    # process 0 hosts the coordination service the others need until they go.
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


# One job's request to the fork server: its pickled (job path, working
# directory, environment), and stdout, stderr and the job's own socket, on
# which the server sends the child's pid, then its exit code (-N for signal N).
REQUEST_FDS = 3
REQUEST_BYTES = 1 << 20
STATUS = struct.Struct("i")


def serve(control_fd: int) -> None:
  """The fork server's loop: a child per request on `control_fd`; exits when that closes.

  Single-threaded, so that a fork copies no lock another thread holds:
  requests and children's exits (SIGCHLD, by a wake-up pipe) wait in one `select`.
  """
  import jax  # noqa: F401 - what the server is for: each child starts with these.

  import grain_jax_sync  # noqa: F401

  control = socket.socket(fileno=control_fd)
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_r, False)
  os.set_blocking(wake_w, False)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
  children: dict[int, socket.socket] = {}
  with selectors.DefaultSelector() as sel:
    sel.register(control, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
      for key, _ in sel.select():
        if key.fileobj is control:
          data, fds, _, _ = socket.recv_fds(control, REQUEST_BYTES, REQUEST_FDS)
          if not data:
            os._exit(0)  # The parent is gone.
          pid = os.fork()
          if pid == 0:
            _child(pickle.loads(data), fds, [control, *children.values(), sel], (wake_r, wake_w))
          out, err, status = fds
          os.close(out)
          os.close(err)
          children[pid] = socket.socket(fileno=status)
          with contextlib.suppress(OSError):  # The parent stopped listening.
            children[pid].send(STATUS.pack(pid))
        else:
          with contextlib.suppress(BlockingIOError):
            while os.read(wake_r, 4096):
              pass
          _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
  """Sends each exited child's exit code on its job's socket."""
  while children:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    sock = children.pop(pid, None)
    if sock is not None:
      with contextlib.suppress(OSError):  # The parent stopped listening.
        sock.send(STATUS.pack(os.waitstatus_to_exitcode(status)))
      sock.close()


def _child(
  request: tuple[str, str, dict[str, str]], fds: list[int], server: list[Any], pipe: tuple[int, int]
) -> None:
  """In the forked child: becomes the job's process (`run_job`), as a fresh one would; never returns."""
  try:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for held in server:  # The server's sockets and selector.
      held.close()
    for fd in pipe:
      os.close(fd)
    job_path, cwd, env = request
    out, err, status = fds
    os.close(status)
    os.setsid()  # As `start_new_session`: the run kills the process's group.
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
      os.dup2(fd, target)
      os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[0] = cwd  # `python -m`'s first entry.
    sys.argv = [os.path.abspath(__file__), job_path]
    from grain_jax_sync._src import signal_at  # pylint: disable=g-import-not-at-top

    signal_at.arm(env)  # Read at import, in the server: this job's own.
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
      numpy_random.seed()  # Not the server's: each child its own, as each fresh process.
    run_job(job_path)
  finally:
    os._exit(70)


if __name__ == "__main__":
  if sys.argv[1] == "--serve":
    serve(int(sys.argv[2]))
  else:
    run_job(sys.argv[1])
