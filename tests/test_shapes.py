"""Shapes that vary (`pad_shapes`): hosts agree on sequence lengths, not only rows.

Real processes (2 x 4 and 4 x 2), every host with its own length at every
position: each global batch is rebuilt here from every host's source batches
(padded rows and elements of `paddings`, the agreed length bucketed) and
compared value by value, with the row mask and the element masks. Unit tests
of the options, `shapes.agree` and the wire codecs
run in this process.
"""

from __future__ import annotations

import bisect
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scenarios
from helpers import check_each, unwire, wire

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import messages
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import shapes as shapes_lib
from grain_jax_sync._src.agreement import ledger as ledger_lib

TOPOLOGIES = [pytest.param(2, 4, id="2x4"), pytest.param(4, 2, id="4x2")]
TIMEOUT = 240
CASES = ["plain", "resume", "tf", "grain", "above", "other_dim", "aot"]

# The scenarios, run in every process: each case returns this host's source
# batches as NumPy (read a second time, for the expectation) and every output
# batch gathered to NumPy.
BUCKETS = [8, 16, 32, 64]
PAD = -1
KW: dict[str, Any] = {
  "batch_size": 4,
  "paddings": PAD,
  "mask_key": "mask",
  "pad_shapes": {"tokens": 1, "feats": 1},
  "shape_buckets": {"tokens": BUCKETS},
  "shape_mask_keys": {"tokens": "tokens_mask", "feats": "feats_mask"},
  "synchronize_lookahead": 2,
}


def length(p: int, b: int) -> int:
  """This host's sequence length at batch `b`: 1 to 40, different on every host."""
  return 1 + (7 * p + 13 * b + 3 * p * b) % 40


def plain_batches(p: int, n: int | None = None) -> list[dict[str, np.ndarray]]:
  """Host `p`: 6 + p batches of 4 rows (the last of 3), each of its own length."""
  count = 6 + p if n is None else n
  out = []
  for b in range(count):
    rows = 3 if b == count - 1 else 4
    ln = length(p, b)
    tokens = (
      100000 * (p + 1) + 1000 * b + 50 * np.arange(rows)[:, None] + np.arange(ln) + 1
    ).astype(np.int32)
    feats = np.stack([tokens, -tokens], axis=-1).astype(np.float32)
    out.append({"tokens": tokens, "feats": feats, "label": np.arange(rows, dtype=np.int32) + b})
  return out


def _tf_source(p: int) -> Any:
  import tensorflow as tf

  def gen():
    for i in range(10 + 3 * p):
      ln = 1 + (5 * p + 3 * i) % 20
      yield np.arange(ln, dtype=np.int32) + 100000 * (p + 1) + 100 * i + 1

  ds = tf.data.Dataset.from_generator(gen, output_signature=tf.TensorSpec([None], tf.int32))
  ds = ds.map(lambda s: {"tokens": s, "label": tf.shape(s)[0]})
  return ds.padded_batch(4, padding_values={"tokens": 0, "label": 0})


def _pad_rows(items: list[np.ndarray]) -> dict[str, np.ndarray]:
  """A Grain `batch_fn`: pads each batch to its own longest sequence."""
  ln = max(len(x) for x in items)
  tokens = np.zeros((len(items), ln), np.int32)
  for r, x in enumerate(items):
    tokens[r, : len(x)] = x
  return {"tokens": tokens, "label": np.asarray([len(x) for x in items], np.int32)}


def grain_source(p: int) -> Any:
  import grain

  seqs = [
    np.arange(1 + (3 * p + 7 * i) % 30, dtype=np.int32) + 100000 * (p + 1) + 100 * i + 1
    for i in range(12 + 2 * p)
  ]
  return grain.MapDataset.source(seqs).batch(4, batch_fn=_pad_rows)


def _consume(it: Any, step: Any = None, limit: int | None = None) -> dict[str, Any]:
  return scenarios.consume(_Stepped(it, step), limit)


