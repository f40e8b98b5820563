"""The errors `plan.decide` gives every host, and their messages.

Each builder returns a `ReportedError` of kind VALUE that every host raises as
the same ValueError: hosts given different settings, resume positions or
batch structures, an uneven number of batches, uneven or oversized batches, a
short batch that is not its host's last, and a batch size the local devices
do not divide. The messages name the processes and batches involved and the
option that fixes them.

Pure Python: no JAX, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src.reports import ErrorKind, Report, ReportedError

# The reference's (Ray Data's `jax_sync_generator`) opening phrases; callers
# match on them, so every message of the same kind starts with them.
UNEVEN_COUNT = "Uneven number of batches detected across JAX workers"
UNEVEN_SIZES = "Uneven batch sizes detected across JAX workers"
NOT_DIVISIBLE = "must be evenly divisible by the number of local JAX devices"


def value_error(message: str, process_index: int = -1, batch_index: int = -1) -> ReportedError:
  """A ValueError that every host raises with `message`."""
  return ReportedError(ErrorKind.VALUE, message, process_index, batch_index)


def config_error(reports: Sequence[Report]) -> ReportedError | None:
  """The error for processes given different settings, if any were."""
  configs = [(r.process_index, r.config) for r in reports if r.config is not None]
  if len(configs) < 2:
    return None
  p0, c0 = configs[0]
  for p, c in configs[1:]:
    if c != c0:
      keys = sorted(set(c0) | set(c))
      differ = [k for k in keys if c0.get(k) != c.get(k)]
      diffs = [f"{k}: {c0.get(k)!r} vs {c.get(k)!r}" for k in differ]
      mesh = any(k.startswith("sharding") for k in differ)
      return value_error(
        f"processes {p0} and {p} were given different settings"
        f" ({'; '.join(diffs)}); every process must build the iterator with"
        " the same arguments"
        + (
          ". If every process was given the same arguments, the processes"
          " created their iterators in a different order (iterators are paired"
          " by creation order): create them in the same order, or pass the"
          " same `name=` to each pair"
          if not mesh
          else ""
        )
        + (
          ", and the same mesh: the same devices in the same order (build it"
          " from jax.devices() in the same way everywhere, e.g."
          " grain_jax_sync.default_mesh())"
          if mesh
          else ""
        )
      )
  return None


def resume_error(reports: Sequence[Report]) -> ReportedError | None:
  """The error for processes resuming from different positions, if they do."""
  resumes = [(r.process_index, r.resume) for r in reports if r.resume is not None]
  if len({b for _, b in resumes}) < 2:
    return None
  where = ", ".join(f"process {p} at batch {b}" for p, b in resumes)
  return value_error(
    f"the processes resume from different positions ({where}); every process"
    " must restore its state from the same checkpoint step"
  )


def signature_error(reports: Sequence[Report]) -> ReportedError | None:
  """The error for processes whose batches differ in structure, if any do."""
  sigs = [(r.process_index, r.signature) for r in reports if r.signature is not None]
  if len(sigs) < 2:
    return None
  p0, s0 = sigs[0]
  for p, s in sigs[1:]:
    if s != s0:
      a = batches_lib.Signature.from_json(s0)
      b = batches_lib.Signature.from_json(s)
      diffs = batches_lib.diff(a, b) or ["tree structure differs"]
      return value_error(
        f"processes {p0} and {p} yield batches of different structure:"
        f" {'; '.join(diffs)} (first: process {p0}, second: process {p});"
        f" process {p0} has [{a.describe()}], process {p} has"
        f" [{b.describe()}]. Every host must yield the same columns,"
        " dtypes and trailing shapes"
      )
  return None


def _fmt(processes: Sequence[int]) -> str:
  """'process 1' or 'processes 1, 2'."""
  return ("process " if len(processes) == 1 else "processes ") + ", ".join(map(str, processes))


def uneven_count_error(reports: Sequence[Report], has: Sequence[bool], index: int) -> ReportedError:
  """Some hosts ran out of batches at batch `index` while others did not."""
  out = [r.process_index for r, h in zip(reports, has, strict=True) if not h]
  left = [r.process_index for r, h in zip(reports, has, strict=True) if h]
  return value_error(
    f"{UNEVEN_COUNT}: {_fmt(out)} ran out of data at batch {index} while"
    f" {_fmt(left)} {'still has' if len(left) == 1 else 'still have'} batches."
    " Set `drop_last=True` to stop at the shortest host, or pass `paddings`"
    " to fill the missing batches with masked dummy batches"
  )


def _sizes(reports: Sequence[Report], rows: Sequence[int], has: Sequence[bool]) -> str:
  """Each process's rows at one position ('none' where it has no batch)."""
  return ", ".join(
    f"process {r.process_index}: {x if h else 'none'}"
    for r, x, h in zip(reports, rows, has, strict=True)
  )


