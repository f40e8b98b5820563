"""The reader stage: every local failure becomes one ending, at the failed read."""

from __future__ import annotations

import numpy as np
import pytest
import scenarios

import grain_jax_sync as gjs
from grain_jax_sync._src import plan, reader, sources


class _CudaLike:
  def __array__(self, *args, **kwargs):
    raise TypeError("can't convert cuda:0 device type tensor to numpy")


class _StateFails:
  def __init__(self, batches, at):
    self._it, self._n, self._at = iter(batches), 0, at

  def __iter__(self):
    return self

  def __next__(self):
    self._n += 1
    return next(self._it)

  def get_state(self):
    if self._n == self._at + 1:
      raise OSError("state file vanished")
    return {"n": self._n}

  def set_state(self, state):
    raise NotImplementedError


def _drain(source, **kw):
  r = reader.Reader(sources.open_source(source), process_index=3, check_int32=True, **kw)
  items = list(r)
  assert all(isinstance(i, reader.Read) for i in items[:-1])
  assert isinstance(items[-1], reader.End)
  return items[:-1], items[-1]


def _raising(batches, at, exc):
  for b, batch in enumerate(batches):
    if b == at:
      raise exc
    yield batch


@pytest.mark.parametrize(
  ("make", "at", "kind", "doing", "type_name"),
  [
    (
      lambda b: b[:1] + [{"x": b[1]["x"], "y": _CudaLike()}] + b[2:],
      1,
      plan.ErrorKind.SOURCE,
      "converting batch 1",
      "TypeError",
    ),
    (
      lambda b: _raising(b, 2, KeyboardInterrupt("stop")),
      2,
      plan.ErrorKind.SOURCE,
      "reading batch 2 from its source",
      "KeyboardInterrupt",
    ),
    (
      lambda b: _raising(b, 1, SystemExit("bye")),
      1,
      plan.ErrorKind.SOURCE,
      "reading batch 1 from its source",
      "SystemExit",
    ),
    (
      lambda b: _StateFails(b, 2),
      2,
      plan.ErrorKind.SOURCE,
      "taking the source state after batch 2",
      "OSError",
    ),
  ],
)
def test_any_exception_type_is_the_ending_at_the_failed_read(make, at, kind, doing, type_name):
  reads, end = _drain(make(scenarios.make_batches(3, [8] * 4)))
  assert len(reads) == at == end.position
  assert end.error.kind == kind and end.error.type_name == type_name
  assert end.error.message.startswith(f"process 3 failed while {doing}: {type_name}: ")
  assert type(end.exception).__name__ == type_name


def test_empty_batches_are_skipped_and_do_not_count_as_positions():
  reads, end = _drain([{"x": np.zeros(0, np.int32)}, {"x": np.arange(8)}])
  assert len(reads) == 1 and end.exhausted and end.position == 1


@pytest.mark.parametrize(
  ("dtype", "value", "kind"), [(np.int64, 2**40 + 1, "int32"), (np.uint64, 2**33, "uint32")]
)
def test_64_bit_values_that_would_wrap_raise_naming_column_batch_and_value(dtype, value, kind):
  data = [{"ids": np.arange(8, dtype=dtype)}, {"ids": np.full(8, value, dtype)}]
  with pytest.raises(
    ValueError, match=rf"process 0, batch 1, column 'ids': value {value} does not fit {kind}"
  ):
    list(gjs.iter_jax_batches(data, batch_size=8))


def test_64_bit_values_in_range_arrive_exactly():
  lo, hi = -(2**31), 2**31 - 1
  data = [{"ids": np.array([lo, hi, 0, 1, -1, 5, 6, 7], np.int64)}]
  out = list(gjs.iter_jax_batches(data, batch_size=8))
  np.testing.assert_array_equal(np.asarray(out[0]["ids"]), data[0]["ids"])


def test_a_type_error_from_array_is_raised_as_itself_in_one_process():
  data = scenarios.make_batches(0, [8, 8])
  data[1] = {"x": data[1]["x"], "y": _CudaLike()}
  it = gjs.iter_jax_batches(data, batch_size=8)
  next(it)
  with pytest.raises(TypeError, match="can't convert cuda"):
    next(it)
  it.close()
