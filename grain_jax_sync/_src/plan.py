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
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import shapes as shapes_lib


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
    local_devices: The data shards the host's local devices hold (its local
      rows divide among them): ``jax.local_device_count()`` unless a model
      axis replicates rows.
    config: The host's settings (first window only), compared across hosts.
    more: True if the host holds at least one more batch after `rows` (it
      read ahead). Without it the last of `rows` counts as the host's last
      batch when a short batch is judged.
    resume: The output batch the host resumes at (first window only),
      compared across hosts.
    digests: Where processes share rows: a digest of the rows of each batch
      in `rows` (`sharding.rows_digest`), compared beside `decide`
      (`agreement.decide`); empty otherwise.
    sizes: With `pad_shapes`: per batch in `rows`, its sizes of the varying
      dims (`batches.HostBatch.sizes`); empty otherwise (nothing on the wire).
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

  def to_json(self) -> str:
    return json.dumps(self.to_obj(), separators=(",", ":"))

  def to_obj(self) -> dict[str, Any]:
    """The report as a JSON-ready object (only the fields that differ from their defaults)."""
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
    if self.more:
      obj["m"] = True
    if self.resume is not None:
      obj["b"] = self.resume
    if self.digests:
      obj["h"] = list(self.digests)
    if self.sizes:
      obj["z"] = [list(z) for z in self.sizes]
    return obj

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
      more=obj.get("m", False),
      resume=obj.get("b"),
      digests=tuple(obj.get("h", ())),
      sizes=tuple(tuple(z) for z in obj.get("z", ())),
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
    sizes: With `pad_shapes`, a yield's agreed sizes of the varying dims
      (leaf by leaf, as `Report.sizes`): every host pads to them.
  """

  action: Action
  rows: int
  real_rows: tuple[int, ...]
  sizes: tuple[int, ...] = ()


class End(enum.StrEnum):
  CONTINUE = "continue"  # Read another window.
  STOP = "stop"  # The stream is over on every host.
  RAISE = "raise"  # Every host raises `Plan.error` after the steps.
  # The next position holds a short batch that may or may not be its host's
  # last (`Options.wait_for_last`): decide again from there once every process
  # in `Plan.waiting` has reported one more batch or its end.
  WAIT = "wait"


@dataclasses.dataclass(frozen=True)
class Plan:
  """What every host does with a window.

  Attributes:
    steps: One step per decided position, in order.
    end: What happens after the steps.
    error: The error every host raises when `end` is `End.RAISE`.
    batch_size: The full batch size the steps were judged by: the one given,
      or the one derived from the first position when `Options.batch_size` is
      None (None if no position was reached).
    waiting: With `End.WAIT`, the processes whose next batch (or end) is
      needed to decide the position after the steps.
  """

  steps: tuple[Step, ...]
  end: End
  error: ReportedError | None = None
  batch_size: int | None = None
  waiting: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Options:
  """The settings that `decide` needs; identical on every host.

  Attributes:
    batch_size: Rows of a full host batch: what `paddings` fill to and what
      `drop_last` calls short. None: the largest host batch of the first
      position decided (see `decide`).
    drop_last: Stop when a host runs out; drop a short last batch.
    pad: Pad short batches and fill missing ones with dummy batches.
    wait_for_last: Where the outcome of a short batch depends on whether it
      is its host's last and the reports do not say (it ends its host's
      report, which is not marked `exhausted`, `error` or `more`), end the
      plan with `End.WAIT` instead of taking it as the last.
    derived: `batch_size` was derived from the first position (set by `pin`);
      a derived size is a guess, so a short batch that is not its host's last
      raises even with `pad`.
    shapes: `pad_shapes` and its buckets: each yield gets agreed sizes
      (`Step.sizes`) from the reports' `sizes`.
  """

  batch_size: int | None
  drop_last: bool
  pad: bool
  wait_for_last: bool = False
  derived: bool = False
  shapes: shapes_lib.Shapes | None = None


def pin(options: Options, plan: Plan) -> Options:
  """The options for the next `decide` call: the derived batch size pinned.

  Call it after every `decide` (and save the pinned size with the resume
  state), so that later positions are judged by the first position's size.
  """
  if options.batch_size is None and plan.batch_size is not None:
    return dataclasses.replace(options, batch_size=plan.batch_size, derived=True)
  return options


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
      differ = [k for k in keys if c0.get(k) != c.get(k)]
      diffs = [f"{k}: {c0.get(k)!r} vs {c.get(k)!r}" for k in differ]
      mesh = any(k.startswith("sharding") for k in differ)
      return _value_error(
        f"processes {p0} and {p} were given different settings"
        f" ({'; '.join(diffs)}); every process must build the iterator with"
        " the same arguments"
        + (
          ". If every process was given the same arguments, the processes"
          " created their iterators in a different order (iterators are paired"
          " by creation order): create them in the same order, or pass the"
          " same `name=` to each pair"
          if not mesh
          else ""
        )
        + (
          ", and the same mesh: the same devices in the same order (build it"
          " from jax.devices() in the same way everywhere, e.g."
          " grain_jax_sync.default_mesh())"
          if mesh
          else ""
        )
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


# The reference's (Ray Data's `jax_sync_generator`) opening phrases; callers
# match on them, so every message of the same kind starts with them.
UNEVEN_COUNT = "Uneven number of batches detected across JAX workers"
UNEVEN_SIZES = "Uneven batch sizes detected across JAX workers"
NOT_DIVISIBLE = "must be evenly divisible by the number of local JAX devices"


def _uneven_count_error(
  reports: Sequence[Report], has: Sequence[bool], index: int
) -> ReportedError:
  out = [r.process_index for r, h in zip(reports, has, strict=True) if not h]
  left = [r.process_index for r, h in zip(reports, has, strict=True) if h]
  return _value_error(
    f"{UNEVEN_COUNT}: {_fmt(out)} ran out of data at batch {index} while"
    f" {_fmt(left)} {'still has' if len(left) == 1 else 'still have'} batches."
    " Set `drop_last=True` to stop at the shortest host, or pass `paddings`"
    " to fill the missing batches with masked dummy batches"
  )


def _sizes(reports: Sequence[Report], rows: Sequence[int], has: Sequence[bool]) -> str:
  return ", ".join(
    f"process {r.process_index}: {x if h else 'none'}"
    for r, x, h in zip(reports, rows, has, strict=True)
  )


def _is_last(report: Report, i: int) -> bool:
  """Whether `report.rows[i]` is its host's last batch, as far as it is known."""
  return i == len(report.rows) - 1 and not report.more