def _full_name(derived: bool) -> str:
  """Where the full batch size came from, for messages."""
  if derived:
    return "the largest host batch of the first batch, as `batch_size` was not given"
  return "`batch_size`"


def uneven_sizes_error(
  reports: Sequence[Report], rows: Sequence[int], has: Sequence[bool], index: int
) -> ReportedError:
  """Host batches of different sizes at batch `index`, with neither `paddings` nor `drop_last`."""
  real = [x for x, h in zip(rows, has, strict=True) if h]
  return value_error(
    f"{UNEVEN_SIZES} at batch {index}: host batch sizes range from"
    f" {min(real)} to {max(real)} ({_sizes(reports, rows, has)}). Pass"
    " `paddings` to pad every batch to the full batch size, or"
    " `drop_last=True` to drop a short last batch"
  )


def larger_error(
  reports: Sequence[Report],
  rows: Sequence[int],
  has: Sequence[bool],
  *,
  full: int,
  derived: bool,
  index: int,
) -> ReportedError:
  """A batch larger than the full batch size that not every host shares."""
  p, x = next((r.process_index, x) for r, x in zip(reports, rows, strict=True) if x > full)
  return value_error(
    f"{UNEVEN_SIZES} at batch {index}: process {p} has {x} rows, more"
    f" than the full batch size {full} ({_full_name(derived)}), and not"
    f" every host has a batch of that size ({_sizes(reports, rows, has)})."
    " Padding only fills batches up to the full size; batch every host's"
    " source with the same batch size"
  )


def short_error(
  reports: Sequence[Report],
  rows: Sequence[int],
  has: Sequence[bool],
  *,
  p: int,
  x: int,
  full: int,
  derived: bool,
  index: int,
) -> ReportedError:
  """Process `p`'s short batch of `x` rows that is not its last, where it cannot be padded."""
  real = [y for y, h in zip(rows, has, strict=True) if h]
  prefix = f"{UNEVEN_SIZES}: " if min(real) != max(real) else ""
  sizes = _sizes(reports, rows, has)
  fix = (
    "Pass `batch_size` (with `paddings`, short batches are then padded)"
    if derived
    else "Pass `paddings` to pad short batches (with `mask_key` to mask them)"
  )
  return value_error(
    f"{prefix}process {p}, batch {index}: {x} rows, fewer than the full"
    f" batch size {full} ({_full_name(derived)}), and it is not the last"
    f" batch of process {p}; only a host's last batch may be short ({sizes})."
    f" {fix}, or batch the source so that only its last batch is short"
  )


def divisibility_error(reports: Sequence[Report], target: int, index: int) -> ReportedError | None:
  """The error for `target` rows per host that a process's data shards do not divide."""
  for r in reports:
    if target % r.local_devices:
      return value_error(
        f"The local batch size ({target}) {NOT_DIVISIBLE}"
        f" ({r.local_devices}) of process {r.process_index}: batch {index}"
        f" has {target} rows per host, not divisible by process"
        f" {r.process_index}'s {r.local_devices} data shards (one per local"
        " device, fewer where a model axis replicates rows). Pass `paddings`"
        " with a divisible `batch_size`, set `drop_last=True`, or batch by a"
        " multiple of that count"
      )
  return None
