"""Unit tests of the agreement decision (pure, no JAX)."""

import pytest
from helpers import unwire, wire

from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.messages import (
  Action,
  ErrorKind,
  Outcome,
  Report,
  ReportedError,
)
from grain_jax_sync._src.plan import Rules

SIG = {"spec": {"d": [["x", "*"]]}, "leaves": [["x", "int32", []]]}
SIG_F = {"spec": {"d": [["x", "*"]]}, "leaves": [["x", "float32", []]]}


def rep(p, rows, exhausted=False, **kw):
  kw.setdefault("signature", SIG if rows else None)
  return Report(
    process_index=p, rows=tuple(rows), exhausted=exhausted, local_devices=kw.pop("d", 1), **kw
  )


PAD = Rules(batch_size=8, drop_last=False, pad=True)
DROP = Rules(batch_size=8, drop_last=True, pad=False)
STRICT = Rules(batch_size=8, drop_last=False, pad=False)
PAD_DROP = Rules(batch_size=8, drop_last=True, pad=True)


def test_decide_full_windows_continue_yield_all():
  p = plan_lib.decide([rep(0, [8, 8]), rep(1, [8, 8])], STRICT)
  assert p.end == Outcome.CONTINUE
  assert [(s.action, s.rows, s.real_rows) for s in p.steps] == [(Action.YIELD, 8, (8, 8))] * 2


def test_decide_all_exhausted_stop():
  p = plan_lib.decide([rep(0, [], True), rep(1, [], True)], STRICT)
  assert p.end == Outcome.STOP and p.steps == ()


@pytest.mark.parametrize(
  ("rules", "end", "steps"),
  [
    (
      PAD,
      Outcome.STOP,
      [(Action.YIELD, 8, (8, 8)), (Action.YIELD, 8, (8, 0)), (Action.YIELD, 8, (3, 0))],
    ),
    (DROP, Outcome.STOP, [(Action.YIELD, 8, (8, 8))]),
    (STRICT, Outcome.RAISE, [(Action.YIELD, 8, (8, 8))]),
  ],
)
def test_decide_uneven_counts_by_option(rules, end, steps):
  p = plan_lib.decide([rep(0, [8, 8, 3], True), rep(1, [8], True)], rules)
  assert p.end == end
  assert [(s.action, s.rows, s.real_rows) for s in p.steps] == steps
  if end == Outcome.RAISE:
    assert p.error.kind == ErrorKind.VALUE
    assert p.error.message.startswith(
      "Uneven number of batches detected across JAX workers: process 1 ran out of data at"
      " batch 1 while process 0 still has batches"
    )


def test_decide_uneven_rows_strict_raises_with_range():
  p = plan_lib.decide([rep(0, [8]), rep(1, [4])], STRICT)
  assert p.end == Outcome.RAISE
  assert p.error.message.startswith("Uneven batch sizes detected across JAX workers at batch 0")
  assert "range from 4 to 8" in p.error.message and "process 1: 4" in p.error.message


def test_decide_uneven_rows_padded_to_batch_size():
  p = plan_lib.decide([rep(0, [8, 5], True), rep(1, [8, 2], True)], PAD)
  assert [(s.rows, s.real_rows) for s in p.steps] == [(8, (8, 8)), (8, (5, 2))]
  assert p.end == Outcome.STOP


def test_decide_drop_last_drops_short_last_batch_everywhere():
  p = plan_lib.decide([rep(0, [8, 5], True), rep(1, [8, 8], True)], DROP)
  assert [s.action for s in p.steps] == [Action.YIELD, Action.DROP]
  assert p.end == Outcome.STOP


@pytest.mark.parametrize("rules", [PAD, DROP, PAD_DROP])
def test_decide_larger_batches_on_every_host_pass_through(rules):
  p = plan_lib.decide([rep(0, [12, 8], True), rep(1, [12, 8], True)], rules)
  assert [(s.action, s.rows, s.real_rows) for s in p.steps] == [
    (Action.YIELD, 12, (12, 12)),
    (Action.YIELD, 8, (8, 8)),
  ]
  assert p.end == Outcome.STOP


