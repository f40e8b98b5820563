"""The agreement decision: per-host window reports -> one plan for every host.

Every host reads up to a window of batches, reports what it got (`Report`), and
receives every host's report. `decide` is a pure function of those reports and
the options, so every host computes the same `Plan` and acts on its own row of
it: yield its real batch (padded if needed), yield a dummy batch, drop the
position, stop, or raise the same error.

No JAX and no I/O here.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping, Sequence
from typing import Any

from grain_jax_sync._src import batches as batches_lib


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


# Endings that end the stream at once, whatever positions are still undecided
# (rows a process posted beyond such an ending are void).
ABORTS = frozenset({ErrorKind.CLOSED, ErrorKind.TIMEOUT, ErrorKind.LOST})


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
    return [
      self.kind.value,
      self.message,
      self.process_index,
      self.batch_index,
      self.type_name,
      list(self.missing),
    ]

  @classmethod
  def from_json(cls, obj: Sequence[Any]) -> ReportedError:
    kind, message, pi, bi, tn, *rest = obj
    missing = tuple(rest[0]) if rest else ()
    return cls(ErrorKind(kind), message, pi, bi, tn, missing)


@dataclasses.dataclass(frozen=True)
class Report:
  """What one host read in one window.

  Attributes:
    process_index: The reporting process.
    rows: Row count of each batch read in this window, in order.
    exhausted: True if the source ended after those batches.
    error: Set if reading or validating the batch after `rows` failed.
    signature: The host's batch structure, once it has seen a batch.
    local_devices: ``jax.local_device_count()`` on the host.
    config: The host's settings (first window only), compared across hosts.
    resume: The output batch the host resumes at (first window only),
      compared across hosts.
  """

  process_index: int
  rows: tuple[int, ...] = ()
  exhausted: bool = False
  error: ReportedError | None = None
  signature: dict[str, Any] | None = None
  local_devices: int = 1
  config: dict[str, Any] | None = None
  resume: int | None = None

  def to_json(self) -> str:
    obj: dict[str, Any] = {
      "p": self.process_index,
      "r": list(self.rows),
      "x": self.exhausted,
      "d": self.local_devices,
    }
    if self.error is not None:
      obj["e"] = self.error.to_json()
    if self.signature is not None:
      obj["s"] = self.signature
    if self.config is not None:
      obj["c"] = self.config
    if self.resume is not None:
      obj["b"] = self.resume
    return json.dumps(obj, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> Report:
    return cls.from_obj(json.loads(text))

  @classmethod
  def from_obj(cls, obj: Mapping[str, Any]) -> Report:
    error = ReportedError.from_json(obj["e"]) if "e" in obj else None
    return cls(
      process_index=obj["p"],
      rows=tuple(obj["r"]),
      exhausted=obj["x"],
      error=error,
      signature=obj.get("s"),
      local_devices=obj["d"],
      config=obj.get("c"),
      resume=obj.get("b"),
    )


class Action(enum.StrEnum):
  YIELD = "yield"  # Every host yields `rows` rows (real, padded or dummy).
  DROP = "drop"  # Every host discards its batch at this position.


@dataclasses.dataclass(frozen=True)
class Step:
  """One window position, the same on every host.

  Attributes:
    action: Yield or drop.
    rows: Rows each host yields (the padded size); 0 for a drop.
    real_rows: Real rows per process (0 where the process yields a dummy).
  """

  action: Action
  rows: int
  real_rows: tuple[int, ...]


class End(enum.StrEnum):
  CONTINUE = "continue"  # Read another window.
  STOP = "stop"  # The stream is over on every host.
  RAISE = "raise"  # Every host raises `Plan.error` after the steps.


@dataclasses.dataclass(frozen=True)
class Plan:
  steps: tuple[Step, ...]
  end: End
  error: ReportedError | None = None


@dataclasses.dataclass(frozen=True)
class Options:
  """The settings that `decide` needs; identical on every host."""

  batch_size: int
  drop_last: bool
  pad: bool


def _value_error(message: str, process_index: int = -1, batch_index: int = -1) -> ReportedError:
  return ReportedError(ErrorKind.VALUE, message, process_index, batch_index)


def _config_error(reports: Sequence[Report]) -> ReportedError | None:
  configs = [(r.process_index, r.config) for r in reports if r.config is not None]
  if len(configs) < 2:
    return None
  p0, c0 = configs[0]
  for p, c in configs[1:]:
    if c != c0:
      keys = sorted(set(c0) | set(c))
      diffs = [f"{k}: {c0.get(k)!r} vs {c.get(k)!r}" for k in keys if c0.get(k) != c.get(k)]
      return _value_error(
        f"processes {p0} and {p} were given different settings"
        f" ({'; '.join(diffs)}); every process must build the iterator with"
        " the same arguments"
      )
  return None


def _resume_error(reports: Sequence[Report]) -> ReportedError | None:
  resumes = [(r.process_index, r.resume) for r in reports if r.resume is not None]
  if len({b for _, b in resumes}) < 2:
    return None
  where = ", ".join(f"process {p} at batch {b}" for p, b in resumes)
  return _value_error(
    f"the processes resume from different positions ({where}); every process"
    " must restore its state from the same checkpoint step"
  )


def _signature_error(reports: Sequence[Report]) -> ReportedError | None:
  sigs = [(r.process_index, r.signature) for r in reports if r.signature is not None]
  if len(sigs) < 2:
    return None
  p0, s0 = sigs[0]
  for p, s in sigs[1:]:
    if s != s0:
      a = batches_lib.Signature.from_json(s0)
      b = batches_lib.Signature.from_json(s)
      diffs = batches_lib.diff(a, b) or ["tree structure differs"]
      return _value_error(
        f"processes {p0} and {p} yield batches of different structure:"
        f" {'; '.join(diffs)} (first: process {p0}, second: process {p});"
        f" process {p0} has [{a.describe()}], process {p} has"
        f" [{b.describe()}]. Every host must yield the same columns,"
        " dtypes and trailing shapes"
      )
  return None


def _fmt(processes: Sequence[int]) -> str:
  return ("process " if len(processes) == 1 else "processes ") + ", ".join(map(str, processes))


def decide(reports: Sequence[Report], options: Options, *, position: int = 0) -> Plan:  # noqa: C901 - size rules: being reshaped on the drop-ins branch
  """Decides what every host does with the window just read.

  Args:
    reports: One report per process, in process order.
    options: The shared settings.
    position: Number of batches yielded before this window (for messages).

  Returns:
    The plan; identical on every host given identical reports.
  """
  error = _config_error(reports) or _resume_error(reports) or _signature_error(reports)
  if error is not None:
    return Plan((), End.RAISE, error)

  window = max((len(r.rows) for r in reports), default=0)
  steps: list[Step] = []
  for i in range(window + 1):
    failed = [r.error for r in reports if r.error is not None and len(r.rows) == i]
    if failed:
      return Plan(tuple(steps), End.RAISE, failed[0])
    has = [i < len(r.rows) for r in reports]
    if not any(has):
      # Every source ended (or every host read a full window: read another).
      done = all(r.exhausted for r in reports)
      return Plan(tuple(steps), End.STOP if done else End.CONTINUE)
    index = position + len([s for s in steps if s.action == Action.YIELD])
    if not all(has):
      if options.drop_last:
        return Plan(tuple(steps), End.STOP)
      out = [r.process_index for r, h in zip(reports, has) if not h]
      left = [r.process_index for r, h in zip(reports, has) if h]
      if not options.pad:
        return Plan(
          tuple(steps),
          End.RAISE,
          _value_error(
            f"uneven number of batches: {_fmt(out)} ran out of data at"
            f" batch {index} while {_fmt(left)}"
            f" {'still has' if len(left) == 1 else 'still have'} batches. Set"
            " `drop_last=True` to stop at the shortest host, or pass"
            " `paddings` to fill the missing batches with masked dummy"
            " batches"
          ),
        )
    rows = [r.rows[i] if h else 0 for r, h in zip(reports, has)]
    real = [x for x, h in zip(rows, has) if h]
    if options.pad or options.drop_last:
      big = [(r.process_index, x) for r, x in zip(reports, rows) if x > options.batch_size]
      if big:
        p, x = big[0]
        return Plan(
          tuple(steps),
          End.RAISE,
          _value_error(
            f"process {p}, output batch {index}: {x} rows, more than"
            f" `batch_size`={options.batch_size}; expected at most"
            " `batch_size` rows per host batch. Batch the source with the"
            " same batch size"
          ),
        )
    if options.drop_last and min(real) < options.batch_size:
      steps.append(Step(Action.DROP, 0, tuple(rows)))
      continue
    if options.pad:
      target = options.batch_size
    else:
      if min(real) != max(real):
        sizes = ", ".join(f"process {r.process_index}: {x}" for r, x in zip(reports, rows))
        return Plan(
          tuple(steps),
          End.RAISE,
          _value_error(
            f"uneven batch sizes at batch {index}: host batch sizes range"
            f" from {min(real)} to {max(real)} ({sizes}). Pass `paddings`"
            " to pad every batch to `batch_size`, or `drop_last=True` to"
            " drop short batches"
          ),
        )
      target = real[0]
    for r in reports:
      if target % r.local_devices:
        return Plan(
          tuple(steps),
          End.RAISE,
          _value_error(
            f"batch {index} has {target} rows per host, not divisible by"
            f" the {r.local_devices} local devices of process"
            f" {r.process_index}. Pass `paddings` with a divisible"
            " `batch_size`, set `drop_last=True`, or batch by a multiple"
            " of the local device count"
          ),
        )
    steps.append(Step(Action.YIELD, target, tuple(rows)))
  return Plan(tuple(steps), End.CONTINUE)


def settings_digest(settings: Mapping[str, Any]) -> dict[str, Any]:
  """A JSON-stable copy of the settings that every host must share."""
  return json.loads(json.dumps(settings, sort_keys=True, default=repr))