class _Stepped:
  """Iterates `it`, calling a jitted `step` on each batch (compile counting)."""

  def __init__(self, it: Any, step: Any):
    self._it = it
    self._step = step

  def __iter__(self):
    for batch in self._it:
      if self._step is not None:
        self._step(batch["tokens"], batch["tokens_mask"]).block_until_ready()
      yield batch


def _plain(p: int) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp

  import grain_jax_sync as gjs

  traces = []

  def body(t: Any, m: Any) -> Any:
    traces.append(t.shape)  # Python runs here once per trace: once per compile.
    return jnp.where(m, t, 0).sum()

  step = jax.jit(body)
  with gjs.iter_jax_batches(plain_batches(p), **KW) as it:
    out = _consume(it, step)
  out["src"] = plain_batches(p)
  out["compiled"] = len(traces)
  return out


def _resume(p: int) -> dict[str, Any]:
  import grain_jax_sync as gjs

  data = plain_batches(p)
  with gjs.iter_jax_batches(data, **KW) as it:
    full = _consume(it)
  with gjs.iter_jax_batches(data, **KW) as it:
    first = _consume(it, limit=3)
    state = json.loads(json.dumps(it.get_state()))
  with gjs.iter_jax_batches(data, **KW) as it:
    it.set_state(state)
    rest = _consume(it)
  other = dict(KW, shape_buckets={"tokens": [16, 64]})
  with gjs.iter_jax_batches(data, **other) as it:
    try:
      it.set_state(state)
      refused = None
    except ValueError as e:
      refused = str(e)
  return {"full": full, "first": first, "rest": rest, "refused": refused}


def _tf(p: int) -> dict[str, Any]:
  import grain_jax_sync as gjs

  kw = dict(KW, pad_shapes={"tokens": 1}, shape_mask_keys={"tokens": "tokens_mask"})
  with gjs.iter_jax_batches(_tf_source(p), **kw) as it:
    out = _consume(it)
  out["src"] = list(_tf_source(p).as_numpy_iterator())
  return out


def _grain(p: int) -> dict[str, Any]:
  import grain_jax_sync as gjs

  kw = dict(KW, pad_shapes={"tokens": 1}, shape_mask_keys={"tokens": "tokens_mask"})
  kw.pop("synchronize_lookahead")
  ds = gjs.device_put(grain_source(p).to_iter_dataset(), **kw)
  out = _consume(iter(ds))
  src = grain_source(p)
  out["src"] = [src[i] for i in range(len(src))]
  return out


def _above(p: int, n: int) -> dict[str, Any]:
  import grain_jax_sync as gjs

  data = plain_batches(p)
  if p == n - 1:  # The last host's batch 2 is longer than the last bucket.
    data[2] = {k: np.concatenate([v] * 20, axis=1) if v.ndim > 1 else v for k, v in data[2].items()}
  with gjs.iter_jax_batches(data, **KW) as it:
    return _consume(it)


def _other_dim(p: int, n: int) -> dict[str, Any]:
  """A dim that `pad_shapes` does not name still has to match."""
  import grain_jax_sync as gjs

  data = plain_batches(p)
  if p == n - 1:
    data = [dict(b, feats=np.concatenate([b["feats"]] * 2, axis=2)) for b in data]
  with gjs.iter_jax_batches(data, **KW) as it:
    return _consume(it)


# Ahead of time (`batch_specs`): three buckets, every one compiled before the loop.
AOT_BUCKETS = [16, 32, 64]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def aot_batches(p: int) -> list[dict[str, np.ndarray]]:
  """`plain_batches` without the unbucketed column."""
  return [{k: v for k, v in b.items() if k != "feats"} for b in plain_batches(p)]