def _unknown_if_last(report: Report, i: int) -> bool:
  """Whether the report does not say if `report.rows[i]` is its host's last."""
  ended = report.exhausted or report.error is not None
  return _is_last(report, i) and not ended


@dataclasses.dataclass(frozen=True)
class _Wait:
  processes: tuple[int, ...]


def _full_name(derived: bool) -> str:
  if derived:
    return "the largest host batch of the first batch, as `batch_size` was not given"
  return "`batch_size`"


def _short_error(
  p: int, rows: int, full: int, derived: bool, index: int, sizes: str, uneven: bool
) -> ReportedError:
  """A short batch that is not its host's last, where it cannot be padded."""
  prefix = f"{UNEVEN_SIZES}: " if uneven else ""
  fix = (
    "Pass `batch_size` (with `paddings`, short batches are then padded)"
    if derived
    else "Pass `paddings` to pad short batches (with `mask_key` to mask them)"
  )
  return _value_error(
    f"{prefix}process {p}, batch {index}: {rows} rows, fewer than the full"
    f" batch size {full} ({_full_name(derived)}), and it is not the last"
    f" batch of process {p}; only a host's last batch may be short ({sizes})."
    f" {fix}, or batch the source so that only its last batch is short"
  )


def _size_step(
  reports: Sequence[Report],
  i: int,
  options: Options,
  *,
  full: int,
  derived: bool,
  index: int,
) -> Step | ReportedError | _Wait:
  """The size rules for position `i`: yield (padded, passed through), drop or error.

  A batch of `full` rows is full. With `paddings` or `drop_last`, a batch larger
  than `full` passes through unpadded when every host has a batch of exactly
  that size (as in the reference), and is an error otherwise. A position whose
  short batches are all their hosts' last is dropped (`drop_last`) or padded
  (`paddings`). A short batch that is not its host's last raises, except that
  `paddings` with a given `batch_size` pads it (as the reference does).
  Without either option every host's batch must have the same size.
  """
  if all(i < len(r.rows) and r.rows[i] == full for r in reports):
    return Step(Action.YIELD, full, (full,) * len(reports))  # Every batch full: the rules agree.
  has = [i < len(r.rows) for r in reports]
  rows = [r.rows[i] if h else 0 for r, h in zip(reports, has, strict=True)]
  real = [x for x, h in zip(rows, has, strict=True) if h]
  even = all(has) and min(real) == max(real)
  if not (options.pad or options.drop_last):
    if not even:
      return _value_error(
        f"{UNEVEN_SIZES} at batch {index}: host batch sizes range from"
        f" {min(real)} to {max(real)} ({_sizes(reports, rows, has)}). Pass"
        " `paddings` to pad every batch to the full batch size, or"
        " `drop_last=True` to drop a short last batch"
      )
    return Step(Action.YIELD, real[0], tuple(rows))
  if max(real) > full:
    if even:  # Every host has the same larger batch: it passes through.
      return Step(Action.YIELD, real[0], tuple(rows))
    p, x = next((r.process_index, x) for r, x in zip(reports, rows, strict=True) if x > full)
    return _value_error(
      f"{UNEVEN_SIZES} at batch {index}: process {p} has {x} rows, more"
      f" than the full batch size {full} ({_full_name(derived)}), and not"
      f" every host has a batch of that size ({_sizes(reports, rows, has)})."
      " Padding only fills batches up to the full size; batch every host's"
      " source with the same batch size"
    )
  short = [(r, x) for r, x, h in zip(reports, rows, has, strict=True) if h and x < full]
  early = [(r, x) for r, x in short if not _is_last(r, i)]
  unknown = tuple(r.process_index for r, _ in short if _unknown_if_last(r, i))
  matters = options.drop_last or derived  # Else padded, last or not.
  refused = early and (derived or not options.pad)
  # Wait where the outcome, or the process the error names (the first one
  # whose short batch is not its last), is not known yet.
  named = early[0][0].process_index if early else -1
  if unknown and matters and options.wait_for_last and (not refused or unknown[0] < named):
    return _Wait(unknown)
  if refused:
    r, x = early[0]
    sizes = _sizes(reports, rows, has)
    return _short_error(r.process_index, x, full, derived, index, sizes, min(real) != max(real))
  if short and options.drop_last and not early:
    return Step(Action.DROP, 0, tuple(rows))
  return Step(Action.YIELD, full, tuple(rows))


