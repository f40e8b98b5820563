"""What a host reports (`Report`, posted in `Chunk`s) and what process 0 decides (`Decision`).

`plan.decide` turns one report per host into one `Step` per position and an
`Outcome`. The wire form is compact JSON carrying `PROTOCOL_VERSION`: every
host raises the same `version_error` for a peer on another version. No JAX, no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from grain_jax_sync._src import batches

# Carried in every chunk and decision; hosts on another version raise the same
# clear error instead of misreading each other. 1 was the windowed protocol;
# 3 added the requested stop (`ErrorKind.STOPPED`).
PROTOCOL_VERSION = 3


class ErrorKind(enum.StrEnum):
  """How a reported error is raised on each host."""

  # Bad data or settings: every host raises ValueError with the same text.
  VALUE = "value"
  # The source itself raised: the failing host re-raises its own exception,
  # the others raise RuntimeError naming the failing process.
  SOURCE = "source"
  # A process closed (or dropped) its iterator: the others raise RuntimeError.
  CLOSED = "closed"
  # A live process did not report within `sync_timeout_s`: PeerTimeoutError.
  TIMEOUT = "timeout"
  # A process stopped its liveness beat (it died): PeerLostError.
  LOST = "lost"
  # A process asked every host to stop (`request_stop()`): every host ends
  # its stream normally at the same position; nothing is raised.
  STOPPED = "stopped"


# Endings that end the stream at once, whatever positions are still undecided
# (rows a process posted beyond such an ending are void).
ABORTS = frozenset({ErrorKind.CLOSED, ErrorKind.TIMEOUT, ErrorKind.LOST, ErrorKind.STOPPED})


@dataclasses.dataclass(frozen=True)
class ReportedError:
  """An error one host hit while reading its window."""

  kind: ErrorKind
  message: str
  process_index: int
  batch_index: int
  type_name: str = "ValueError"
  # Processes the ending is about (TIMEOUT and LOST: the awaited ones).
  missing: tuple[int, ...] = ()

  def to_json(self) -> list[Any]:
    fields = (self.kind.value, self.message, self.process_index, self.batch_index, self.type_name)
    return [*fields, list(self.missing)]

  @classmethod
  def from_json(cls, obj: Sequence[Any]) -> ReportedError:
    kind, message, pi, bi, tn, missing = obj
    return cls(ErrorKind(kind), message, pi, bi, tn, tuple(missing))


@dataclasses.dataclass(frozen=True)
class Report:
  """What one host read in one window.

  Attributes:
    rows: Row count of each batch read in this window, in order.
    exhausted: True if the source ended after those batches.
    error: Set if reading or validating the batch after `rows` failed.
    signature: The host's batch structure, once it has seen a batch.
    local_devices: The data shards the host's local devices hold (its local
      rows divide among them).
    config: The host's settings (first window only), compared across hosts.
    more: True if the host read at least one more batch after `rows`;
      otherwise the last of `rows` counts as its last when a short batch is judged.
    resume: The output batch the host resumes at (first window only).
    digests: Where processes share rows: each batch's `reader.rows_digest`.
    sizes: With `pad_shapes`: each batch's sizes of the varying dims.
  """

  process_index: int
  rows: tuple[int, ...] = ()
  exhausted: bool = False
  error: ReportedError | None = None
  signature: dict[str, Any] | None = None
  local_devices: int = 1
  config: dict[str, Any] | None = None
  more: bool = False
  resume: int | None = None
  digests: tuple[str | None, ...] = ()
  sizes: tuple[tuple[int, ...], ...] = ()

  def to_obj(self) -> dict[str, Any]:
    """The report as a JSON-ready object (only the fields that differ from their defaults)."""
    obj = {"p": self.process_index, "r": self.rows, "x": self.exhausted, "d": self.local_devices}
    optional = {
      "e": None if self.error is None else self.error.to_json(),
      "s": self.signature,
      "c": self.config,
      "m": self.more or None,
      "b": self.resume,
      "h": self.digests or None,
      "z": self.sizes or None,
    }
    obj.update((k, v) for k, v in optional.items() if v is not None)
    return obj

  @classmethod
  def from_obj(cls, obj: Mapping[str, Any]) -> Report:
    error = ReportedError.from_json(obj["e"]) if "e" in obj else None
    return cls(
      process_index=obj["p"],
      rows=tuple(obj["r"]),
      exhausted=obj["x"],
      error=error,
      signature=batches.checked_json(obj.get("s")),
      local_devices=obj["d"],
      config=obj.get("c"),
      more=obj.get("m", False),
      resume=obj.get("b"),
      digests=tuple(obj.get("h", ())),
      sizes=tuple(tuple(z) for z in obj.get("z", ())),
    )


def signature_of(reports: Iterable[Report]) -> dict[str, Any] | None:
  """The first structure any report carries."""
  return next((r.signature for r in reports if r.signature is not None), None)


# -- the decision ------------------------------------------------------------------


class Action(enum.StrEnum):
  YIELD = "yield"  # Every host yields `rows` rows (real, padded or dummy).
  DROP = "drop"  # Every host discards its batch at this position.


@dataclasses.dataclass(frozen=True)
class Step:
  """One decided position, the same on every host.

  Attributes:
    rows: Rows each host yields (the padded size); 0 for a drop.
    real_rows: Real rows per process (0 for a dummy); empty when read from a `Decision`.
    sizes: With `pad_shapes`, a yield's agreed sizes of the varying dims.
  """

  action: Action
  rows: int
  real_rows: tuple[int, ...]
  sizes: tuple[int, ...] = ()


class Outcome(enum.StrEnum):
  """What every host does after a decision's steps."""

  CONTINUE = "continue"  # Read on and decide the next positions.
  STOP = "stop"  # The stream is over on every host.
  RAISE = "raise"  # Every host raises the decision's error after the steps.
  # The next position holds a short batch that may or may not be its host's
  # last (`plan.Rules.wait_for_last`): decide again from there once every
  # process in `plan.Plan.waiting` has reported one more batch or its end.
  WAIT = "wait"