def aot_sums(srcs: list[list[dict[str, np.ndarray]]]) -> list[int]:
  """Per global batch, the real tokens and labels summed over every host (`_aot_step`)."""
  out = []
  for j in range(max(len(s) for s in srcs)):
    here = [s[j] for s in srcs if j < len(s)]
    out.append(int(sum(b["tokens"].sum() + b["label"].sum() for b in here)))
  return out


def _aot_step(batch: Any) -> Any:
  import jax.numpy as jnp

  tokens = jnp.where(batch["tokens_mask"], batch["tokens"], 0).sum()
  return tokens + jnp.where(batch["mask"], batch["label"], 0).sum()


def _described(tree: Any) -> list[Any]:
  """Per leaf (sorted by key): its key, shape, dtype and sharding."""
  return [(k, tuple(v.shape), str(v.dtype), v.sharding) for k, v in sorted(tree.items())]


def _aot(p: int, **kw: Any) -> dict[str, Any]:
  """Every bucket's step compiled from `batch_specs()` before the loop; compiles counted in it."""
  import jax

  import grain_jax_sync as gjs

  batch_size = 4 if jax.process_count() > 1 else 8
  options = dict(KW, batch_size=batch_size, pad_shapes={"tokens": 1}, **kw)
  options.update(shape_buckets={"tokens": AOT_BUCKETS}, shape_mask_keys={"tokens": "tokens_mask"})
  step = jax.jit(_aot_step)
  compiles: list[str] = []

  def listen(name: str, _secs: float, **_: Any) -> None:
    if name == COMPILE_EVENT:
      compiles.append(name)

  with gjs.iter_jax_batches(aot_batches(p), **options) as it:
    specs = it.batch_specs()
    received_before = it.get_state()["batches"]
    compiled = {s["tokens"].shape: step.lower(s).compile() for s in specs}
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
      sums, matched, widths = [], [], []
      for batch in it:
        spec = next(s for s in specs if s["tokens"].shape == batch["tokens"].shape)
        matched.append(_described(batch) == _described(spec))
        widths.append(batch["tokens"].shape[1])
        sums.append(int(compiled[batch["tokens"].shape](batch)))
        sums.append(int(step(batch)))  # The jitted step finds its compiled bucket too.
    finally:
      jax.monitoring.unregister_event_duration_listener(listen)
  return {
    "specs": [[(k, shape, dtype) for k, shape, dtype, _ in _described(s)] for s in specs],
    "received_before": received_before,
    "matched": matched,
    "widths": widths,
    "sums": sums[::2],
    "jit_sums": sums[1::2],
    "compiles": len(compiles),
  }


def _aot_cases(p: int) -> dict[str, Any]:
  """With prefetch (the build thread) and without (every stage in the call)."""
  return {"prefetch": _aot(p), "inline": _aot(p, prefetch_batches=0)}


def run_shapes(cases: list[str]) -> list[dict[str, Any]]:
  """Runs each case in turn on this host."""
  import jax

  p, n = jax.process_index(), jax.process_count()
  runs = {
    "plain": lambda: _plain(p),
    "resume": lambda: _resume(p),
    "tf": lambda: _tf(p),
    "grain": lambda: _grain(p),
    "above": lambda: _above(p, n),
    "other_dim": lambda: _other_dim(p, n),
    "aot": lambda: _aot_cases(p),
  }
  return [runs[c]() for c in cases]


def _run(n, d):
  """Every case in one launch of n processes x d devices: {case: [each process's value]}."""
  outs = testing.values(
    testing.run_processes(
      run_shapes, num_processes=n, devices_per_process=d, args=(CASES,), timeout_s=TIMEOUT
    )
  )
  return {c: [outs[p][i] for p in range(n)] for i, c in enumerate(CASES)}


def _bucket(size, buckets):
  return size if buckets is None else buckets[bisect.bisect_left(buckets, size)]


