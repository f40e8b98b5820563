"""Command-line tool: `python -m grain_jax_sync {demo,doctor,simulate}`."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

# How often the demo's progress bar polls the hosts' batch counts.
_PROGRESS_POLL_S = 0.1


def _show_progress(progress_file: str, total: int, ended: threading.Event) -> None:
  """Shows the demo hosts' batches (a byte each in `progress_file`) until `ended`: tqdm on
  stderr, else plain lines."""
  try:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top

    bar = tqdm(total=total, desc="batches (all hosts)", unit="batch", leave=True)
  except ImportError:
    bar = None
  shown, last = 0, False
  while not last:
    last = ended.wait(_PROGRESS_POLL_S)  # Once it has ended, one more read shows the end.
    done = os.path.getsize(progress_file)
    if done > shown:
      if bar is None:
        print(f"batches (all hosts): {done}/{total}", file=sys.stderr, flush=True)
      else:
        bar.update(done - shown)
      shown = done
  if bar is not None:
    bar.close()


def _run_with_progress(args: argparse.Namespace) -> list[Any]:
  """Runs the demo hosts, showing their batches (summed over hosts) as they go."""
  from grain_jax_sync import testing  # pylint: disable=g-import-not-at-top
  from grain_jax_sync._src import demo  # pylint: disable=g-import-not-at-top

  total = args.processes * demo.expected_batches(args.processes, args.batch_size)
  ended = threading.Event()
  with tempfile.NamedTemporaryFile() as progress_file:
    progress = threading.Thread(
      target=_show_progress, args=(progress_file.name, total, ended), daemon=True
    )
    progress.start()
    try:
      return testing.run_processes(
        demo.demo_host,
        num_processes=args.processes,
        devices_per_process=args.devices,
        kwargs={"batch_size": args.batch_size, "progress_file": progress_file.name},
        timeout_s=args.timeout,
      )
    finally:
      ended.set()
      progress.join()


def _print_stats(outcomes: list[Any]) -> None:
  """`JaxBatchIterator.stats()` of every host, as a table."""
  from grain_jax_sync._src import stats  # pylint: disable=g-import-not-at-top

  rows = [(o.process_index, s) for o in outcomes if (s := _entry(o, "stats")) is not None]
  if not rows:
    return
  print("\nstats() per host (seconds are each stage's own time):")
  _print_table(rows, stats.FIELDS)
  # The cross-host view, as the last host (a follower of process 0's decisions) sees it.
  last = outcomes[-1]
  job = _entry(last, "job")
  if job is not None:
    slowest = job["slowest"]
    which = f"slowest by source time: host {slowest}"
    if slowest is None:
      which = "no host slowest by source time at 0.1 ms"
    print(f"\nstats(all_hosts=True) on host {last.process_index} ({which}):")
    _print_table(
      [(h["process_index"], h) for h in job["hosts"]], (*stats.FIELDS, "padding_fraction")
    )


def _entry(outcome: Any, key: str) -> Any:
  """The first `key` entry of a demo host's rows; None if it failed or has none."""
  return next((r[key] for r in outcome.value if key in r), None) if outcome.ok else None


