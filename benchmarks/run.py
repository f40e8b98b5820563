"""Side-by-side ratio benchmarks for grain_jax_sync (not a test; nothing asserted).

Run from the repository root:

  python -m benchmarks.run            # print the table
  python -m benchmarks.run --write    # also write benchmarks/RESULTS.md
  python -m benchmarks.run --quick    # fewer batches and trials (a smoke run)

Every figure is a ratio measured within one run (or a byte count), so it holds
on a noisy machine. Hosts are simulated with `grain_jax_sync.testing`: N real
JAX processes x D forced CPU devices joined by jax.distributed on loopback. The
"reference" column is `benchmarks/reference.py`, a baseline model of Ray Data's
`jax_sync_generator`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from typing import Any

from benchmarks import workloads
from grain_jax_sync import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOTES = "## Notes"


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


def _machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  import jax

  return (
    f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()},"
    f" jax {jax.__version__}, {platform.system()} {platform.release()}"
  )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--write", action="store_true", help="write benchmarks/RESULTS.md")
  parser.add_argument("--quick", action="store_true", help="fewer batches and trials")
  args = parser.parse_args(argv)
  q = args.quick
  kw1 = {
    "overhead": {"n": 60, "trials": 2} if q else {},
    "prefetch_sizes": {"n": 12, "trials": 1} if q else {},
    "grain_device_put": {"n": 60, "trials": 2} if q else {},
    "dtype_bytes": {"n": 30, "trials": 2} if q else {},
    "column_scaling": {"n": 30, "trials": 1} if q else {},
    "per_batch": {"n": 100, "trials": 1} if q else {},
  }
  kw2 = {
    "agreement": {"n": 150, "ref_n": 150, "trials": 1} if q else {},
    "overlap": {"n": 20} if q else {},
    "per_batch": {"n": 100, "trials": 1} if q else {},
    "memory": {"n": 12} if q else {},
    "varying_lengths": {"n": 20, "trials": 1} if q else {},
    "elastic": {"n": 30, "trials": 2} if q else {},
  }
  started = time.monotonic()
  one = _run(list(kw1), 1, 8, kw1)
  two = _run(list(kw2), 2, 4, kw2)
  four = _run(["per_batch"], 4, 2, {"per_batch": kw2["per_batch"]})
  o = one[0]

  rows: list[tuple[str, str, str, str, str]] = []

  def add(what: str, setup: str, ours: str, ref: str, target: str) -> None:
    rows.append((what, setup, ours, ref, target))

  ov = o["overhead"]
  add(
    "overhead: throughput vs bare `make_array_from_process_local_data` loop",
    "1 proc x 8 dev, 256-row uint8 image batches",
    f"{_thr(ov, 'ours') / _thr(ov, 'bare'):.2f}"
    f" (prefetch_batches=0: {_thr(ov, 'ours_p0') / _thr(ov, 'bare'):.2f})",
    f"{_thr(ov, 'reference') / _thr(ov, 'bare'):.2f}",
    ">= 0.90",
  )
  for size, res in o["prefetch_sizes"].items():
    add(
      "prefetch vs inline: throughput, default `prefetch_batches=2` / `0`",
      f"1 proc x 8 dev, 256-row uint8 batches of {size}, no training step",
      f"{_thr(res, 'prefetch') / _thr(res, 'inline'):.2f}",
      "-",
      ">= 0.95",
    )
  ag = [v["agreement"] for v in two]
  add(
    "agreement: synchronized / unsynchronized throughput",
    "2 proc x 4 dev, 64-row batches, defaults (lookahead 10);"
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
  for cfg in two[0]["overlap"]:
    add(
      "overlap: wall / (N x max(S, L))",
      f"2 proc x 4 dev, synchronized, {cfg}",
      f"{max(v['overlap'][cfg]['ours'] for v in two):.2f}",
      f"{max(v['overlap'][cfg]['reference'] for v in two):.2f}",
      "<= 1.15",
    )
  gd = o["grain_device_put"]
  add(
    "vs `grain.experimental.device_put`: throughput ratio",
    "1 proc x 8 dev, same Grain pipeline and sharding",
    f"{_thr(gd, 'ours') / _thr(gd, 'grain'):.2f}",
    "-",
    ">= 1.05",
  )
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
  el = [v["elastic"] for v in two]
  add(
    "elastic source, no resize: throughput vs today's `MapDataset` path",
    "2 proc x 4 dev, 64-row batches of 32x32x3 uint8 records, `.batch(64)` per host",
    f"{_worst(el, lambda e: _thr(e, 'elastic') / _thr(e, 'today')):.2f}",
    "-",
    ">= 0.95",
  )
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
  for ncols, res in o["column_scaling"].items():
    ours_ms = res["ours"]["s"] / res["ours"]["batches"] * 1e3
    bare_ms = res["bare"]["s"] / res["bare"]["batches"] * 1e3
    add(
      "scaling: per-batch cost vs columns",
      f"1 proc x 8 dev, {ncols} x (64, 16) float32 columns",
      f"{ours_ms:.2f} ms ({bare_ms / ours_ms:.2f} of bare throughput)",
      "-",
      ">= 0.95 of bare" if int(ncols) == 64 else "-",
    )
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

  header = ("figure", "setup", "grain_jax_sync", "reference (baseline model)", "target")
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  table = "\n".join(lines)
  command = (
    "python -m benchmarks.run" + (" --quick" if q else "") + (" --write" if args.write else "")
  )
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  print(table)
  print(f"\n{stamp}; {_machine()}; {time.monotonic() - started:.0f}s")
  if args.write:
    text = (
      "# Benchmark results\n\n"
      f"- Date: {stamp}\n"
      f"- Machine: {_machine()}\n"
      f"- Command (from the repository root): `{command}`\n"
      f"- Run time: {time.monotonic() - started:.0f}s\n\n"
      "Each figure is a ratio within one run (or a byte count); multi-host figures"
      " are the slowest host's. The reference column is `benchmarks/reference.py`,"
      " a baseline model of Ray Data's `jax_sync_generator`, not Ray itself.\n\n"
      f"{table}\n"
    )
    path = os.path.join(_ROOT, "benchmarks", "RESULTS.md")
    notes = ""
    if os.path.exists(path):  # Keep the hand-written notes below the table.
      with open(path) as f:
        old = f.read()
      if _NOTES in old:
        notes = "\n" + old[old.index(_NOTES) :]
    with open(path, "w") as f:
      f.write(text + notes)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