def _divisibility_error(reports: Sequence[Report], target: int, index: int) -> ReportedError | None:
  for r in reports:
    if target % r.local_devices:
      return _value_error(
        f"The local batch size ({target}) {NOT_DIVISIBLE}"
        f" ({r.local_devices}) of process {r.process_index}: batch {index}"
        f" has {target} rows per host, not divisible by process"
        f" {r.process_index}'s {r.local_devices} data shards (one per local"
        " device, fewer where a model axis replicates rows). Pass `paddings`"
        " with a divisible `batch_size`, set `drop_last=True`, or batch by a"
        " multiple of that count"
      )
  return None


def decide(reports: Sequence[Report], options: Options, *, position: int = 0) -> Plan:
  """Decides what every host does with the window just read.

  With `Options.shapes`, each yielded step carries the agreed sizes of the
  varying dims (`agree_sizes`).

  Args:
    reports: One report per process, in process order.
    options: The shared settings (see `decide_rows`).
    position: Number of batches yielded before this window (for messages).

  Returns:
    The plan; identical on every host given identical reports.
  """
  plan = decide_rows(reports, options, position=position)
  if options.shapes is None or not plan.steps:
    return plan
  return agree_sizes(plan, reports, options.shapes, position=position)


def agree_sizes(
  plan: Plan, reports: Sequence[Report], shapes: shapes_lib.Shapes, *, position: int
) -> Plan:
  """`plan` with each yield's agreed sizes: per varying dim the max over hosts, bucketed.

  A size above its column's last bucket ends the plan before that step with
  the same ValueError on every host.
  """
  sig = next((r.signature for r in reports if r.signature is not None), None)
  if sig is None:
    return plan
  leaves = sig["leaves"]
  layout = shapes_lib.flat(
    shapes, tuple(n for n, _, _ in leaves), tuple(tuple(x) for _, _, x in leaves)
  )
  steps: list[Step] = []
  index = position
  for i, step in enumerate(plan.steps):
    if step.action == Action.YIELD:
      per_host = [r.sizes[i] if i < len(r.sizes) else None for r in reports]
      sizes = shapes_lib.agree(per_host, layout)
      if isinstance(sizes, shapes_lib.Above):
        message = shapes_lib.above_message(layout, sizes, per_host, index)
        return dataclasses.replace(
          plan, steps=tuple(steps), end=End.RAISE, error=_value_error(message, -1, index)
        )
      step = Step(step.action, step.rows, step.real_rows, sizes)
      index += 1
    steps.append(step)
  return dataclasses.replace(plan, steps=tuple(steps))


