"""Padding, masks and the full batch size: `paddings`, `mask_key`, `drop_last`.

End to end (1 and 2 processes): the warning for paddings without a mask, the
full batch size derived from the first batch when `batch_size` is unset, and
a short batch that is not its host's last. Unit tests of `padding`'s NumPy
helpers (`element_mask`, `fill_leaf`) run in this process.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import scenarios
import scenarios_dropin
from helpers import check_each, run_cases

import grain_jax_sync as gjs
from grain_jax_sync._src import padding

# -- paddings without a mask ---------------------------------------------------------


@pytest.mark.parametrize(
  ("kwargs", "warnings"),
  [
    ({"paddings": 0}, 1),
    ({"paddings": 0, "mask_key": None}, 0),
    ({"paddings": 0, "mask_key": "mask"}, 0),
    ({}, 0),
  ],
)
def test_paddings_without_mask_key_warn_once_unless_none_is_passed(caplog, kwargs, warnings):
  data = scenarios.make_batches(0, [8, 5] if kwargs else [8, 8])
  with (
    caplog.at_level("WARNING", logger="grain_jax_sync"),
    gjs.iter_jax_batches(data, batch_size=8, **kwargs) as it,
  ):
    got = list(it)
  assert caplog.text.count("indistinguishable from real rows") == warnings
  assert [b["x"].shape for b in got] == [(8,), (8,)]


@pytest.mark.parametrize(
  ("kwargs", "shapes"),
  [
    ({}, [(16,), (8,)]),
    ({"paddings": 0, "mask_key": None}, [(16,), (16,)]),
    ({"drop_last": True}, [(16,)]),
  ],
)
def test_batch_size_left_unset_is_the_first_batch_size_with_paddings_or_drop_last(kwargs, shapes):
  data = scenarios.make_batches(0, [16, 8])
  with gjs.iter_jax_batches(data, **kwargs) as it:
    assert [b["x"].shape for b in it] == shapes


# -- the full batch size derived, exact "last batch" -------------------------------------


def test_without_batch_size_paddings_pad_to_the_first_batch_and_resume_keeps_it():
  data = scenarios.make_batches(0, [24, 24, 16])
  kwargs = {"paddings": -1, "mask_key": "mask"}
  with gjs.iter_jax_batches(data, **kwargs) as it:
    got = list(it)
  assert [b["x"].shape for b in got] == [(24,)] * 3
  np.testing.assert_array_equal(np.asarray(got[2]["mask"]), np.arange(24) < 16)
  with gjs.iter_jax_batches(data, **kwargs) as it:
    next(it)
    next(it)
    state = it.get_state()
  with gjs.iter_jax_batches(data, **kwargs) as it:
    it.set_state(state)  # Resumed before the short batch: still judged by 24.
    rest = list(it)
  assert [b["x"].shape for b in rest] == [(24,)]
  np.testing.assert_array_equal(np.asarray(rest[0]["mask"]), np.arange(24) < 16)


def test_without_batch_size_drop_last_drops_only_the_short_last_batch():
  data = scenarios.make_batches(0, [24, 24, 16])
  with gjs.iter_jax_batches(data, drop_last=True) as it:
    assert [b["x"].shape for b in it] == [(24,), (24,)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_drop_last_short_batch_that_is_not_the_last_raises_naming_both_sizes(prefetch):
  data = scenarios.make_batches(0, [24, 16, 24])
  with (
    pytest.raises(
      ValueError, match=r"process 0, batch 1: 16 rows, fewer than the full batch size 24"
    ),
    gjs.iter_jax_batches(data, batch_size=24, drop_last=True, prefetch_batches=prefetch) as it,
  ):
    list(it)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_single_process_decisions_reused_for_repeated_sizes_keep_positions_and_masks(prefetch):
  # One process reuses the decision for a window of the same sizes; an error
  # must still name its own batch, and every padded batch its own mask.
  data = scenarios.make_batches(0, [8] * 12 + [4, 8])
  with (
    pytest.raises(ValueError, match=r"process 0, batch 12: 4 rows, fewer than the full"),
    gjs.iter_jax_batches(data, batch_size=8, drop_last=True, prefetch_batches=prefetch) as it,
  ):
    list(it)
  data = scenarios.make_batches(0, [8, 4, 8, 4, 8, 4])
  kw = {"batch_size": 8, "paddings": -1, "mask_key": "m", "prefetch_batches": prefetch}
  with gjs.iter_jax_batches(data, **kw) as it:
    got = [(np.asarray(b["x"]), np.asarray(b["m"])) for b in it]
  assert len(got) == len(data)
  for (x, m), batch in zip(got, data, strict=True):
    n = len(batch["x"])
    np.testing.assert_array_equal(x[:n], batch["x"])
    assert (x[n:] == -1).all()
    np.testing.assert_array_equal(m, np.arange(8) < n)


def check_two_processes_short_batch_that_is_not_the_last_raises_on_every_host(outs, short):
  case = f"short_not_last/{short}"
  for out in outs:
    res = out[case]
    assert res["error_type"] == "ValueError"
    assert f"process {short}, batch 1: 16 rows, fewer than the full batch size 24" in res["error"]
    assert len(res["batches"]) == 1
  assert outs[0][case]["error"] == outs[1][case]["error"]


def check_two_processes_without_batch_size_pad_or_drop_by_the_first_batch(outs):
  for out in outs:
    pad = out["derived_pad"]
    assert pad["error"] is None and [len(b["x"]) for b in pad["batches"]] == [48] * 3
    mask = pad["batches"][2]["mask"].tolist()
    assert mask == [True] * 16 + [False] * 8 + [True] * 24
    assert pad["batches"][2]["x"].tolist()[:24] == [*scenarios.rows_for(0, 2, 16), *[-1] * 8]
    drop = out["derived_drop"]
    assert drop["error"] is None and [len(b["x"]) for b in drop["batches"]] == [48, 48]
    assert out["state_batch_size"] == 24
    rest = out["resumed"]
    assert rest["error"] is None and [len(b["x"]) for b in rest["batches"]] == [48]
    assert rest["batches"][0]["mask"].tolist() == ([True] * 16 + [False] * 8) * 2


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_processes_batch_sizes_with_and_without_prefetch():
  # One launch runs the size cases at prefetch 0, then at 2; each case's own checks.
  cases = {f"prefetch={k}": (scenarios_dropin.run_size_cases, (k,), {}) for k in (0, 2)}
  values = run_cases(2, 4, cases, timeout_s=240)
  calls = {}
  for case in cases:
    outs = [v[case] for v in values]
    for short in (0, 1):
      calls[f"{case}/short_not_last/{short}"] = functools.partial(
        check_two_processes_short_batch_that_is_not_the_last_raises_on_every_host, outs, short
      )
    calls[f"{case}/without_batch_size"] = functools.partial(
      check_two_processes_without_batch_size_pad_or_drop_by_the_first_batch, outs
    )
  check_each(calls)


# -- per-column options (`padding.per_leaf`) -------------------------------------------


def test_paddings_dict_with_unknown_column_raises():
  with pytest.raises(
    ValueError, match=r"`paddings` names columns that the batches do not have: \['z'\]"
  ):
    list(
      gjs.iter_jax_batches(
        scenarios.make_batches(0, [8]), batch_size=8, paddings={"x": 0, "y": 0, "z": 1}
      )
    )


def test_a_bare_array_batch_takes_a_one_entry_dict_whatever_its_key_as_the_reference_does():
  data = [np.arange(8, dtype=np.int64), np.arange(5, dtype=np.int64)]
  out = list(gjs.iter_jax_batches(data, batch_size=8, paddings={"any": 7}, dtypes={"x": "int8"}))
  assert [a.dtype for a in out] == [np.int8, np.int8]
  assert np.asarray(out[1]).tolist() == [0, 1, 2, 3, 4, 7, 7, 7]
  with pytest.raises(
    ValueError, match=r"`dtypes` for a single-array batch must be a scalar or a dict with one entry"
  ):
    list(gjs.iter_jax_batches(data, batch_size=8, dtypes={"a": "int8", "b": "int16"}))


# -- padding's NumPy helpers ----------------------------------------------------------


def test_element_mask_rows_and_dims():
  m = padding.element_mask((2, 3, 5, 4), 4, (6, 5, 8), (0, 2))
  assert m.shape == (4, 6, 5, 8)
  assert m[:2, :3, :, :4].all() and m.sum() == 2 * 3 * 5 * 4
  assert not padding.element_mask(None, 4, (6,), (0,)).any()


def test_fill_leaf_pads_trailing_dims():
  leaf = np.arange(6, dtype=np.int32).reshape(2, 3)
  out = padding.fill_leaf(leaf, target=3, shape=(5,), dtype=np.dtype(np.int32), pad=np.int32(-1))
  np.testing.assert_array_equal(out, [[0, 1, 2, -1, -1], [3, 4, 5, -1, -1], [-1] * 5])