def expected(srcs, *, batch_size, buckets, varying=("tokens", "feats")):
  """Every global batch, rebuilt from each host's source batches."""
  out = []
  for j in range(max(len(s) for s in srcs)):
    here = [s[j] if j < len(s) else None for s in srcs]
    batch = {}
    for key, ref in next(b for b in here if b is not None).items():
      ln = max(b[key].shape[1] if b[key].ndim > 1 else 0 for b in here if b is not None)
      ln = _bucket(ln, buckets) if key == "tokens" else ln
      parts, masks = [], []
      for b in here:
        shape = (batch_size, *((ln,) if key in varying else ()), *ref.shape[2:])
        part = np.full(shape, PAD, ref.dtype)
        m = np.zeros(shape[:2] if key in varying else shape[:1], bool)
        if b is not None:
          v = b[key]
          part[tuple(slice(0, x) for x in v.shape)] = v
          m[tuple(slice(0, x) for x in v.shape[: m.ndim])] = True
        parts.append(part)
        masks.append(m)
      batch[key] = np.concatenate(parts)
      if key in varying:
        batch[f"{key}_mask"] = np.concatenate(masks)
    rows = [np.arange(batch_size) < (0 if b is None else b["tokens"].shape[0]) for b in here]
    batch["mask"] = np.concatenate(rows)
    out.append(batch)
  return out


def assert_batches(got, want):
  assert len(got) == len(want)
  for j, (g, w) in enumerate(zip(got, want, strict=True)):
    assert sorted(g) == sorted(w), j
    for key in w:
      assert g[key].shape == w[key].shape, (j, key, g[key].shape, w[key].shape)
      np.testing.assert_array_equal(g[key], w[key], err_msg=f"batch {j}, {key}")


# -- real processes ------------------------------------------------------------


def check_every_value_and_both_masks_variable_lengths(by_case, n):
  runs = by_case["plain"]
  srcs = [r["src"] for r in runs]
  want = expected(srcs, batch_size=4, buckets=BUCKETS)
  for r in runs:
    assert r["error"] is None, r["error"]
    assert_batches(r["batches"], want)
  # The hosts with fewer batches got dummy batches of the agreed shape.
  short = min(len(s) for s in srcs)
  assert len(want) > short
  for j in range(short, len(want)):  # Process 0 has the fewest batches: dummies from here.
    got = runs[0]["batches"][j]
    assert got["tokens"].shape[1] in BUCKETS
    assert (got["tokens"][:4] == PAD).all() and (got["feats"][:4] == PAD).all()
    assert not got["mask"][:4].any() and not got["tokens_mask"][:4].any()
    assert not got["feats_mask"][:4].any() and got["tokens_mask"][4:].any()


def check_global_shapes_per_bucket_and_compile_count(by_case, n):
  runs = by_case["plain"]
  shapes = {b["tokens"].shape for b in runs[0]["batches"]}
  assert {s[1] for s in shapes} <= set(BUCKETS)
  assert all(s[0] == 4 * n for s in shapes)
  # Unbucketed `feats` takes the agreed max itself; its mask is (rows, length).
  for b in runs[0]["batches"]:
    assert b["feats"].shape[1] <= b["tokens"].shape[1]
    assert b["feats_mask"].shape == b["feats"].shape[:2]
  for r in runs:
    assert r["compiled"] == len(shapes) <= len(BUCKETS)


def check_resume_mid_stream_exact_and_other_buckets_refused(by_case, n):
  for r in by_case["resume"]:
    full, first, rest = r["full"]["batches"], r["first"]["batches"], r["rest"]["batches"]
    assert len(first) == 3
    assert_batches(first + rest, full)
    assert r["refused"] is not None and "pad_shapes" in r["refused"]


def check_tf_padded_batch_and_grain_batches(by_case, n, case):
  runs = by_case[case]
  srcs = [r["src"] for r in runs]
  want = expected(srcs, batch_size=4, buckets=BUCKETS, varying=("tokens",))
  for r in runs:
    assert r["error"] is None, r["error"]
    assert_batches(r["batches"], want)
  lengths = {b["tokens"].shape[1] for s in srcs for b in s}
  assert len(lengths) > 3  # The lengths did vary per host and batch.


