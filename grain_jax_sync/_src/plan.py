"""The agreement decision: every host's reports -> one plan, and its errors.

`decide` is a pure function of every host's `messages.Report` and the rules,
so every host acts on the same `Plan`, each on its own row of it. Its errors
are `messages.ReportedError`s of kind VALUE that every host raises as the
same ValueError, naming the processes, the batch and the option that fixes
them. No JAX, no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import shapes as shapes_lib
from grain_jax_sync._src.messages import (
  Action,
  Decision,
  ErrorKind,
  Outcome,
  Report,
  ReportedError,
  Step,
  signature_of,
)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What every host does with a window: its steps, then `end`."""

  steps: tuple[Step, ...]  # One per decided position, in order.
  end: Outcome
  error: ReportedError | None = None  # What every host raises when `end` is `Outcome.RAISE`.
  # The full batch size the steps were judged by: given, or derived from the first position
  # (None if no position was reached).
  batch_size: int | None = None
  waiting: tuple[int, ...] = ()  # With `Outcome.WAIT`: whose next batch (or end) it waits for.


@dataclasses.dataclass(frozen=True)
class Rules:
  """The rules `decide` applies, from the options; identical on every host."""

  # Rows of a full host batch: what `paddings` fill to and what `drop_last` calls short.
  # None: the largest host batch of the first position decided (see `decide`).
  batch_size: int | None
  drop_last: bool  # Stop when a host runs out; drop a short last batch.
  pad: bool  # Pad short batches and fill missing ones with dummy batches.
  # Where a short batch's outcome depends on whether it is its host's last and the report
  # does not say, end with `Outcome.WAIT`.
  wait_for_last: bool = False
  # `batch_size` was derived (set by `pin`): a guess, so a short batch that is not its
  # host's last raises even with `pad`.
  derived: bool = False
  shapes: shapes_lib.Shapes | None = None  # Each yield gets agreed sizes (`Step.sizes`).


def pin(rules: Rules, plan: Plan | Decision) -> Rules:
  """The rules for the next `decide` (call it after each): the derived batch size pinned."""
  if rules.batch_size is None and plan.batch_size is not None:
    return dataclasses.replace(rules, batch_size=plan.batch_size, derived=True)
  return rules


def _is_last(report: Report, i: int) -> bool:
  """Whether `report.rows[i]` is its host's last batch, as far as it is known."""
  return i == len(report.rows) - 1 and not report.more


