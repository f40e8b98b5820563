"""A simulated cluster: N hosts' real agreement cores over the real `KeyValueExchange` on an
in-memory store; their threads are tasks of a discrete-event scheduler (virtual time, no thread).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from grain_jax_sync._src import liveness, memory_store, messages, periods, reader, sources, stats
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.agreement import common, core, decider, interpreter
from grain_jax_sync._src.exchange import key_value

INF = math.inf
_NS = "grain_jax_sync/sim/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostPlan:
  """What one simulated host does, in virtual seconds.

  A "batch" counts the batches its loop received (dummies included), from 1;
  times are seconds >= 0. A plan that cannot happen raises `ValueError`
  (from `SimulatedCluster.run` for a batch past the longest shard's last).

  Attributes:
    batches: Batches in its shard (then its source is exhausted).
    rows: Rows of each batch.
    step_s: Its training step after each batch (`SimulatedCluster.collective_steps`).
    read_s: Each read of its source.
    stall: ``(read, seconds)``: its source's read `read` (from 0; `batches`
      finds it exhausted) takes this long (alive).
    error_at: Its source raises `error` (default: an `OSError`) when asked for
      batch `error_at` (from 0, below `batches`).
    error: What its source raises.
    refused: Its state was refused (`set_state`): this `ValueError` text is its ending.
    stop: ``(batch, seconds)``: `request_stop()` this long into the step after
      that batch; batch 0: this long after `start_s`.
    pause: ``(batch, seconds)``: its loop pauses this long after that batch's step (alive).
    close_at: `close()` instead of its next call once it received this many batches.
    close_s: `close()` from another thread at this time.
    kill_at: The process dies at this time (its beat stops).
    start_s: Its first `next()` (its stream's start) at this time.
    resume: The batch of the job its restored state resumes from.
    config: Its settings, as its first report carries them.
    sync_timeout_s: Its own `sync_timeout_s`, if not the cluster's.
  """

  batches: int = 20
  rows: int = 8
  step_s: float = 0.05
  read_s: float = 0.0
  stall: tuple[int, float] | None = None
  error_at: int | None = None
  error: BaseException | None = None
  refused: str | None = None
  stop: tuple[int, float] | None = None
  pause: tuple[int, float] | None = None
  close_at: int | None = None
  close_s: float | None = None
  kill_at: float | None = None
  start_s: float = 0.0
  resume: int = 0
  config: Any = None
  sync_timeout_s: float | None = None

  # The fields that count (a pair's first), and those in seconds (a pair's second).
  _COUNTS = ("batches", "resume", "close_at", "error_at", "rows", "stall", "stop", "pause")
  _TIMES = ("step_s", "read_s", "close_s", "kill_at", "start_s", "stall", "stop", "pause")

  def __post_init__(self) -> None:
    for name in self._COUNTS:
      least = 1 if name in ("rows", "pause") else 0
      given = getattr(self, name)
      value = given[0] if isinstance(given, tuple) else given
      if value is not None and (not isinstance(value, int | np.integer) or value < least):
        raise ValueError(f"`{name}` must be an int >= {least}, got {given!r}")
    for name in self._TIMES:
      given = getattr(self, name)
      value = given[1] if isinstance(given, tuple) else given
      if value is not None and not 0 <= value < INF:
        raise ValueError(f"`{name}` must be a finite number of seconds >= 0, got {given!r}")
    if self.error_at is not None and self.error_at >= self.batches:
      raise ValueError(
        f"`error_at` must be below `batches` ({self.batches}): its source never reads"
        f" batch {self.error_at}, got {self.error_at}"
      )
    if self.stall is not None and self.stall[0] > self.batches:
      raise ValueError(
        f"`stall` must name a read <= `batches` ({self.batches}), got {self.stall!r}"
      )


@dataclasses.dataclass
class HostOutcome:
  """How one simulated host ended.

  Attributes:
    process_index: Its index (as `ProcessOutcome.process_index`).
    received: Virtual times at which its consumer received each batch.
    ending: "end" (the agreed end or stop), "closed", "killed", or the
      error's type name; None if it had not ended by `until_s`.
    message: The error's message, if any.
    ended_at: When its consumer saw the ending (`math.inf` if it did not).
    stopped_by: The process whose stop ended the stream, if one did.
    resume: The batch its restored state resumed from (`HostPlan.resume`).
  """

  process_index: int
  received: list[float] = dataclasses.field(default_factory=list)
  ending: str | None = None
  message: str = ""
  ended_at: float = INF
  stopped_by: int | None = None
  resume: int = 0

  @property
  def batches(self) -> int:
    """The batch its checkpoint would name (``get_state()["batches"]``): `resume` plus those received."""
    return self.resume + len(self.received)


Wait = tuple[Any, float]  # (channel or None, deadline): resumed with True if signalled.
Task = Generator[Wait, bool, None]


class _Clock:
  """The discrete-event scheduler: tasks park on a channel and a deadline.

  A timeout runs after what else happens at its instant (a real wait starts a
  little after what started it); a store's (its channel a key) after a local
  queue's (its answer comes back a round trip later).
  """

  def __init__(self) -> None:
    self.now = 0.0
    self._heap: list[tuple[float, int, int, Any, int, bool]] = []
    self._order = itertools.count()
    self._parked: dict[Any, list[tuple[Any, int]]] = collections.defaultdict(list)
    self._turn: dict[int, int] = {}  # Per task: its current wait.
    self.dead: set[int] = set()  # Tasks that are never resumed again.

  def spawn(self, task: Task, at: float = 0.0) -> None:
    self._turn[id(task)] = 0
    heapq.heappush(self._heap, (at, 0, next(self._order), task, 0, False))

  def signal(self, channel: Any) -> None:
    for task, turn in self._parked.pop(channel, ()):
      heapq.heappush(self._heap, (self.now, 0, next(self._order), task, turn, True))

  def run(self, until: float) -> None:
    while self._heap and self._heap[0][0] <= until:
      t, _, _, task, turn, signalled = heapq.heappop(self._heap)
      if id(task) in self.dead or self._turn.get(id(task)) != turn:
        continue
      self.now = max(self.now, t)
      try:
        channel, deadline = task.send(signalled) if turn else next(task)
      except StopIteration:
        self._turn.pop(id(task), None)
        continue
      turn = self._turn[id(task)] = turn + 1
      if channel is not None:
        self._parked[channel].append((task, turn))
      if deadline < INF:
        # A timeout: after what happens at that instant; a store's after a queue's.
        late = 0 if channel is None else 2 if isinstance(channel, str) else 1
        heapq.heappush(self._heap, (deadline, late, next(self._order), task, turn, False))


class _Queue:
  """A stage's buffer: `slots` taken before producing, as `prefetch.Prefetcher` does."""

  def __init__(self, clock: _Clock, size: int):
    self._clock, self.free, self.items = clock, size, collections.deque[Any]()

  def take_slot(self) -> Iterator[Wait]:
    while self.free == 0:
      yield (("slot", id(self)), INF)
    self.free -= 1

  def put(self, item: Any) -> None:
    self.items.append(item)
    self._clock.signal(("item", id(self)))

  def get(self) -> Generator[Wait, bool, Any]:
    while not self.items:
      yield (("item", id(self)), INF)
    self.free += 1
    self._clock.signal(("slot", id(self)))
    return self.items.popleft()


class _Host(interpreter.World):
  """One host: its core, the real exchange over the shared store, its stages spawned as tasks; the
  core's world in virtual time (`interpreter.World`), where `interpreter.drive`'s waits park."""

  def __init__(self, cluster: SimulatedCluster, p: int, plan: HostPlan):
    self.c, self.p, self.plan, self.clock = cluster, p, plan, cluster.clock
    self.out = HostOutcome(p, resume=plan.resume)
    self.ex = key_value.KeyValueExchange(
      cluster.store, _NS, process_index=p, process_count=cluster.processes
    )
    config = {"sim": 1} if plan.config is None else plan.config
    self.threaded = cluster.prefetch_batches > 0
    self.core = decider.core_for(
      plan_lib.Rules(batch_size=plan.rows, drop_last=False, pad=True, wait_for_last=True),
      common.Identity(process=p, devices=1, config=config, resume=plan.resume),
      namespace=_NS,
      process_count=cluster.processes,
      lookahead=cluster.synchronize_lookahead,
      timeout_s=plan.sync_timeout_s or cluster.sync_timeout_s,
      position=plan.resume,
      threaded=self.threaded,
    )
    refused = None if plan.refused is None else ValueError(plan.refused)
    self.reads = reader.Reader(
      sources.open_source(self._source()), process_index=p, check_int32=False, start_error=refused
    )
    self.done = self.asked = self.reading = 0  # Positions built; reads asked for, not made; made.
    self.pace_of = stats.Pace(cluster.decide_ahead_s, cluster.prefetch_batches)
    self.read_q = collections.deque[Any]()  # Reads made by the reading task, not taken.
    self.busy = False  # The core's turn is held (`driver.Driver.turn`).
    self.reached_end = False  # As `session.Stream.reached_end`.
    self.unacked: tuple[Any, Any] | None = None  # A store call's result on its way back.
    self.live = liveness.Liveness(self, clock=lambda: self.clock.now)  # Peers' beats: `beat_of`.
    items, stages = None, []  # Inline: the training loop's `next()` drives the core.
    if self.threaded:  # The reading, agreement and build threads.
      runs, items = _Queue(self.clock, 1), _Queue(self.clock, cluster.prefetch_batches)
      stages = [self.reading_task(), self.agree_task(runs), self.build_task(runs, items)]
    self.all = [*stages, self.consumer_task(items), self.timed_task()]
    for task in self.all[:-1]:  # Its stream starts at its first next().
      self.clock.spawn(task, plan.start_s)
    self.clock.spawn(self.all[-1])
    if plan.stop is not None and plan.stop[0] == 0:  # Asked before its first batch.
      self.clock.spawn(self._stop_task(), plan.start_s + plan.stop[1])

  def _source(self) -> Iterator[dict[str, np.ndarray]]:
    for b in range(self.plan.batches):
      if b == self.plan.error_at:
        raise self.plan.error or OSError(f"process {self.p}'s source failed at batch {b}")
      yield {"x": np.full(self.plan.rows, 1000 * self.p + b, np.int32)}

  def read(self) -> Generator[Wait, bool, Any]:
    stall = self.plan.stall
    read_s = stall[1] if stall is not None and stall[0] == self.reading else self.plan.read_s
    yield (None, self.clock.now + read_s)
    self.reading += 1
    return next(self.reads)

  def drive(self, runner: Any = None) -> Generator[Wait, bool, Any]:
    """Runs the core (or `runner`, a side run) to its next run, or its ending as an item: a
    `StopIteration` at the agreed end or stop, else the error."""
    self.runner: Any = runner or self.core  # Its store calls' results go back to it (`call`).
    action = yield from interpreter.drive(self.runner, self.ex, self)
    if type(action) is core.Deliver:
      return action.run
    return StopIteration() if action.error is None else action.error

  # -- the core's world in virtual time (`interpreter.World`) --------------------------

  def now(self) -> core.Now:
    return core.Now(self.clock.now, self.done, bool(self.read_q) or not self.threaded)

  def call(self, fn: Any, *args: Any) -> Generator[Wait, bool, Any]:
    self.c.store.missed, ops, runner = None, self.ex.ops, self.runner
    result = fn(*args)
    key = self.c.store.missed  # A blocking read in the call found nothing: park on its key.
    # A wait ends at the core's next deadline (the action's `wait_s`).
    if key is not None and (yield (key, self.clock.now + args[-1].wait_s)):
      ops += 1  # Answered once the key is set: one call of the client.
      result = fn(*args)
    # Each client call is a round trip: its effect lands at once, its result comes back later.
    calls = self.ex.ops - ops
    if calls and self.c.store_s > 0:
      self.unacked = (runner, result)
      yield (None, self.clock.now + calls * self.c.store_s)
      self.unacked = None
    return result

  def ask_reads(self, n: int) -> None:
    self.asked += n
    self.clock.signal(("ask", self.p))

  def next_read(self, wait_s: float) -> Generator[Wait, bool, Any]:
    if not self.threaded:
      return (yield from self.read())
    if not self.read_q and wait_s > 0:
      yield (("read", self.p), self.clock.now + wait_s)
    return self.read_q.popleft() if self.read_q else None

  def wait_build(self, beyond: int) -> Generator[Wait, bool, Any]:
    if self.done <= beyond:
      yield (("built", self.p), self.clock.now + periods.LIVENESS_PERIOD_S)

  def pace(self) -> int:
    return self.pace_of.count(self.clock.now)

  def dead(self, peer: int) -> bool:
    return self.live.dead(peer)

  def beat_of(self, peer: int) -> float:
    """`peer`'s beat as its key reads now: one a period while alive (`liveness.Beat`)."""
    out, now = self.c.hosts[peer].out, self.clock.now
    return (min(now, out.ended_at) if out.ending == "killed" else now) // periods.LIVENESS_PERIOD_S

  def closed(self, peer: int) -> str | None:
    host = self.c.hosts[peer]  # One stream everywhere.
    if host.out.ending != "closed":
      return None
    return key_value.close_note(_NS, peer, host.out.batches)

  def reading_task(self) -> Task:
    item = None
    while not isinstance(item, core.End):
      while not self.asked:
        yield (("ask", self.p), INF)
      self.asked -= 1
      item = yield from self.read()
      self.read_q.append(item)
      self.clock.signal(("read", self.p))

  def agree_task(self, runs: _Queue) -> Task:
    item = None
    while not isinstance(item, BaseException):
      yield from runs.take_slot()
      self.busy = True
      item = yield from self.drive()
      self.busy = False
      runs.put(item)

  def build_task(self, runs: _Queue, items: _Queue) -> Task:
    """A slot, then the next position's batch (a drop takes none); each position counted done."""
    steps: collections.deque[Any] = collections.deque()
    yield from items.take_slot()
    while True:
      while not steps:
        run = yield from runs.get()
        if isinstance(run, BaseException):
          items.put(run)
          return
        steps.extend(s for _, s in run.steps)
      step = steps.popleft()
      # The agreement thread goes on while this position is built: it finds it not built yet.
      yield (None, self.clock.now)
      if step.action == messages.Action.YIELD:
        items.put(step)
        yield from items.take_slot()
      self.done += 1  # A drop at once; a batch once the build resumes (as `build.Builder` counts).
      self.pace_of.done(self.clock.now)
      self.clock.signal(("built", self.p))

  def consumer_task(self, items: _Queue | None) -> Task:
    """A batch, a step, and what the plan asks of this host."""
    clock, plan, received = self.clock, self.plan, self.out.received
    inline: collections.deque[Any] = collections.deque()
    turn = not self.threaded  # Inline, `next()` holds the core's turn.
    while plan.close_at != len(received):
      self.busy = self.busy or turn
      item = yield from self._next(items, inline)
      if isinstance(item, StopIteration) and self.core.reached_end:  # As `session.Stream`.
        self.reached_end = True
        item = yield from self.drive(self.core.side(self.core.at_end()))
      self.busy = self.busy and not turn
      if isinstance(item, StopIteration):
        return self._end("end", by=self.core.stop_requested_by)
      if isinstance(item, BaseException):
        return self._end(type(item).__name__, str(item), post=True)
      received.append(clock.now)
      if plan.stop is not None and plan.stop[0] == len(received):
        clock.spawn(self._stop_task(), clock.now + plan.stop[1])
      yield from self.c.enter_step(len(received))
      pause = plan.pause[1] if plan.pause is not None and plan.pause[0] == len(received) else 0.0
      yield (None, clock.now + plan.step_s + pause)
    self._end("closed", post=True)

  def _next(self, items: _Queue | None, inline: collections.deque[Any]) -> Any:
    if items is not None:
      return (yield from items.get())
    if self.out.received:  # The builder counts a position handed on once the next call comes.
      self.pace_of.done(self.clock.now)
    while not inline:
      run = yield from self.drive()
      if isinstance(run, BaseException):
        return run
      for _, step in run.steps:
        if step.action == messages.Action.YIELD:
          inline.append(step)
        else:  # A drop, at once.
          self.pace_of.done(self.clock.now)
    return inline.popleft()

  def _stop_task(self) -> Task:
    self.core.stop_asked(self.out.batches)  # As `request_stop` does: the resume counts.
    self.clock.signal(("read", self.p))  # The nudge: a wait for a read returns at once.
    if not self.busy and self.core.stop_pending():
      yield from self.drive(self.core.side(self.core.stop_now()))

  def timed_task(self) -> Task:
    """A `close()` from another thread (`close_s`), or the process's death (`kill_at`)."""
    close_s, kill_at = (INF if t is None else t for t in (self.plan.close_s, self.plan.kill_at))
    yield (None, min(close_s, kill_at))
    self._end("closed" if close_s < kill_at else "killed", post=close_s < kill_at)

  def _end(self, ending: str, message: str = "", by: Any = None, post: bool = False) -> None:
    """Records this host's ending and retires its tasks; with `post`, posts it for the peers."""
    self.out.ending, self.out.message, self.out.stopped_by = ending, message, by
    self.out.ended_at = self.clock.now
    self.clock.dead.update(id(t) for t in self.all)  # Its threads joined, or its process gone.
    if not post:
      return
    # As `close()` asks it (decide no more); `left` as `session.Stream.left` (an error is no close).
    left = ending == "closed" and not self.reached_end  # Peers waiting at the end are told.
    self.core.asked(core.Closing(self.out.batches, left=left))
    if self.unacked is not None:  # Told first (`core.Side`): its ending goes after what it posted.
      self.unacked[0].send(self.unacked[1], self.now())
    interpreter.best_effort(self.ex, self.core.ending())


@dataclasses.dataclass(kw_only=True)
class SimulatedCluster:
  """N hosts' real agreement cores over one in-memory store, in virtual time.

  Example::

    cluster = SimulatedCluster(processes=64, prefetch_batches=2)
    plans = [HostPlan(batches=50, step_s=2.0)] * 64
    plans[5] = HostPlan(batches=50, step_s=2.0, stop=(3, 0.5))  # A SIGTERM on host 5.
    outcomes = cluster.run(plans)
    assert {o.batches for o in outcomes} == {outcomes[0].batches}

  Attributes:
    processes: Hosts.
    prefetch_batches: As the iterator's, and its default (0: inline).
    decide_ahead_s: As the iterator's, and its default.
    sync_timeout_s: As the iterator's.
    synchronize_lookahead: As the iterator's.
    store_s: Each store call's round trip: its effect lands at once, its result reaches the core
      this much later.
    collective_steps: Each host's step after batch k is a collective (a cross-host reduction): it
      ends `step_s` after the last host entered it, so a slow, paused, closed or killed host holds
      the others (one that never enters holds them to `until_s`: their `ending` stays None).
      False: each host steps on its own.
  """

  processes: int
  prefetch_batches: int = options_lib.Options.prefetch_batches
  decide_ahead_s: float = options_lib.Options.decide_ahead_s
  sync_timeout_s: float = 60.0
  synchronize_lookahead: int | None = None
  store_s: float = 0.0
  collective_steps: bool = True

  def enter_step(self, k: int) -> Iterator[Wait]:
    """A host enters its step after batch `k`: a collective returns once every host entered it."""
    if not self.collective_steps:
      return
    entered = self._entered[k] = self._entered.get(k, 0) + 1
    if entered == self.processes:
      del self._entered[k]
      self.clock.signal(("step", k))
    else:
      yield (("step", k), INF)  # Held by a peer that never enters it, as JAX's collective holds.

  def run(self, plans: list[HostPlan], *, until_s: float = 3600.0) -> list[HostOutcome]:
    """Runs every host to its ending (or `until_s` of virtual time); their outcomes."""
    if len(plans) != self.processes:
      raise ValueError(f"`plans` must have {self.processes} entries, got {len(plans)}")
    last = max(p.resume + p.batches for p in plans) - min(p.resume for p in plans)
    for plan in plans:  # A batch it names past the job's last.
      for name, at in (("stop", plan.stop), ("pause", plan.pause), ("close_at", plan.close_at)):
        at = at[0] if isinstance(at, tuple) else at
        if at is not None and at > last:
          raise ValueError(
            f"`{name}` names batch {at}, past the job's last ({last}, the longest shard):"
            f" its loop never gets there, got {getattr(plan, name)!r}"
          )
    self.clock = _Clock()
    self._entered: dict[int, int] = {}  # Per collective step: the hosts that entered it.
    self.store = memory_store.MemoryStore(self.clock.signal, wait=False)
    self.hosts = [_Host(self, p, plan) for p, plan in enumerate(plans)]
    self.clock.run(until_s)
    return [h.out for h in self.hosts]

  @property
  def store_ops(self) -> int:
    """Calls of the in-memory store in the last `run`, every host's."""
    return self.store.ops