def check_size_above_last_bucket_raises_on_every_host(by_case, n):
  runs = by_case["above"]
  errors = {r["error"] for r in runs}
  assert len(errors) == 1
  (error,) = errors
  assert "column 'tokens' dim 1" in error and "above the last" in error
  assert str(BUCKETS) in error and "batch 2" in error
  assert all(r["error_type"] == "ValueError" and len(r["batches"]) == 2 for r in runs)


def check_dim_not_named_still_must_match(by_case, n):
  runs = by_case["other_dim"]
  assert len({r["error"] for r in runs}) == 1
  assert "column 'feats': trailing shape (*, 2) vs (*, 4)" in runs[0]["error"], runs[0]["error"]
  assert all(r["error_type"] == "ValueError" for r in runs)


def check_aot(run: dict[str, Any], srcs: list[Any], rows: int) -> None:
  """Three specs, the buckets ascending; every batch matched its spec; no compile in the loop."""
  want = [
    [
      ("label", (rows,), "int32"),
      ("mask", (rows,), "bool"),
      ("tokens", (rows, b), "int32"),
      ("tokens_mask", (rows, b), "bool"),
    ]
    for b in AOT_BUCKETS
  ]
  assert run["specs"] == want
  assert run["received_before"] == 0
  assert run["sums"] == run["jit_sums"] == aot_sums(srcs)
  assert run["matched"] == [True] * len(run["sums"])
  assert set(run["widths"]) <= set(AOT_BUCKETS)
  assert run["compiles"] == 0


def check_batch_specs_compile_every_bucket_before_the_loop(by_case, n):
  runs = by_case["aot"]
  srcs = [aot_batches(p) for p in range(n)]
  for r in runs:
    for how in ("prefetch", "inline"):
      check_aot(r[how], srcs, rows=4 * n)
  if n == 2:  # Every bucket came up in the loop (at 4 hosts the longest lengths skip 16).
    assert sorted(set(runs[0]["prefetch"]["widths"])) == AOT_BUCKETS


# -- one process -----------------------------------------------------------------


def test_batch_specs_compile_every_bucket_before_the_loop_one_process():
  for kw in ({}, {"prefetch_batches": 0}):
    run = _aot(0, **kw)
    check_aot(run, [aot_batches(0)], rows=8)
    assert sorted(set(run["widths"])) == AOT_BUCKETS  # Every bucket came up in the loop.


def _one(data, **kw):
  with gjs.iter_jax_batches(data, **{**KW, **kw}) as it:
    return [{k: np.asarray(v) for k, v in b.items()} for b in it]


def test_one_process_values_match_expected():
  srcs = [plain_batches(0)]
  got = _one(srcs[0], batch_size=8)  # 8 local devices here.
  assert_batches(got, expected(srcs, batch_size=8, buckets=BUCKETS))


def test_bare_array_int_dim():
  data = [np.ones((8, n), np.float32) for n in (3, 5)]
  with gjs.iter_jax_batches(data, paddings=0, mask_key=None, pad_shapes=1) as it:
    got = [np.asarray(b) for b in it]
  assert [g.shape for g in got] == [(8, 3), (8, 5)]


def test_jax_sync_generator_takes_the_options():
  data = [{"tokens": np.ones((8, n), np.int32)} for n in (3, 9)]
  got = list(
    gjs.jax_sync_generator(
      data,
      drop_last=False,
      batch_size=8,
      paddings=0,
      pad_shapes={"tokens": 1},
      shape_buckets={"tokens": [4, 16]},
      shape_mask_keys={"tokens": "m"},
    )
  )
  assert [b["tokens"].shape for b in got] == [(8, 4), (8, 16)]
  assert np.asarray(got[1]["m"]).sum() == 8 * 9