class _Position:
  """Every host's batch at position `i` of a window: the size rules, and their errors.

  A batch of `batch_size` rows is full. With `paddings` or `drop_last`, a batch larger
  than `batch_size` passes through unpadded when every host has a batch of exactly
  that size (as in the reference), and is an error otherwise. A position whose
  short batches are all their hosts' last is dropped (`drop_last`) or padded
  (`paddings`). A short batch that is not its host's last raises, except that
  `paddings` with a given `batch_size` pads it (as the reference does).
  Without either option every host's batch must have the same size.
  """

  def __init__(self, walk: _Walk, batch_size: int):
    self.reports, self.i, self.index = walk.reports, walk.i, walk.index
    self.derived, self.batch_size = walk.derived, batch_size
    self.has = [self.i < len(r.rows) for r in self.reports]
    self.rows = [r.rows[self.i] if h else 0 for r, h in zip(self.reports, self.has, strict=True)]
    self.real = [x for x, h in zip(self.rows, self.has, strict=True) if h]

  def judge(self, rules: Rules) -> Step | ReportedError | tuple[int, ...]:
    """The size rules for this position: yield (padded, passed through), drop, error, or wait
    (the processes whose next batch or end it waits for)."""
    i, batch_size, real, rows = self.i, self.batch_size, self.real, tuple(self.rows)
    even = all(self.has) and min(real) == max(real)
    if not (rules.pad or rules.drop_last):
      return Step(Action.YIELD, real[0], rows) if even else self._uneven_error()
    if max(real) > batch_size:
      # Every host has the same larger batch: it passes through.
      return Step(Action.YIELD, real[0], rows) if even else self._larger_error()
    short = [
      (r, x) for r, x, h in zip(self.reports, rows, self.has, strict=True) if h and x < batch_size
    ]
    early = [(r, x) for r, x in short if not _is_last(r, i)]
    # Short batches whose reports do not say whether they are their hosts' last.
    unknown = tuple(
      r.process_index
      for r, _ in short
      if _is_last(r, i) and not (r.exhausted or r.error is not None)
    )
    matters = rules.drop_last or self.derived  # Else padded, last or not.
    refused = early and (self.derived or not rules.pad)
    # Wait where the outcome, or the process the error names (the first one
    # whose short batch is not its last), is not known yet.
    named = early[0][0].process_index if early else -1
    if unknown and matters and rules.wait_for_last and (not refused or unknown[0] < named):
      return unknown
    if refused:
      return self._short_error(early[0][0].process_index, early[0][1])
    if short and rules.drop_last and not early:
      return Step(Action.DROP, 0, rows)
    return Step(Action.YIELD, batch_size, rows)

  def _listing(self) -> str:
    """Each process's rows ('none' where it has no batch)."""
    return ", ".join(
      f"process {r.process_index}: {x if h else 'none'}"
      for r, x, h in zip(self.reports, self.rows, self.has, strict=True)
    )

  def _full_name(self) -> str:
    """Where the full batch size came from, for messages."""
    if self.derived:
      return "the largest host batch of the first batch, as `batch_size` was not given"
    return "`batch_size`"

  def _uneven_error(self) -> ReportedError:
    """Host batches of different sizes, with neither `paddings` nor `drop_last`."""
    return value_error(
      f"{UNEVEN_SIZES} at batch {self.index}: host batch sizes range from"
      f" {min(self.real)} to {max(self.real)} ({self._listing()}). Pass"
      " `paddings` to pad every batch to the full batch size, or"
      " `drop_last=True` to drop a short last batch"
    )

  def _larger_error(self) -> ReportedError:
    """A batch larger than the full batch size that not every host shares."""
    p, x = next(
      (r.process_index, x)
      for r, x in zip(self.reports, self.rows, strict=True)
      if x > self.batch_size
    )
    return value_error(
      f"{UNEVEN_SIZES} at batch {self.index}: process {p} has {x} rows, more"
      f" than the full batch size {self.batch_size} ({self._full_name()}), and not"
      f" every host has a batch of that size ({self._listing()})."
      " Padding only fills batches up to the full size; batch every host's"
      " source with the same batch size"
    )

  def _short_error(self, p: int, x: int) -> ReportedError:
    """Process `p`'s short batch of `x` rows that is not its last, where it cannot be padded."""
    prefix = f"{UNEVEN_SIZES}: " if min(self.real) != max(self.real) else ""
    fix = (
      "Pass `batch_size` (with `paddings`, short batches are then padded)"
      if self.derived
      else "Pass `paddings` to pad short batches (with `mask_key` to mask them)"
    )
    return value_error(
      f"{prefix}process {p}, batch {self.index}: {x} rows, fewer than the full"
      f" batch size {self.batch_size} ({self._full_name()}), and it is not the last"
      f" batch of process {p}; only a host's last batch may be short ({self._listing()})."
      f" {fix}, or batch the source so that only its last batch is short"
    )


