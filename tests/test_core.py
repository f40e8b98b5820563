"""The agreement's cores driven directly: no thread, no clock, time advanced by hand.

As h11's `ConnectionPair` and aioquic's `roundtrip`: `Cores` wires N cores
(`decider.Decider`, `follower.Follower`) to one in-memory store through the
library's one `interpreter.carry`, each with a `Hand` world whose time
is the test's. A host steps until a wait in the store finds nothing (then the
next host steps), until it delivers its runs and ends. Every ending the core
decides has its test here: the agreed end and the wait at it, a close, a
stream a peer never started, two processes waiting crosswise, and the
lockstep core's stop, end and error (`Lockstepped`: the test all-gathers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from grain_jax_sync._src import messages, periods, plan, reader, sources
from grain_jax_sync._src.agreement import (
  common,
  core,
  decider,
  endings,
  interpreter,
  lockstep,
  streamed,
)
from grain_jax_sync._src.exchange import key_value
from grain_jax_sync._src.memory_store import MemoryStore

NS = "grain_jax_sync/core/1"
RULES = plan.Rules(batch_size=4, drop_last=False, pad=True)
# What a wait in the store that found nothing returns (`MemoryStore(wait=False)`), or one for a read.
EMPTY = {core.WaitChunk: [], core.WaitDecision: None, core.WaitAllReachedEnd: False, core.Take: []}


class Hand(interpreter.World):
  """One host's world with no thread: its reads from a list, the pair's time, the pair's looks.

  With a build thread (`Cores(threaded=True)`), its reading thread has read
  `at_hand` batches (all: None), each `Take` gets them in one run, and its build
  stage hands on what was delivered only when the core waits for it (`wait_build`).
  """

  def __init__(self, cores: Cores, p: int, sizes: list[int]):
    self.cores, self.p = cores, p
    rows = ({"x": np.full(n, 100 * p + b, np.int32)} for b, n in enumerate(sizes))
    self.reads = reader.Reader(sources.open_source(rows), process_index=p, check_int32=False)
    self.theirs: list[str] = []  # The streams a peer waits on, made and not started here.
    self.pre_ended: dict[str, str] = {}
    self.at_hand: int | None = None
    self.taken = self.delivered = self.done = 0  # Reads taken; positions delivered, handed on.

  def now(self) -> core.Now:
    return core.Now(self.cores.t, self.done, self.at_hand is None or self.taken < self.at_hand)

  def call(self, fn, *args):
    yield from ()
    return fn(*args)

  @property
  def threaded(self) -> bool:
    return self.cores.threaded

  def ask_reads(self, n):
    pass

  def next_read(self, wait_s):
    yield from ()
    if self.at_hand is not None and self.taken >= self.at_hand:
      return None
    self.taken += 1
    return next(self.reads)

  def wait_build(self, beyond):
    yield from ()
    self.done = self.delivered

  def pace(self) -> int:
    return self.cores.pace

  def dead(self, peer: int) -> bool:
    return peer in self.cores.dead

  def closed(self, peer: int) -> str | None:
    return self.cores.notes.get(peer)

  def crosswise(self, peer: int) -> list[str]:
    return self.theirs

  def pre_end(self, namespace: str, message: str) -> None:
    self.pre_ended[namespace] = message


class Cores:
  """N cores over one in-memory store, stepped by hand (`step`, `roundtrip`), time set by hand (`t`).

  `sizes`: per host, its batches' rows (default: `batches` of 4); `threaded`: with build threads.
  """

  def __init__(
    self,
    n: int,
    batches: int = 5,
    timeout_s: float = 100.0,
    *,
    sizes: list[list[int]] | None = None,
    rules: plan.Rules = RULES,
    lookahead: int | None = None,
    threaded: bool = False,
  ):
    self.t = 0.0
    self.threaded = threaded
    self.pace = 1  # The consumer takes a batch per `decide_ahead_s`: one position decided ahead.
    self.dead: set[int] = set()
    # Per host: what it wrote as it closed (`key_value.close_note`).
    self.notes: dict[int, str] = {}
    self.store = MemoryStore(wait=False)
    self.ex = [
      key_value.KeyValueExchange(self.store, NS, process_index=p, process_count=n) for p in range(n)
    ]
    sizes = sizes or [[4] * batches] * n
    self.world = [Hand(self, p, sizes[p]) for p in range(n)]
    who = [common.Identity(process=p, devices=1, config={"c": 1}, resume=0) for p in range(n)]
    self.cores = [
      decider.core_for(
        rules,
        who[p],
        threaded=threaded,
        namespace=NS,
        process_count=n,
        lookahead=lookahead,
        timeout_s=timeout_s,
        position=0,
      )
      for p in range(n)
    ]
    self.runners: list = list(self.cores)  # The main runs; `side` puts a side run in their place.
    self.results: list = [None] * n
    self.yielded = [[] for _ in range(n)]  # Per host: the values of the batches it yields.
    self.ended: list[core.Ended | None] = [None] * n

  def step(self, p: int, limit: int = 1000, until: type | None = None) -> Any:
    """Host p acts until a wait in the store finds nothing, it delivers a run (its consumer's turn), or it ends.

    Or until it carried out an action of type `until`, whose result its core is not told yet.
    The action it stopped at comes back.
    """
    for _ in range(limit):
      if self.ended[p] is not None:
        return self.ended[p]
      action = self.runners[p].send(self.results[p], self.world[p].now())
      self.results[p] = None
      if type(action) is core.Ended:
        self.ended[p] = action
      elif type(action) is core.Deliver:
        self.yielded[p] += _values(action.run)
        self.world[p].delivered += len(action.run.steps)
        return action
      else:
        self.results[p] = interpreter.blocking(interpreter.carry(action, self.ex[p], self.world[p]))
        if EMPTY.get(type(action), ...) == self.results[p] or type(action) is until:
          return action
    raise AssertionError(f"host {p} never waited")

  def roundtrip(self, rounds: int = 100) -> None:
    """Every host steps in turn until every one ended (or `rounds` pass)."""
    for _ in range(rounds):
      if all(e is not None for e in self.ended):
        return
      for p in range(len(self.cores)):
        self.step(p)

  def side(self, p: int, steps: core.Steps) -> None:
    """Host p runs `steps` (`at_end`) from here on, as a side run of its core."""
    self.runners[p], self.ended[p], self.results[p] = self.cores[p].side(steps), None, None

  def close(self, p: int, at_batch: int, *, left: bool = False) -> None:
    """Host p's ending, asked: its closing calls carried out as the driver does."""
    interpreter.best_effort(self.ex[p], self.cores[p].closing(at_batch, None, left=left))
    self.ended[p] = core.Ended(None)


def _values(run: common.Run) -> list[int | None]:
  """The first value of each batch a run yields (None: a dummy)."""
  return [
    None if read is None else int(read.batch.leaves[0][0])
    for read, s in run.steps
    if s.action == messages.Action.YIELD
  ]


def _error(ended: core.Ended | None) -> BaseException:
  assert ended is not None and ended.error is not None, ended
  return ended.error


def test_cores_agree_on_every_batch_and_wait_for_each_other_at_the_end():
  c = Cores(2, batches=5)
  c.roundtrip()
  assert c.ended == [core.Ended(None)] * 2
  assert c.yielded == [[0, 1, 2, 3, 4], [100, 101, 102, 103, 104]]
  assert all(x.reached_end for x in c.cores)
  # The wait at the agreed end: host 0 gets there first and waits for host 1.
  for p in (0, 1):
    c.side(p, c.cores[p].at_end())
  c.step(0)
  assert c.ended[0] is None  # Host 1 is not there yet.
  c.roundtrip()
  assert c.ended == [core.Ended(None)] * 2


def test_a_peer_that_never_reaches_the_end_times_out_once_the_hand_passes_the_timeout():
  c = Cores(2, batches=3, timeout_s=10.0)
  c.roundtrip()
  c.side(0, c.cores[0].at_end())
  c.step(0)
  c.t = 9.0
  c.step(0)
  assert c.ended[0] is None  # Not yet: time is the test's.
  c.t = 10.5
  c.step(0)
  error = _error(c.ended[0])
  assert isinstance(error, endings.PeerTimeoutError) and error.missing == (1,)
  assert "processes [1] did not reach the end of the stream (3 batches)" in str(error)


def test_a_peer_that_left_before_the_end_is_named_at_the_end():
  c = Cores(2, batches=3)
  c.roundtrip()
  c.close(1, 3, left=True)  # Its consumer closed before it received the end.
  c.side(0, c.cores[0].at_end())
  c.step(0)  # Posted that it got there; nobody else did.
  c.step(0)
  assert str(_error(c.ended[0])) == "process 1 closed its iterator at batch 3"


@pytest.mark.parametrize("closer", [0, 1])
def test_a_close_ends_the_peer_with_its_count(closer):
  c = Cores(2, batches=20)
  other = 1 - closer
  while len(c.yielded[closer]) < 2:
    c.step(0)
    c.step(1)
  at = len(c.yielded[closer])
  c.close(closer, at)
  c.roundtrip()
  error = _error(c.ended[other])
  assert isinstance(error, RuntimeError)
  assert f"process {closer} closed its iterator at batch {at}" in str(error)
  assert len(c.yielded[other]) >= at  # What was decided before the close reached it.


@pytest.mark.parametrize("closer", [0, 1])
def test_a_close_in_two_steps_decides_no_more_then_posts_its_count_once(closer):
  c = Cores(2, batches=20)
  while len(c.yielded[closer]) < 2:
    c.step(0)
    c.step(1)
  x = c.cores[closer]
  x.asked(core.CLOSING)  # From another thread, at once: the count is not known yet.
  assert x.close.awaited and x.ending() == []
  c.step(closer)
  assert c.ended[closer] == core.Ended(None)  # It decides no more.
  got = len(c.yielded[closer])
  x.asked(core.Closing(got))  # The consumer's call returned: its ending, with its count.
  x.asked(core.Closing(got + 5))  # A later one changes nothing.
  calls = x.ending()
  assert not x.close.awaited and calls and x.ending() == []  # Posted once.
  interpreter.best_effort(c.ex[closer], calls)
  c.roundtrip()
  assert f"process {closer} closed its iterator at batch {got}" in str(_error(c.ended[1 - closer]))


@pytest.mark.parametrize("resetter", [0, 1])
def test_a_restart_asked_as_a_post_returns_is_posted_after_it_and_raised_by_the_peer(resetter):
  # The agreement thread carried out a post and takes the restart (`reset()`)
  # before it tells its core the post's result: its ending goes after that
  # post, not over it (process 0's decision, read by the peer already).
  c = Cores(2, batches=20)
  other, post = 1 - resetter, (core.PostDecision, core.PostChunk)[resetter]
  while type(c.step(resetter, until=post)) is not post or not c.yielded[resetter]:
    c.step(other)
  got = len(c.yielded[other])
  c.step(other)  # The peer takes what was posted.
  assert resetter == 1 or len(c.yielded[other]) > got
  at, x = len(c.yielded[resetter]), c.cores[resetter]
  x.asked(core.Closing(at, endings.closed_error(resetter, at, "reset its iterator"), left=True))
  assert c.runners[resetter].send(c.results[resetter], c.world[resetter].now()) == core.ENDED
  interpreter.best_effort(c.ex[resetter], x.ending())
  c.ended[resetter] = core.Ended(None)
  # Then closed in the stream it restarted into, unstarted (`session.Streams.end`).
  c.notes[resetter] = key_value.close_note("grain_jax_sync/core/2", resetter, 0)
  c.roundtrip()
  assert str(_error(c.ended[other])) == f"process {resetter} reset its iterator at batch {at}"


@pytest.mark.parametrize("never", [0, 1])
def test_a_stream_a_peer_never_started_ends_with_its_ending_posted_there(never):
  c = Cores(2, batches=5)
  # Its iterator closed (or restarted) before its first next(): the ending of
  # the stream it never started, as `session.Streams.end` posts it.
  interpreter.best_effort(c.ex[never], streamed.unstarted(never, 2, None))
  c.ended[never] = core.Ended(None)
  c.roundtrip()
  error = _error(c.ended[1 - never])
  assert str(error) == f"process {never} closed its iterator at batch 2"
  assert c.yielded[1 - never] == []


def test_two_cores_waiting_crosswise_end_once_the_hand_passes_the_crosswise_wait():
  c = Cores(2, batches=5)
  theirs = "grain_jax_sync/other/1"
  c.world[0].theirs = [theirs]  # Process 1 waits at the start of a stream made here, not started.
  c.step(0)
  c.step(0)  # Idle: it looks at process 1's beat, crosswise from now.
  assert c.ended[0] is None
  c.t = streamed.CROSS_WAIT_S - 1
  c.step(0)
  assert c.ended[0] is None
  c.t = streamed.CROSS_WAIT_S + 1
  c.step(0)
  error = _error(c.ended[0])
  assert "neither has started the other's" in str(error)
  assert c.world[0].pre_ended == {theirs: str(error)}
  # Posted where process 1 waits too, as its first and final decision.
  other = key_value.KeyValueExchange(c.store, theirs, process_index=1, process_count=2)
  final = messages.Decision.from_json(other.try_decision(0))
  assert final.end == messages.Outcome.RAISE and final.error.message == str(error)


def test_a_dead_peer_is_named_once_its_beat_stopped():
  c = Cores(2, batches=5)
  c.step(0)
  c.step(0)
  c.dead.add(1)
  c.step(0)
  error = _error(c.ended[0])
  assert isinstance(error, endings.PeerLostError) and error.missing == (1,)


# A short batch is judged by whether it is its host's last (`plan.Rules.wait_for_last`).
SHORT_CASES = {
  "short_not_last": ([[24, 24, 24], [24, 16, 24]], plan.Rules(24, drop_last=True, pad=False)),
  "derived_drop": ([[24, 24, 24], [24, 24, 16]], plan.Rules(None, drop_last=True, pad=False)),
  "derived_pad": ([[24, 24, 24], [24, 24, 16]], plan.Rules(None, drop_last=False, pad=True)),
}


def _short_cores(case: str, lookahead: int = 2) -> Cores:
  sizes, rules = SHORT_CASES[case]
  rules = dataclasses.replace(rules, wait_for_last=True)
  return Cores(2, sizes=sizes, rules=rules, lookahead=lookahead, threaded=True)


@pytest.mark.parametrize("reads", ["in_a_run", "one_by_one"])
@pytest.mark.parametrize("case", sorted(SHORT_CASES))
def test_a_short_read_that_fills_the_read_ahead_is_judged_by_the_next_whatever_the_build_holds(
  case, reads
):
  # Process 1's build stage hands nothing on meanwhile (its consumer is in a step).
  if reads == "in_a_run":
    # The hang of test_padding's size cases at prefetch 2: the follower's reading thread hands
    # it its reads in one run (the short one last, filling a read-ahead of 2); process 0 decides
    # the positions before it and waits to know whether the short one is the last, its news of
    # the peers old by then (it reads them again before posting).
    c = _short_cores(case)
    c.step(1)
    c.t = common.FOLLOWER_GRACE_S
    c.roundtrip()
  else:
    # A read at a time, three ahead: the read after the short one, taken, is posted at once.
    c = _short_cores(case, lookahead=3)
    c.pace = 3
    c.world[1].at_hand = 0
    for _ in range(20):
      c.world[1].at_hand += 1
      c.step(0)
      c.step(1)
  if case == "short_not_last":
    errors = [_error(e) for e in c.ended]
    want = "process 1, batch 1: 16 rows, fewer than the full batch size 24"
    assert all(isinstance(e, ValueError) and want in str(e) for e in errors), errors
    assert c.yielded == [[0], [100]]
  else:  # Its last batch: dropped, or padded with the mask.
    assert c.ended == [core.Ended(None)] * 2
    last = 3 if case == "derived_pad" else 2
    assert c.yielded == [[0, 1, 2][:last], [100, 101, 102][:last]]


def test_a_position_every_host_read_is_decided_though_the_next_read_of_a_peer_never_comes():
  # Process 1's source stalls after its short batch: the position before it is decided all the
  # same (a stuck read holds up only the positions it has not read), though process 0 read the
  # peers' posts again between its plan and the decision.
  c = _short_cores("short_not_last")
  c.world[1].at_hand = 2  # In one run.
  c.step(1)
  c.t = common.FOLLOWER_GRACE_S
  for _ in range(5):
    c.step(0)
    c.step(1)
  assert c.yielded == [[0], [100]] and c.ended == [None, None]


def _read(p: int, b: int) -> core.Read:
  """Process p's batch b of 4 rows, as its reader reads it."""
  rows = iter([{"x": np.full(4, 100 * p + b, np.int32)}])
  read = next(reader.Reader(sources.open_source(rows), process_index=p, check_int32=False))
  assert isinstance(read, core.Read)
  return read


def test_own_reads_count_what_the_reading_thread_was_asked_and_measure_a_run_that_ends():
  own = common.OwnReads(lookahead=None, threaded=True, inline=False)
  own.batch_size = 4
  steps = own.read()
  assert next(steps) == core.Take(2, 0.0, ask=2)  # A horizon of 1, two ahead with a build thread.
  with pytest.raises(StopIteration):
    steps.send([])  # None came yet.
  steps = own.read()
  assert next(steps) == core.Take(2, 0.0, ask=0)  # Asked already, not taken: asked no more.
  assert steps.send([_read(0, 0)]) is core.PACE
  with pytest.raises(StopIteration):
    steps.send(5)
  assert own.asked == 1 and own.limit == 5
  steps = own.read()
  assert next(steps) == core.Take(9, 0.0, ask=8)  # Two horizons ahead, less the one it holds.
  # The stream's end in the run of its last reads: the horizon is measured for them too.
  assert steps.send([_read(0, 1), _read(0, 2), core.End(3)]) is core.PACE
  with pytest.raises(StopIteration):
    steps.send(2)
  assert own.limit == 2 and own.end == core.End(3) and own.count == 3


def _rows(p: int, batches: int, fail: bool = False):
  for b in range(batches):
    yield {"x": np.full(4, 100 * p + b, np.int32)}
  if fail:
    raise ValueError(f"bad row on process {p}")


class Lockstepped(interpreter.World):
  """N lockstep cores stepped by hand: reads through `interpreter.carry`, the window's exchange by the test."""

  def __init__(self, batches: list[int], window: int = 1, fail: int | None = None):
    n = len(batches)
    self.reads = [
      reader.Reader(sources.open_source(_rows(p, b, p == fail)), process_index=p, check_int32=False)
      for p, b in enumerate(batches)
    ]
    self.cores = [
      lockstep.Lockstep(
        RULES,
        common.Identity(process=p, devices=1, config={"c": 1}, resume=0),
        process_count=n,
        window=window,
        position=0,
      )
      for p in range(n)
    ]
    self.results: list = [None] * n
    self.texts: dict[int, str] = {}  # The window's reports, as each host hands its own in.
    self.actions: list[list[type]] = [[] for _ in range(n)]
    self.yielded: list[list[int | None]] = [[] for _ in range(n)]
    self.ended: list[core.Ended | None] = [None] * n
    self._p = 0

  def read_window(self, count: int) -> list:
    out = []
    while len(out) < count and not (out and isinstance(out[-1], core.End)):
      out.append(next(self.reads[self._p]))
    return out

  def step(self, p: int) -> None:
    """Host p acts until it delivers a run, hands its report in for the window's exchange, or ends."""
    self._p = p
    while self.ended[p] is None and p not in self.texts:
      action = self.cores[p].send(self.results[p])
      self.results[p] = None
      self.actions[p].append(type(action))
      if type(action) is core.Ended:
        self.ended[p] = action
      elif type(action) is core.AllGather:
        self.texts[p] = action.text
      elif type(action) is core.Deliver:
        self.yielded[p] += _values(action.run)
        return
      else:
        self.results[p] = interpreter.blocking(interpreter.carry(action, None, self))

  def window(self) -> None:
    """Every host steps; once all handed their report in, the exchange answers each."""
    for p in range(len(self.cores)):
      self.step(p)
    if len(self.texts) == len(self.cores):  # The collective holds every host until then.
      for p in self.texts:
        self.results[p] = [self.texts[q] for q in sorted(self.texts)]
      self.texts = {}

  def run(self, windows: int = 100) -> None:
    for _ in range(windows):
      if all(e is not None for e in self.ended):
        return
      self.window()


def test_lockstep_alone_stops_before_its_next_window_with_one_read_per_window():
  c = Lockstepped([10])
  c.window()
  c.window()
  assert c.yielded == [[0, 1]]
  # One process: a read and a run per window, no exchange.
  assert c.actions[0] == [core.ReadWindow, core.Deliver] * 2
  c.cores[0].stop_asked(2)
  c.window()
  assert c.ended == [core.Ended(None)] and c.yielded == [[0, 1]]
  assert c.cores[0].stop_requested_by == 0


def test_lockstep_alone_ends_at_the_end_of_its_source():
  c = Lockstepped([3])
  c.run()
  assert c.ended == [core.Ended(None)] and c.yielded == [[0, 1, 2]]
  assert c.cores[0].stop_requested_by is None


@pytest.mark.parametrize("asker", [0, 1])
def test_lockstep_cores_stop_together_before_the_window_after_the_ask(asker):
  c = Lockstepped([20, 20], window=2)
  c.window()  # The first window's reports exchanged,
  c.window()  # and delivered: each host's next step starts the second window.
  assert c.yielded == [[0, 1], [100, 101]]
  c.cores[asker].stop_asked(2)
  c.run()
  assert c.ended == [core.Ended(None)] * 2
  assert c.yielded == [[0, 1], [100, 101]]
  assert [x.stop_requested_by for x in c.cores] == [asker, asker]


def test_lockstep_cores_raise_one_hosts_source_error_on_every_host():
  c = Lockstepped([10, 3], window=2, fail=1)
  c.run()
  errors = [_error(e) for e in c.ended]
  assert all("bad row on process 1" in str(e) for e in errors), errors
  assert c.yielded == [[0, 1, 2], [100, 101, 102]]  # Every batch before the error, on both.


@pytest.mark.parametrize("waiter", [0, 1])
def test_a_wait_in_the_store_ends_at_the_cores_next_deadline_and_the_timeout_fires_there(waiter):
  c = Cores(2, batches=5, timeout_s=10.0)
  # Process 0 waits for process 1's rows, or process 1 for process 0's decision; the other never comes.
  limit = 10.0 if waiter == 0 else 10.0 + common.FOLLOWER_GRACE_S
  c.step(waiter)
  # A liveness period: the beats are looked at again then.
  assert c.cores[waiter].timer == pytest.approx(periods.LIVENESS_PERIOD_S)
  c.t = limit - 0.25
  c.step(waiter)
  assert c.cores[waiter].timer == pytest.approx(limit)  # Its deadline, not a liveness period later.
  c.t = c.cores[waiter].timer  # The driver waits until then, and no longer.
  c.step(waiter)
  if waiter == 1:  # It gave up: its timed-out ending posted, it waits a grace more for process 0.
    assert c.cores[1].timer == pytest.approx(limit + periods.LIVENESS_PERIOD_S)
    c.t = limit + common.FOLLOWER_GRACE_S
    c.step(1)
  error = _error(c.ended[waiter])
  assert isinstance(error, endings.PeerTimeoutError), error
