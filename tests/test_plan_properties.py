"""Property-based tests of the agreement decision (Hypothesis; pure, no JAX).

`simulate` plays the producer's protocol for N hosts over random per-host
batch counts and sizes: each host reads a window of up to `lookahead` batches,
reports it, every host decides on its own JSON copy of all reports, and acts
on its row of the plan, building the padded leaf and the mask with the real
`padding` functions. The properties are the library's promises: one plan for
every host; with padding and a mask every real row appears exactly once and
every padded row is masked; with `drop_last` no padded row appears and exactly
the documented batches are dropped; no host ever yields more batches than the
longest host has. With `Rules.batch_size=None` the simulated producer pins
the full size the first plan derived, as the iterator does; with `peek` every
host also reports whether it holds another batch (`Report.more`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from helpers import unwire, wire
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_jax_sync._src import messages, padding
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.messages import Action, ErrorKind, Outcome, Report, ReportedError
from grain_jax_sync._src.plan import Rules

SIG = {"spec": {"d": [["x", "*"]]}, "leaves": [["x", "int64", []]]}
PAD_VALUE = -1
PROPERTY_SETTINGS = settings(max_examples=300, deadline=None)


def row_ids(host: int, batch: int, n: int) -> np.ndarray:
  return 100_000 * host + 100 * batch + np.arange(n, dtype=np.int64)


@dataclasses.dataclass
class Run:
  """What every host did.

  Attributes:
    yields: Per yielded batch, per host: (target rows, source batch or None,
      padded leaf, mask).
    dropped: Per dropped position, per host: the source batch or None.
    end: How the stream ended (STOP or RAISE).
    error: The raised error, if any.
  """

  yields: list[list[tuple[int, int | None, np.ndarray, np.ndarray]]]
  dropped: list[list[int | None]]
  end: Outcome
  error: ReportedError | None


@dataclasses.dataclass
class _Hosts:
  """Every simulated host's reader: where it is, how it ended, what it read and not decided yet."""

  sizes: list[list[int]]
  fail: tuple[int, int] | None
  next_batch: list[int]
  exhausted: list[bool]
  errors: list[ReportedError | None]
  reads: list[list[int]]  # Read, not decided yet.

  @classmethod
  def start(cls, sizes: list[list[int]], fail: tuple[int, int] | None) -> _Hosts:
    """Hosts that have read nothing yet."""
    n = len(sizes)
    return cls(sizes, fail, [0] * n, [False] * n, [None] * n, [[] for _ in range(n)])

  def read(self, h: int, want: int) -> None:
    """Host `h` reads until it holds `want` undecided batches, runs out or fails."""
    sizes, fail = self.sizes, self.fail
    while len(self.reads[h]) < want and not self.exhausted[h] and self.errors[h] is None:
      b = self.next_batch[h]
      if b == len(sizes[h]):
        self.exhausted[h] = True
        break
      if fail is not None and fail == (h, b):
        self.errors[h] = ReportedError(ErrorKind.SOURCE, f"host {h} broke", h, b, "OSError")
        break
      self.reads[h].append(b)
      self.next_batch[h] += 1

  def report(self, h: int, window: int, options: Rules, devices: int, peek: bool) -> Report:
    """Host `h`'s report of what it holds."""
    sizes, next_batch = self.sizes, self.next_batch
    more = next_batch[h] < len(sizes[h]) and self.fail != (h, next_batch[h])
    return Report(
      process_index=h,
      rows=tuple(sizes[h][b] for b in self.reads[h]),
      exhausted=self.exhausted[h],
      error=self.errors[h],
      signature=SIG if next_batch[h] else None,
      local_devices=devices,
      config={"batch_size": options.batch_size} if window == 0 else None,
      more=peek and bool(self.reads[h]) and more,
    )


