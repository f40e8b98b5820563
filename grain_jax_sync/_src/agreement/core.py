"""The streamed agreement's core: one host's protocol as a coroutine, with no I/O.

The core (`decider.Decider` on process 0, `follower.Follower` on the others)
holds no thread, no clock and no store. It is a generator: it yields an
action, and whoever drives it carries the action out and sends back its
result together with a `Now`, the few facts of the world outside it. The
agreement thread (`driver.Driver`), the inline mode (the same driver, in the
consumer's `next()`) and the simulated cluster (`sim_cluster`, virtual time)
are its drivers (docs/internals.md, "The core and its drivers", draws them).
An ending asked from outside (a stop) is a field the core reads at its next
step; an agreed error is raised by the core; a failed action is thrown into it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NamedTuple

from grain_jax_sync._src import messages

if TYPE_CHECKING:
  from grain_jax_sync._src import batches as batches_lib


# -- The events from this host's reader (`reader.Reader`) -----------------------


@dataclasses.dataclass(slots=True)  # Per batch: no frozen-init cost.
class Read:
  """One validated non-empty batch and the source state right after it.

  Attributes:
    batch: The batch.
    state: The source state right after it.
    digest: `rows_digest` of its rows, where processes share rows.
  """

  batch: batches_lib.HostBatch
  state: Any
  digest: str | None = None


@dataclasses.dataclass(frozen=True)
class End:
  """How this host's stream ended.

  Attributes:
    position: Non-empty batches read before the end (the ended position).
    error: None when the source was exhausted; else what failed, reported.
    exception: The local exception (re-raised on this host only).
  """

  position: int
  error: messages.ReportedError | None = None
  exception: BaseException | None = None

  @property
  def exhausted(self) -> bool:
    return self.error is None


# -- What the driver tells the core, and the actions -----------------------------


class Now(NamedTuple):
  """What the driver tells the core with every result.

  Attributes:
    t: Seconds on the driver's clock (monotonic, or virtual).
    done: Positions the build stage handed on (or dropped).
    ready: Whether a read waits to be taken at once (inline: always).
  """

  t: float
  done: int = 0
  ready: bool = True


class Take(NamedTuple):
  """Take this host's next read (a `Read` or `End`), or None within `wait_s`.

  `want`: reads this host may hold undecided now (the reading stage is asked for as many).
  """

  want: int
  wait_s: float


class Store(NamedTuple):
  """One call of the exchange (`KeyValueExchange`'s method `op`); its result comes back."""

  op: str
  args: tuple[Any, ...] = ()


class Look(NamedTuple):
  """A look at `peer`'s liveness beat (`liveness.Liveness`'s method `op`: dead, closed; or cross).

  `cross`: whether `peer` waits crosswise at the start of a stream not started here
  (`cross_wait.CrossWait.check`, with `at_batch`); `done`: no longer waiting at the start.
  """

  op: str
  peer: int = 0
  at_batch: int = 0


class WaitBuild(NamedTuple):
  """Block until the build stage hands on more than `beyond` positions (or a liveness period)."""

  beyond: int


class Pace(NamedTuple):
  """The positions the consumer took in the last `decide_ahead_s` seconds (an int comes back)."""


class Deliver(NamedTuple):
  """A decided run (`common.Run`), for the build stage."""

  run: Any


Action = Take | Store | Look | WaitBuild | Pace | Deliver
Steps = Generator[Action, Any, Any]
