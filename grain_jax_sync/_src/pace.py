"""The build stage's pace: when the consumer works itself and when the thread does.

`build_stage.BuildStage` is the mechanism (a lock, the pending and ready
queues, the thread); `Pace` is its policy, from moving averages of what it
timed: a build, a fetch (CPU and waiting, per position) and the consumer's
time away from `__next__` (its training step). Written by whichever of the
consumer and the thread holds the stage's lock, or by the consumer alone
while it fetches and builds alone. The tuning numbers below were measured on
the 2-core machine of `benchmarks/RESULTS.md` (docs/performance.md).
"""

from __future__ import annotations

import time

# The build thread builds ahead only while the consumer is away from
# `__next__` (in its training step) for longer than AWAY_BUILDS builds take,
# now and on average (moving averages with weight BUILD_S_WEIGHT; a build is
# taken to cost BUILD_S_START until one is timed). A consumer that comes
# straight back (no step to hide behind) builds every batch itself: no
# hand-off, and every buffer is allocated and freed by one thread. Measured on
# 2 cores, 1 process x 8 devices, no step: with the thread building whenever
# it had a decided position, the consumer waited for the thread's build in 42%
# of its calls (1.5 ms each) at 0.8 MB batches (0.61 of the bare loop); with a
# grace of one build (no average), 32 MB batches still went to the thread
# during the consumer's wait for the transfer and took 13x the page faults and
# 1.35x the CPU time of inline (allocations alternating between threads).
BUILD_S_WEIGHT = 0.2
BUILD_S_START = 0.001
AWAY_BUILDS = 2.0
# Time away counts from when the consumer's last item was ready (given
# `wait_ready`), not from when it left: a build returns before its transfer
# ends, and a consumer that waits for that transfer (`block_until_ready`,
# or a step that needs the batch) is not in a step the thread can build
# beside. Measured at 32 MB batches, no step (a build returns after 1.06 ms,
# its transfer ends 1.07 ms later): timed from the consumer's leaving, the
# thread built 1-10 of 40 batches beside the transfer and the loop ran at
# 0.80-0.86 of inline (both cores copying, twice the page faults).
# Where the stage may fetch decided runs in the consumer (`inline_fetch`: one
# process, no exchange to wait on), a consumer with nothing pending fetches
# the next run itself while a fetch is quick Python (moving averages per
# position: CPU time under INLINE_FETCH_S, time waiting (I/O, another
# process) under INLINE_WAIT_S), its builds are short (under INLINE_BUILD_S)
# and the consumer spends under AWAY_FETCH_S away from `__next__` on average:
# then the thread could only run the same Python under the GIL, plus a
# hand-off (measured: 28 us of thread CPU per 0.8 MB batch against about
# 10 us inline; prefetch / inline throughput 0.82-0.87 with the thread's
# reads, 0.94-0.96 with the consumer's). A long build spends its time in
# copies that release the GIL, so the thread's reads run beside it (8 MB
# batches: 0.99-1.01 with the thread's reads, 0.93-0.99 with the
# consumer's). A source that waits or computes longer, or a consumer with a
# training step to hide reads behind, is read in the thread.
INLINE_FETCH_S = 0.0002
INLINE_WAIT_S = 0.00002
# A longer build still counts as short where it moves under SLOW_BUILD_BPS
# bytes per second (given `read_bytes`): a build of many small leaves is
# Python under the GIL, not copies, so the thread's reads cannot run beside
# it. 64 float32 columns of (64, 16): 256 KB in about 10 ms (25 MB/s), with
# the thread's reads 0.93 of inline; 8 MB batches: 5 GB/s.
SLOW_BUILD_BPS = 200e6
# The consumer times one fetch in INLINE_FETCH_SAMPLE (the thread every one):
# its CPU clock is a system call (about 1 us, twice per fetch), which was a
# fifth of the stage's own cost per item (10.2 us, no JAX: 50,000 items).
INLINE_FETCH_SAMPLE = 4
INLINE_BUILD_S = 0.001
AWAY_FETCH_S = 0.001
# A consumer that fetches inline fetches and builds in one go (`build_stage.BuildStage._direct`)
# while builds average under DIRECT_BUILD_S: the thread can neither read nor
# build meanwhile, which costs nothing beside a short build but wasted a
# longer one's copies (they release the GIL, and the thread's reads ran beside
# them): 8 MB batches (builds of 1-1.5 ms, near INLINE_BUILD_S) went from
# 0.84-1.0 of inline to 0.44-0.87 with no such bound.
DIRECT_BUILD_S = 0.0005


class Pace:
  """Moving averages of the build stage's work, and the choices they make.

  Args:
    inline_fetch: Whether the consumer may fetch runs itself (no exchange to
      wait on).
  """

  def __init__(self, *, inline_fetch: bool):
    self.inline_fetch = inline_fetch
    self.build_s = BUILD_S_START  # A build's time.
    # Per fetched position: CPU time, and time spent waiting.
    self.fetch_s = 0.0
    self.wait_s = 0.0
    self.fetches = 0  # Fetches so far (the consumer's are timed 1 in INLINE_FETCH_SAMPLE).
    self.away_avg = 0.0  # The consumer's time away from `__next__` (its step).
    self.left_at = time.perf_counter()  # When it last left `__next__`.
    self.bytes = float("inf")  # A batch's bytes (given by the stage's first read).

  def left(self) -> None:
    """The consumer leaves `__next__` now."""
    self.left_at = time.perf_counter()

  def came_back(self) -> None:
    """Folds the consumer's time away from `__next__` (its step) into the average."""
    self.away_avg += BUILD_S_WEIGHT * (time.perf_counter() - self.left_at - self.away_avg)

  def built(self, seconds: float) -> None:
    self.build_s += BUILD_S_WEIGHT * (seconds - self.build_s)

  def count_fetch(self) -> bool:
    """Counts a fetch; whether to time it (the first, then one in `INLINE_FETCH_SAMPLE`)."""
    self.fetches += 1
    return self.fetches % INLINE_FETCH_SAMPLE == 1

  def fetched(self, t0: float, cpu0: float, positions: int) -> tuple[float, float]:
    """Updates the fetch averages (CPU and waiting, per position); returns (now, CPU now)."""
    now, cpu = time.perf_counter(), time.thread_time()
    n = max(1, positions)
    self.fetch_s += BUILD_S_WEIGHT * ((cpu - cpu0) / n - self.fetch_s)
    self.wait_s += BUILD_S_WEIGHT * (max(0.0, now - t0 - (cpu - cpu0)) / n - self.wait_s)
    return now, cpu

  def fetches_inline(self) -> bool:
    """Whether the consumer fetches quick runs itself (nothing to hide them behind).

    The first fetch is the consumer's: it waits for the first batch either
    way, and the fetch is timed, so that a slow source moves to the thread
    from the second read on.
    """
    if not self.inline_fetch:
      return False
    if self.fetches == 0:
      return True
    return (
      self.fetch_s < INLINE_FETCH_S
      and self.wait_s < INLINE_WAIT_S
      and (self.build_s < INLINE_BUILD_S or self.bytes < SLOW_BUILD_BPS * self.build_s)
      and self.away_avg < AWAY_FETCH_S
    )

  def builds_direct(self) -> bool:
    """Whether builds are short enough to fetch and build in one go."""
    return self.build_s < DIRECT_BUILD_S

  def grace(self) -> float:
    """How long the consumer must be away before the thread builds for it."""
    return AWAY_BUILDS * self.build_s

  def stepping(self) -> bool:
    """Whether the consumer is away longer than `grace()` on average (a training step)."""
    return self.away_avg >= self.grace()