def _decide(reports: list[Report], options: Rules, position: int) -> plan_lib.Plan:
  """Every host decides on its own deserialized copy of every report: one plan."""
  texts = [wire(r) for r in reports]
  plans = [
    plan_lib.decide([unwire(w) for w in texts], options, position=position)
    for _ in range(len(reports))
  ]
  assert all(p == plans[0] for p in plans), "hosts computed different plans"
  return plans[0]


def _act(plan: plan_lib.Plan, hosts: _Hosts, options: Rules, run: Run) -> int:
  """Every host acts on its row of `plan` (drops, or yields a padded leaf); returns the yields."""
  n = len(hosts.sizes)
  yielded = 0
  for i, step in enumerate(plan.steps):
    per_host = [hosts.reads[h][i] if i < len(hosts.reads[h]) else None for h in range(n)]
    if step.action == Action.DROP:
      run.dropped.append(per_host)
      continue
    run.yields.append([_built(h, b, step, hosts.sizes, options) for h, b in enumerate(per_host)])
    yielded += 1
  return yielded


def _built(
  h: int, b: int | None, step: messages.Step, sizes: list[list[int]], options: Rules
) -> tuple[int, int | None, np.ndarray, np.ndarray]:
  """Host `h`'s (target rows, source batch, padded leaf, mask) for a yielded step."""
  real = None if b is None else row_ids(h, b, sizes[h][b])
  assert step.real_rows[h] == (0 if real is None else len(real))
  leaf = padding.fill_leaf(
    real,
    target=step.rows,
    shape=(),
    dtype=np.dtype(np.int64),
    pad=np.asarray(PAD_VALUE, np.int64) if options.pad else None,
  )
  real_rows = 0 if real is None else len(real)
  return (step.rows, b, leaf, padding.mask(real_rows, step.rows))


def simulate(
  sizes: list[list[int]],
  options: Rules,
  *,
  lookahead: int,
  devices: int = 1,
  fail: tuple[int, int] | None = None,
  peek: bool = False,
) -> Run:
  """Plays the window protocol; `fail` = (host, batch) whose read raises.

  Each host holds the batches it read and that are not decided yet; after
  `Outcome.WAIT` they are reported again, and each waiting host reads one more.
  """
  n = len(sizes)
  hosts = _Hosts.start(sizes, fail)
  waiting: tuple[int, ...] = ()
  position = 0
  run = Run([], [], Outcome.CONTINUE, None)
  for window in range(1000):
    reports = []
    # Every live host reports the same positions; a waiting host needs one more.
    want = max([lookahead] + [len(hosts.reads[h]) + (h in waiting) for h in range(n)])
    for h in range(n):
      hosts.read(h, want)
      reports.append(hosts.report(h, window, options, devices, peek))
    plan = _decide(reports, options, position)
    options = plan_lib.pin(options, plan)
    position += _act(plan, hosts, options, run)
    hosts.reads = [r[len(plan.steps) :] for r in hosts.reads]
    waiting = plan.waiting
    if plan.end == Outcome.WAIT:
      assert waiting and all(not hosts.exhausted[h] and hosts.errors[h] is None for h in waiting)
      continue
    assert not any(hosts.reads) or plan.end != Outcome.CONTINUE  # Every read position decided.
    if plan.end != Outcome.CONTINUE:
      run.end, run.error = plan.end, plan.error
      return run
  raise AssertionError("the protocol did not end")


@st.composite
def scenarios(draw, *, max_size_over: int = 0):
  """(sizes, batch_size, devices, lookahead): random per-host batches."""
  devices = draw(st.sampled_from([1, 2, 4]))
  batch_size = devices * draw(st.integers(1, 4))
  n = draw(st.integers(1, 5))
  sizes = draw(
    st.lists(
      st.lists(st.integers(1, batch_size + max_size_over), max_size=7), min_size=n, max_size=n
    )
  )
  lookahead = draw(st.integers(1, 4))
  return sizes, batch_size, devices, lookahead


def _all_real_rows(sizes):
  return sorted(
    int(r) for h, hs in enumerate(sizes) for b, k in enumerate(hs) for r in row_ids(h, b, k)
  )


