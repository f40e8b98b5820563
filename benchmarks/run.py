"""Side-by-side ratio benchmarks for grain_jax_sync (not a test; nothing asserted).

Run from the repository root:

  python -m benchmarks.run            # print the table
  python -m benchmarks.run --write    # also replace its table in benchmarks/RESULTS.md
  python -m benchmarks.run --quick    # fewer batches and trials (a smoke run)
  python -m benchmarks.run --only cpu_per_batch --only input_bound   # some rows alone

`--only` takes workload names: the keys of `_ONE` and `_TWO` below and
`benchmarks.host.NAMES` (benchmarks of a real host: CPU beside a step,
memory against Grain's `device_put`, an input-bound job).

Every figure is a ratio measured within one run (or a byte count), so it holds
on a noisy machine. Hosts are simulated with `grain_jax_sync.testing`: N real
JAX processes x D forced CPU devices joined by jax.distributed on loopback. The
"reference" column is `benchmarks/reference.py`, a baseline model of Ray Data's
`jax_sync_generator`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from benchmarks import host, results_file, workloads
from grain_jax_sync import testing

SECTION = "benchmarks.run"  # Its section of benchmarks/RESULTS.md.


def _run(
  names: list[str], procs: int, devices: int, kwargs: dict[str, Any]
) -> list[dict[str, Any]]:
  outs = testing.run_processes(
    workloads.suite,
    num_processes=procs,
    devices_per_process=devices,
    args=(names, kwargs),
    timeout_s=1200,
  )
  return testing.values(outs)


def _thr(res: dict[str, Any], key: str) -> float:
  """Batches per second of one variant."""
  return res[key]["batches"] / res[key]["s"]


def _worst(values: list[dict[str, Any]], fn: Any) -> float:
  """The slowest host decides a multi-host figure."""
  return min(fn(v) for v in values)


# Workloads of the 1 x 8 and 2 x 4 runs, with their --quick arguments.
_ONE = {
  "overhead": {"n": 60, "trials": 2},
  "prefetch_sizes": {"n": 12, "trials": 1},
  "grain_device_put": {"n": 60, "trials": 2},
  "dtype_bytes": {"n": 30, "trials": 2},
  "column_scaling": {"n": 30, "trials": 1},
  "cross_thread_free": {"n": 30, "trials": 1},
  "per_batch": {"n": 100, "trials": 1},
  "hf_map_style": {"n": 10, "trials": 1},
}
_TWO = {
  "agreement": {"n": 150, "ref_n": 150, "trials": 1},
  "overlap": {"n": 20},
  "per_batch": {"n": 100, "trials": 1},
  "memory": {"n": 12},
  "varying_lengths": {"n": 20, "trials": 1},
  "elastic": {"n": 30, "trials": 2},
  "hf_map_style": {"n": 10, "trials": 1},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  """The command line, parsed; `--write` with `--only` is refused (a partial table)."""
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument(
    "--write", action="store_true", help="replace its table in benchmarks/RESULTS.md"
  )
  parser.add_argument("--quick", action="store_true", help="fewer batches and trials")
  known = sorted({*_ONE, *_TWO, *host.NAMES})
  parser.add_argument(
    "--only",
    action="append",
    choices=known,
    metavar="NAME",
    help=f"run only this workload (repeatable): {', '.join(known)}",
  )
  args = parser.parse_args(argv)
  if args.write and args.only:
    parser.error("--write needs the whole table: leave out --only")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  q = args.quick
  names = set(args.only or [*_ONE, *_TWO, *host.NAMES])
  kw1 = {k: (v if q else {}) for k, v in _ONE.items() if k in names}
  kw2 = {k: (v if q else {}) for k, v in _TWO.items() if k in names}
  started = time.monotonic()
  one = _run(list(kw1), 1, 8, kw1) if kw1 else [{}]
  two = _run(list(kw2), 2, 4, kw2) if kw2 else [{}]
  four = _run(["per_batch"], 4, 2, {"per_batch": kw2["per_batch"]}) if "per_batch" in kw2 else []
  hosts = host.run(sorted(names & set(host.NAMES)), q)
  rows = _rows(one, two, four) + host.rows(hosts)
  header = ("figure", "setup", "grain_jax_sync", "peer or reference", "target")
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  table = "\n".join(lines)
  command = (
    "python -m benchmarks.run" + (" --quick" if q else "") + (" --write" if args.write else "")
  )
  head = results_file.provenance(command, time.monotonic() - started)
  print(f"{table}\n\n{head}")
  if args.write:
    results_file.write_section(SECTION, f"{head}\n{table}")
  return 0


Row = tuple[str, str, str, str, str]
Add = Callable[[str, str, str, str, str], None]


def _rows(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]]
) -> list[Row]:
  """The rows of the 1 x 8, 2 x 4 and 4 x 2 runs' workloads that ran, in table order."""
  rows: list[Row] = []

  def add(what: str, setup: str, ours: str, ref: str, target: str) -> None:
    rows.append((what, setup, ours, ref, target))

  for name, fn in _ROWS.items():
    if name in one[0] or name in two[0]:
      fn(one, two, four, add)
  return rows


