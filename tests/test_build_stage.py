"""The build stage: order, errors and who builds or reads, whoever does it.

Behaviour only; speed lives in benchmarks/.
"""

from __future__ import annotations

import threading
import time

import pytest

from grain_jax_sync._src import build_stage

# -- the build stage (work stealing) --------------------------------------------


class _Run:
  def __init__(self, steps):
    self.steps = steps
    self.signature = "sig"
    self.batch_size = 8


def _stage_runs(n, run_len=3, *, fail_at=None):
  """Decided runs of positions 0..n-1; None marks a dropped position (every 5th)."""
  pos = 0
  while pos < n:
    steps = []
    for p in range(pos, min(n, pos + run_len)):
      steps.append((p, "drop" if p % 5 == 4 else "yield"))
    pos += len(steps)
    yield _Run(steps)
  if fail_at is not None:
    raise KeyError(f"upstream failed after {n}")


def _stage_build(built_by, fail_at=None):
  def build(read, step, sig, batch_size):
    assert sig == "sig" and batch_size == 8
    if read == fail_at:
      raise ValueError(f"build failed at {read}")
    built_by.append((read, threading.current_thread().name))
    time.sleep(0.001)  # A build that takes some time.
    return None if step == "drop" else read

  return build


def _drain_stage(runs, build, step_s, inline_fetch):
  """A build stage named "builder" drained with a step of `step_s`, then closed."""
  stage = build_stage.BuildStage(
    runs, build, buffer_size=2, name="builder", inline_fetch=inline_fetch
  )
  got = []
  for item in stage:
    got.append(item)
    time.sleep(step_s)
  stage.close()
  return stage, got


@pytest.mark.parametrize("inline_fetch", [False, True])
@pytest.mark.parametrize("step_s", [0.0, 0.02])
def test_build_stage_order_is_exact_whoever_builds(step_s, inline_fetch):
  built_by = []
  stage, got = _drain_stage(_stage_runs(30), _stage_build(built_by), step_s, inline_fetch)
  want = [p for p in range(30) if p % 5 != 4]
  assert got == want
  assert [p for p, _ in built_by] == list(range(30))  # Each position built once, in order.
  by_thread = sum(1 for _, name in built_by if name == "builder")
  if step_s:  # A training step to hide behind: the thread builds ahead.
    assert by_thread >= 20
  else:  # Nothing to hide: the consumer builds (steals) nearly every batch.
    assert by_thread <= 10
  assert not stage.thread.is_alive()


@pytest.mark.parametrize("inline_fetch", [False, True])
@pytest.mark.parametrize("failing", ["build", "upstream"])
def test_build_stage_raises_after_the_batches_before_the_error(failing, inline_fetch):
  built_by = []
  runs = _stage_runs(12, fail_at=12 if failing == "upstream" else None)
  fail_at = 7 if failing == "build" else None
  stage = build_stage.BuildStage(
    runs, _stage_build(built_by, fail_at), buffer_size=2, inline_fetch=inline_fetch
  )
  got = []
  error = ValueError if failing == "build" else KeyError
  with pytest.raises(error, match="failed"):
    for item in stage:
      got.append(item)
  stage.close()
  end = 7 if failing == "build" else 12
  assert got == [p for p in range(end) if p % 5 != 4]
  assert next(stage, "done") == "done"
  assert not stage.thread.is_alive()


def _fetched_by(fetched_by, n, read_s):
  """Runs of one position; records which thread advanced them."""
  for p in range(n):
    fetched_by.append(threading.current_thread().name)
    if read_s:
      time.sleep(read_s)  # A source that waits (I/O).
    yield _Run([(p, "yield")])


@pytest.mark.parametrize(
  ("inline_fetch", "read_s", "step_s", "consumer_fetches"),
  [
    (True, 0.0, 0.0, "nearly all"),  # Quick reads, nothing to hide them behind.
    (True, 0.003, 0.0, "few"),  # A slow source: read in the thread.
    (True, 0.0, 0.01, "few"),  # A training step to hide the reads behind.
    (False, 0.0, 0.0, "none"),  # Several processes: never in the consumer.
  ],
)
def test_build_stage_fetches_in_the_consumer_only_quick_runs_with_nothing_to_hide(
  inline_fetch, read_s, step_s, consumer_fetches
):
  fetched_by = []
  runs = _fetched_by(fetched_by, 40, read_s)
  stage, got = _drain_stage(runs, lambda read, step, sig, size: read, step_s, inline_fetch)
  assert got == list(range(40))
  in_consumer = sum(1 for name in fetched_by if name != "builder")
  assert len(fetched_by) == 40
  if consumer_fetches == "nearly all":
    assert in_consumer >= 30
  elif consumer_fetches == "few":
    assert in_consumer <= 10
  else:
    assert in_consumer == 0
  assert not stage.thread.is_alive()


