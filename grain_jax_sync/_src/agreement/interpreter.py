"""The one place where the core's actions are carried out, against a store and a clock.

`carry` gives each of the core's typed actions its meaning; `drive` is the
one loop that steps a core with them. A real host (`driver.Driver`) and a
simulated one (`sim_cluster`) differ only in the store they hand in and the
`World` (monotonic time and blocking waits, or a virtual clock a wait yields to).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from grain_jax_sync._src.agreement import core

if TYPE_CHECKING:
  from grain_jax_sync._src.exchange import key_value

logger = logging.getLogger(__name__)


class World:
  """The clock and this host's stages, as `carry` reaches them, real (`driver.Driver`) or simulated (`sim_cluster`).

  `now()`, `call(fn, *args)` (one store call), `wait_build`, `pace`, `dead`, `closed`, and the
  reads: `threaded`, `ask_reads(n)`, `next_read(wait_s)` (None if none came) (lockstep's:
  `read_window`). `call`, `next_read` and `wait_build` are generators a real world never yields
  from (its waits block).
  """

  threaded = False  # No reading thread: inline, each read in `next_read`.

  def crosswise(self, peer: int) -> list[str]:
    del peer
    return []

  def not_waiting(self) -> None:
    pass

  def pre_end(self, namespace: str, message: str) -> None:
    del namespace, message


# Each store action's call of the exchange, by type.
_STORE: dict[type, Callable[[Any, Any], Any]] = {
  core.PostChunk: lambda ex, a: ex.post_chunk(a.text, final=a.final),
  core.PostDecision: lambda ex, a: ex.post_decision(a.seq, a.text, final=a.final),
  core.DeleteChunks: lambda ex, a: ex.delete_chunks(a.below),
  core.DeleteDecisions: lambda ex, a: ex.delete_decisions(a.below),
  core.ReadChunks: lambda ex, a: ex.read_chunks(),
  core.WaitChunk: lambda ex, a: ex.wait_chunk(a.peer, a.wait_s),
  core.TryDecision: lambda ex, a: ex.try_decision(a.seq),
  core.WaitDecision: lambda ex, a: ex.wait_decision(a.seq, a.wait_s),
  core.EndExchange: lambda ex, a: ex.end(),
  core.PostLeft: lambda ex, a: ex.post_left(a.message),
  core.PostReachedEnd: lambda ex, a: ex.post_reached_end(),
  core.WaitAllReachedEnd: lambda ex, a: ex.wait_all_reached_end(a.wait_s),
  core.EndNotes: lambda ex, a: ex.end_notes(),
}

# Each action that never waits, by type: on the exchange `ex`, the world `w`.
_PLAIN: dict[type, Callable[[Any, Any, Any], Any]] = {
  core.ReadWindow: lambda ex, w, a: w.read_window(a.count),
  core.AllGather: lambda ex, w, a: ex.all_gather(a.seq, a.text),
  core.Pace: lambda ex, w, a: w.pace(),
  core.IsDead: lambda ex, w, a: w.dead(a.peer),
  core.ClosedNote: lambda ex, w, a: w.closed(a.peer),
  core.Crosswise: lambda ex, w, a: w.crosswise(a.peer),
  core.NotWaiting: lambda ex, w, a: w.not_waiting(),
}


def carry(action: Any, exchange: Any, world: Any) -> core.Steps:
  """Carries `action` out on the stream's `exchange` and this host's `world`; its result.

  Holding neither, it makes no cycle: a dropped stream is freed at once (its
  ending's traceback would otherwise keep the consumer's frame alive).
  """
  store = _STORE.get(type(action))
  if store is not None:
    return (yield from world.call(store, exchange, action))
  plain = _PLAIN.get(type(action))
  if plain is not None:
    return plain(exchange, world, action)
  match action:
    case core.Take(want, wait_s, ask):
      return (yield from take(world, want, wait_s, ask))
    case core.WaitBuild(beyond):
      return (yield from world.wait_build(beyond))
    case core.Elsewhere(namespace, message, calls):
      world.pre_end(namespace, message)
      return best_effort(exchange.sibling(namespace), calls)
  raise TypeError(f"not an action: {action!r}")


def take(world: Any, want: int, wait_s: float, ask: int) -> core.Steps:
  """`core.Take`: inline, one read; else the reading thread's, `ask` more asked of it, up to
  `want`, the first waited for up to `wait_s` (`next_read`), then those at hand."""
  if not world.threaded:
    return [(yield from world.next_read(wait_s))]
  if ask:
    world.ask_reads(ask)
  items: list[Any] = []
  item = yield from world.next_read(wait_s)
  while item is not None:
    items.append(item)
    if len(items) == want or type(item) is core.End:
      break
    item = yield from world.next_read(0.0)
  return items


def best_effort(ex: key_value.KeyValueExchange, calls: Sequence[core.StoreCall]) -> None:
  """Posts an ending: `calls` in order, a failure logged, a last `EndExchange` made whatever happens;
  never raises (it also runs in `close()` and at exit), never waits."""
  last = len(calls) - 1 if calls and type(calls[-1]) is core.EndExchange else len(calls)
  try:
    for call in calls[:last]:
      _STORE[type(call)](ex, call)
  except Exception as e:  # noqa: BLE001 - best effort: the peers find it otherwise.
    logger.warning("grain_jax_sync: could not post this host's end to %s: %s", ex.namespace, e)
  finally:
    if last < len(calls):
      ex.end()


def drive(
  runner: Any, exchange: Any, world: Any, asks: Any = None, early: bool = False
) -> core.Steps:
  """Steps `runner` (a core, or a side run of it) to its `core.Deliver` or `core.Ended`: the one
  loop of every host, real (`runs`) or simulated; a failure is thrown in.

  `asks()`: whether an ending was asked (`early`: before each step too): then `core.ENDED`,
  before the next action.
  """
  result: Any = None
  error: Exception | None = None
  while True:
    closing = early and asks()
    now = world.now()
    action = runner.send(result, now) if error is None else runner.throw(error, now)
    result = error = None
    if closing or (asks is not None and asks()):
      return core.ENDED
    if type(action) is core.Ended or type(action) is core.Deliver:
      return action
    try:
      result = yield from carry(action, exchange, world)
    except Exception as e:  # noqa: BLE001 - raised inside the core, where it ends.
      error = e


def runs(
  runner: Any, exchange: Any, world: Any, asks: Any = None, early: bool = False, turn: Any = None
) -> Any:
  """`drive` on a real world (its waits block): the runs; an error raises. `turn` is held but while a
  run is handed on."""
  if turn is not None:
    turn.acquire()
  try:
    while True:
      action = blocking(drive(runner, exchange, world, asks, early))
      if type(action) is core.Ended:
        if action.error is not None:
          raise action.error
        return
      run, action = action.run, None
      if turn is not None:
        turn.release()
      try:
        yield run
      finally:
        if turn is not None:
          turn.acquire()
      del run  # The build stage's alone once handed on: not held while the core runs on.
  finally:
    if turn is not None:
      turn.release()


def blocking(steps: core.Steps) -> Any:
  """The result of a real world's steps, which never yield (their waits block)."""
  try:
    steps.send(None)
  except StopIteration as done:
    return done.value
  raise AssertionError("a real host's action yielded: its waits block")
