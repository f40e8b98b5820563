"""The build stage: order, endings and close, whoever builds (the thread or the consumer)."""

from __future__ import annotations

import threading
import time

import pytest

from grain_jax_sync._src import agreement, build_stage


class _Read:
  def __init__(self, i):
    self.i = i


def _runs(n, per_run=1, fail_at=None):
  i = 0
  while i < n:
    if fail_at is not None and i >= fail_at:
      raise KeyError("boom")
    steps = tuple((_Read(j), "yield") for j in range(i, min(n, i + per_run)))
    i += len(steps)
    yield agreement.Run(steps, None, None)


def _build(step_s=0.0, dropped=(), fail=None, who=None):
  def build(read, step, sig, size):
    del step, sig, size
    if who is not None:
      who.append(threading.current_thread().name)
    if step_s:
      time.sleep(step_s)
    if read.i == fail:
      raise ValueError(f"bad {read.i}")
    return None if read.i in dropped else read.i

  return build


@pytest.mark.parametrize("per_run", [1, 3])
@pytest.mark.parametrize("consumer_step_s", [0.0, 0.003])
def test_order_is_exact_whoever_builds(per_run, consumer_step_s):
  who: list[str] = []
  stage = build_stage.BuildStage(
    _runs(40, per_run), _build(0.001, dropped={5, 17}, who=who), built=2, decided=4
  )
  got = []
  for item in stage:
    got.append(item)
    time.sleep(consumer_step_s)
  stage.close()
  assert got == [i for i in range(40) if i not in (5, 17)]
  assert len(who) == 40  # Each position built once.


def test_a_consumer_that_finds_nothing_built_builds_itself():
  # Builds slower than the consumer: it finds decided positions unbuilt and
  # builds some of them itself (the one rule), in order.
  who: list[str] = []
  stage = build_stage.BuildStage(_runs(30), _build(0.005, who=who), built=1, decided=8)
  assert list(stage) == list(range(30))
  stage.close()
  assert threading.current_thread().name in who


def test_an_error_comes_after_the_batches_before_it():
  stage = build_stage.BuildStage(_runs(10), _build(fail=4), built=2, decided=2)
  got = []
  with pytest.raises(ValueError, match="bad 4"):
    for item in stage:
      got.append(item)
  assert got == [0, 1, 2, 3]
  stage.close()
  assert not stage.thread.is_alive()


def test_a_runs_error_comes_after_the_batches_before_it():
  stage = build_stage.BuildStage(_runs(10, fail_at=6), _build(), built=2, decided=2)
  got = []
  with pytest.raises(KeyError, match="boom"):
    for item in stage:
      got.append(item)
  assert got == list(range(6))
  stage.close()


def test_close_from_another_thread_wakes_a_waiting_consumer():
  gate = threading.Event()

  def runs():
    yield agreement.Run(((_Read(0), "yield"),), None, None)
    gate.wait(30)  # Nothing decided for a while (a slow peer).
    yield agreement.Run(((_Read(1), "yield"),), None, None)

  stage = build_stage.BuildStage(runs(), _build(), built=2, decided=2, on_close=gate.set)
  assert next(stage) == 0
  threading.Timer(0.1, stage.close).start()
  t0 = time.monotonic()
  with pytest.raises(StopIteration):
    next(stage)
  assert time.monotonic() - t0 < 5
  stage.thread.join(5)
  assert not stage.thread.is_alive()


def test_request_stop_takes_no_lock():
  stage = build_stage.BuildStage(_runs(1000), _build(0.001), built=2, decided=2)
  assert next(stage) == 0
  with stage._cond:  # As a signal handler finds it, inside the consumer's `next()`.
    stage.request_stop()
  with pytest.raises(StopIteration):
    while True:
      next(stage)
  stage.close()
  assert not stage.thread.is_alive()


def test_bounds_are_checked():
  with pytest.raises(ValueError, match="must be >= 1"):
    build_stage.BuildStage(iter(()), _build(), built=0, decided=1)