def decide(
  reports: Sequence[Report],
  rules: Rules,
  *,
  position: int = 0,
  groups: Sequence[Sequence[int]] = (),
) -> Plan:
  """Decides what every host does with the window just read.

  Args:
    reports: One report per process, in process order.
    rules: The shared settings. With ``rules.batch_size=None`` the full
      batch size is the largest host batch of the first position (returned
      in `Plan.batch_size`; ``pin(rules, plan)`` keeps it).
    position: Number of batches yielded before this window (for messages).
    groups: Where processes share rows (`BatchPlacement.groups`): the
      processes of each group, whose reports' digests must agree.

  Returns:
    The plan; identical on every host given identical reports. With
    `Rules.shapes`, each yield carries its agreed sizes: per varying dim the
    max over hosts, bucketed. A size above its column's last bucket, or rows
    that differ within a group (`shared_rows_error`), end the plan before
    that step with the same ValueError on every host.
  """
  plan = _decide_rows(reports, rules, position)
  if (rules.shapes is None and not groups) or not plan.steps:
    return plan
  sig = signature_of(reports)
  layout = None
  if rules.shapes is not None and sig is not None:
    signature = batches_lib.Signature.from_json(sig)
    layout = shapes_lib.flat(rules.shapes, signature.names, signature.shapes)
  steps: list[Step] = []
  index = position
  for i, step in enumerate(plan.steps):
    if step.action == Action.YIELD:
      message = None
      if layout is not None:
        per_host = [r.sizes[i] if i < len(r.sizes) else None for r in reports]
        sizes = shapes_lib.agree(per_host, layout, index)
        if isinstance(sizes, str):
          message = sizes
        else:
          step = Step(step.action, step.rows, step.real_rows, sizes)
      if message is None and groups:
        digests = [r.digests[i] if i < len(r.digests) else None for r in reports]
        message = shared_rows_error(digests, groups, index)
      if message is not None:
        error = value_error(message, index)
        return dataclasses.replace(plan, steps=tuple(steps), end=Outcome.RAISE, error=error)
      index += 1
    steps.append(step)
  return dataclasses.replace(plan, steps=tuple(steps))


def _decide_rows(reports: Sequence[Report], rules: Rules, position: int) -> Plan:
  """`decide` by the rows alone (no agreed sizes)."""
  error = config_error(reports) or resume_error(reports) or signature_error(reports)
  if error is not None:
    return Plan((), Outcome.RAISE, error)
  window = max((len(r.rows) for r in reports), default=0)
  walk = _Walk(reports, rules, position)
  while walk.i <= window:
    # A run of full positions first (it stops where a position is not full
    # everywhere, at or before `window`), then that position by the rules.
    end = walk.full_run() or walk.end_here() or walk.step()
    if end is not None:
      return end
  return walk.plan(Outcome.CONTINUE)


class _Walk:
  """`_decide_rows` going through a window's positions in order."""

  def __init__(self, reports: Sequence[Report], rules: Rules, position: int):
    self.reports = reports
    self.rules = rules
    self.batch_size = rules.batch_size
    self.derived = self.batch_size is None or rules.derived
    self.i = 0  # The next position of the window to decide.
    self.steps: list[Step] = []
    self.index = position  # Output batches before position i (for messages).
    self.divisible: set[int] = set()  # Row counts every process's devices divide.

  def plan(self, end: Outcome, error: ReportedError | None = None) -> Plan:
    """The plan of the steps so far, ending with `end`."""
    return Plan(tuple(self.steps), end, error, batch_size=self.batch_size)

  def full_run(self) -> Plan | None:
    """Decides the positions from `i` on where every host's batch is full (or raises)."""
    if self.batch_size is None or not (run := _full_run(self.reports, self.i, self.batch_size)):
      return None
    # One shared step each, as `_Position.judge` would decide them one by one.
    if (error := self._divisibility_error(self.batch_size)) is not None:
      return self.plan(Outcome.RAISE, error)
    step = Step(Action.YIELD, self.batch_size, (self.batch_size,) * len(self.reports))
    self.steps.extend(itertools.repeat(step, run))
    self.index += run
    self.i += run
    return None

  def end_here(self) -> Plan | None:
    """The plan if it ends at position `i`: a host failed there, or some host has no batch."""
    reports, i = self.reports, self.i
    failed = [r.error for r in reports if r.error is not None and len(r.rows) == i]
    if failed:
      return self.plan(Outcome.RAISE, failed[0])
    has = [i < len(r.rows) for r in reports]
    if not any(has):
      # Every source ended (or every host read a full window: read another).
      return self.plan(Outcome.STOP if all(r.exhausted for r in reports) else Outcome.CONTINUE)
    if not all(has):
      if self.rules.drop_last:
        return self.plan(Outcome.STOP)
      if not self.rules.pad:
        return self.plan(Outcome.RAISE, uneven_count_error(reports, has, self.index))
    return None

  def step(self) -> Plan | None:
    """Decides position `i` by the size rules: its step added, or the plan's end."""
    if self.batch_size is None:
      self.batch_size = max(r.rows[self.i] for r in self.reports if self.i < len(r.rows))
    step = _Position(self, self.batch_size).judge(self.rules)
    if isinstance(step, ReportedError):
      return self.plan(Outcome.RAISE, step)
    if isinstance(step, tuple):
      return dataclasses.replace(self.plan(Outcome.WAIT), waiting=step)
    if step.action == Action.YIELD and (error := self._divisibility_error(step.rows)):
      return self.plan(Outcome.RAISE, error)
    self.steps.append(step)
    self.index += step.action == Action.YIELD
    self.i += 1
    return None

  def _divisibility_error(self, rows: int) -> ReportedError | None:
    """The error if some process's devices do not divide `rows` (each count checked once)."""
    if rows in self.divisible:
      return None
    for r in self.reports:
      if rows % r.local_devices:
        return value_error(
          f"The local batch size ({rows}) {NOT_DIVISIBLE}"
          f" ({r.local_devices}) of process {r.process_index}: batch {self.index}"
          f" has {rows} rows per host, not divisible by process"
          f" {r.process_index}'s {r.local_devices} data shards (one per local"
          " device, fewer where a model axis replicates rows). Pass `paddings`"
          " with a divisible `batch_size`, set `drop_last=True`, or batch by a"
          " multiple of that count"
        )
    self.divisible.add(rows)
    return None