def _print_table(rows: list[tuple[int, dict[str, Any]]], fields: Sequence[str]) -> None:
  table = [["host", *fields]]
  for p, s in rows:
    cells = [f"{s[k]:.4f}" if isinstance(s[k], float) else str(s[k]) for k in fields]
    table.append([str(p), *cells])
  widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
  for row in table:
    print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def _demo(args: argparse.Namespace) -> int:
  print(
    f"grain_jax_sync demo: {args.processes} local processes x {args.devices}"
    f" CPU devices, batch_size={args.batch_size}; host p holds 10 + 7p records",
    flush=True,
  )
  outcomes = _run_with_progress(args)
  failed = False
  for o in outcomes:
    print(f"\n== host {o.process_index} ==")
    if not o.ok:
      failed = True
      print(f"FAILED: {o.error_type}: {o.error_message}\n{o.log[-2000:]}")
      continue
    for row in o.value:  # Its batches, then its state, stats() and stats(all_hosts=True).
      if "batch" in row:
        print(
          f"  batch {row['batch']}: global {row['global_shape']} features"
          f" {row['features_dtype']}; this host: {row['local_real_rows']} real +"
          f" {row['local_padded_rows']} padded rows; global mask sum"
          f" {row['global_mask_sum']}"
        )
      elif "state" in row:
        print(f"  resume state after the last batch: {json.dumps(row['state'])}")
  if not failed:
    counts = {len([r for r in o.value if "batch" in r]) for o in outcomes}
    seen = sorted(i for r in outcomes[0].value if "batch" in r for i in r["real_ids"])
    total = sum(10 + 7 * p for p in range(args.processes))
    print(
      f"\nevery host yielded {counts.pop() if len(counts) == 1 else counts} batches;"
      f" {len(seen)} of {total} records seen once each:"
      f" {len(seen) == total == len(set(seen))}"
    )
  _print_stats(outcomes)
  return 1 if failed else 0


def _doctor(args: argparse.Namespace) -> int:
  del args
  import jax  # pylint: disable=g-import-not-at-top

  import grain_jax_sync  # pylint: disable=g-import-not-at-top
  from grain_jax_sync._src import placement  # pylint: disable=g-import-not-at-top
  from grain_jax_sync._src.exchange import key_value  # pylint: disable=g-import-not-at-top

  print(f"grain_jax_sync {grain_jax_sync.__version__}, Python {platform.python_version()}")
  print(f"jax {jax.__version__}, backend {jax.default_backend()}")
  print(
    f"processes {jax.process_count()} (this: {jax.process_index()}), devices {jax.device_count()} (local {jax.local_device_count()})"
  )
  print(
    f"key-value store client: {'yes' if key_value.distributed_client() is not None else 'no (single process or jax.distributed not initialised)'}"
  )
  for mod in ("grain", "tensorflow", "tensorflow_datasets", "orbax.checkpoint", "ml_dtypes"):
    found = importlib.util.find_spec(mod.split(".")[0]) is not None
    print(f"  {mod}: {'installed' if found else 'not installed'}")
  order, reason = placement.default_device_order(jax.devices())
  ids = [d.id for d in order]
  shown = ", ".join(map(str, ids[:16])) + (", ..." if len(ids) > 16 else "")
  slices = placement.slice_indices(order)
  print(f"default mesh: 1-D 'data' axis over {len(order)} devices; {reason}")
  print(f"  device ids in mesh order: [{shown}]; slices: {slices or 'none reported'}")
  print(f"batches go to: {placement.resolve_placement().describe()}")
  return 0


def _signal_at(text: str) -> Any:
  """``--signal PROCESS:SIGNAL:BATCH`` (e.g. ``1:SIGTERM:5``) as a `testing.SignalAt`."""
  import signal  # pylint: disable=g-import-not-at-top

  from grain_jax_sync import testing  # pylint: disable=g-import-not-at-top

  process, name, batch = (text.split(":") + ["", ""])[:3]
  name = name.upper()
  try:
    by_name = name if name.startswith("SIG") else f"SIG{name}"
    signum = signal.Signals(int(name)) if name.isdigit() else signal.Signals[by_name]
    return testing.SignalAt(process=int(process), after_batch=int(batch), signal=signum)
  except (KeyError, ValueError):
    raise argparse.ArgumentTypeError(
      f"expected PROCESS:SIGNAL:BATCH such as 1:SIGTERM:5, got {text!r}"
    ) from None