def test_build_stage_closed_before_its_first_batch_closes_its_runs():
  closed = []

  def runs():
    try:
      yield _Run([(0, "yield")])
    finally:
      closed.append(True)

  gen = runs()
  stage = build_stage.BuildStage(gen, lambda *a: a[0], buffer_size=2)
  next(gen)  # Started, so that closing it runs its `finally`.
  stage.close()
  assert closed == [True]
  assert next(stage, "done") == "done"


class _Batch:
  """A built item that can be watched for release."""

  def __init__(self, position):
    self.position = position


@pytest.mark.parametrize("inline_fetch", [False, True])
def test_a_dropped_item_lives_until_the_next_one_is_built_then_close_releases_the_last(
  inline_fetch,
):
  import gc
  import weakref

  built: list[weakref.ref] = []
  alive_at_build: list[list[int]] = []

  def build(read, step, sig, batch_size):
    alive_at_build.append([r().position for r in built if r() is not None])
    item = _Batch(read)
    built.append(weakref.ref(item))
    return item

  runs = iter([_Run([(p, "yield") for p in range(4)])])
  stage = build_stage.BuildStage(
    runs, build, buffer_size=1, name="builder", inline_fetch=inline_fetch
  )
  got = [next(stage).position for _ in range(4)]  # Each dropped at once, as `step(next(it))`.
  gc.collect()
  assert got == [0, 1, 2, 3]
  # While position p is built, the item handed out last (p - 1) is still alive,
  # as in the inline path's generator; nothing older is.
  assert alive_at_build == [[], [0], [1], [2]]
  assert [r() is not None for r in built] == [False, False, False, True]
  stage.close()
  gc.collect()
  assert all(r() is None for r in built)


def _mixed_runs(fetched_by, n, *, fail_upstream=False, block=None):
  """Quick runs of one position, every 7th run of three; every 5th position dropped.

  With `block` (a dict: "from", "blocked", "release"): the first read of a
  position >= from by a thread other than the build thread ("builder") sets
  `blocked`, records the position as "at" and waits for `release`.
  """
  p = 0
  while p < n:
    name = threading.current_thread().name
    fetched_by.append(name)
    if block is not None and p >= block["from"] and name != "builder" and "at" not in block:
      block["at"] = p
      block["blocked"].set()
      block["release"].wait(10)
    size = 3 if p % 7 == 6 else 1
    yield _Run([(q, "drop" if q % 5 == 4 else "yield") for q in range(p, min(n, p + size))])
    p += size
  if fail_upstream:
    raise KeyError(f"upstream failed after {n}")


@pytest.mark.parametrize("failing", [None, "build", "upstream"])
def test_build_stage_consumer_fetches_and_builds_quick_runs_itself_in_order(failing):
  # Quick runs and builds, no step: the consumer fetches and builds each run
  # itself in one go (`_direct`); runs of several positions, dropped
  # positions and errors keep their order.
  fetched_by, built_by = [], []

  def build(read, step, sig, batch_size):
    assert sig == "sig" and batch_size == 8
    if failing == "build" and read == 40:
      raise ValueError("build failed at 40")
    built_by.append(threading.current_thread().name)
    return None if step == "drop" else read

  runs = _mixed_runs(fetched_by, 60, fail_upstream=failing == "upstream")
  stage = build_stage.BuildStage(runs, build, buffer_size=2, name="builder", inline_fetch=True)
  got = []
  if failing is None:
    got = list(stage)
  else:
    with pytest.raises(ValueError if failing == "build" else KeyError, match="failed"):
      for item in stage:
        got.append(item)
  stage.close()
  end = 40 if failing == "build" else 60
  assert got == [p for p in range(end) if p % 5 != 4]
  # Most in the consumer (the thread takes the first run, and any stretch
  # where a read or build looked slow).
  assert sum(1 for name in fetched_by if name != "builder") >= len(fetched_by) // 2
  assert sum(1 for name in built_by if name != "builder") >= len(built_by) // 2
  assert next(stage, "done") == "done"
  assert not stage.thread.is_alive()