# -- the wire form -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One post: consecutive positions of one process.

  Attributes:
    start: The position of ``report.rows[0]``.
    ack: The poster's count of decisions read: process 0 deletes those every peer has read.
    times: The poster's stage times (`stats.TIMES` order) for `job_stats`;
      None when unchanged since its last chunk.
  """

  start: int
  ack: int
  report: Report
  times: tuple[float, ...] | None = None

  def to_json(self) -> str:
    # The report as a nested object (one parse at the decider, not two).
    obj = {"v": PROTOCOL_VERSION, "s": self.start, "a": self.ack, "R": self.report.to_obj()}
    if self.times is not None:
      obj["t"] = self.times
    return json.dumps(obj, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> Chunk:
    """Parses a chunk; ProtocolError if it is of another version or does not parse."""
    return cls.from_obj(load(text, "report"))

  @classmethod
  def from_obj(cls, obj: Mapping[str, Any]) -> Chunk:
    """`from_json` from `load`'s object."""
    try:
      times = tuple(map(float, obj["t"])) if "t" in obj else None
      return cls(obj["s"], obj["a"], Report.from_obj(obj["R"]), times)
    except (KeyError, TypeError, ValueError) as e:
      raise ProtocolError(f"a report that does not parse ({type(e).__name__}: {e})") from e


class ProtocolError(ValueError):
  """A message from a peer that this version cannot read (`version`: the peer's, if read)."""

  def __init__(self, message: str, version: Any = None):
    super().__init__(message)
    self.version = version


_DECODER = json.JSONDecoder()


def load(text: str, what: str) -> dict[str, Any]:
  """A message's JSON object, checked for this protocol version."""
  try:
    obj, end = _DECODER.raw_decode(text)  # As posted: no whitespace for `json.loads` to skip.
    if end != len(text):
      raise ValueError(text)
  except (TypeError, ValueError):
    try:
      obj = json.loads(text)
    except ValueError as e:
      raise ProtocolError(f"a {what} that is not JSON ({e})") from e
  version = obj.get("v") if isinstance(obj, dict) else None
  if version != PROTOCOL_VERSION:
    raise ProtocolError(f"a {what} of protocol version {version!r}", version)
  return obj


def version_error(versions: Mapping[int, Any], processes: Iterable[int]) -> str:
  """The message, the same on every host, for processes on another protocol version.

  `versions`: the other version each process posted; `processes`: those to show.
  """
  shown = ", ".join(f"process {p}: {versions.get(p, PROTOCOL_VERSION)!r}" for p in processes)
  return (
    "the processes run different versions of the grain_jax_sync agreement"
    f" protocol ({shown}); every process must run the same version of the library"
  )


def unreadable_error(peer: int, e: ProtocolError, reader: int) -> str:
  """The message for a post of `peer` that process `reader` cannot read."""
  if e.version != PROTOCOL_VERSION and e.version is not None:
    return version_error({peer: e.version}, sorted({peer, reader}))
  return f"process {peer} posted {e}; every process must run the same version of the library"


@dataclasses.dataclass(frozen=True)
class Decision:
  """What process 0 decided for a run of positions (run-length encoded); every process reads it.

  Attributes:
    end: Whether the stream goes on, stops or raises after the steps.
    error: The error every host raises (with `Outcome.RAISE`).
    signature: The agreed batch structure, sent once (in the first decision that knows it).
    batch_size: The agreed full batch size, sent once: every host judges by it
      and saves it with its state.
    table: Rows of the cross-host view (`job_stats`) that changed; None if not sent.
  """

  start: int
  steps: tuple[Step, ...]
  end: Outcome
  error: ReportedError | None = None
  signature: dict[str, Any] | None = None
  batch_size: int | None = None
  table: tuple[tuple[Any, ...], ...] | None = None

  def to_json(self) -> str:
    # One run per equal (action, rows, sizes); the agreed sizes (`pad_shapes`) only where some.
    runs = [
      [action, rows, sum(1 for _ in run), *([list(sizes)] if sizes else [])]
      for (action, rows, sizes), run in itertools.groupby(
        self.steps, key=lambda s: (s.action.value, s.rows, s.sizes)
      )
    ]
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "j": self.start, "st": runs, "e": self.end.value}
    error = None if self.error is None else self.error.to_json()
    optional = {"x": error, "g": self.signature, "b": self.batch_size, "t": self.table}
    obj.update((k, v) for k, v in optional.items() if v is not None)
    return json.dumps(obj, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> Decision:
    """Parses a decision; ProtocolError if it is of another version or does not parse."""
    obj = load(text, "decision")
    try:
      steps = tuple(  # One shared (frozen) step per run of equal positions.
        itertools.chain.from_iterable(
          itertools.repeat(Step(Action(a), rows, (), tuple(sizes[0]) if sizes else ()), n)
          for a, rows, n, *sizes in obj["st"]  # Agreed sizes (`pad_shapes`) 4th.
        )
      )
      error = ReportedError.from_json(obj["x"]) if "x" in obj else None
      table = tuple(tuple(row) for row in obj["t"]) if "t" in obj else None
      end = Outcome(obj["e"])
      signature = batches.checked_json(obj.get("g"))
      return cls(obj["j"], steps, end, error, signature, obj.get("b"), table)
    except (KeyError, TypeError, ValueError) as e:
      raise ProtocolError(f"a decision that does not parse ({type(e).__name__}: {e})") from e