def _rows_overhead(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  o = one[0]
  ov = o["overhead"]
  add(
    "overhead: throughput vs bare `make_array_from_process_local_data` loop",
    "1 proc x 8 dev, 256-row uint8 image batches",
    f"{_thr(ov, 'ours') / _thr(ov, 'bare'):.2f}"
    f" (prefetch_batches=0: {_thr(ov, 'ours_p0') / _thr(ov, 'bare'):.2f})",
    f"{_thr(ov, 'reference') / _thr(ov, 'bare'):.2f}",
    ">= 0.90",
  )


def _rows_prefetch_sizes(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  o = one[0]
  for size, res in o["prefetch_sizes"].items():
    add(
      "prefetch vs inline: throughput, default `prefetch_batches=2` / `0`",
      f"1 proc x 8 dev, 256-row uint8 batches of {size}, no training step",
      f"{_thr(res, 'prefetch') / _thr(res, 'inline'):.2f}",
      "-",
      ">= 0.95",
    )


def _rows_agreement(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  ag = [v["agreement"] for v in two]
  add(
    "agreement: synchronized / unsynchronized throughput",
    "2 proc x 4 dev, 64-row batches, defaults;"
    f" {ag[0]['ours_sync']['batches']:,} batches per trial"
    f" (the reference model {ag[0]['ref_nosync']['batches']:,})",
    f"{_worst(ag, lambda a: _thr(a, 'ours_sync') / _thr(a, 'ours_nosync')):.2f}",
    f"{_worst(ag, lambda a: _thr(a, 'ref_sync10') / _thr(a, 'ref_nosync')):.2f}"
    f" (lookahead 1: {_worst(ag, lambda a: _thr(a, 'ref_sync1') / _thr(a, 'ref_nosync')):.2f})",
    ">= 0.90",
  )
  add(
    "agreement: an iterator's start and end (10 batches), synchronized / unsynchronized",
    "2 proc x 4 dev, 64-row batches, defaults",
    f"{max(a['ours_sync_short']['s'] for a in ag) * 1e3:.1f} ms"
    f" / {max(a['ours_nosync_short']['s'] for a in ag) * 1e3:.1f} ms",
    "-",
    "-",
  )


def _rows_overlap(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  for cfg in two[0]["overlap"]:
    add(
      "overlap: wall / (N x max(S, L))",
      f"2 proc x 4 dev, synchronized, {cfg}",
      f"{max(v['overlap'][cfg]['ours'] for v in two):.2f}",
      f"{max(v['overlap'][cfg]['reference'] for v in two):.2f}",
      "<= 1.15",
    )


def _rows_grain_device_put(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  o = one[0]
  gd = o["grain_device_put"]
  add(
    "vs `grain.experimental.device_put`: throughput ratio",
    "1 proc x 8 dev, same Grain pipeline and sharding",
    f"{_thr(gd, 'ours') / _thr(gd, 'grain'):.2f}",
    "-",
    ">= 1.05",
  )


def _rows_dtype_bytes(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  o = one[0]
  db = o["dtype_bytes"]
  if not db["policy_bytes_per_batch"]:
    raise RuntimeError(
      "dtype_bytes counted no bytes: the transfer is called where it does not look"
    )
  add(
    "dtype policy: bytes handed to the transfer per batch (f32 -> bf16)",
    "1 proc x 8 dev, 256 x 1024 float32",
    f"{db['policy_bytes_per_batch'] / 2**20:.2f} MiB"
    f" ({db['policy_bytes_per_batch'] / db['after_bytes_per_batch']:.2f}x),"
    f" time {db['policy']['s'] / db['after']['s']:.2f}x",
    f"{db['after_bytes_per_batch'] / 2**20:.2f} MiB (1.00x)",
    "0.5x bytes",
  )


def _rows_per_batch(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  scale = {1: one, 2: two, 4: four}
  base_ms = None
  for p, vals in scale.items():
    ms = max(v["per_batch"]["ours"]["s"] / v["per_batch"]["ours"]["batches"] for v in vals) * 1e3
    bare = max(v["per_batch"]["bare"]["s"] / v["per_batch"]["bare"]["batches"] for v in vals) * 1e3
    base_ms = base_ms or ms
    add(
      "scaling: per-batch cost vs process count",
      f"{p} proc x {8 // p} dev, 64-row batches, synchronized",
      f"{ms:.2f} ms ({ms / base_ms:.2f}x of 1 proc; bare loop {bare:.2f} ms)",
      "-",
      "-",
    )


def _rows_column_scaling(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  o = one[0]
  for ncols, res in o["column_scaling"].items():
    ours_ms = res["ours"]["s"] / res["ours"]["batches"] * 1e3
    p0_ms = res["ours_p0"]["s"] / res["ours_p0"]["batches"] * 1e3
    bare_ms = res["bare"]["s"] / res["bare"]["batches"] * 1e3
    add(
      "scaling: per-batch cost vs columns",
      f"1 proc x 8 dev, {ncols} x (64, 16) float32 columns, no training step",
      f"{ours_ms:.2f} ms ({bare_ms / ours_ms:.2f} of bare throughput);"
      f" prefetch_batches=0: {p0_ms:.2f} ms ({bare_ms / p0_ms:.2f})",
      f"bare loop {bare_ms:.2f} ms",
      ">= 0.90 of bare" if int(ncols) == 64 else "-",
    )


def _rows_cross_thread_free(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  res = one[0]["cross_thread_free"]

  def cell(k: str) -> str:
    ratio = res["inline"]["s"] / res[k]["s"]
    return f"{ratio:.2f} of inline, {res[k]['switches']:.0f} context switches per batch"

  add(
    "a hand-off between threads, no library code, no step: throughput vs the inline bare loop",
    "1 proc x 8 dev, 64 x (64, 16) float32 columns; the bare loop in a thread, each batch"
    " handed over a queue",
    f"consumer frees each batch: {cell('thread_free')}; keeps them all: {cell('thread_keep')}",
    f"`grain.experimental.device_put`: {cell('grain')}; inline:"
    f" {res['inline']['switches']:.0f} switches per batch",
    "- (the cause of the no-step rows)",
  )


def _rows_memory(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  mem = [v["memory"] for v in two]
  b = mem[0]["batch_bytes"]

  def batches(key: str) -> str:
    worst = max(m[key] for m in mem)
    return f"{worst / b:.1f} batches ({worst / 2**20:.0f} MiB)"

  add(
    "memory: peak RSS growth per host, 64 MB batches",
    "2 proc x 4 dev, synchronized, defaults; gc.collect() after each step",
    batches("ours_collected"),
    batches("reference_collected"),
    "bounded, documented",
  )
  add(
    "memory: as above, without the per-step gc.collect()",
    "2 proc x 4 dev, synchronized, defaults",
    batches("ours"),
    batches("reference"),
    "-",
  )


def _rows_elastic(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  el = [v["elastic"] for v in two]
  add(
    "elastic source, no resize: throughput vs today's `MapDataset` path",
    "2 proc x 4 dev, 64-row batches of 32x32x3 uint8 records, `.batch(64)` per host",
    f"{_worst(el, lambda e: _thr(e, 'elastic') / _thr(e, 'today')):.2f}",
    "-",
    ">= 0.95",
  )


def _rows_varying_lengths(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  vl = two[0]["varying_lengths"]
  per = [v["varying_lengths"]["times"] for v in two]
  add(
    "pad_shapes: tokens computed / real tokens, skewed lengths",
    "2 proc x 4 dev, 64-row length-grouped batches, log-normal lengths <= 1024;"
    f" buckets 64..1024 ({vl['bucket_shapes']} shapes), agreed max ({vl['agreed_shapes']} shapes)",
    f"buckets {vl['bucketed'] / vl['real']:.2f} (agreed max {vl['agreed'] / vl['real']:.2f})",
    f"pad to max {vl['to_max'] / vl['real']:.2f}",
    "-",
  )
  add(
    "pad_shapes: agreement's per-batch cost, option on / off",
    "2 proc x 4 dev, synchronized, equal (64, 128) int32 batches",
    f"{max(t['on']['s'] / t['off']['s'] for t in per):.2f}x"
    f" ({max(t['on']['s'] / t['on']['batches'] for t in per) * 1e3:.2f} ms vs"
    f" {max(t['off']['s'] / t['off']['batches'] for t in per) * 1e3:.2f} ms)",
    "-",
    "~1.00",
  )


def _rows_hf_map_style(
  one: list[dict[str, Any]], two: list[dict[str, Any]], four: list[dict[str, Any]], add: Add
) -> None:
  for setup, values in (("1 proc x 8 dev", one), ("2 proc x 4 dev", two)):
    hf = [v["hf_map_style"] for v in values if "hf_map_style" in v]
    if hf:
      add(
        "Hugging Face map-style `Dataset`: rows/s through `iter_jax_batches(hf_pipeline(ds))`"
        " vs the bare `ds.iter(batch_size=...)` + `make_array_from_process_local_data` loop",
        f"{setup}, {hf[0]['rows']}-row batches of (1024,) int32 tokens + 2 scalars, NumPy format",
        f"{_worst(hf, lambda h: _thr(h, 'ours') / _thr(h, 'bare')):.2f}",
        f"bare loop {max(h['bare']['s'] / h['bare']['batches'] for h in hf) * 1e3:.2f} ms a batch",
        ">= 0.95",
      )


_ROWS = {
  "overhead": _rows_overhead,
  "prefetch_sizes": _rows_prefetch_sizes,
  "agreement": _rows_agreement,
  "overlap": _rows_overlap,
  "grain_device_put": _rows_grain_device_put,
  "dtype_bytes": _rows_dtype_bytes,
  "per_batch": _rows_per_batch,
  "column_scaling": _rows_column_scaling,
  "cross_thread_free": _rows_cross_thread_free,
  "memory": _rows_memory,
  "varying_lengths": _rows_varying_lengths,
  "elastic": _rows_elastic,
  "hf_map_style": _rows_hf_map_style,
}


if __name__ == "__main__":
  raise SystemExit(main())
