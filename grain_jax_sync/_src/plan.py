"""The agreement decision: per-host window reports -> one plan for every host.

Every host reads up to a window of batches, reports what it got (`Report`), and
receives every host's report. `decide` is a pure function of those reports and
the options, so every host computes the same `Plan` and acts on its own row of
it: yield its real batch (padded if needed), yield a dummy batch, drop the
position, stop, or raise the same error.

The reports and their wire form are in `reports.py` (named here as well:
`plan.Report`), the errors and their messages in `plan_errors.py`.

No JAX and no I/O here.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from grain_jax_sync._src import plan_errors as errors_lib
from grain_jax_sync._src import shapes as shapes_lib

# The decision's input, named here as well (`plan.Report`, ...).
from grain_jax_sync._src.reports import ErrorKind as ErrorKind
from grain_jax_sync._src.reports import Report as Report
from grain_jax_sync._src.reports import ReportedError as ReportedError


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
      return errors_lib.uneven_sizes_error(reports, rows, has, index)
    return Step(Action.YIELD, real[0], tuple(rows))
  if max(real) > full:
    if even:  # Every host has the same larger batch: it passes through.
      return Step(Action.YIELD, real[0], tuple(rows))
    return errors_lib.larger_error(reports, rows, has, full=full, derived=derived, index=index)
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
    return errors_lib.short_error(
      reports, rows, has, p=r.process_index, x=x, full=full, derived=derived, index=index
    )
  if short and options.drop_last and not early:
    return Step(Action.DROP, 0, tuple(rows))
  return Step(Action.YIELD, full, tuple(rows))


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
          plan, steps=tuple(steps), end=End.RAISE, error=errors_lib.value_error(message, -1, index)
        )
      step = Step(step.action, step.rows, step.real_rows, sizes)
      index += 1
    steps.append(step)
  return dataclasses.replace(plan, steps=tuple(steps))


def decide_rows(reports: Sequence[Report], options: Options, *, position: int = 0) -> Plan:
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
  error = (
    errors_lib.config_error(reports)
    or errors_lib.resume_error(reports)
    or errors_lib.signature_error(reports)
  )
  if error is not None:
    return Plan((), End.RAISE, error)
  window = max((len(r.rows) for r in reports), default=0)
  walk = _Walk(reports, options, position)
  while walk.i <= window:
    # A run of full positions first (it stops where a position is not full
    # everywhere, at or before `window`), then that position by the rules.
    end = walk.full_run() or walk.end_here() or walk.step()
    if end is not None:
      return end
  return walk.plan(End.CONTINUE)


class _Walk:
  """`decide_rows` going through a window's positions in order, adding one step each."""

  def __init__(self, reports: Sequence[Report], options: Options, position: int):
    self.reports = reports
    self.options = options
    self.full = options.batch_size
    self.derived = self.full is None or options.derived
    self.i = 0  # The next position of the window to decide.
    self.steps: list[Step] = []
    self.index = position  # Output batches before position i (for messages), kept as it goes.
    self.divisible: set[int] = set()  # Row counts every process's devices divide.

  def plan(self, end: End, error: ReportedError | None = None) -> Plan:
    """The plan of the steps so far, ending with `end`."""
    return Plan(tuple(self.steps), end, error, batch_size=self.full)

  def full_run(self) -> Plan | None:
    """Decides the positions from `i` on where every host's batch is full (or raises)."""
    if self.full is None or not (run := _full_run(self.reports, self.i, self.full)):
      return None
    # One shared step each, as `_size_step` would decide them one by one.
    if (error := self._divisibility_error(self.full)) is not None:
      return self.plan(End.RAISE, error)
    step = Step(Action.YIELD, self.full, (self.full,) * len(self.reports))
    self.steps.extend(itertools.repeat(step, run))
    self.index += run
    self.i += run
    return None

  def end_here(self) -> Plan | None:
    """The plan if it ends at position `i`: a host failed there, or some host has no batch."""
    reports, i = self.reports, self.i
    failed = [r.error for r in reports if r.error is not None and len(r.rows) == i]
    if failed:
      return self.plan(End.RAISE, failed[0])
    has = [i < len(r.rows) for r in reports]
    if not any(has):
      # Every source ended (or every host read a full window: read another).
      return self.plan(End.STOP if all(r.exhausted for r in reports) else End.CONTINUE)
    if not all(has):
      if self.options.drop_last:
        return self.plan(End.STOP)
      if not self.options.pad:
        return self.plan(End.RAISE, errors_lib.uneven_count_error(reports, has, self.index))
    return None

  def step(self) -> Plan | None:
    """Decides position `i` by the size rules: its step added, or the plan's end."""
    reports, i = self.reports, self.i
    if self.full is None:
      self.full = max(r.rows[i] for r in reports if i < len(r.rows))
    step = _size_step(
      reports, i, self.options, full=self.full, derived=self.derived, index=self.index
    )
    if isinstance(step, ReportedError):
      return self.plan(End.RAISE, step)
    if isinstance(step, _Wait):
      return dataclasses.replace(self.plan(End.WAIT), waiting=step.processes)
    if step.action == Action.YIELD and (error := self._divisibility_error(step.rows)):
      return self.plan(End.RAISE, error)
    self.steps.append(step)
    self.index += step.action == Action.YIELD
    self.i += 1
    return None

  def _divisibility_error(self, rows: int) -> ReportedError | None:
    """The error if some process's devices do not divide `rows` (each count checked once)."""
    if rows in self.divisible:
      return None
    error = errors_lib.divisibility_error(self.reports, rows, self.index)
    if error is None:
      self.divisible.add(rows)
    return error


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