@pytest.mark.parametrize("rules", [PAD, DROP, PAD_DROP])
def test_decide_larger_batch_on_one_host_raises_naming_both_sizes(rules):
  p = plan_lib.decide([rep(0, [9]), rep(1, [8])], rules)
  assert p.end == Outcome.RAISE and p.error.kind == ErrorKind.VALUE
  assert p.error.message.startswith(
    "Uneven batch sizes detected across JAX workers at batch 0: process 0 has 9 rows, more"
    " than the full batch size 8 (`batch_size`)"
  )
  assert "(process 0: 9, process 1: 8)" in p.error.message


def test_decide_larger_batch_with_a_dummy_batch_raises():
  p = plan_lib.decide([rep(0, [8, 9], True), rep(1, [8], True)], PAD)
  assert len(p.steps) == 1 and p.end == Outcome.RAISE
  assert "process 0 has 9 rows" in p.error.message and "process 1: none" in p.error.message


def test_decide_not_divisible_by_local_devices_raises():
  p = plan_lib.decide([rep(0, [6], d=4), rep(1, [6], d=4)], STRICT)
  assert p.end == Outcome.RAISE
  assert p.error.message.startswith(
    "The local batch size (6) must be evenly divisible by the number of local JAX devices"
    " (4) of process 0: batch 0 has 6 rows per host"
  )


def test_decide_passed_through_batch_checked_for_divisibility():
  p = plan_lib.decide([rep(0, [10], d=4), rep(1, [10], d=4)], PAD)
  assert p.end == Outcome.RAISE and "The local batch size (10) must be evenly" in p.error.message


# -- the full batch size ---------------------------------------------------------------

DERIVED_DROP = Rules(batch_size=None, drop_last=True, pad=False)
DERIVED_PAD = Rules(batch_size=None, drop_last=False, pad=True)


@pytest.mark.parametrize("rules", [DERIVED_DROP, DERIVED_PAD, Rules(None, False, False)])
def test_decide_without_batch_size_yields_equal_batches_of_any_size(rules):
  p = plan_lib.decide([rep(0, [3, 3, 3], True), rep(1, [3, 3, 3], True)], rules)
  assert [(s.action, s.rows) for s in p.steps] == [(Action.YIELD, 3)] * 3
  assert p.end == Outcome.STOP and p.batch_size == 3


def test_decide_derives_full_size_from_largest_host_batch_of_first_position():
  # Process 0's first batch (4 rows) is short against process 1's 6 and not its last.
  p = plan_lib.decide([rep(0, [4, 6, 6, 2], True), rep(1, [6, 6, 6], True)], DERIVED_PAD)
  assert p.end == Outcome.RAISE and p.batch_size == 6 and "4 rows, fewer than" in p.error.message
  p = plan_lib.decide([rep(0, [6, 6, 2], True), rep(1, [6, 6, 6], True)], DERIVED_PAD)
  assert p.batch_size == 6
  assert [(s.rows, s.real_rows) for s in p.steps] == [(6, (6, 6)), (6, (6, 6)), (6, (2, 6))]
  p = plan_lib.decide([rep(0, [6, 6, 2], True), rep(1, [6, 6, 6], True)], DERIVED_DROP)
  assert [s.action for s in p.steps] == [Action.YIELD, Action.YIELD, Action.DROP]


def test_decide_derived_full_size_is_the_same_on_every_host_and_pinned_by_the_caller():
  texts = [wire(rep(0, [8, 8])), wire(rep(1, [5, 8]))]
  plans = [plan_lib.decide([unwire(w) for w in texts], DERIVED_PAD, position=0) for _ in range(2)]
  assert plans[0] == plans[1]
  # Process 1's short first batch is followed by another: an error naming both sizes.
  assert plans[0].end == Outcome.RAISE and plans[0].batch_size == 8
  # A later window is judged by the pinned size, not by its own first position.
  later = plan_lib.pin(DERIVED_DROP, plans[0])
  assert (later.batch_size, later.derived) == (8, True)
  p = plan_lib.decide([rep(0, [5], True), rep(1, [5], True)], later)
  assert [s.action for s in p.steps] == [Action.DROP]
  assert plan_lib.pin(later, p) == later and plan_lib.pin(DROP, p) == DROP
  # A pinned (derived) size stays a guess: a short batch that is not the last raises.
  p = plan_lib.decide([rep(0, [8, 5, 8]), rep(1, [8, 8, 8])], plan_lib.pin(DERIVED_PAD, plans[0]))
  assert p.end == Outcome.RAISE and "as `batch_size` was not given" in p.error.message