def decide_rows(reports: Sequence[Report], options: Options, *, position: int = 0) -> Plan:  # noqa: C901 - one rule per branch, in order
  """Decides what every host does with the window just read (rows, not sizes).

  Args:
    reports: One report per process, in process order.
    options: The shared settings. With ``options.batch_size=None`` the full
      batch size is the largest host batch of the window's first position
      (the same on every host); `Plan.batch_size` returns it, and the caller
      passes ``pin(options, plan)`` from then on.
    position: Number of batches yielded before this window (for messages).

  Returns:
    The plan; identical on every host given identical reports.
  """
  error = _config_error(reports) or _resume_error(reports) or _signature_error(reports)
  if error is not None:
    return Plan((), End.RAISE, error)

  full = options.batch_size
  derived = full is None or options.derived
  window = max((len(r.rows) for r in reports), default=0)
  steps: list[Step] = []
  index = position  # Output batches before position i (for messages), kept as it goes.
  divisible: set[int] = set()  # Row counts every process's devices divide.

  def plan(end: End, error: ReportedError | None = None) -> Plan:
    return Plan(tuple(steps), end, error, batch_size=full)

  i = 0
  while i <= window:
    if full is not None and (run := _full_run(reports, i, full)):
      # Every host's batch is full at positions [i, i + run): one shared
      # step each, as `_size_step` would decide them one by one.
      if full not in divisible:
        error = _divisibility_error(reports, full, index)
        if error is not None:
          return plan(End.RAISE, error)
        divisible.add(full)
      steps.extend(itertools.repeat(Step(Action.YIELD, full, (full,) * len(reports)), run))
      index += run
      i += run
      continue
    failed = [r.error for r in reports if r.error is not None and len(r.rows) == i]
    if failed:
      return plan(End.RAISE, failed[0])
    has = [i < len(r.rows) for r in reports]
    if not any(has):
      # Every source ended (or every host read a full window: read another).
      return plan(End.STOP if all(r.exhausted for r in reports) else End.CONTINUE)
    if not all(has):
      if options.drop_last:
        return plan(End.STOP)
      if not options.pad:
        return plan(End.RAISE, _uneven_count_error(reports, has, index))
    if full is None:
      full = max(r.rows[i] for r, h in zip(reports, has, strict=True) if h)
    step = _size_step(reports, i, options, full=full, derived=derived, index=index)
    if isinstance(step, ReportedError):
      return plan(End.RAISE, step)
    if isinstance(step, _Wait):
      return dataclasses.replace(plan(End.WAIT), waiting=step.processes)
    if step.action == Action.YIELD and step.rows not in divisible:
      error = _divisibility_error(reports, step.rows, index)
      if error is not None:
        return plan(End.RAISE, error)
      divisible.add(step.rows)
    steps.append(step)
    index += step.action == Action.YIELD
    i += 1
  return plan(End.CONTINUE)


def _full_run(reports: Sequence[Report], i: int, full: int) -> int:
  """How many positions from `i` on hold a batch of `full` rows on every host.

  A quick stream's common case, compared a slice at a time instead of
  position by position (no error can sit there: a report's error follows
  its last row).
  """
  n = min(len(r.rows) for r in reports) - i
  if n <= 0:
    return 0
  want = (full,) * n
  for r in reports:
    got = r.rows[i : i + n]
    if got != want:
      n = next((k for k, x in enumerate(got) if x != full), n)
      if not n:
        return 0
      want = want[:n]
  return n


def settings_digest(settings: Mapping[str, Any]) -> dict[str, Any]:
  """A JSON-stable copy of the settings that every host must share."""
  return json.loads(json.dumps(settings, sort_keys=True, default=repr))