def test_device_put_takes_the_options():
  grain = pytest.importorskip("grain")
  ds = grain_source(0).to_iter_dataset()
  out = list(gjs.device_put(ds, batch_size=8, paddings=0, mask_key=None, pad_shapes={"tokens": 1}))
  src = grain_source(0)
  assert [b["tokens"].shape[1] for b in out] == [src[i]["tokens"].shape[1] for i in range(len(src))]
  assert isinstance(ds, grain.IterDataset)


@pytest.mark.parametrize(
  ("kw", "match"),
  [
    ({"pad_shapes": {"tokens": 1}, "paddings": None}, "needs `paddings`"),
    ({"pad_shapes": {"tokens": 0}}, "dims must be ints >= 1"),
    ({"pad_shapes": {"tokens": (1, 1)}}, "distinct dims"),
    ({"shape_buckets": {"tokens": [8]}, "pad_shapes": None}, "needs `pad_shapes`"),
    ({"shape_buckets": {"other": [8]}}, "names columns that `pad_shapes` does not"),
    ({"shape_buckets": {"tokens": [16, 8]}}, "ascending ints"),
    ({"shape_mask_keys": {"tokens": 3}}, "must be a str"),
  ],
)
def test_bad_options_raise_early(kw, match):
  args = {**KW, "batch_size": 8, **kw}
  if args["pad_shapes"] is None:  # Only the option under test is left without it.
    args["shape_mask_keys"] = None
  with pytest.raises(ValueError, match=match):
    gjs.iter_jax_batches([], **args)


@pytest.mark.parametrize(
  ("kw", "match"),
  [
    ({"pad_shapes": {"nope": 1}}, r"names columns that the batches do not have: \['nope'\]"),
    ({"pad_shapes": {"tokens": 2}}, "names dim 2, but the leaf has 2 dims"),
    ({"shape_mask_keys": {"tokens": "label"}}, "already a column"),
    ({"pad_shapes": {"tokens": 1, "label": 1}}, "'label'.*names dim 1"),
  ],
)
def test_bad_columns_and_dims_name_the_batch(kw, match):
  data = [{"tokens": np.ones((8, 3), np.int32), "label": np.ones((8,), np.int32)}]
  kw = {
    "shape_buckets": None,
    "shape_mask_keys": None,
    "batch_size": 8,
    "pad_shapes": {"tokens": 1},
    **kw,
  }
  with pytest.raises(ValueError, match=match):
    _one(data, **kw)


def test_signature_leaves_named_dims_out():
  shapes = shapes_lib.make({"a": 1}, None, None, 0)
  varying = lambda names, ranks: shapes_lib.leaf_dims(shapes, names, ranks)  # noqa: E731
  a = batches_lib.validate({"a": np.ones((2, 3))}, process_index=0, batch_index=0, varying=varying)
  b = batches_lib.validate(
    {"a": np.ones((2, 7))}, process_index=0, batch_index=1, expected=a.signature, varying=varying
  )
  assert b.signature is a.signature and a.signature.shapes == ((-1,),)
  assert (a.sizes, b.sizes) == ((3,), (7,))


def _report(p, rows, sizes):
  return messages.Report(p, rows=rows, sizes=sizes, signature=_SIG, exhausted=True)


_SIG = {"spec": {"d": [["tokens", "*"]]}, "leaves": [["tokens", "int32", [-1]]]}


@pytest.mark.parametrize(("buckets", "want"), [(None, [(9,), (3,)]), ([4, 8, 16], [(16,), (4,)])])
def test_decide_agrees_on_the_max_bucketed(buckets, want):
  shapes = shapes_lib.make({"tokens": 1}, buckets and {"tokens": buckets}, None, 0)
  options = plan_lib.Rules(batch_size=4, drop_last=False, pad=True, shapes=shapes)
  reports = [
    _report(0, (4, 4), ((9,), (2,))),
    _report(1, (4,), ((5,),)),
    _report(2, (4, 4), ((1,), (3,))),
  ]
  plan = plan_lib.decide(reports, options)
  assert [s.sizes for s in plan.steps] == want and plan.end == messages.Outcome.STOP


