"""The one place where the core's actions are carried out, against a store and a clock.

The core (`core`, `decider`, `follower`) says what to do as typed actions;
`Interpreter.carry` gives each its meaning, dispatched by type. Only two
things differ between a real host and a simulated one, and both come in:

* the store: a `KeyValueExchange` over `jax.distributed`'s client, or over
  the in-memory store (`memory_store`);
* the clock, with this host's stages: a `World`. On a real host
  (`driver.Driver`) time is monotonic and a wait blocks a thread, so its
  steps never yield; in the simulated cluster (`sim_cluster`) time is
  virtual and a wait yields to the scheduler.

Both the real `driver.Driver` and `sim_cluster` use this module; neither
gives an action a meaning of its own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

from grain_jax_sync._src.agreement import core

if TYPE_CHECKING:
  from grain_jax_sync._src.exchange import key_value

logger = logging.getLogger(__name__)

Steps = Generator[Any, Any, Any]


class World:
  """The clock and this host's stages, as `Interpreter` reaches them: real (`driver.Driver`) or simulated.

  `now()` says the time, the build stage's progress and whether a read
  waits; `call(fn)` makes one store call; `take`, `wait_build` and `pace`
  carry out `core.Take`, `core.WaitBuild` and `core.Pace`; `dead` and
  `closed` look at a peer. Each of `call`, `take` and `wait_build` is a
  generator: a real one never yields (its waits block), a simulated one
  yields its waits to the virtual scheduler. This process's streams (the
  crosswise watch) are none by default: one stream per host.
  """

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
  core.WaitChunk: lambda ex, a: ex.wait_chunk(a.peer),
  core.TryDecision: lambda ex, a: ex.try_decision(a.seq),
  core.WaitDecision: lambda ex, a: ex.wait_decision(a.seq),
  core.EndExchange: lambda ex, a: ex.end(),
  core.PostLeft: lambda ex, a: ex.post_left(a.message),
  core.PostReachedEnd: lambda ex, a: ex.post_reached_end(),
  core.WaitAllReachedEnd: lambda ex, a: ex.wait_all_reached_end(),
  core.EndNotes: lambda ex, a: ex.end_notes(),
}


def _store_call(ex: key_value.KeyValueExchange, action: core.StoreCall) -> Callable[[], Any]:
  """The exchange's call for a store action."""
  return functools.partial(_STORE[type(action)], ex, action)


class Interpreter:
  """Carries out one host's actions on its stream's exchange and its `World`.

  Args:
    exchange: The stream's key-value exchange.
    world: The clock and this host's stages.
  """

  def __init__(self, exchange: key_value.KeyValueExchange, world: Any):
    self.exchange = exchange
    self.world = world

  def carry(self, action: Any) -> Steps:
    """Carries `action` out; its result. A real world's steps never yield."""
    w = self.world
    match action:
      case core.Take(want, wait_s):
        return (yield from w.take(want, wait_s))
      case core.Pace():
        return w.pace()
      case core.WaitBuild(beyond):
        return (yield from w.wait_build(beyond))
      case core.IsDead(peer):
        return w.dead(peer)
      case core.ClosedNote(peer):
        return w.closed(peer)
      case core.Crosswise(peer):
        return w.crosswise(peer)
      case core.NotWaiting():
        return w.not_waiting()
      case core.PreEnd(namespace, message):
        return w.pre_end(namespace, message)
      case core.Elsewhere(namespace, calls):
        return best_effort(self.exchange.sibling(namespace), calls)
    return (yield from w.call(_store_call(self.exchange, action)))


def best_effort(ex: key_value.KeyValueExchange, calls: Sequence[core.StoreCall]) -> None:
  """Posts an ending: `calls` in order, a failure logged; a last `EndExchange` made whatever happens.

  An ending never raises (it also runs in `close()` and at exit), and never waits.
  """
  last = len(calls) - 1 if calls and type(calls[-1]) is core.EndExchange else len(calls)
  try:
    for call in calls[:last]:
      _store_call(ex, call)()
  except Exception as e:  # noqa: BLE001 - best effort: the peers find it otherwise.
    logger.warning("grain_jax_sync: could not post this host's end to %s: %s", ex.namespace, e)
  finally:
    if last < len(calls):
      ex.end()


def blocking(steps: Steps) -> Any:
  """The result of a real world's steps, which never yield (their waits block)."""
  try:
    steps.send(None)
  except StopIteration as done:
    return done.value
  raise AssertionError("a real host's action yielded: its waits block")


def tell_done(runner: Any, result: Any, now: core.Now) -> None:
  """Tells the core the result of a store call carried out, where an ending stops the drive after it.

  So that its ending is posted after what the core posted, not over it;
  what the core does next is not carried out (nor raised): this host ends.
  """
  runner.send(result, now)