def test_build_stage_closed_from_another_thread_while_the_consumer_reads():
  # The consumer is inside a blocking read of its own (its inline fetch);
  # close() from another thread returns at once, and the consumer's next()
  # ends when the read returns, without the run it read.
  # From 26: a one-position run after a yielded one (25), so that the
  # consumer reads it in `_direct`, not after a dropped position in `_take`.
  block = {"from": 26, "blocked": threading.Event(), "release": threading.Event()}
  runs = _mixed_runs([], 60, block=block)
  stage = build_stage.BuildStage(
    runs,
    lambda read, step, sig, size: None if step == "drop" else read,
    buffer_size=2,
    name="builder",
    inline_fetch=True,
  )
  got = []
  consumer = threading.Thread(target=lambda: got.extend(stage), name="consumer")
  consumer.start()
  assert block["blocked"].wait(10)  # The consumer reads a position >= 26 itself.
  t0 = time.monotonic()
  closer = threading.Thread(target=stage.close)
  closer.start()
  closer.join(5)
  closed_s = time.monotonic() - t0
  block["release"].set()
  consumer.join(10)
  assert not closer.is_alive() and closed_s < 2
  assert not consumer.is_alive()
  # Every position before the blocked read, in order; not the run it read.
  assert got == [p for p in range(block["at"]) if p % 5 != 4]
  assert next(stage, "done") == "done"
  assert not stage.thread.is_alive()


@pytest.mark.parametrize(("batch_bytes", "consumer_fetches"), [(4096, "most"), (8 << 20, "few")])
def test_build_stage_long_builds_of_few_bytes_still_fetch_in_the_consumer(
  batch_bytes, consumer_fetches
):
  # 2 ms builds, over INLINE_BUILD_S: moving 4 KB each (2 MB/s, Python-bound
  # leaves) the consumer still fetches itself; moving 8 MB (4 GB/s, copies
  # that release the GIL) the thread reads beside them.
  fetched_by = []

  def build(read, step, sig, size):
    time.sleep(0.002)
    return read

  stage = build_stage.BuildStage(
    _fetched_by(fetched_by, 40, 0.0),
    build,
    buffer_size=2,
    name="builder",
    inline_fetch=True,
    read_bytes=lambda read: batch_bytes,
  )
  got = list(stage)
  stage.close()
  assert got == list(range(40))
  in_consumer = sum(1 for name in fetched_by if name != "builder")
  if consumer_fetches == "most":
    assert in_consumer >= 30
  else:
    assert in_consumer <= 10


def test_a_consumer_that_stops_fetching_inline_wakes_the_thread(monkeypatch):
  # The thread parks (for `WAKE_S`) while the consumer fetches quick runs
  # itself. When the consumer's averages move (here its first training step)
  # it waits for the thread instead, and must wake it: before, it slept out
  # the thread's whole wait (50 ms at each such turn; here it would be 60 s).
  monkeypatch.setattr(build_stage.prefetch, "WAKE_S", 60.0)
  fetched_by = []
  stage = build_stage.BuildStage(
    _fetched_by(fetched_by, 30, 0.0),
    lambda read, step, sig, size: read,
    buffer_size=2,
    name="builder",
    inline_fetch=True,
  )
  got = [next(stage) for _ in range(15)]
  assert not stage._waiting  # Not left set by the first call, which waits for the thread.
  assert fetched_by[-5:] == ["MainThread"] * 5  # Fetching inline, the thread parked.
  time.sleep(0.05)  # A step: the consumer no longer fetches for itself.
  start = time.monotonic()
  got.append(next(stage))
  assert time.monotonic() - start < 10.0
  assert fetched_by[15] == "builder"
  got.extend(stage)
  stage.close()
  assert got == list(range(30))
  assert not stage.thread.is_alive()


@pytest.mark.parametrize("ending", ["end", "build_error", "upstream_error", "close"])
def test_a_consumer_alone_keeps_order_and_ends_as_the_locked_path_does(ending):
  # 300 quick runs of one position (a run of three and a dropped position now
  # and then), no step: after the first runs the consumer fetches and builds
  # alone (`_solo_next`, no lock) and the thread stays parked. Whatever ends
  # the stream, the items are those before the ending, in order, each built
  # once, and nothing after it.
  fetched_by, built_by = [], []
  block = None
  if ending == "close":
    block = {"from": 250, "blocked": threading.Event(), "release": threading.Event()}

  def build(read, step, sig, batch_size):
    if ending == "build_error" and read == 250:
      raise ValueError("build failed at 250")
    built_by.append((read, threading.current_thread().name))
    return None if step == "drop" else read

  runs = _mixed_runs(fetched_by, 300, fail_upstream=ending == "upstream_error", block=block)
  stage = build_stage.BuildStage(runs, build, buffer_size=2, name="builder", inline_fetch=True)
  got, raised, solo_seen = [], [], []

  def consume():
    try:
      for item in stage:
        got.append(item)
        solo_seen.append(stage._solo)
    except (ValueError, KeyError) as e:
      raised.append(e)

  consumer = threading.Thread(target=consume, name="consumer")
  consumer.start()
  if block is not None:
    assert block["blocked"].wait(10)
    stage.close()  # From this thread, while the consumer reads position 250 alone.
    block["release"].set()
  consumer.join(20)
  assert not consumer.is_alive()
  stage.close()
  end = 250 if ending in ("build_error", "close") else 300
  assert got == [p for p in range(end) if p % 5 != 4]
  # Each built once, in order; a close drops the position read meanwhile.
  built = [p for p, _ in built_by]
  assert built == list(range(end + 1 if ending == "close" else end))
  # Alone except after a dropped position or a run of three (back under the
  # lock, then alone again from the next quick run on).
  assert sum(solo_seen[100:]) >= len(solo_seen[100:]) // 3
  assert all(name == "consumer" for name in fetched_by[100:])  # The thread stayed out.
  if ending == "build_error":
    assert [str(e) for e in raised] == ["build failed at 250"]
  elif ending == "upstream_error":
    assert [type(e) for e in raised] == [KeyError]
  else:
    assert raised == []
  assert next(stage, "done") == "done"
  assert not stage.thread.is_alive()