def _full_run(reports: Sequence[Report], i: int, batch_size: int) -> int:
  """How many positions from `i` on hold a batch of `batch_size` rows on every host, compared a
  slice at a time (no error can sit there: a report's error follows its last row)."""
  n = min(len(r.rows) for r in reports) - i
  if n <= 0:
    return 0
  want = (batch_size,) * n
  for got in [r.rows[i : i + n] for r in reports if r.rows[i : i + n] != want]:
    n = min(n, next(k for k, x in enumerate(got) if x != batch_size))
  return n


def settings_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, str]:
  """Per key where two settings digests differ, ``"key: a vs b"``, in key order."""
  keys = sorted(set(a) | set(b))
  return {k: f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)}


# -- the errors --------------------------------------------------------------------

# The reference's (Ray Data's `jax_sync_generator`) opening phrases, which callers match on.
UNEVEN_COUNT = "Uneven number of batches detected across JAX workers"
UNEVEN_SIZES = "Uneven batch sizes detected across JAX workers"
NOT_DIVISIBLE = "must be evenly divisible by the number of local JAX devices"


def value_error(message: str, batch_index: int = -1) -> ReportedError:
  """A ValueError that every host raises with `message` (no one process's: process -1)."""
  return ReportedError(ErrorKind.VALUE, message, -1, batch_index)


def _first_difference(
  given: Sequence[tuple[int, Any]],
) -> tuple[tuple[int, Any], tuple[int, Any]] | None:
  """The first (process, value) not None and the first later one whose value differs."""
  known = [(p, v) for p, v in given if v is not None]
  for p, v in known[1:]:
    if v is not known[0][1] and v != known[0][1]:  # The ledger shares equal structures.
      return known[0], (p, v)
  return None


def config_error(reports: Sequence[Report]) -> ReportedError | None:
  """The error for processes given different settings, if any were."""
  found = _first_difference([(r.process_index, r.config) for r in reports])
  if found is None:
    return None
  (p0, c0), (p, c) = found
  diffs = settings_diff(c0, c)
  fix = (
    ", and the same mesh: the same devices in the same order (build it"
    " from jax.devices() in the same way everywhere, e.g."
    " grain_jax_sync.default_mesh())"
    if any(k.startswith("sharding") for k in diffs)
    else ". If every process was given the same arguments, the processes"
    " created their iterators in a different order (iterators are paired"
    " by creation order): create them in the same order, or pass the"
    " same `name=` to each pair"
  )
  return value_error(
    f"processes {p0} and {p} were given different settings"
    f" ({'; '.join(diffs.values())}); every process must build the iterator with"
    f" the same arguments{fix}"
  )


