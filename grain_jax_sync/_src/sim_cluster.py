"""A simulated cluster: N hosts' real agreement cores, an in-memory store, a virtual clock.

Every host runs the library's own core (`agreement.decider.Decider` or
`agreement.follower.Follower`) over the real `KeyValueExchange`, whose client
is an in-memory store with the key-value store's semantics. What the threads
of a real host do (the reading thread, the agreement thread, the build thread,
the consumer's training step) are tasks of a discrete-event scheduler: a wait
is a task parked on a key, a queue or a deadline, and time moves only from one
event to the next. One process, no thread, deterministic: a bound in seconds
is checked in milliseconds, at any host count.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import liveness, messages, reader, sources, stats
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.agreement import common, core, decider, driver, follower

INF = math.inf
_NS = "grain_jax_sync/sim/1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostPlan:
  """What one simulated host does, in virtual seconds.

  Attributes:
    batches: Batches in its shard (then its source is exhausted).
    rows: Rows of each batch.
    step_s: Its training step, after each batch it receives.
    read_s: Each read of its source.
    stall: ``(batch, seconds)``: that read takes this long (the process is alive).
    error_at: Its source raises `error` (default: an `OSError`) at this batch.
    error: What its source raises.
    refused: Its state was refused (`set_state`): this `ValueError` text is its ending.
    stop: ``(batch, seconds)``: `request_stop()` this long into the step after that batch.
    pause: ``(batch, seconds)``: its loop pauses this long after that batch's step (alive).
    close_at: `close()` instead of its next call once it received this many batches.
    close_s: `close()` from another thread at this time.
    kill_at: The process dies at this time (its beat stops).
    start_s: Its first `next()` (its stream's start) at this time.
    resume: The batch its restored state resumes from.
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


@dataclasses.dataclass
class HostOutcome:
  """How one simulated host ended.

  Attributes:
    process: Its index.
    received: Virtual times at which its consumer received each batch.
    ending: "end" (the agreed end or stop), "closed", "killed", or the error's type name.
    message: The error's message, if any.
    ended_at: When its consumer saw the ending.
    stopped_by: The process whose stop ended the stream, if one did.
  """

  process: int
  received: list[float] = dataclasses.field(default_factory=list)
  ending: str | None = None
  message: str = ""
  ended_at: float = INF
  stopped_by: int | None = None

  @property
  def batches(self) -> int:
    return len(self.received)


class MemoryStore:
  """The key-value store's semantics in memory; a missing key read blocking raises at once.

  The scheduler parks the reader on that key (`missed`) until it is set or the slice ends.
  """

  def __init__(self, on_set: Callable[[str], None]):
    self._data: dict[str, str] = {}
    self._keys: list[str] = []  # Sorted: a directory is one slice.
    self._on_set = on_set
    self.ops = 0
    self.missed: str | None = None

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    self.ops += 1
    if key in self._data and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
    self._put(key, value)

  def _put(self, key: str, value: str) -> None:
    if key not in self._data:
      bisect.insort(self._keys, key)
    self._data[key] = value
    self._on_set(key)

  def _under(self, prefix: str) -> tuple[int, int]:
    """The slice of `_keys` that start with `prefix`."""
    start = bisect.bisect_left(self._keys, prefix)
    return start, bisect.bisect_left(self._keys, prefix + "\U0010ffff", start)

  def key_value_try_get(self, key: str) -> str:
    self.ops += 1
    if key not in self._data:
      raise RuntimeError(f"NOT_FOUND: key {key} not found")
    return self._data[key]

  def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
    del timeout_in_ms
    self.ops += 1
    if key not in self._data:
      self.missed = key
      raise RuntimeError(f"DEADLINE_EXCEEDED: timed out waiting for {key}")
    return self._data[key]

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    self.ops += 1
    start, stop = self._under(prefix)
    return [(k, self._data[k]) for k in self._keys[start:stop]]

  def key_value_delete(self, key: str) -> None:
    self.ops += 1
    self._data.pop(key, None)
    for sub in (key, key.rstrip("/") + "/"):
      start, stop = self._under(sub)
      if sub == key:  # The key itself, not its siblings that share its prefix.
        stop = start + (start < len(self._keys) and self._keys[start] == key)
      for k in self._keys[start:stop]:
        self._data.pop(k, None)
      del self._keys[start:stop]

  def key_value_increment(self, key: str, increment: int) -> int:
    self.ops += 1
    value = int(self._data.get(key, "0")) + increment
    self._put(key, str(value))
    return value


Wait = tuple[Any, float]  # (channel or None, deadline): resumed with True if signalled.
Task = Generator[Wait, bool, None]


class _Clock:
  """The discrete-event scheduler: tasks park on a channel and a deadline."""

  def __init__(self) -> None:
    self.now = 0.0
    self._heap: list[tuple[float, int, Any, int, bool]] = []
    self._order = itertools.count()
    self._parked: dict[Any, list[tuple[Any, int]]] = collections.defaultdict(list)
    self._turn: dict[int, int] = {}  # Per task: its current wait.
    self.dead: set[int] = set()  # Tasks that are never resumed again.

  def spawn(self, task: Task, at: float = 0.0) -> None:
    self._turn[id(task)] = 0
    heapq.heappush(self._heap, (at, next(self._order), task, 0, False))

  def signal(self, channel: Any) -> None:
    for task, turn in self._parked.pop(channel, ()):
      heapq.heappush(self._heap, (self.now, next(self._order), task, turn, True))

  def run(self, until: float) -> None:
    while self._heap and self._heap[0][0] <= until:
      t, _, task, turn, signalled = heapq.heappop(self._heap)
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
        heapq.heappush(self._heap, (deadline, next(self._order), task, turn, False))


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


_END = object()


class _Finished(Exception):
  """The core returned: the agreed end (or an agreed stop)."""


class _Host:
  """One host: its core, the real exchange over the shared store, and its stages as tasks."""

  def __init__(self, cluster: SimulatedCluster, p: int, plan: HostPlan):
    self.c, self.p, self.plan = cluster, p, plan
    self.out = HostOutcome(p)
    n, options = cluster.processes, cluster
    self.ex = exchange_lib.KeyValueExchange(cluster.store, _NS, process_index=p, process_count=n)
    config = {"sim": 1} if plan.config is None else plan.config
    who = common.Identity(process=p, devices=1, config=config, resume=plan.resume)
    kind = decider.Decider if p == 0 else follower.Follower
    self.threaded = options.prefetch_batches > 0
    rules = plan_lib.Rules(batch_size=plan.rows, drop_last=False, pad=True, wait_for_last=True)
    self.core = kind(
      rules,
      who,
      namespace=_NS,
      process_count=n,
      lookahead=options.synchronize_lookahead,
      timeout_s=plan.sync_timeout_s or options.sync_timeout_s,
      dead_after_s=liveness.DEAD_AFTER_S,
      position=plan.resume,
      threaded=self.threaded,
      inline=not self.threaded,
    )
    refused = None if plan.refused is None else ValueError(plan.refused)
    self.reads = reader.Reader(
      sources.open_source(self._source()), process_index=p, check_int32=False, start_error=refused
    )
    self.done = 0  # The build's positions handed on.
    self.pace = stats.Pace(cluster.decide_ahead_s, options.prefetch_batches)
    self.read_q = collections.deque[Any]()  # Reads made by the reading task, not taken.
    self.asked = self.reading = 0
    self.busy = False  # The consumer is inside `next()` (inline: the core's turn).
    self.killed_at = INF
    self.closed_note: str | None = None

  def _source(self) -> Iterator[dict[str, np.ndarray]]:
    for b in range(self.plan.batches):
      if b == self.plan.error_at:
        raise self.plan.error or OSError(f"process {self.p}'s source failed at batch {b}")
      yield {"x": np.full(self.plan.rows, 1000 * self.p + b, np.int32)}

  def _read_s(self) -> float:
    stall = self.plan.stall
    return stall[1] if stall is not None and stall[0] == self.reading else self.plan.read_s

  # -- the core's actions ------------------------------------------------------------

  def _now(self) -> core.Now:
    return core.Now(self.c.clock.now, self.done, bool(self.read_q) or not self.threaded)

  def drive(self, deliver: Callable[[Any], Any]) -> Generator[Wait, bool, Any]:
    """Runs the core until it delivers a run (handed to `deliver`) or ends; its error raised."""
    result: Any = None
    while True:
      try:
        action = self.core.send(result, self._now())
      except StopIteration:
        raise _Finished() from None
      if type(action) is core.Deliver:
        return deliver(action.run)
      result = yield from self._do(action)

  def _do(self, action: core.Action) -> Generator[Wait, bool, Any]:
    clock = self.c.clock
    if isinstance(action, core.Store):
      result = driver.call_store(self.ex, action)
      if action.op in ("wait_chunk", "wait_decision") and not result:
        key, self.c.store.missed = self.c.store.missed, None
        if (yield (key, clock.now + common.WAIT_SLICE_S)):
          result = driver.call_store(self.ex, action)
      return result
    if isinstance(action, core.Read):
      return (yield from self._read(action))
    if isinstance(action, core.Pace):
      return self.pace.count(clock.now)
    if isinstance(action, core.WaitBuild):
      if self.done <= action.beyond:
        yield (("built", self.p), clock.now + common.WAIT_SLICE_S)
      return None
    assert isinstance(action, core.Look), action
    return self._look(action)

  def _read(self, action: core.Read) -> Generator[Wait, bool, Any]:
    clock = self.c.clock
    if not self.threaded:
      yield (None, clock.now + self._read_s())
      self.reading += 1
      return next(self.reads)
    if action.want > self.asked:
      self.asked = action.want
      clock.signal(("ask", self.p))
    if not self.read_q and action.wait_s > 0:
      yield (("read", self.p), clock.now + action.wait_s)
    if not self.read_q:
      return None
    self.asked -= 1
    return self.read_q.popleft()

  def _look(self, look: core.Look) -> Any:
    peer = self.c.hosts[look.peer]
    if look.op == "dead":
      return self.c.clock.now - peer.killed_at >= liveness.DEAD_AFTER_S
    if look.op == "closed":
      return peer.closed_note
    return None  # "cross", "done": every host starts the one stream.

  # -- the stages ----------------------------------------------------------------------

  def reading_task(self) -> Task:
    """The reading thread: one read at a time, as many as asked for."""
    clock = self.c.clock
    while True:
      while self.asked <= len(self.read_q):
        yield (("ask", self.p), INF)
      yield (None, clock.now + self._read_s())
      self.reading += 1
      item = next(self.reads)
      self.read_q.append(item)
      clock.signal(("read", self.p))
      if isinstance(item, reader.End):
        return

  def agree_task(self, runs: _Queue) -> Task:
    """The agreement thread: a slot, then the core until its next run."""
    while True:
      yield from runs.take_slot()
      try:
        yield from self.drive(runs.put)
      except _Finished:
        runs.put(_END)
        return
      except BaseException as e:  # noqa: BLE001 - handed on, as the stage hands it on.
        runs.put(e)
        return

  def build_task(self, runs: _Queue, items: _Queue) -> Task:
    """The build thread: a slot, then the next position's batch (a drop takes none)."""
    pending: collections.deque[Any] = collections.deque()
    handed = False  # The last batch is counted done when the build resumes (`build.Builder`).
    while True:
      yield from items.take_slot()
      while True:
        if handed:
          self._built()
          handed = False
        while not pending:
          run = yield from runs.get()
          if run is _END or isinstance(run, BaseException):
            items.put(run)
            return
          pending.extend(run.steps)
        _, step = pending.popleft()
        if step.action == messages.Action.YIELD:
          items.put(step)
          handed = True
          break
        self._built()  # A drop: done at once.

  def _built(self) -> None:
    self.done += 1
    self.pace.done(self.c.clock.now)
    self.c.clock.signal(("built", self.p))

  def consumer_task(self, items: _Queue | None) -> Task:
    """The training loop: a batch, a step, and what the plan asks of this host."""
    clock, plan = self.c.clock, self.plan
    inline: collections.deque[Any] = collections.deque()
    while True:
      if plan.close_at == len(self.out.received):
        self._closes()
        return
      self.busy = True
      try:
        item = yield from self._next(items, inline)
      except _Finished:
        item = _END
      except BaseException as e:  # noqa: BLE001 - recorded, as the loop gets it.
        item = e
      self.busy = False
      if item is _END or isinstance(item, BaseException):
        self._ended(item)
        return
      self.out.received.append(clock.now)
      b = len(self.out.received)
      if plan.stop is not None and plan.stop[0] == b:
        clock.spawn(self._stop_task(), clock.now + plan.stop[1])
      pause = plan.pause[1] if plan.pause is not None and plan.pause[0] == b else 0.0
      yield (None, clock.now + plan.step_s + pause)

  def _next(self, items: _Queue | None, inline: collections.deque[Any]) -> Any:
    if items is not None:
      item = yield from items.get()
      if isinstance(item, BaseException):
        raise item
      return item
    while not inline:
      run = yield from self.drive(lambda r: r)
      inline.extend(s for _, s in run.steps if s.action == messages.Action.YIELD)
    return inline.popleft()

  def _stop_task(self) -> Task:
    self.core.request_stop(len(self.out.received))
    self.c.clock.signal(("read", self.p))  # The nudge: a wait for a read returns at once.
    if not self.threaded and not self.busy and self.core.stop_pending():
      yield from self.drive_aside(self.core.stop_now())

  def drive_aside(self, steps: core.Steps) -> Generator[Wait, bool, None]:
    result: Any = None
    while True:
      try:
        action = steps.send(result)
      except StopIteration:
        return
      result = yield from self._do(action)

  def _ended(self, item: Any) -> None:
    self.out.ended_at = self.c.clock.now
    if item is _END:
      self.out.ending, self.out.stopped_by = "end", self.core.stop_requested_by
    else:
      self.out.ending, self.out.message = type(item).__name__, str(item)
      self._post_end(len(self.out.received), None)
    self.c.retire(self)

  def _closes(self) -> None:
    self.out.ending, self.out.ended_at = "closed", self.c.clock.now
    self.c.retire(self)
    self.closed_note = f'["{_NS}", "process {self.p} closed its iterator"]'
    self._post_end(len(self.out.received), None)

  def _post_end(self, at: int, error: messages.ReportedError | None) -> None:
    calls = self.core.closing(at, error)
    for call in calls:
      driver.call_store(self.ex, call)

  def timed_task(self) -> Task:
    """A `close()` from another thread (`close_s`), or the process's death (`kill_at`)."""
    close_s, kill_at = (INF if t is None else t for t in (self.plan.close_s, self.plan.kill_at))
    yield (None, min(close_s, kill_at))
    if close_s < kill_at:
      self._closes()
      return
    self.killed_at = self.c.clock.now
    self.out.ending, self.out.ended_at = "killed", self.c.clock.now
    self.c.retire(self)


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
    prefetch_batches: As the iterator's (0: inline).
    decide_ahead_s: As the iterator's.
    sync_timeout_s: As the iterator's.
    synchronize_lookahead: As the iterator's.
  """

  processes: int
  prefetch_batches: int = 2
  decide_ahead_s: float = 1.0
  sync_timeout_s: float = 60.0
  synchronize_lookahead: int | None = None

  def run(self, plans: list[HostPlan], *, until_s: float = 3600.0) -> list[HostOutcome]:
    """Runs every host to its ending (or `until_s` of virtual time); their outcomes."""
    if len(plans) != self.processes:
      raise ValueError(f"`plans` must have {self.processes} entries, got {len(plans)}")
    self.clock = _Clock()
    self.store = MemoryStore(self.clock.signal)
    self.hosts = [_Host(self, p, plan) for p, plan in enumerate(plans)]
    self._tasks: dict[int, list[Task]] = {}
    for h in self.hosts:
      tasks = []
      if h.threaded:
        runs, items = _Queue(self.clock, 1), _Queue(self.clock, self.prefetch_batches)
        tasks += [h.reading_task(), h.agree_task(runs), h.build_task(runs, items)]
        tasks.append(h.consumer_task(items))
      else:
        tasks.append(h.consumer_task(None))
      for task in tasks:  # Its stream starts at its first next().
        self.clock.spawn(task, h.plan.start_s)
      self._tasks[h.p] = [*tasks, h.timed_task()]
      self.clock.spawn(self._tasks[h.p][-1])
    self.clock.run(until_s)
    return [h.out for h in self.hosts]

  def retire(self, host: _Host) -> None:
    """Ends every task of `host` (its threads joined, or its process gone)."""
    self.clock.dead.update(id(t) for t in self._tasks[host.p])

  @property
  def store_ops(self) -> int:
    return self.store.ops
