"""Property-based tests of the agreement decision (Hypothesis; pure, no JAX).

`simulate` plays the producer's protocol for N hosts over random per-host
batch counts and sizes: each host reads a window of up to `lookahead` batches,
reports it, every host decides on its own JSON copy of all reports, and acts
on its row of the plan, building the padded leaf and the mask with the real
`padding` functions. The properties are the library's promises: one plan for
every host; with padding and a mask every real row appears exactly once and
every padded row is masked; with `drop_last` no padded row appears and exactly
the documented batches are dropped; no host ever yields more batches than the
longest host has.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_jax_sync._src import padding
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.plan import Action, End, ErrorKind, Options, Report

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
  end: End
  error: plan_lib.ReportedError | None


def simulate(
  sizes: list[list[int]],
  options: Options,
  *,
  lookahead: int,
  devices: int = 1,
  fail: tuple[int, int] | None = None,
) -> Run:
  """Plays the window protocol; `fail` = (host, batch) whose read raises."""
  n = len(sizes)
  next_batch = [0] * n
  exhausted = [False] * n
  failed = [False] * n
  position = 0
  run = Run([], [], End.CONTINUE, None)
  for window in range(1000):
    reads: list[list[int]] = []
    reports = []
    for h in range(n):
      got: list[int] = []
      error = None
      while len(got) < lookahead and not exhausted[h] and not failed[h]:
        b = next_batch[h]
        if b == len(sizes[h]):
          exhausted[h] = True
          break
        if fail is not None and fail == (h, b):
          failed[h] = True
          error = plan_lib.ReportedError(ErrorKind.SOURCE, f"host {h} broke", h, b, "OSError")
          break
        got.append(b)
        next_batch[h] += 1
      reads.append(got)
      reports.append(
        Report(
          process_index=h,
          rows=tuple(sizes[h][b] for b in got),
          exhausted=exhausted[h],
          error=error,
          signature=SIG if (got or next_batch[h]) else None,
          local_devices=devices,
          config={"batch_size": options.batch_size} if window == 0 else None,
        )
      )
    # Every host decides on its own deserialized copy of every report.
    wire = [r.to_json() for r in reports]
    plans = [
      plan_lib.decide([Report.from_json(w) for w in wire], options, position=position)
      for _ in range(n)
    ]
    assert all(p == plans[0] for p in plans), "hosts computed different plans"
    plan = plans[0]
    for i, step in enumerate(plan.steps):
      per_host = [reads[h][i] if i < len(reads[h]) else None for h in range(n)]
      if step.action == Action.DROP:
        run.dropped.append(per_host)
        continue
      row = []
      for h, b in enumerate(per_host):
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
        row.append((step.rows, b, leaf, padding.mask(real_rows, step.rows)))
      run.yields.append(row)
      position += 1
    if plan.end != End.CONTINUE:
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
  options = Options(batch_size=batch_size, drop_last=False, pad=True)
  run = simulate(sizes, options, lookahead=lookahead, devices=devices)
  assert run.end == End.STOP and run.error is None
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


@PROPERTY_SETTINGS
@given(scenarios(), st.booleans())
def test_drop_last_yields_no_padded_row_and_drops_exactly_the_documented_batches(case, pad):
  sizes, batch_size, devices, lookahead = case
  options = Options(batch_size=batch_size, drop_last=True, pad=pad)
  run = simulate(sizes, options, lookahead=lookahead, devices=devices)
  assert run.end == End.STOP and run.error is None
  # The documented rule: stop when any host runs out; drop a position where
  # any host's batch is shorter than `batch_size`.
  shortest = min((len(s) for s in sizes), default=0)
  kept = [k for k in range(shortest) if all(s[k] == batch_size for s in sizes)]
  assert [row[0][1] for row in run.yields] == kept
  for row in run.yields:
    for h, (target, b, leaf, mask) in enumerate(row):
      assert target == batch_size and mask.all()  # No padded row.
      np.testing.assert_array_equal(leaf, row_ids(h, b, batch_size))
  dropped_positions = [per_host[0] for per_host in run.dropped]
  assert dropped_positions == [k for k in range(shortest) if k not in kept][: len(run.dropped)]


@PROPERTY_SETTINGS
@given(
  scenarios(max_size_over=2),
  st.sampled_from(["strict", "pad", "drop", "pad_drop"]),
  st.data(),
)
def test_no_host_yields_more_than_the_longest_host_and_errors_are_shared(case, mode, data):
  sizes, batch_size, devices, lookahead = case
  options = Options(batch_size=batch_size, drop_last="drop" in mode, pad="pad" in mode)
  fail = None
  if data.draw(st.booleans()) and any(sizes):
    h = data.draw(st.sampled_from([h for h, s in enumerate(sizes) if s]))
    fail = (h, data.draw(st.integers(0, len(sizes[h]) - 1)))
  run = simulate(sizes, options, lookahead=lookahead, devices=devices, fail=fail)
  longest = max((len(s) for s in sizes), default=0)
  assert len(run.yields) + len(run.dropped) <= longest
  for row in run.yields:
    assert len({target for target, *_ in row}) == 1  # Same global shape on every host.
    assert any(b is not None for _, b, _, _ in row)  # Never an all-dummy batch.
  if fail is not None:
    assert len(run.yields) + len(run.dropped) <= fail[1]
  if run.end == End.RAISE:
    assert run.error is not None
    if run.error.kind == ErrorKind.SOURCE:
      assert fail is not None and run.error.process_index == fail[0]
      assert run.error.batch_index == fail[1]
  else:
    assert run.end == End.STOP and run.error is None
    if fail is not None:  # Only drop_last may stop before reaching the failure.
      assert options.drop_last
      assert min(len(s) for s in sizes) <= fail[1]


@PROPERTY_SETTINGS
@given(scenarios())
def test_strict_mode_yields_only_equal_batches_or_raises_value_error(case):
  sizes, batch_size, devices, lookahead = case
  run = simulate(sizes, Options(batch_size, drop_last=False, pad=False), lookahead=lookahead)
  del devices
  equal = len({len(s) for s in sizes}) <= 1 and all(
    len({s[k] for s in sizes}) == 1 for k in range(len(sizes[0]))
  )
  if equal:
    assert run.end == End.STOP and len(run.yields) == len(sizes[0])
    for row in run.yields:
      assert all(mask.all() for *_, mask in row)
  else:
    assert run.end == End.RAISE and run.error.kind == ErrorKind.VALUE
    assert run.error.message.startswith(("uneven number of batches", "uneven batch sizes"))


@PROPERTY_SETTINGS
@given(scenarios(), st.data())
def test_source_failure_yields_every_batch_before_it_then_raises_everywhere(case, data):
  sizes, batch_size, devices, lookahead = case
  hosts = [h for h, s in enumerate(sizes) if s]
  if not hosts:
    return
  h = data.draw(st.sampled_from(hosts))
  k = data.draw(st.integers(0, len(sizes[h]) - 1))
  options = Options(batch_size=batch_size, drop_last=False, pad=True)
  run = simulate(sizes, options, lookahead=lookahead, devices=devices, fail=(h, k))
  assert run.end == End.RAISE
  assert (run.error.kind, run.error.process_index, run.error.batch_index) == (
    ErrorKind.SOURCE,
    h,
    k,
  )
  assert len(run.yields) == k and not run.dropped
  assert [row[h][1] for row in run.yields] == list(range(k))
