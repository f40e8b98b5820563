"""The reader stage: each local failure becomes one ending, at the failed read; row digests."""

from __future__ import annotations

import functools
import hashlib
import types

import jax
import ml_dtypes
import numpy as np
import pytest
import scenarios

import grain_jax_sync as gjs
from grain_jax_sync._src import batches, build, messages, reader, sources
from grain_jax_sync._src.agreement import core


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
  assert all(isinstance(i, core.Read) for i in items[:-1])
  assert isinstance(items[-1], core.End)
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
      messages.ErrorKind.SOURCE,
      "converting batch 1",
      "TypeError",
    ),
    (
      lambda b: _raising(b, 2, KeyboardInterrupt("stop")),
      2,
      messages.ErrorKind.SOURCE,
      "reading batch 2 from its source",
      "KeyboardInterrupt",
    ),
    (
      lambda b: _raising(b, 1, SystemExit("bye")),
      1,
      messages.ErrorKind.SOURCE,
      "reading batch 1 from its source",
      "SystemExit",
    ),
    (
      lambda b: _StateFails(b, 2),
      2,
      messages.ErrorKind.SOURCE,
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


def _narrowed(batches, dtypes=None):
  """The reader's ending over `batches` with the iterator's narrowing float casts (x64 off)."""
  narrowing = functools.partial(build.narrowing, dtypes=dtypes)
  return _drain(batches, narrowing=narrowing)


def test_narrowing_names_the_leaves_a_host_cast_narrows_and_why():
  assert not jax.config.read("jax_enable_x64")
  sig = batches.validate(
    {
      "f64": np.zeros(8),
      "f32": np.zeros(8, np.float32),
      "keep": np.zeros(8, np.float32),
      "i32": np.zeros(8, np.int32),
      "u8": np.zeros(8, np.uint8),
      "c128": np.zeros(8, np.complex128),
    },
    process_index=0,
    batch_index=0,
  ).signature
  dtypes = {"f32": np.float16, "u8": np.float32, "i32": ml_dtypes.bfloat16}
  got = {sig.names[n.leaf]: (n.dtype, n.why) for n in build.narrowing(sig, dtypes=dtypes)}
  # Not "keep" (no cast), "i32" (bfloat16's range holds every int32), "u8"
  # (widened on the device), "c128" (complex: not checked).
  assert got == {
    "f32": (np.dtype(np.float16), "`dtypes` casts it to on the host"),
    "f64": (np.dtype(np.float32), "JAX holds float64 values in while x64 is off"),
  }


@pytest.mark.parametrize(
  ("leaf", "dtypes", "value", "into", "becomes"),
  [
    (np.float64, None, 1e300, "float32", "inf"),  # x64 off: float64 lands as float32.
    (np.float64, None, -1e300, "float32", "-inf"),
    (np.float64, np.float32, 3.5e38, "float32", "inf"),
    (np.float32, np.float16, 65520.0, "float16", "inf"),  # Rounds up past 65504.
    (np.int32, np.float16, 70000, "float16", "inf"),
    (np.float32, ml_dtypes.float8_e4m3fn, 500.0, "float8_e4m3fn", "nan"),
  ],
)
def test_a_finite_value_a_narrowing_float_cast_would_lose_ends_naming_it(
  leaf, dtypes, value, into, becomes
):
  good = np.arange(8).astype(leaf)
  bad = good.copy()
  bad[5] = value
  reads, end = _narrowed([{"x": good}, {"x": bad}], None if dtypes is None else {"x": dtypes})
  assert len(reads) == 1 and end.error is not None
  assert end.error.kind == messages.ErrorKind.VALUE and end.error.batch_index == 1
  assert end.error.message.startswith(
    f"process 3, batch 1, column 'x': value {value!r} does not fit {into}, the dtype"
  ), end.error.message
  assert f"(it would become {becomes} silently)" in end.error.message
  assert f"or bring the values into the {into} range (magnitude at most" in end.error.message


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_nan_and_inf_in_the_source_pass_unchanged(dtype):
  x = np.array([np.nan, np.inf, -np.inf, 0.0, 1.5, -2.0, 65504.0, 7.0], dtype)
  dtypes = {"x": np.float16} if dtype == np.float32 else None
  reads, end = _narrowed([{"x": x}, {"x": np.full(8, np.nan, dtype)}], dtypes)
  assert end.exhausted and len(reads) == 2
  out = list(gjs.iter_jax_batches([{"x": x}], batch_size=8, dtypes=dtypes))
  np.testing.assert_array_equal(np.asarray(out[0]["x"]).astype(np.float64), x.astype(np.float64))


def test_only_narrowed_columns_are_checked():
  big = np.full(8, 3e38, np.float32)  # Fits float32, would not fit float16.
  batch = {"kept": big, "wide": big, "small": np.full(8, 60000.0, np.float32)}
  dtypes = {"wide": np.float64, "small": np.float16}  # float64: widened on the device.
  reads, end = _narrowed([batch, batch], dtypes)
  assert end.exhausted and len(reads) == 2
  batch = {**batch, "small": np.full(8, 3e38, np.float32)}
  _, end = _narrowed([batch], dtypes)
  assert end.error is not None and "column 'small': value 3e+38" in end.error.message


def test_a_float64_value_beyond_float32_raises_in_one_process():
  data = [{"x": np.zeros(8)}, {"x": np.full(8, 1e300)}]
  with pytest.raises(ValueError, match=r"process 0, batch 1, column 'x': value 1e\+300 does"):
    list(gjs.iter_jax_batches(data, batch_size=8))


def test_a_type_error_from_array_is_raised_as_itself_in_one_process():
  data = scenarios.make_batches(0, [8, 8])
  data[1] = {"x": data[1]["x"], "y": _CudaLike()}
  it = gjs.iter_jax_batches(data, batch_size=8)
  next(it)
  with pytest.raises(TypeError, match="can't convert cuda"):
    next(it)
  it.close()


# -- the row digest that processes sharing a data shard compare -------------------


def _batch(seed=0, rows=16):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 255, (rows, 8, 8, 3), dtype=np.uint8), np.arange(rows, dtype=np.int32)]