def test_decide_above_last_bucket_raises_at_that_step():
  shapes = shapes_lib.make({"tokens": 1}, {"tokens": [4, 8]}, None, 0)
  options = plan_lib.Rules(batch_size=4, drop_last=False, pad=True, shapes=shapes)
  reports = [_report(0, (4, 4), ((3,), (2,))), _report(1, (4, 4), ((5,), (12,)))]
  plan = plan_lib.decide(reports, options, position=5)
  assert len(plan.steps) == 1 and plan.end == messages.Outcome.RAISE
  assert plan.error.message.startswith("column 'tokens' dim 1: size 12 at batch 6 (process 1)")
  assert "[4, 8]" in plan.error.message


def test_wire_unchanged_when_off_and_sizes_round_trip():
  off = messages.Report(0, rows=(4, 4))
  assert '"z"' not in wire(off)
  on = messages.Report(0, rows=(4, 4), sizes=((3, 1), (7, 2)))
  assert unwire(wire(on)).sizes == ((3, 1), (7, 2))
  steps = tuple(messages.Step(messages.Action.YIELD, 4, (), s) for s in ((8,), (8,), (16,)))
  text = messages.Decision(0, steps, messages.Outcome.CONTINUE).to_json()
  assert [s.sizes for s in messages.Decision.from_json(text).steps] == [(8,), (8,), (16,)]
  plain = (messages.Step(messages.Action.YIELD, 4, ()),) * 2
  assert '"st":[["yield",4,2]]' in messages.Decision(0, plain, messages.Outcome.STOP).to_json()


def test_jitted_step_compiles_once_per_bucket():
  import jax
  import jax.numpy as jnp

  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 1025, size=40)
  data = [{"tokens": np.ones((8, int(n)), np.int32)} for n in lengths]
  traces = []

  def body(t, m):
    traces.append(t.shape)  # Python runs here once per trace: once per compile.
    return jnp.where(m, t, 0).sum()

  step = jax.jit(body)
  buckets = [128, 256, 512, 1024]
  with gjs.iter_jax_batches(
    data,
    batch_size=8,
    paddings=0,
    mask_key=None,
    pad_shapes={"tokens": 1},
    shape_buckets={"tokens": buckets},
    shape_mask_keys={"tokens": "tokens_mask"},
  ) as it:
    sums = [int(step(b["tokens"], b["tokens_mask"])) for b in it]
  assert sums == [8 * int(n) for n in lengths]
  assert sorted(traces) == [(8, b) for b in buckets]  # One compile per bucket.


def test_ledger_keeps_sizes_beside_rows():
  led = ledger_lib.Ledger(2, sizes=True)
  led.add_rows(0, 4, None, (7,))
  led.add_rows(0, 4, None, (9,))
  report = messages.Report(1, rows=(4, 3), sizes=((12,), (2,)), exhausted=True)
  led.add(messages.Chunk.from_json(messages.Chunk(0, 0, report).to_json()))
  reports = led.window_reports(0, 2, with_config=False)
  assert [r.sizes for r in reports] == [((7,), (9,)), ((12,), (2,))]
  led.forget(1)
  assert [r.sizes for r in led.window_reports(1, 1, with_config=False)] == [((9,),), ((2,),)]
  assert ledger_lib.Ledger(1).window_reports(0, 0, with_config=False)[0].sizes == ()