class _InFlight:
  """An item whose arrays are "ready" (transferred) only at `ready_at`."""

  def __init__(self, read, ready_at):
    self.read = read
    self.ready_at = ready_at

  def wait(self):
    time.sleep(max(0.0, self.ready_at - time.perf_counter()))


def _in_flight_build(built_by, build_s, transfer_s):
  def build(read, step, sig, size):
    built_by.append(threading.current_thread().name)
    time.sleep(build_s)  # The build returns before its transfer ends.
    return None if step == "drop" else _InFlight(read, time.perf_counter() + transfer_s)

  return build


@pytest.mark.parametrize(
  ("step_s", "thread_builds"),
  [
    (0.0, "few"),  # Waiting for the transfer only: nothing to build beside.
    (0.03, "most"),  # A step after the transfer: build ahead.
  ],
)
def test_time_spent_waiting_for_the_transfer_is_not_a_step(step_s, thread_builds):
  # A build returns before its transfer ends; a consumer that then waits for
  # the transfer (`block_until_ready`) is away from `__next__` for longer
  # than `AWAY_BUILDS` builds take, yet has no step to build beside: the
  # thread's build would only compete with the transfer for the cores (32 MB
  # batches: 0.80-0.86 of inline). Time away counts from when the item was
  # ready, seen by the thread through `wait_ready`.
  built_by = []
  stage = build_stage.BuildStage(
    _stage_runs(30, run_len=30),
    _in_flight_build(built_by, build_s=0.002, transfer_s=0.006),
    buffer_size=2,
    name="builder",
    wait_ready=_InFlight.wait,
  )
  got = []
  for item in stage:
    item.wait()  # The consumer's `block_until_ready`.
    got.append(item.read)
    time.sleep(step_s)
  stage.close()
  assert got == [p for p in range(30) if p % 5 != 4]
  by_thread = built_by.count("builder")
  assert len(built_by) == 30
  if thread_builds == "few":
    assert by_thread <= 5, built_by
  else:
    assert by_thread >= 20, built_by


def test_a_wait_ready_that_raises_counts_as_ready():
  # A donated (deleted) array raises in `block_until_ready`: nothing to wait
  # for, so the thread goes on building ahead beside the step.
  built_by = []

  def deleted(item):
    raise RuntimeError("Array has been deleted")

  stage = build_stage.BuildStage(
    _stage_runs(20, run_len=20),
    _in_flight_build(built_by, build_s=0.002, transfer_s=0.0),
    buffer_size=2,
    name="builder",
    wait_ready=deleted,
  )
  got = []
  for item in stage:
    got.append(item.read)
    time.sleep(0.03)
  stage.close()
  assert got == [p for p in range(20) if p % 5 != 4]
  assert built_by.count("builder") >= 14, built_by


def test_a_thread_with_a_full_buffer_is_woken_when_the_consumer_takes(monkeypatch):
  # With a step, the thread fills the buffer and parks; the consumer taking
  # an item must wake it to build the next. Before, it slept out `WAKE_S`
  # (50 ms; 60 s here) and the consumer built every batch after the first
  # buffer itself, each time in the step's path.
  monkeypatch.setattr(build_stage.prefetch, "WAKE_S", 60.0)
  built_by = []
  stage = build_stage.BuildStage(
    _stage_runs(30, run_len=30),
    _stage_build(built_by),
    buffer_size=2,
    name="builder",
  )
  got = []
  start = time.monotonic()
  for item in stage:
    got.append(item)
    time.sleep(0.01)
  stage.close()
  assert got == [p for p in range(30) if p % 5 != 4]
  assert time.monotonic() - start < 30.0
  assert sum(1 for _, name in built_by if name == "builder") >= 25, built_by