@PROPERTY_SETTINGS
@given(scenarios())
def test_padding_with_mask_every_real_row_once_every_padded_row_masked(case):
  sizes, batch_size, devices, lookahead = case
  options = Rules(batch_size=batch_size, drop_last=False, pad=True)
  run = simulate(sizes, options, lookahead=lookahead, devices=devices)
  assert run.end == Outcome.STOP and run.error is None
  assert len(run.yields) == max((len(s) for s in sizes), default=0)
  seen = []
  for row in run.yields:
    assert {target for target, *_ in row} == {batch_size}
    for target, _, leaf, mask in row:
      assert leaf.shape == mask.shape == (target,)
      seen.extend(int(v) for v in leaf[mask])
      assert (leaf[~mask] == PAD_VALUE).all()  # Padded rows: pad value, masked.
  assert sorted(seen) == _all_real_rows(sizes)  # Each real row exactly once.
  # Each host's real batches arrive in its source order.
  for h in range(len(sizes)):
    order = [row[h][1] for row in run.yields if row[h][1] is not None]
    assert order == list(range(len(sizes[h])))


def _drop_last_rule(sizes, batch_size, pad):
  """The documented drop_last outcome: (kept, dropped) positions and the failing one.

  Stop when any host runs out; a position whose short batches are all their
  hosts' last is dropped; a short batch that is not its host's last is padded
  with `paddings` (a given `batch_size`) and an error otherwise.
  """
  kept, dropped = [], []
  for k in range(min((len(s) for s in sizes), default=0)):
    short = [h for h, s in enumerate(sizes) if s[k] < batch_size]
    if not short:
      kept.append(k)
    elif all(k == len(sizes[h]) - 1 for h in short):
      dropped.append(k)
    elif pad:
      kept.append(k)
    else:
      return kept, dropped, k
  return kept, dropped, None


@PROPERTY_SETTINGS
@given(scenarios(), st.booleans(), st.sampled_from(["peek", "wait", "both"]))
def test_drop_last_keeps_full_batches_drops_short_last_ones_exactly(case, pad, know):
  sizes, batch_size, devices, lookahead = case
  options = Rules(batch_size, drop_last=True, pad=pad, wait_for_last=know != "peek")
  run = simulate(sizes, options, lookahead=lookahead, devices=devices, peek=know != "wait")
  kept, dropped, failing = _drop_last_rule(sizes, batch_size, pad)
  assert [row[0][1] for row in run.yields] == kept
  assert [per_host[0] for per_host in run.dropped] == dropped
  if failing is None:
    assert run.end == Outcome.STOP and run.error is None
  else:
    assert run.end == Outcome.RAISE and run.error.kind == ErrorKind.VALUE
    assert f"batch {len(kept)}: " in run.error.message
    assert f"fewer than the full batch size {batch_size}" in run.error.message
  for row in run.yields:
    for h, (target, b, leaf, mask) in enumerate(row):
      assert target == batch_size
      n = sizes[h][b]
      np.testing.assert_array_equal(leaf[:n], row_ids(h, b, n))
      assert mask.sum() == n  # Padded rows (only with `paddings`) are masked.


@PROPERTY_SETTINGS
@given(scenarios(), st.booleans())
def test_drop_last_without_peek_never_pads_without_paddings(case, pad):
  sizes, batch_size, devices, lookahead = case
  options = Rules(batch_size=batch_size, drop_last=True, pad=pad)
  run = simulate(sizes, options, lookahead=lookahead, devices=devices)
  # Without `more` a short batch at the end of a report counts as last: it may
  # be dropped instead of raising, but is never yielded with padding it was not
  # given, and the stream still stops at the shortest host.
  assert len(run.yields) + len(run.dropped) <= min((len(s) for s in sizes), default=0)
  for row in run.yields:
    assert {target for target, *_ in row} == {batch_size}
    assert pad or all(mask.all() for *_, mask in row)


