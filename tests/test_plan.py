"""Unit tests of the agreement decision (pure, no JAX)."""

import pytest

from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.plan import Action, End, ErrorKind, Options, Report

SIG = {"spec": {"d": [["x", "*"]]}, "leaves": [["x", "int32", []]]}
SIG_F = {"spec": {"d": [["x", "*"]]}, "leaves": [["x", "float32", []]]}


def rep(p, rows, exhausted=False, **kw):
  kw.setdefault("signature", SIG if rows else None)
  return Report(
    process_index=p, rows=tuple(rows), exhausted=exhausted, local_devices=kw.pop("d", 1), **kw
  )


PAD = Options(batch_size=8, drop_last=False, pad=True)
DROP = Options(batch_size=8, drop_last=True, pad=False)
STRICT = Options(batch_size=8, drop_last=False, pad=False)


def test_decide_full_windows_continue_yield_all():
  p = plan_lib.decide([rep(0, [8, 8]), rep(1, [8, 8])], STRICT)
  assert p.end == End.CONTINUE
  assert [(s.action, s.rows, s.real_rows) for s in p.steps] == [(Action.YIELD, 8, (8, 8))] * 2


def test_decide_all_exhausted_stop():
  p = plan_lib.decide([rep(0, [], True), rep(1, [], True)], STRICT)
  assert p.end == End.STOP and p.steps == ()


@pytest.mark.parametrize(
  ("options", "end", "steps"),
  [
    (
      PAD,
      End.STOP,
      [(Action.YIELD, 8, (8, 8)), (Action.YIELD, 8, (8, 0)), (Action.YIELD, 8, (3, 0))],
    ),
    (DROP, End.STOP, [(Action.YIELD, 8, (8, 8))]),
    (STRICT, End.RAISE, [(Action.YIELD, 8, (8, 8))]),
  ],
)
def test_decide_uneven_counts_by_option(options, end, steps):
  p = plan_lib.decide([rep(0, [8, 8, 3], True), rep(1, [8], True)], options)
  assert p.end == end
  assert [(s.action, s.rows, s.real_rows) for s in p.steps] == steps
  if end == End.RAISE:
    assert p.error.kind == ErrorKind.VALUE
    assert (
      "process 1 ran out of data at batch 1 while process 0 still has batches" in p.error.message
    )


def test_decide_uneven_rows_strict_raises_with_range():
  p = plan_lib.decide([rep(0, [8]), rep(1, [4])], STRICT)
  assert p.end == End.RAISE
  assert "range from 4 to 8" in p.error.message and "process 1: 4" in p.error.message


def test_decide_uneven_rows_padded_to_batch_size():
  p = plan_lib.decide([rep(0, [8, 5], True), rep(1, [8, 2], True)], PAD)
  assert [(s.rows, s.real_rows) for s in p.steps] == [(8, (8, 8)), (8, (5, 2))]
  assert p.end == End.STOP


def test_decide_drop_last_drops_short_position_everywhere():
  p = plan_lib.decide([rep(0, [8, 5], True), rep(1, [8, 8], True)], DROP)
  assert [s.action for s in p.steps] == [Action.YIELD, Action.DROP]
  assert p.end == End.STOP


def test_decide_rows_above_batch_size_raise_when_padding():
  p = plan_lib.decide([rep(0, [9]), rep(1, [8])], PAD)
  assert (
    p.end == End.RAISE
    and "process 0, output batch 0: 9 rows, more than `batch_size`=8" in p.error.message
  )


def test_decide_not_divisible_by_local_devices_raises():
  p = plan_lib.decide([rep(0, [6], d=4), rep(1, [6], d=4)], STRICT)
  assert (
    p.end == End.RAISE
    and "6 rows per host, not divisible by the 4 local devices" in p.error.message
  )


def test_decide_single_process_short_final_batch_drop_last():
  p = plan_lib.decide([rep(0, [3], True)], DROP)
  assert [s.action for s in p.steps] == [Action.DROP] and p.end == End.STOP


def test_decide_error_raised_after_earlier_positions():
  err = plan_lib.ReportedError(ErrorKind.SOURCE, "process 1 failed", 1, 2, "KeyError")
  p = plan_lib.decide([rep(0, [8, 8, 8]), rep(1, [8, 8], error=err)], STRICT)
  assert len(p.steps) == 2 and p.end == End.RAISE and p.error == err


def test_decide_signature_mismatch_names_processes_and_columns():
  p = plan_lib.decide([rep(0, [8]), rep(1, [8], signature=SIG_F)], STRICT)
  assert p.end == End.RAISE and p.steps == ()
  assert (
    "processes 0 and 1" in p.error.message
    and "column 'x': dtype int32 vs float32" in p.error.message
  )


def test_decide_config_mismatch_names_setting():
  p = plan_lib.decide(
    [rep(0, [8], config={"batch_size": 8}), rep(1, [8], config={"batch_size": 16})], STRICT
  )
  assert p.end == End.RAISE and "batch_size: 8 vs 16" in p.error.message


def test_decide_empty_host_gets_dummies_with_padding():
  p = plan_lib.decide([rep(0, [8, 8], True), rep(1, [], True)], PAD)
  assert [(s.rows, s.real_rows) for s in p.steps] == [(8, (8, 0)), (8, (8, 0))]


def test_report_json_round_trip():
  err = plan_lib.ReportedError(ErrorKind.VALUE, "bad", 1, 3, "ValueError")
  r = rep(1, [8, 4], True, error=err, config={"a": 1}, d=4)
  assert Report.from_json(r.to_json()) == r
