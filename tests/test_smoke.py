"""The harness itself: real processes, real collectives, bounded time."""

import numpy as np
import pytest
import scenarios

from grain_jax_sync import testing


@pytest.mark.multiprocess
def test_run_iter_two_processes_equal_batches_rows_in_process_order():
  sizes = [[8, 8], [8, 8]]
  outs = testing.values(
    testing.run_processes(
      scenarios.run_iter,
      num_processes=2,
      devices_per_process=4,
      args=(sizes, {"batch_size": 8}),
      timeout_s=120,
    )
  )
  for out in outs:
    assert out["error"] is None
    assert len(out["batches"]) == 2
    for b, batch in enumerate(out["batches"]):
      want = np.concatenate([scenarios.rows_for(p, b, 8) for p in range(2)])
      np.testing.assert_array_equal(batch["x"], want)


def signalled_at(num_batches: int, install_handler: bool) -> dict:
  """Runs in every process: the positions a SIGTERM found the iterator at."""
  import signal

  import jax

  import grain_jax_sync as gjs

  got = []
  shard = [{"x": np.full(4, jax.process_index(), np.float32)}] * num_batches
  with gjs.iter_jax_batches(shard, batch_size=4) as it:
    if install_handler:
      signal.signal(signal.SIGTERM, lambda *_: got.append(it.get_state()["batches"]))
    n = sum(1 for _ in it)
  print(f"host {jax.process_index()} done")
  return {"batches": n, "signalled_at": got}


@pytest.mark.multiprocess
def test_signal_at_reaches_one_process_right_after_its_batch():
  outcomes = testing.run_processes(
    signalled_at,
    num_processes=2,
    devices_per_process=2,
    kwargs={"num_batches": 6, "install_handler": True},
    signal_at=testing.SignalAt(process=1, after_batch=3),
    timeout_s=120,
  )
  assert testing.values(outcomes) == [
    {"batches": 6, "signalled_at": []},
    {"batches": 6, "signalled_at": [3]},
  ]
  sent = "testing signal_at: sending SIGTERM to this process after batch 3"
  assert [sent in o.log for o in outcomes] == [False, True]


@pytest.mark.multiprocess
def test_signal_at_without_a_handler_ends_a_lone_process():
  (outcome,) = testing.run_processes(
    signalled_at,
    num_processes=1,
    kwargs={"num_batches": 6, "install_handler": False},
    signal_at=[testing.SignalAt(process=0, after_batch=2)],
    timeout_s=120,
  )
  # No jax.distributed (one process): SIGTERM's default action, after batch 2.
  assert not outcome.ok and outcome.exit_code == -15 and outcome.value is None
  assert "sending SIGTERM to this process after batch 2" in outcome.log
  assert "host 0 done" not in outcome.log


@pytest.mark.multiprocess
def test_echo_shows_each_process_stdout_and_stderr_labelled(capsys):
  outcomes = testing.run_processes(
    scenarios.run_iter,
    num_processes=2,
    devices_per_process=2,
    args=([[4], [4, 4]], {"batch_size": 4, "paddings": 0}),  # Unmasked: a logged warning.
    echo=True,
    timeout_s=120,
  )
  assert [len(v["batches"]) for v in testing.values(outcomes)] == [2, 2]
  err = capsys.readouterr().err.splitlines()
  for p in (0, 1):
    warned = [line for line in err if line.startswith(f"[process {p}] grain_jax_sync: `paddings`")]
    assert len(warned) == 1, err
    assert "`mask_key` is not" in outcomes[p].log  # Kept in the outcome too.


@pytest.mark.parametrize(
  "signal_at,match",
  [
    (testing.SignalAt(process=2, after_batch=1), r"distinct processes in \[0, 2\)"),
    ([testing.SignalAt(1, 1), testing.SignalAt(1, 2)], r"distinct processes in \[0, 2\)"),
    (testing.SignalAt(process=0, after_batch=0), "after_batch >= 1"),
    (testing.SignalAt(process=0, after_batch=1, signal=999), "a signal number"),
  ],
)
def test_signal_at_refuses_bad_values_before_starting(signal_at, match):
  with pytest.raises(ValueError, match=match):
    testing.run_processes(
      signalled_at, num_processes=2, signal_at=signal_at, kwargs={}, timeout_s=10
    )