def test_rows_digest_equal_rows_equal_digest_any_layout():
  a = _batch()
  b = [np.asfortranarray(a[0]), a[1].astype(">i4").astype(np.int32)]  # Same values, other layout.
  assert reader.rows_digest(a) == reader.rows_digest(b)
  assert len(reader.rows_digest(a)) == 16


@pytest.mark.parametrize(
  "change",
  [
    lambda x, y: (x, y[::-1].copy()),  # Another order (another shuffle).
    lambda x, y: (x, y + 16),  # Another shard.
    lambda x, y: (x[:8], y[:8]),  # Fewer rows.
    lambda x, y: (x, y.astype(np.int64)),  # Another dtype.
    lambda x, y: (x.reshape(16, 8, 24), y),  # Another shape.
  ],
)
def test_rows_digest_differs_for_other_rows(change):
  x, y = _batch()
  assert reader.rows_digest([x, y]) != reader.rows_digest(list(change(x, y)))


def test_rows_digest_large_leaves_are_sampled_but_see_each_sampled_row():
  rng = np.random.default_rng(1)
  big = rng.integers(0, 255, (256, 64, 64, 3), dtype=np.uint8)  # 3 MiB: sampled.
  assert big.nbytes > reader.DIGEST_FULL_BYTES
  base = reader.rows_digest([big])
  other = big.copy()
  other[255, 0, 0, 0] ^= 1  # The last row and its first element are always sampled.
  assert reader.rows_digest([other]) != base
  shuffled = big[rng.permutation(256)]
  assert reader.rows_digest([shuffled]) != base
  bf16 = big[:, :1, :1, 0].astype(ml_dtypes.bfloat16)
  assert reader.rows_digest([bf16]) == reader.rows_digest([bf16.copy()])


def test_rows_digest_reads_a_bounded_sample_of_a_large_batch(monkeypatch):
  big = np.random.default_rng(0).integers(0, 256, (256, 224, 224, 3), np.uint8)
  labels = np.arange(256, dtype=np.int32)
  expected = reader.rows_digest([big, labels])
  hashed = []

  class Counting:
    def __init__(self, **kwargs):
      self._h = hashlib.blake2b(**kwargs)

    def update(self, data):
      hashed.append(len(data))
      self._h.update(data)

    def hexdigest(self):
      return self._h.hexdigest()

  monkeypatch.setattr(reader, "hashlib", types.SimpleNamespace(blake2b=Counting))
  assert reader.rows_digest([big, labels]) == expected
  # 38.5 MB of images: the digest reads at most DIGEST_SAMPLE_ROWS rows of
  # DIGEST_ROW_BYTES each (a stride may round a row's sample up by one element),
  # plus the whole 1 KiB of labels and two short headers; never the batch.
  bound = reader.DIGEST_SAMPLE_ROWS * (reader.DIGEST_ROW_BYTES + 1) + labels.nbytes + 2 * 64
  assert sum(hashed) <= bound, (sum(hashed), bound)
  assert sum(hashed) < big.nbytes // 500