def resume_error(reports: Sequence[Report]) -> ReportedError | None:
  """The error for processes resuming from different positions, if they do."""
  resumes = [(r.process_index, r.resume) for r in reports if r.resume is not None]
  if len({b for _, b in resumes}) < 2:
    return None
  where = ", ".join(f"process {p} at batch {b}" for p, b in resumes)
  return value_error(
    f"the processes resume from different positions ({where}); every process"
    " must restore its state from the same checkpoint step"
  )


def signature_error(reports: Sequence[Report]) -> ReportedError | None:
  """The error for processes whose batches differ in structure, if any do."""
  found = _first_difference([(r.process_index, r.signature) for r in reports])
  if found is None:
    return None
  (p0, s0), (p, s) = found
  a = batches_lib.Signature.from_json(s0)
  b = batches_lib.Signature.from_json(s)
  diffs = batches_lib.diff(a, b) or ["tree structure differs"]
  return value_error(
    f"processes {p0} and {p} yield batches of different structure:"
    f" {'; '.join(diffs)} (first: process {p0}, second: process {p});"
    f" process {p0} has [{a.describe()}], process {p} has"
    f" [{b.describe()}]. Every host must yield the same columns,"
    " dtypes and trailing shapes"
  )


def uneven_count_error(reports: Sequence[Report], has: Sequence[bool], index: int) -> ReportedError:
  """Some hosts ran out of batches at batch `index` while others did not."""
  out = [r.process_index for r, h in zip(reports, has, strict=True) if not h]
  left = [r.process_index for r, h in zip(reports, has, strict=True) if h]
  return value_error(
    f"{UNEVEN_COUNT}: {processes(out)} ran out of data at batch {index} while"
    f" {processes(left)} {'still has' if len(left) == 1 else 'still have'} batches."
    " Set `drop_last=True` to stop at the shortest host, or pass `paddings`"
    " to fill the missing batches with masked dummy batches"
  )


# -- identical rows where processes share a data shard ----------------------------


def shared_rows_error(
  digests: Sequence[str | None], groups: Sequence[Sequence[int]], batch_index: int
) -> str | None:
  """The error when processes that share a data shard fed different rows (`digests`: per process,
  `reader.rows_digest` of its rows at this batch, None for a dummy batch); None if they agree."""
  for shard, procs in enumerate(groups):
    fed = {p: digests[p] for p in procs if digests[p] is not None}
    ended = [p for p in procs if digests[p] is None]
    head = (
      f"batch {batch_index}: processes {list(procs)} hold the same data shards"
      f" (input shard {shard}) and must feed identical rows, but"
    )
    if fed and ended:
      # A dummy batch on one replica and real rows on another would make a
      # global array whose copies differ from process to process.
      return (
        f"{head} {processes(ended)} had no batch {batch_index} (its source ended) while"
        f" {processes(list(fed))} had one. Processes that share data shards must"
        f" feed the same number of batches: load {_LOAD_SHARD}"
      )
    if len(set(fed.values())) > 1:
      detail = ", ".join(f"process {p}: {d}" for p, d in fed.items())
      return f"{head} their rows differ (row digests {detail}). Load {_LOAD_SHARD}"
  return None


_LOAD_SHARD = (
  "the data with grain_jax_sync.data_shard_info(mesh) as the shard"
  " (tfds_pipeline(mesh=...) does) and the same seed on every process"
)


def processes(ps: Sequence[int]) -> str:
  """'process 1' or 'processes [1, 2]', for messages."""
  return f"process {ps[0]}" if len(ps) == 1 else f"processes {list(ps)}"
