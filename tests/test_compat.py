"""jax_sync_generator behaves as Ray Data's reference wherever the reference works.

Reference: ``ray.data.util.jax_util.jax_sync_generator`` (batch_size, paddings,
dtypes). One process x 8 devices in-process (conftest.py); 2 processes x 4
devices for everything that involves more than one host.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time

import numpy as np
import pytest
import scenarios
import scenarios_dropin
from helpers import check_each, run

import grain_jax_sync as gjs
from grain_jax_sync import testing

# The reference's parameters, in order, with their defaults.
REFERENCE = [
  ("batch_iterable", inspect.Parameter.empty),
  ("drop_last", inspect.Parameter.empty),
  ("batch_size", 256),
  ("paddings", None),
  ("dtypes", None),
  ("synchronize_batches", False),
  ("synchronize_lookahead", 10),
]


def x_of(batches):
  return [np.asarray(b["x"]).tolist() for b in batches]


def test_compat_keeps_the_reference_signature_and_defaults():
  params = inspect.signature(gjs.jax_sync_generator).parameters
  assert [(n, p.default) for n, p in params.items()][: len(REFERENCE)] == REFERENCE
  assert repr(params["batch_size"].default) == "256"
  assert params["prefetch_batches"].kind == inspect.Parameter.KEYWORD_ONLY
  assert params["prefetch_batches"].default == 0


@pytest.mark.parametrize("drop_last", [False, True])
def test_compat_defaults_yield_every_equal_batch_of_any_size(drop_last):
  data = scenarios.make_batches(0, [24, 24, 24])
  got = list(gjs.jax_sync_generator(data, drop_last=drop_last))
  assert x_of(got) == [scenarios.rows_for(0, b, 24).tolist() for b in range(3)]


def test_compat_batch_size_none_without_paddings_keeps_every_size():
  data = scenarios.make_batches(0, [16, 8, 24])
  got = list(gjs.jax_sync_generator(data, drop_last=False, batch_size=None))
  assert [len(x) for x in x_of(got)] == [16, 8, 24]
  assert x_of(got)[2] == scenarios.rows_for(0, 2, 24).tolist()


@pytest.mark.parametrize("drop_last", [False, True])
def test_compat_larger_batch_passes_through_with_paddings(drop_last):
  data = scenarios.make_batches(0, [8, 16, 8])
  got = list(
    gjs.jax_sync_generator(data, drop_last=drop_last, batch_size=8, paddings={"x": -1, "y": 0})
  )
  assert [len(x) for x in x_of(got)] == [8, 16, 8]
  assert x_of(got)[1] == scenarios.rows_for(0, 1, 16).tolist()


def test_compat_pads_short_batches_to_a_given_batch_size_as_the_reference():
  data = scenarios.make_batches(0, [8, 5, 8])
  got = x_of(gjs.jax_sync_generator(data, drop_last=False, batch_size=8, paddings=-1))
  assert got[1] == [*scenarios.rows_for(0, 1, 5).tolist(), -1, -1, -1]
  assert len(got) == 3


def test_compat_not_divisible_message_starts_like_the_reference():
  data = scenarios.make_batches(0, [6])
  with pytest.raises(
    ValueError,
    match=r"^The local batch size \(6\) must be evenly divisible by the number of local JAX"
    r" devices \(8\)",
  ):
    list(gjs.jax_sync_generator(data, drop_last=False))


class _CountingSource:
  """Counts reads and records their threads."""

  def __init__(self, batches, wait_s=0.0):
    self.batches = batches
    self.reads = []
    self.wait_s = wait_s

  def __iter__(self):
    for b in self.batches:
      self.reads.append(threading.get_ident())
      if self.wait_s:
        time.sleep(self.wait_s)  # A source that waits on I/O.
      yield b


def test_compat_reads_lazily_in_the_callers_thread():
  src = _CountingSource(scenarios.make_batches(0, [8] * 5))
  gen = gjs.jax_sync_generator(src, drop_last=False)
  assert src.reads == []  # Nothing is read before the first next().
  for k in range(1, 4):
    next(gen)
    assert len(src.reads) == k  # One read per yielded batch, as the reference.
  assert set(src.reads) == {threading.get_ident()}
  gen.close()


def test_one_process_reads_one_batch_per_yield_when_batch_sizes_change():
  # Padded short batches mid-stream: a batch of a size not decided before is
  # still read alone, not with the next one (the one-process fast path).
  src = _CountingSource(scenarios.make_batches(0, [8, 8, 6, 8, 6, 6, 8]))
  it = gjs.iter_jax_batches(src, batch_size=8, paddings=0, prefetch_batches=0)
  for k in range(1, 8):
    batch = next(it)
    assert len(src.reads) == k
    assert batch["x"].shape[0] == 8
  with pytest.raises(StopIteration):
    next(it)


def test_compat_prefetch_batches_reads_a_waiting_source_in_a_background_thread():
  src = _CountingSource(scenarios.make_batches(0, [8] * 6), wait_s=0.005)
  got = list(gjs.jax_sync_generator(src, drop_last=False, prefetch_batches=2))
  assert len(got) == 6
  # The first read shows that the source waits; every later one is in the thread.
  assert threading.get_ident() not in set(src.reads[1:])


def test_compat_does_not_warn_about_the_mask_it_cannot_have(caplog):
  data = scenarios.make_batches(0, [8, 5])
  with caplog.at_level("WARNING", logger="grain_jax_sync"):
    list(gjs.jax_sync_generator(data, drop_last=False, batch_size=8, paddings=0))
  assert "mask_key" not in caplog.text


# -- with the new iterator (full batch size derived from the first batch) ----------------


def test_compat_default_batch_size_drops_only_a_short_last_batch_under_drop_last():
  data = scenarios.make_batches(0, [24, 24, 16])
  assert len(list(gjs.jax_sync_generator(data, drop_last=True))) == 2


@pytest.mark.parametrize("batch_size", ["default", None])
def test_compat_paddings_without_batch_size_pad_to_the_first_batch(batch_size):
  data = scenarios.make_batches(0, [24, 16])
  kwargs = {} if batch_size == "default" else {"batch_size": None}
  got = x_of(gjs.jax_sync_generator(data, drop_last=False, paddings=-1, **kwargs))
  assert [len(x) for x in got] == [24, 24]
  assert got[1][16:] == [-1] * 8


# -- two processes -----------------------------------------------------------------------

SIZES = {
  "equal": [[8, 8, 8], [8, 8, 8]],
  "uneven_sizes": [[8, 8], [8, 4]],
  "uneven_count": [[8, 8], [8]],
  "not_divisible": [[6], [6]],
  "larger": [[8, 16, 8], [8, 16, 8]],
}


def _expected(case, b, n=8):
  return np.concatenate([scenarios.rows_for(p, b, n) for p in range(2)]).tolist()


def check_compat_two_processes_defaults_yield_every_equal_batch(outs, sync, drop_last):
  for out in outs:
    res = out[f"defaults/sync={sync}/drop_last={drop_last}"]
    assert res["error"] is None
    assert [b["x"].tolist() for b in res["batches"]] == [_expected("equal", b) for b in range(3)]


ERRORS = {
  "uneven_sizes": (
    "Uneven batch sizes detected across JAX workers at batch 1:",
    "range from 4 to 8 (process 0: 8, process 1: 4)",
  ),
  "uneven_count": (
    "Uneven number of batches detected across JAX workers:",
    "process 1 ran out of data at batch 1 while process 0 still has batches",
  ),
  "not_divisible": (
    "The local batch size (6) must be evenly divisible by the number of local JAX devices (4)",
    "batch 0 has 6 rows per host",
  ),
}


def check_compat_two_processes_errors_start_with_the_reference_phrases(outs, case, start, detail):
  for out in outs:
    res = out[case]
    assert res["error_type"] == "ValueError"
    assert res["error"].startswith(start) and detail in res["error"]
  assert outs[0][case]["error"] == outs[1][case]["error"]


def check_compat_two_processes_larger_batches_pass_through(outs, case):
  for out in outs:
    res = out[case]
    assert res["error"] is None
    got = [b["x"].tolist() for b in res["batches"]]
    assert got == [_expected(case, 0), _expected(case, 1, 16), _expected(case, 2)]


def check_compat_two_processes_synchronized_reads_in_the_callers_thread(outs):
  for out in outs:
    res = out["lazy_sync"]
    assert res["error"] is None and len(res["batches"]) == 3
    assert res["read_threads"] == [res["caller_thread"]]


def check_compat_two_processes_unsynchronized_read_one_batch_per_yield(outs):
  for out in outs:
    res = out["lazy_unsync"]
    assert res["reads"] == [1, 2, 3] and len(res["threads"]) == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_compat_two_processes_every_case_behaves_as_the_reference():
  # One launch runs every case (`run_compat_cases`); each case's own checks.
  outs = testing.values(run(scenarios_dropin.run_compat_cases, 2, 4, SIZES))
  calls = {
    f"defaults/sync={sync}/drop_last={drop_last}": functools.partial(
      check_compat_two_processes_defaults_yield_every_equal_batch, outs, sync, drop_last
    )
    for sync in (False, True)
    for drop_last in (False, True)
  }
  for case, (start, detail) in ERRORS.items():
    calls[case] = functools.partial(
      check_compat_two_processes_errors_start_with_the_reference_phrases, outs, case, start, detail
    )
  for case in ("larger", "batch_size_none"):
    calls[case] = functools.partial(
      check_compat_two_processes_larger_batches_pass_through, outs, case
    )
  calls["lazy_sync"] = functools.partial(
    check_compat_two_processes_synchronized_reads_in_the_callers_thread, outs
  )
  calls["lazy_unsync"] = functools.partial(
    check_compat_two_processes_unsynchronized_read_one_batch_per_yield, outs
  )
  check_each(calls)