def started_as() -> dict:
  """Runs in every process: how it was started, and what it took of its own environment."""
  import os

  import jax

  from grain_jax_sync._src import signal_at

  return {
    "parent": os.getppid(),
    "session": os.getsid(0) == os.getpid(),
    "cwd": os.getcwd(),
    "own": os.environ.get("GJS_TEST_OWN"),
    "signal_at": signal_at.AFTER_BATCH,
    "devices": len(jax.local_devices()),
    "draw": float(np.random.rand()),  # The legacy global state: forked, reseeded.
  }


@pytest.mark.multiprocess
@pytest.mark.parametrize("fork", ["1", "0"])
def test_each_process_has_its_own_environment_session_and_exit_forked_or_fresh(
  fork, monkeypatch, tmp_path
):
  import os

  monkeypatch.setenv("GRAIN_JAX_SYNC_SIM_FORK", fork)
  monkeypatch.chdir(tmp_path)
  outcomes = testing.run_processes(
    started_as,
    num_processes=2,
    devices_per_process=3,
    env={"GJS_TEST_OWN": f"fork {fork}"},
    signal_at=testing.SignalAt(process=1, after_batch=7),
    timeout_s=120,
  )
  got = testing.values(outcomes)
  # Forked, the processes are the server's children; fresh, this process's.
  assert [g["parent"] == os.getpid() for g in got] == [fork == "0"] * 2
  assert [g["session"] for g in got] == [True, True]  # Each killed with its own group.
  assert [g["cwd"] for g in got] == [str(tmp_path)] * 2
  assert [g["own"] for g in got] == [f"fork {fork}"] * 2
  assert [g["signal_at"] for g in got] == [-1, 7]
  assert [g["devices"] for g in got] == [3, 3]
  assert got[0]["draw"] != got[1]["draw"]  # Not the server's random state.
  assert [o.exit_code for o in outcomes] == [0, 0]
  # Killed past the bound: its exit code as `subprocess` gives it (-9).
  with pytest.raises(TimeoutError, match=r"within 3s; all were killed.\n--- process 0 \(exit -9\)"):
    testing.run_processes(paused, num_processes=1, timeout_s=3, env={"GJS_TEST_OWN": fork})


def paused() -> None:
  import signal

  signal.pause()


def test_one_fork_server_serves_every_environment_that_differs_only_in_what_no_import_reads():
  from grain_jax_sync._src import signal_at, sim_processes

  base = {"PATH": "/bin", "JAX_PLATFORMS": "cpu"}
  same = [
    base,
    {**base, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},  # Read by the backend.
    {**base, signal_at.ENV: "3:15"},  # Read again in the child.
    {**base, "PYTEST_CURRENT_TEST": "tests/test_smoke.py::test (call)"},  # Set per test.
  ]
  assert len({sim_processes._key(env) for env in same}) == 1
  # Read when JAX is imported, in the server: another server.
  assert sim_processes._key({**base, "JAX_ENABLE_X64": "1"}) != sim_processes._key(base)


def parent_pid() -> int:
  import os

  return os.getppid()


@pytest.mark.multiprocess
def test_a_dead_fork_server_is_replaced_and_one_that_will_not_start_falls_back_to_fresh(
  monkeypatch, caplog
):
  import os

  from grain_jax_sync._src import sim_processes

  def run() -> int:
    (parent,) = testing.values(testing.run_processes(parent_pid, num_processes=1, timeout_s=60))
    return parent

  monkeypatch.setenv("GRAIN_JAX_SYNC_SIM_FORK", "1")
  first = run()
  servers = {s.popen.pid for s in sim_processes._SERVERS.values()}
  assert first in servers  # Forked by a server.
  os.kill(first, 9)
  os.waitpid(first, 0)
  second = run()
  assert second != first and second in {s.popen.pid for s in sim_processes._SERVERS.values()}

  def refuses(env):
    raise OSError("no server here")

  monkeypatch.setattr(sim_processes, "_Server", refuses)
  monkeypatch.setenv("GJS_TEST_OWN", "an environment no server serves yet")
  assert run() == os.getpid()  # Fresh, this process's child.
  assert "the fork server failed (OSError('no server here'))" in caplog.text
  assert run() == os.getpid()  # And from then on, without trying again.
  assert caplog.text.count("the fork server failed") == 1