@pytest.mark.parametrize(
  ("rules", "how"),
  [
    (DROP, "(`batch_size`)"),
    (Rules(None, drop_last=True, pad=True), "as `batch_size` was not given"),
    (DERIVED_PAD, "as `batch_size` was not given"),
  ],
)
def test_decide_short_batch_that_is_not_the_last_raises_naming_both_sizes(rules, how):
  p = plan_lib.decide([rep(0, [8, 5, 8]), rep(1, [8, 8, 8])], rules)
  assert [s.rows for s in p.steps] == [8] and p.end == Outcome.RAISE
  msg = p.error.message
  assert msg.startswith(
    "Uneven batch sizes detected across JAX workers: process 0, batch 1: 5 rows, fewer than"
    " the full batch size 8"
  )
  assert how in msg and "not the last batch of process 0" in msg


def test_decide_short_batch_on_every_host_that_is_not_the_last_raises_without_prefix():
  p = plan_lib.decide([rep(0, [4, 8], True), rep(1, [4, 8], True)], DROP)
  assert p.end == Outcome.RAISE and p.error.message.startswith("process 0, batch 0: 4 rows, fewer")


@pytest.mark.parametrize("rules", [PAD, PAD_DROP])
def test_decide_short_batch_with_given_batch_size_and_paddings_is_padded_anywhere(rules):
  p = plan_lib.decide([rep(0, [8, 5, 8, 3], True), rep(1, [8, 8, 8], True)], rules)
  want = [(Action.YIELD, 8, (8, 8)), (Action.YIELD, 8, (5, 8)), (Action.YIELD, 8, (8, 8))]
  if rules.drop_last:  # Stops where process 1 ran out.
    assert [(s.action, s.rows, s.real_rows) for s in p.steps] == want
  else:
    assert [(s.action, s.rows, s.real_rows) for s in p.steps] == [
      *want,
      (Action.YIELD, 8, (3, 0)),
    ]
  assert p.end == Outcome.STOP


def test_decide_short_last_of_report_is_not_the_last_batch_when_more_follow():
  reports = [rep(0, [8, 5], more=True), rep(1, [8, 8])]
  p = plan_lib.decide(reports, DROP)
  assert p.end == Outcome.RAISE and "not the last batch of process 0" in p.error.message
  p = plan_lib.decide([rep(0, [8, 5]), rep(1, [8, 8])], DROP)  # Not known: taken as last.
  assert [s.action for s in p.steps] == [Action.YIELD, Action.DROP] and p.end == Outcome.CONTINUE


def test_decide_single_process_short_final_batch_drop_last():
  p = plan_lib.decide([rep(0, [3], True)], DROP)
  assert [s.action for s in p.steps] == [Action.DROP] and p.end == Outcome.STOP


def test_decide_error_raised_after_earlier_positions():
  err = ReportedError(ErrorKind.SOURCE, "process 1 failed", 1, 2, "KeyError")
  p = plan_lib.decide([rep(0, [8, 8, 8]), rep(1, [8, 8], error=err)], STRICT)
  assert len(p.steps) == 2 and p.end == Outcome.RAISE and p.error == err


def test_decide_signature_mismatch_names_processes_and_columns():
  p = plan_lib.decide([rep(0, [8]), rep(1, [8], signature=SIG_F)], STRICT)
  assert p.end == Outcome.RAISE and p.steps == ()
  assert (
    "processes 0 and 1" in p.error.message
    and "column 'x': dtype int32 vs float32" in p.error.message
  )


def test_decide_config_mismatch_names_setting():
  p = plan_lib.decide(
    [rep(0, [8], config={"batch_size": 8}), rep(1, [8], config={"batch_size": 16})], STRICT
  )
  assert p.end == Outcome.RAISE and "batch_size: 8 vs 16" in p.error.message