def _simulate(args: argparse.Namespace) -> int:
  from grain_jax_sync import testing  # pylint: disable=g-import-not-at-top
  from grain_jax_sync._src import sim_worker  # pylint: disable=g-import-not-at-top

  run = {
    "num_processes": args.processes,
    "devices_per_process": args.devices,
    "timeout_s": args.timeout,
    "signal_at": getattr(args, "signal", ()),
    "echo": True,  # Every line each process writes, as it writes it.
  }
  if args.target.endswith(".py"):
    try:
      outcomes = testing.run_script(args.target, args.args, **run)
    except ValueError as e:  # A missing file, a --signal for a process not started.
      print(f"simulate: {e}", file=sys.stderr)
      return 2
    for o in outcomes:
      if o.ok:
        print(f"== process {o.process_index}: ok ==")
      elif o.error_type is None:
        print(f"== process {o.process_index}: FAILED: exit code {o.exit_code} ==")
      else:
        print(f"== process {o.process_index}: FAILED: {o.error_type}: {o.error_message} ==")
        for line in (o.traceback or "").rstrip("\n").splitlines():
          print(f"[process {o.process_index}] {line}")
  else:
    kwargs = {}
    for arg in args.args:
      name, sep, value = arg.partition("=")
      if not sep:
        print(f"simulate: a function takes name=value arguments, got {arg!r}", file=sys.stderr)
        return 2
      with contextlib.suppress(ValueError, SyntaxError):
        value = ast.literal_eval(value)  # A Python literal, else the string.
      kwargs[name.lstrip("-").replace("-", "_")] = value
    fn = sim_worker.resolve_function(args.target)
    outcomes = testing.run_processes(fn, kwargs=kwargs, **run)
    for o in outcomes:
      status = "ok" if o.ok else f"{o.error_type}: {o.error_message} (exit code {o.exit_code})"
      print(f"process {o.process_index}: {status}; value={o.value!r}")
  return 0 if all(o.ok for o in outcomes) else 1


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m grain_jax_sync", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser(
    "demo",
    help="two local hosts with uneven data",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  demo.add_argument("--processes", type=int, default=2, help="simulated hosts")
  demo.add_argument("--devices", type=int, default=4, help="CPU devices per process")
  demo.add_argument("--batch-size", type=int, default=8, help="rows per host per batch")
  demo.add_argument("--timeout", type=float, default=300.0, help="seconds before it is stopped")
  demo.set_defaults(fn=_demo)
  sub.add_parser("doctor", help="what this machine offers").set_defaults(fn=_doctor)
  sim = sub.add_parser(
    "simulate",
    allow_abbrev=False,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    help="run a script, or a function, in N local processes",
    description="Runs a script, or a function, in N local processes of D CPU"
    " devices each, joined by jax.distributed as hosts are. Each line a"
    " process writes (its warnings and errors included) is shown as it is"
    " written, labelled [process i].",
    epilog="Arguments after the target that simulate does not know (or all after"
    " `--`) go to the script as sys.argv[1:], or to the function as name=value"
    " keyword arguments.",
  )
  sim.add_argument("target", help="file.py (run as __main__), file.py:function or module:function")
  sim.add_argument("--processes", "-n", type=int, default=2, help="simulated hosts")
  sim.add_argument("--devices", "-d", type=int, default=4, help="CPU devices per process")
  sim.add_argument(
    "--timeout", type=float, default=300.0, help="seconds before every process is killed"
  )
  sim.add_argument(
    "--signal",
    type=_signal_at,
    action="append",
    default=argparse.SUPPRESS,  # None given: no signal (and no "(default: ...)").
    metavar="PROCESS:SIGNAL:BATCH",
    help="send SIGNAL to PROCESS right after its iterator delivered batch BATCH,"
    " e.g. 1:SIGTERM:5 (repeatable, one per process)",
  )
  sim.set_defaults(fn=_simulate)
  argv = list(sys.argv[1:] if argv is None else argv)
  passed: list[str] = []
  if "--" in argv:  # Everything after `--` goes to the script unread.
    argv, passed = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
  args, extra = parser.parse_known_args(argv)
  if args.command != "simulate" and (extra or passed):
    parser.error(f"unrecognized arguments: {' '.join(extra + passed)}")
  args.args = extra + passed
  return args.fn(args)


if __name__ == "__main__":
  sys.exit(main())
