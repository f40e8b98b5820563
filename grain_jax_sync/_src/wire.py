"""The pipelined exchange's messages in their wire form: chunks and decisions.

Every process posts what it read as `Chunk`s (consecutive positions of its
stream, with `plan.Report`'s rows and ending); process 0 posts what it decided
as `Decision`s (run-length encoded steps). Both are compact JSON that carries
`PROTOCOL_VERSION`: a host on another version raises `ProtocolError`, and every
host raises the same `version_error`. `ledger.Ledger` keeps what the chunks say.

Pure Python: no JAX, no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import reports as reports_lib

# Carried in every chunk and decision; hosts on another version raise the same
# clear error instead of misreading each other. 1 was the windowed protocol;
# 3 added the requested stop (`ErrorKind.STOPPED`).
PROTOCOL_VERSION = 3


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One post: consecutive positions of one process.

  Attributes:
    start: The position of ``report.rows[0]`` (the process's count of
      non-empty batches read before this chunk).
    ack: Positions the poster had decided when posting; peers release their
      chunks that end at or before the smallest ack they have seen.
    report: The rows read, and the end of the stream if it was reached
      (exhausted or error), plus signature/config/device count.
    times: The poster's stage times (`stats.TIMES` order), for the
      cross-host view (`job_stats`); None when unchanged since its last chunk.
  """

  start: int
  ack: int
  report: reports_lib.Report
  times: tuple[float, ...] | None = None

  def to_json(self) -> str:
    # The report as a nested object (one parse at the decider, not two).
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "s": self.start, "a": self.ack}
    obj["R"] = self.report.to_obj()
    if self.times is not None:
      obj["t"] = list(self.times)
    return json.dumps(obj, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> Chunk:
    """Parses a chunk.

    Raises:
      ProtocolError: If it comes from another protocol version or does not parse.
    """
    obj = load(text, "report")
    try:
      times = tuple(map(float, obj["t"])) if "t" in obj else None
      return cls(obj["s"], obj["a"], reports_lib.Report.from_obj(obj["R"]), times)
    except (KeyError, TypeError, ValueError) as e:
      raise ProtocolError(f"a report that does not parse ({type(e).__name__}: {e})") from e


class ProtocolError(ValueError):
  """A message from a peer that this version cannot read.

  Attributes:
    version: The peer's protocol version, where it could be read.
  """

  def __init__(self, message: str, version: Any = None):
    super().__init__(message)
    self.version = version


def load(text: str, what: str) -> dict[str, Any]:
  """A message's JSON object, checked for this protocol version."""
  try:
    obj = json.loads(text)
  except ValueError as e:
    raise ProtocolError(f"a {what} that is not JSON ({e})") from e
  version = obj.get("v") if isinstance(obj, dict) else None
  if version != PROTOCOL_VERSION:
    raise ProtocolError(f"a {what} of protocol version {version!r}", version)
  return obj


def version_error(peer: int, version: Any, reader: int) -> str:
  """The message, the same on every host, for peers on another protocol version."""
  versions = sorted({peer: version, reader: PROTOCOL_VERSION}.items())
  shown = ", ".join(f"process {p}: {v!r}" for p, v in versions)
  return (
    "the processes run different versions of the grain_jax_sync agreement"
    f" protocol ({shown}); every process must run the same version of the library"
  )


@dataclasses.dataclass(frozen=True)
class Decision:
  """What process 0 decided for a run of positions; every process reads it.

  O(1) per position: (action, rows) per position, run-length encoded, not the
  per-process rows.

  Attributes:
    start: The first position decided.
    steps: The decided positions, in order.
    end: Whether the stream goes on, stops or raises after them.
    error: The error every host raises (with `End.RAISE`).
    signature: The agreed batch structure, sent once (in the first decision
      that knows it).
    batch_size: The full batch size the steps were judged by (given, or
      derived from the first position: every host saves it with its state).
    table: Rows of the cross-host view that changed (`job_stats`): per
      process, its index, decided counts and latest times; None if not sent.
  """

  start: int
  steps: tuple[plan_lib.Step, ...]
  end: plan_lib.End
  error: reports_lib.ReportedError | None = None
  signature: dict[str, Any] | None = None
  batch_size: int | None = None
  table: tuple[tuple[Any, ...], ...] | None = None

  def to_json(self) -> str:
    runs: list[list[Any]] = []
    for s in self.steps:
      if (
        runs
        and runs[-1][0] == s.action.value
        and runs[-1][1] == s.rows
        and _sizes(runs[-1]) == s.sizes
      ):
        runs[-1][2] += 1
      else:  # The agreed sizes (`pad_shapes`) only where there are some.
        runs.append(
          [s.action.value, s.rows, 1, list(s.sizes)] if s.sizes else [s.action.value, s.rows, 1]
        )
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "j": self.start, "st": runs, "e": self.end.value}
    if self.error is not None:
      obj["x"] = self.error.to_json()
    if self.signature is not None:
      obj["g"] = self.signature
    if self.batch_size is not None:
      obj["b"] = self.batch_size
    if self.table is not None:
      obj["t"] = [list(row) for row in self.table]
    return json.dumps(obj, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> Decision:
    """Parses a decision.

    Raises:
      ProtocolError: If it comes from another protocol version or does not parse.
    """
    obj = load(text, "decision")
    try:
      steps = tuple(  # One shared (frozen) step per run of equal positions.
        itertools.chain.from_iterable(
          itertools.repeat(plan_lib.Step(plan_lib.Action(a), rows, (), _sizes(run)), n)
          for run in obj["st"]
          for a, rows, n in (run[:3],)
        )
      )
      error = reports_lib.ReportedError.from_json(obj["x"]) if "x" in obj else None
      table = tuple(tuple(row) for row in obj["t"]) if "t" in obj else None
      end = plan_lib.End(obj["e"])
      return cls(obj["j"], steps, end, error, obj.get("g"), obj.get("b"), table)
    except (KeyError, TypeError, ValueError) as e:
      raise ProtocolError(f"a decision that does not parse ({type(e).__name__}: {e})") from e


def _sizes(run: list[Any]) -> tuple[int, ...]:
  """A decision run's agreed sizes (a 4th entry with `pad_shapes`)."""
  return tuple(run[3]) if len(run) > 3 else ()