def test_decide_empty_host_gets_dummies_with_padding():
  p = plan_lib.decide([rep(0, [8, 8], True), rep(1, [], True)], PAD)
  assert [(s.rows, s.real_rows) for s in p.steps] == [(8, (8, 0)), (8, (8, 0))]


def test_report_json_round_trip():
  err = ReportedError(ErrorKind.VALUE, "bad", 1, 3, "ValueError")
  r = rep(1, [8, 4], True, error=err, config={"a": 1}, d=4)
  assert unwire(wire(r)) == r
  r = rep(0, [8], more=True)
  assert unwire(wire(r)) == r and wire(r) != wire(rep(0, [8]))


WAIT_DROP = Rules(batch_size=8, drop_last=True, pad=False, wait_for_last=True)


def test_decide_waits_for_a_short_batch_whose_host_may_have_more():
  p = plan_lib.decide([rep(0, [8, 5]), rep(1, [8, 8])], WAIT_DROP)
  assert p.end == Outcome.WAIT and p.waiting == (0,)
  assert [s.action for s in p.steps] == [Action.YIELD]
  # Once process 0 reports its end (or another batch), the position is decided.
  p = plan_lib.decide([rep(0, [5], True), rep(1, [8], True)], WAIT_DROP, position=1)
  assert [s.action for s in p.steps] == [Action.DROP] and p.end == Outcome.STOP
  p = plan_lib.decide([rep(0, [5, 8]), rep(1, [8, 8])], WAIT_DROP, position=1)
  assert p.end == Outcome.RAISE and "not the last batch of process 0" in p.error.message


@pytest.mark.parametrize(
  ("rules", "waits"),
  [
    (Rules(8, drop_last=False, pad=True, wait_for_last=True), False),  # Padded either way.
    (Rules(None, drop_last=False, pad=True, wait_for_last=True), True),
    (Rules(8, drop_last=True, pad=True, wait_for_last=True), True),
    (Rules(8, drop_last=True, pad=False), False),  # Not asked to wait: taken as last.
  ],
)
def test_decide_waits_only_where_being_the_last_changes_the_outcome(rules, waits):
  p = plan_lib.decide([rep(0, [8, 5]), rep(1, [8, 8])], rules)
  assert (p.end == Outcome.WAIT) == waits
  assert p.waiting == ((0,) if waits else ())


def test_decide_raises_at_once_rather_than_waiting_when_a_short_batch_is_known_early():
  p = plan_lib.decide([rep(0, [8, 5, 8]), rep(1, [8, 4])], WAIT_DROP)
  assert p.end == Outcome.RAISE and "process 0, batch 1: 5 rows" in p.error.message


def test_shared_rows_error_names_the_processes_and_the_batch():
  groups = [(0, 1), (2, 3)]
  same = ["a", "a", "b", "b"]
  assert plan_lib.shared_rows_error(same, groups, 3) is None
  assert plan_lib.shared_rows_error(["a", "a", None, None], groups, 3) is None  # Both dummies.
  # A dummy on one replica and rows on the other: copies of one global array
  # would differ from process to process.
  assert plan_lib.shared_rows_error(["a", "a", "b", None], groups, 3) == (
    "batch 3: processes [2, 3] hold the same data shards (input shard 1) and must"
    " feed identical rows, but process 3 had no batch 3 (its source ended) while"
    " process 2 had one. Processes that share data shards must feed the same number"
    " of batches: load the data with grain_jax_sync.data_shard_info(mesh) as the"
    " shard (tfds_pipeline(mesh=...) does) and the same seed on every process"
  )
  message = plan_lib.shared_rows_error(["a", "a", "b", "c"], groups, 3)
  assert message == (
    "batch 3: processes [2, 3] hold the same data shards (input shard 1) and"
    " must feed identical rows, but their rows differ (row digests process 2:"
    " b, process 3: c). Load the data with grain_jax_sync.data_shard_info(mesh)"
    " as the shard (tfds_pipeline(mesh=...) does) and the same seed on every process"
  )
  assert plan_lib.shared_rows_error(["a", "b"], [(0,), (1,)], 0) is None  # No sharing.


# -- 2 processes x 4 devices -------------------------------------------------------------
