"""The streamed agreement's core: one host's protocol as a coroutine, with no I/O.

The core (`decider.Decider` on process 0, `follower.Follower` on the others)
is a generator: it yields an action; its driver (`driver.Driver`, in a thread
or inline; `sim_cluster`, in virtual time) carries it out (`interpreter`) and
sends back the result with a `Now`. A failed action is thrown into it; its
last output is `Ended` (docs/internals.md, "The core and its drivers").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NamedTuple, dataclass_transform

from grain_jax_sync._src import messages

if TYPE_CHECKING:
  from grain_jax_sync._src import batches as batches_lib


# -- The events from this host's reader (`reader.Reader`) -----------------------


@dataclasses.dataclass(slots=True)  # Per batch: no frozen-init cost.
class Read:
  """One validated non-empty batch and the source state right after it."""

  batch: batches_lib.HostBatch
  state: Any
  digest: str | None = None  # `rows_digest` of its rows, where processes share rows.


@dataclasses.dataclass(frozen=True)
class End:
  """How this host's stream ended, after `position` non-empty batches."""

  position: int
  error: messages.ReportedError | None = None  # None: exhausted; else what failed, reported.
  exception: BaseException | None = None  # The local exception (re-raised on this host only).

  @property
  def exhausted(self) -> bool:
    return self.error is None


# -- What the driver tells the core, and the actions -----------------------------


class Now(NamedTuple):
  """What the driver tells the core with every result."""

  t: float  # Seconds on the driver's clock (monotonic, or virtual).
  done: int = 0  # Positions the build stage handed on (or dropped).
  ready: bool = True  # Whether a read waits to be taken at once (inline: always).


@dataclass_transform(frozen_default=True)
class Action:
  """What the core asks of its world: each a small frozen type, dispatched by type (`interpreter`)."""

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    dataclasses.dataclass(frozen=True)(cls)


class Take(Action):
  """This host's reads at hand, up to `want` (the last may be its `End`), the first waited for up to `wait_s`; a list."""

  want: int
  wait_s: float
  ask: int = 0  # Asked of the reading thread first: the core counts the reads asked, not taken.


class StoreCall(Action):
  """A call of the exchange (`exchange.key_value.KeyValueExchange`'s method of that name)."""


class PostChunk(StoreCall):  # Its sequence number comes back.
  text: str
  final: bool = False


class PostDecision(StoreCall):
  seq: int
  text: str
  final: bool = False


class DeleteChunks(StoreCall):
  below: int


class DeleteDecisions(StoreCall):
  below: int


class ReadChunks(StoreCall):
  """Every peer's new chunks, ``[(process, text)]``."""


class WaitChunk(StoreCall):
  """Up to `wait_s` (the core's next deadline): what came, as `ReadChunks`."""

  peer: int
  wait_s: float


class TryDecision(StoreCall):  # Its text, or None.
  seq: int


class WaitDecision(StoreCall):  # Up to `wait_s` (the core's next deadline): its text, or None.
  seq: int
  wait_s: float


class EndExchange(StoreCall):
  """Counts this host out of the stream's keys: its last call in it."""


class PostLeft(StoreCall):  # Peers waiting at the agreed end are told why this host left.
  message: str


class PostReachedEnd(StoreCall):
  """This host's consumer reached the agreed end."""


class WaitAllReachedEnd(StoreCall):
  """Up to `wait_s` (the core's next deadline): whether every host reached the agreed end."""

  wait_s: float


class EndNotes(StoreCall):
  """Per host at the agreed end or gone: "" (it got there) or why it left."""


class Elsewhere(Action):
  """Stream `namespace`, never started here: this host's ending there (`message`), recorded and posted."""

  namespace: str
  message: str
  calls: tuple[StoreCall, ...]


# Looks at this process's streams or at a peer's liveness beat (`liveness.Liveness`).
class IsDead(Action):  # Its beat stopped.
  peer: int


class ClosedNote(Action):  # What it wrote as it closed (`key_value.close_note`), or None.
  peer: int


class Crosswise(Action):  # Streams it waits at the start of, made, not started here; marks ours.
  peer: int


class NotWaiting(Action):
  """This host no longer waits for its stream's first decision."""


class WaitBuild(Action):
  """Until the build stage hands on more than `beyond` positions (or a liveness period)."""

  beyond: int


class Pace(Action):
  """The positions the consumer took in the last `decide_ahead_s` seconds (an int comes back)."""


PACE = Pace()


class ReadWindow(Action):
  """This host's next reads (lockstep): up to `count`, the last one an `End` if reached."""

  count: int


class AllGather(Action):
  """Every process's `text` for window `seq`, in process order (lockstep's exchange)."""

  seq: int
  text: str


class Deliver(Action):
  """A decided run (`common.Run`), for the build stage."""

  run: Any


class Closing(NamedTuple):
  """This host's ending, asked (`streamed.Streamed.asked`): closed at `at_batch`, or `error`.

  A close asks twice: `CLOSING` at once (decide no more), then, once the
  consumer's call returned, the ending with its exact count. `left`: this
  host leaves before the agreed end (peers waiting there are told too).
  """

  at_batch: int | None
  error: messages.ReportedError | None = None
  left: bool = False


CLOSING = Closing(None)


class Close:
  """This host's close, asked in two steps (`Closing`): `asked`, then the first ending, posted once."""

  def __init__(self) -> None:
    self.asked = False
    self.ending: Closing | None = None
    self._posted = False

  def take(self, ask: Closing) -> None:
    self.asked = True
    if ask is not CLOSING and self.ending is None:
      self.ending = ask

  @property
  def awaited(self) -> bool:
    """Whether a close was asked and its ending (with its count) is still to come."""
    return self.asked and self.ending is None

  def to_post(self) -> Closing | None:
    """The ending, once it came; None before and once handed out."""
    if self.ending is None or self._posted:
      return None
    self._posted = True
    return self.ending


class Ended(Action):
  """The core's last output: the agreed end or stop (`error` None), or the error this host raises."""

  error: BaseException | None = None


Steps = Generator[Any, Any, Any]


ENDED = Ended()


class Side:
  """A run of a core's steps (its main run, or a side one): `Now` comes in, `Ended` last.

  `clock`: where the core reads the driver's last `Now`. `close`: once asked, `Ended` comes at
  once, after the core is told the result of a store call carried out first (posted before it).
  """

  def __init__(self, steps: Steps, clock: Any = None, close: Close | None = None):
    self._clock, self._steps, self._close = clock, steps, close
    self._owed = False  # The last action is a store call: its result is due to the core.

  def send(self, result: Any, now: Now | None = None) -> Any:
    """The next action, given the last one's `result` and `now`."""
    return self._on(self._steps.send, result, now)

  def throw(self, error: BaseException, now: Now | None = None) -> Any:
    """The last action failed with `error`: raised inside the core (it may end on it)."""
    return self._on(self._steps.throw, error, now)

  def _on(self, step: Any, value: Any, now: Now | None) -> Any:
    if self._clock is not None:
      self._clock.now = now
    closed = self._close is not None and self._close.asked
    if closed and not self._owed:
      return ENDED
    try:
      action = step(value)
    except StopIteration:
      return ENDED
    except BaseException as e:  # noqa: BLE001 - the agreed or own error, of any type: its ending.
      return ENDED if closed else Ended(e)
    self._owed = not closed and isinstance(action, StoreCall)
    return ENDED if closed else action