def test_batch_specs_without_pad_shapes_one_spec_with_casts_and_nesting():
  data = [{"a": {"x": np.full((8, 3), i, np.float32)}, "y": np.arange(8) + i} for i in range(3)]
  with gjs.iter_jax_batches(data, dtypes={"a/x": "bfloat16"}, prefetch_batches=0) as it:
    (spec,) = it.batch_specs()
    assert it.get_state()["batches"] == 0
    got = list(it)
    assert it.batch_specs() == [spec]  # Known: at once, after the end too.
  assert [float(b["a"]["x"][0, 0]) for b in got] == [0.0, 1.0, 2.0]  # None was skipped.
  for b in got:
    pairs = zip(jax.tree.leaves(b), jax.tree.leaves(spec), strict=True)
    assert [(a.shape, a.dtype, a.sharding) for a, _ in pairs] == [
      (s.shape, s.dtype, s.sharding) for s in jax.tree.leaves(spec)
    ]
  assert (spec["a"]["x"].dtype, spec["y"].dtype) == (jnp.bfloat16, np.int32)
  assert jax.tree.structure(spec) == jax.tree.structure(got[0])


def test_batch_specs_refuses_a_varying_dim_without_buckets():
  data = [{"tokens": np.ones((8, n), np.int32)} for n in (3, 9)]
  with gjs.iter_jax_batches(data, paddings=0, pad_shapes={"tokens": 1}) as it:
    with pytest.raises(ValueError, match="column 'tokens' dim 1 varies.*without `shape_buckets`"):
      it.batch_specs()
    assert [b["tokens"].shape for b in it] == [(8, 3), (8, 9)]


@pytest.mark.parametrize("prefetch", [2, 0])
def test_batch_specs_raises_the_streams_ending_before_its_first_batch(prefetch):
  with gjs.iter_jax_batches([], prefetch_batches=prefetch) as it:
    with pytest.raises(RuntimeError, match="ended before its first batch"):
      it.batch_specs()
    assert list(it) == []
  unbatched = [{"id": np.int32(i)} for i in range(8)]
  with gjs.iter_jax_batches(unbatched, prefetch_batches=prefetch) as it:
    with pytest.raises(ValueError, match="column 'id': 0-d leaf.*Batch the elements first"):
      it.batch_specs()
    assert list(it) == []  # The error ended the stream, as raised by `next()`.


def test_device_put_iterator_batch_specs_before_its_first_batch():
  import grain

  rows = [{"x": np.full((2,), i, np.int32)} for i in range(20)]
  ds = grain.MapDataset.source(rows).batch(8)
  it = iter(gjs.device_put(ds, batch_size=8, paddings=0, mask_key="mask"))
  (spec,) = it.batch_specs()
  got = list(it)
  assert [np.asarray(b["x"])[:, 0].tolist() for b in got] == [
    list(range(8)), list(range(8, 16)), [16, 17, 18, 19, 0, 0, 0, 0]
  ]  # fmt: skip
  for b in got:
    assert _described(b) == _described(spec)
  it.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize(("n", "d"), TOPOLOGIES)
def test_varying_shapes_agree_across_real_processes(n, d):
  pytest.importorskip("tensorflow")  # A case reads a tf.data pipeline.
  # One launch per topology runs every case (`CASES`); each case's own checks.
  by_case = _run(n, d)
  checks = {
    "plain values and masks": check_every_value_and_both_masks_variable_lengths,
    "plain shapes and compiles": check_global_shapes_per_bucket_and_compile_count,
    "resume": check_resume_mid_stream_exact_and_other_buckets_refused,
    "above": check_size_above_last_bucket_raises_on_every_host,
    "other_dim": check_dim_not_named_still_must_match,
    "aot": check_batch_specs_compile_every_bucket_before_the_loop,
  }
  calls = {name: functools.partial(check, by_case, n) for name, check in checks.items()}
  for case in ("tf", "grain"):
    calls[case] = functools.partial(check_tf_padded_batch_and_grain_batches, by_case, n, case)
  check_each(calls)