@st.composite
def batched_sources(draw):
  """Per-host record counts batched by one fixed size: only last batches are short."""
  devices = draw(st.sampled_from([1, 2]))
  fixed = devices * draw(st.integers(1, 4))
  n = draw(st.integers(1, 4))
  # Record counts divisible by the devices, so that every batch size is.
  counts = [devices * c for c in draw(st.lists(st.integers(1, 10), min_size=n, max_size=n))]
  sizes = [[fixed] * (c // fixed) + ([c % fixed] if c % fixed else []) for c in counts]
  return sizes, fixed, devices, draw(st.integers(1, 4)), draw(st.booleans())


@PROPERTY_SETTINGS
@given(batched_sources(), st.sampled_from(["pad", "drop", "pad_drop"]))
def test_without_batch_size_a_fixed_size_source_never_yields_zero_batches(case, mode):
  sizes, fixed, devices, lookahead, peek = case
  options = Rules(None, drop_last="drop" in mode, pad="pad" in mode, wait_for_last=not peek)
  run = simulate(sizes, options, lookahead=lookahead, devices=devices, peek=peek)
  full = max(s[0] for s in sizes)  # The largest host batch of the first position.
  assert run.end == Outcome.STOP and run.error is None
  assert {target for row in run.yields for target, *_ in row} <= {full}
  if options.drop_last:
    shortest = min(len(s) for s in sizes)
    want = [k for k in range(shortest) if all(s[k] == full for s in sizes)]
    assert [row[0][1] for row in run.yields] == want
    assert run.yields or any(s[0] < full for s in sizes)
  else:
    seen = [int(v) for row in run.yields for _, _, leaf, mask in row for v in leaf[mask]]
    assert sorted(seen) == _all_real_rows(sizes)


@PROPERTY_SETTINGS
@given(
  scenarios(max_size_over=2),
  st.sampled_from(["strict", "pad", "drop", "pad_drop"]),
  st.data(),
)
def test_no_host_yields_more_than_the_longest_host_and_errors_are_shared(case, mode, data):
  sizes, batch_size, devices, lookahead = case
  derived = data.draw(st.booleans())
  options = Rules(
    batch_size=None if derived else batch_size,
    drop_last="drop" in mode,
    pad="pad" in mode,
    wait_for_last=data.draw(st.booleans()),
  )
  fail = None
  if data.draw(st.booleans()) and any(sizes):
    h = data.draw(st.sampled_from([h for h, s in enumerate(sizes) if s]))
    fail = (h, data.draw(st.integers(0, len(sizes[h]) - 1)))
  peek = data.draw(st.booleans())
  run = simulate(sizes, options, lookahead=lookahead, devices=devices, fail=fail, peek=peek)
  longest = max((len(s) for s in sizes), default=0)
  assert len(run.yields) + len(run.dropped) <= longest
  for row in run.yields:
    assert len({target for target, *_ in row}) == 1  # Same global shape on every host.
    assert any(b is not None for _, b, _, _ in row)  # Never an all-dummy batch.
  if fail is not None:
    assert len(run.yields) + len(run.dropped) <= fail[1]
  if run.end == Outcome.RAISE:
    assert run.error is not None
    if run.error.kind == ErrorKind.SOURCE:
      assert fail is not None and run.error.process_index == fail[0]
      assert run.error.batch_index == fail[1]
  else:
    assert run.end == Outcome.STOP and run.error is None
    if fail is not None:  # Only drop_last may stop before reaching the failure.
      assert options.drop_last
      assert min(len(s) for s in sizes) <= fail[1]


@PROPERTY_SETTINGS
@given(scenarios())
def test_strict_mode_yields_only_equal_batches_or_raises_value_error(case):
  sizes, batch_size, devices, lookahead = case
  run = simulate(sizes, Rules(batch_size, drop_last=False, pad=False), lookahead=lookahead)
  del devices
  equal = len({len(s) for s in sizes}) <= 1 and all(
    len({s[k] for s in sizes}) == 1 for k in range(len(sizes[0]))
  )
  if equal:
    assert run.end == Outcome.STOP and len(run.yields) == len(sizes[0])
    for row in run.yields:
      assert all(mask.all() for *_, mask in row)
  else:
    assert run.end == Outcome.RAISE and run.error.kind == ErrorKind.VALUE
    assert run.error.message.startswith(
      (
        "Uneven number of batches detected across JAX workers",
        "Uneven batch sizes detected across JAX workers",
      )
    )


@PROPERTY_SETTINGS
@given(scenarios(), st.data())
def test_source_failure_yields_every_batch_before_it_then_raises_everywhere(case, data):
  sizes, batch_size, devices, lookahead = case
  hosts = [h for h, s in enumerate(sizes) if s]
  if not hosts:
    return
  h = data.draw(st.sampled_from(hosts))
  k = data.draw(st.integers(0, len(sizes[h]) - 1))
  options = Rules(batch_size=batch_size, drop_last=False, pad=True)
  run = simulate(sizes, options, lookahead=lookahead, devices=devices, fail=(h, k))
  assert run.end == Outcome.RAISE
  assert (run.error.kind, run.error.process_index, run.error.batch_index) == (
    ErrorKind.SOURCE,
    h,
    k,
  )
  assert len(run.yields) == k and not run.dropped
  assert [row[h][1] for row in run.yields] == list(range(k))


@PROPERTY_SETTINGS
@given(scenarios(), st.sampled_from(["pad", "drop", "pad_drop"]), st.booleans())
def test_waiting_for_the_last_batch_decides_as_knowing_it(case, mode, derived):
  """`wait_for_last` without `more` reaches the same outcome as `more` everywhere."""
  sizes, batch_size, devices, lookahead = case
  base = Rules(None if derived else batch_size, drop_last="drop" in mode, pad="pad" in mode)
  waited = simulate(
    sizes, dataclasses.replace(base, wait_for_last=True), lookahead=lookahead, devices=devices
  )
  known = simulate(sizes, base, lookahead=lookahead, devices=devices, peek=True)
  assert (waited.end, waited.error) == (known.end, known.error)
  assert [[b for _, b, _, _ in row] for row in waited.yields] == [
    [b for _, b, _, _ in row] for row in known.yields
  ]
  assert waited.dropped == known.dropped


@st.composite
def window_reports(draw):
  """(reports, options, position): one window, mostly full batches, any ending."""
  devices = draw(st.sampled_from([1, 2, 4]))
  full = devices * draw(st.integers(1, 3))
  n = draw(st.integers(1, 4))
  sizes = st.one_of(st.just(full), st.integers(1, full + 2))  # Full half the time.
  reports = []
  for h in range(n):
    rows = tuple(draw(st.lists(sizes, max_size=12)))
    error = None
    if draw(st.integers(0, 4)) == 0:
      error = ReportedError(ErrorKind.SOURCE, f"host {h} broke", h, len(rows), "OSError")
    reports.append(
      Report(
        process_index=h,
        rows=rows,
        exhausted=error is None and draw(st.booleans()),
        error=error,
        signature=SIG,
        local_devices=draw(st.sampled_from([devices, devices, 3])),
        config={"batch_size": full},
        more=draw(st.booleans()),
      )
    )
  pad, drop_last = draw(st.sampled_from([(False, False), (True, False), (False, True)]))
  batch_size = draw(st.sampled_from([full, None]))
  options = Rules(
    batch_size=batch_size,
    pad=pad,
    drop_last=drop_last,
    wait_for_last=draw(st.booleans()),
    derived=batch_size is not None and draw(st.booleans()),
  )
  return reports, options, draw(st.integers(0, 50))


@PROPERTY_SETTINGS
@given(window_reports())
def test_runs_of_full_batches_are_decided_as_position_by_position(case):
  # `decide` takes a run of positions where every host's batch is full in one
  # go (`_full_run`); the plan must be the one the per-position rules give.
  from unittest import mock

  reports, options, position = case
  quick = plan_lib.decide(reports, options, position=position)
  with mock.patch.object(plan_lib, "_full_run", return_value=0):
    slow = plan_lib.decide(reports, options, position=position)
  assert quick == slow


# -- shapes that vary (`pad_shapes`, issue 25) -----------------------------------

SHAPE_SIG = {"spec": {"d": [["tokens", "*"]]}, "leaves": [["tokens", "int64", [-1]]]}


@st.composite
def shape_cases(draw):
  """Per host, batches of (rows, length); the batch size; buckets (or None)."""
  n = draw(st.integers(1, 4))
  batch_size = draw(st.integers(1, 6))
  hosts = [
    draw(st.lists(st.tuples(st.integers(1, batch_size), st.integers(0, 40)), max_size=5))
    for _ in range(n)
  ]
  buckets = draw(
    st.none() | st.lists(st.integers(1, 48), min_size=1, max_size=5, unique=True).map(sorted)
  )
  return hosts, batch_size, buckets


def _element_ids(host: int, batch: int, rows: int, length: int) -> np.ndarray:
  return (
    10_000_000 * host + 10_000 * batch + 100 * np.arange(rows)[:, None] + np.arange(length) + 1
  ).astype(np.int64)


@PROPERTY_SETTINGS
@given(shape_cases())
def test_shapes_every_real_element_once_every_padded_element_masked(case):
  from grain_jax_sync._src import shapes as shapes_lib

  hosts, batch_size, buckets = case
  shapes = shapes_lib.make({"tokens": 1}, buckets and {"tokens": buckets}, None, PAD_VALUE)
  options = Rules(batch_size=batch_size, drop_last=False, pad=True, shapes=shapes)
  reports = [
    Report(
      h,
      rows=tuple(r for r, _ in batches),
      sizes=tuple((ln,) for _, ln in batches),
      exhausted=True,
      signature=SHAPE_SIG,
    )
    for h, batches in enumerate(hosts)
  ]
  plan = plan_lib.decide([unwire(wire(r)) for r in reports], options)
  # Every host acts on the decision as it travels (sizes in the codec).
  decision = messages.Decision(0, plan.steps, plan.end, plan.error)
  steps = messages.Decision.from_json(decision.to_json()).steps
  assert [s.sizes for s in steps] == [s.sizes for s in plan.steps]
  longest = max(len(b) for b in hosts)
  lengths = [max(b[j][1] for b in hosts if j < len(b)) for j in range(longest)]
  above = [j for j, ln in enumerate(lengths) if buckets and ln > buckets[-1]]
  if above:
    assert plan.end == Outcome.RAISE and len(steps) == above[0]
    assert f"size {lengths[above[0]]} at batch {above[0]}" in plan.error.message
  else:
    assert plan.end == Outcome.STOP and len(steps) == longest
  seen: list[int] = []
  for j, step in enumerate(steps):
    assert step.action == Action.YIELD and step.rows == batch_size
    want = lengths[j] if not buckets else min(b for b in buckets if b >= lengths[j])
    assert step.sizes == (want,)
    for h, batches in enumerate(hosts):
      leaf = _element_ids(h, j, *batches[j]) if j < len(batches) else None
      out = padding.fill_leaf(
        leaf, target=batch_size, shape=step.sizes, dtype=np.dtype(np.int64), pad=np.int64(-1)
      )
      mask = padding.element_mask(
        None if leaf is None else leaf.shape, batch_size, step.sizes, (0,)
      )
      assert out.shape == mask.shape == (batch_size, want)
      assert (out[~mask] == PAD_VALUE).all()
      seen.extend(out[mask].tolist())
  real = [
    _element_ids(h, j, r, ln).ravel().tolist()
    for h, batches in enumerate(hosts)
    for j, (r, ln) in enumerate(batches)
    if j < len(steps)
  ]
  assert sorted(seen) == sorted(x for ids in real for x in ids)
  assert len(set(seen)) == len(seen)
