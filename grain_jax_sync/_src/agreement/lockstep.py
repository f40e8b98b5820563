"""The lockstep form: every process reads a window, the reports are all-gathered, every process decides.

One process (no exchange) and the collective fallback (which runs in the
caller's thread) use it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import build as build_lib
from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import ledger as ledger_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src.agreement import common, endings

logger = logging.getLogger(__name__)

ErrorKind = plan_lib.ErrorKind


# -- lockstep ----------------------------------------------------------------------


def lockstep(  # noqa: C901 - one window per pass, in order; the one-process fast path first
  reader: Iterator[reader_lib.Read | reader_lib.End],
  exchange: exchange_lib.LocalExchange | exchange_lib.CollectiveExchange,
  options: plan_lib.Options,
  who: common.Identity,
  *,
  window: int,
  position: int,
) -> Iterator[build_lib.Run]:
  """Reads a window, all-gathers the reports, decides; in the calling thread.

  On `End.WAIT` the undecided reads are kept and every process reads at least
  one more batch (or its end) before the next decision, which starts at the
  first undecided position.
  """
  signature: batches_lib.Signature | None = None
  end: reader_lib.End | None = None
  reads: list[reader_lib.Read] = []  # Undecided reads kept after a WAIT.
  alone = exchange.process_count == 1 and not who.groups
  memo: dict[tuple[tuple[int, ...], plan_lib.Options], tuple[plan_lib.Plan, int]] = {}
  # One process, one batch per window, mid-stream: the decided step and its
  # yield count per row count, for the current `options` (cleared when they
  # change). A batch of a known size is yielded without building a window
  # (about 4 of the 8 us the window costs per batch).
  quick: dict[int, tuple[plan_lib.Step, int]] | None = None
  if alone and window == 1 and options.shapes is None:  # `pad_shapes`: sizes decide too.
    quick = {}
  for w in range(1 << 62):
    need = max(window, len(reads) + 1)  # Counted before a quick read, which it includes.
    if quick and not reads and end is None:
      end = _read(reader, reads, 1)
      hit = quick.get(reads[0].batch.rows) if end is None else None
      if hit is not None:
        position += hit[1]
        yield build_lib.Run(((reads.pop(), hit[0]),), signature, options.batch_size)
        continue
    if end is None:
      end = _read(reader, reads, need)
    if signature is None and reads:
      signature = reads[0].batch.signature
    rows = tuple(r.batch.rows for r in reads)
    # One process, mid-stream: a window of the same sizes gets the same plan
    # (an error-free plan does not depend on the position).
    # Not with `pad_shapes`: the plan depends on the sizes too (and they take many values).
    memoize = alone and w and end is None and options.shapes is None
    key = (rows, options) if memoize else None
    known = memo.get(key) if key is not None else None
    if known is not None:
      decision, yields = known
    else:
      decision, signature = _decide_window(
        reads, rows, end, signature, who, exchange, options, w=w, position=position
      )
      yields = sum(1 for s in decision.steps if s.action == plan_lib.Action.YIELD)
      if key is not None and decision.error is None:
        memo[key] = (decision, yields)
    pinned = plan_lib.pin(options, decision)
    if quick is not None and pinned is not options:
      quick.clear()
    elif quick is not None and key is not None and _repeatable(decision):
      quick[rows[0]] = (decision.steps[0], yields)
    options = pinned
    n = len(decision.steps)
    steps = tuple(
      (reads[i] if i < len(reads) else None, step) for i, step in enumerate(decision.steps)
    )
    position += yields
    reads = reads[n:] if decision.end == plan_lib.End.WAIT else []
    if steps:
      yield build_lib.Run(steps, signature, options.batch_size)
    steps = ()
    if decision.end == plan_lib.End.STOP:
      return
    if decision.end == plan_lib.End.RAISE:
      assert decision.error is not None
      raise endings.to_exception(decision.error, who.process, end)


def _read(
  reader: Iterator[reader_lib.Read | reader_lib.End], reads: list[reader_lib.Read], need: int
) -> reader_lib.End | None:
  """Reads into `reads` until it holds `need` batches; the stream's end if reached first."""
  while len(reads) < need:
    item = next(reader)
    if isinstance(item, reader_lib.End):
      return item
    reads.append(item)
  return None


def _decide_window(
  reads: list[reader_lib.Read],
  rows: tuple[int, ...],
  end: reader_lib.End | None,
  signature: batches_lib.Signature | None,
  who: common.Identity,
  exchange: exchange_lib.LocalExchange | exchange_lib.CollectiveExchange,
  options: plan_lib.Options,
  *,
  w: int,
  position: int,
) -> tuple[plan_lib.Plan, batches_lib.Signature | None]:
  """Reports a window (all-gathered with several processes) and decides it.

  Returns:
    The decision, and the agreed signature (learnt from a peer's report
    where this process has read no batch yet).
  """
  sig = None if signature is None else signature.to_json()
  digests = tuple(r.digest for r in reads) if who.groups else ()
  report = common.make_report(who, rows, end, sig, w == 0, digests, common.sizes_of(reads, options))
  if exchange.process_count == 1:
    reports = [report]  # Nothing to exchange: skip the JSON round trip.
  else:
    chunk = ledger_lib.Chunk(start=position, ack=w, report=report)
    chunks = _parse_all(exchange.all_gather(w, chunk.to_json()))
    _check_in_step(chunks)
    reports = [c.report for c in chunks]
    if signature is None and (found := ledger_lib.signature_of(reports)) is not None:
      signature = batches_lib.Signature.from_json(found)
  return common.decide(reports, options, groups=who.groups, position=position), signature


def _repeatable(decision: plan_lib.Plan) -> bool:
  """Whether a one-batch window's decision holds for any later batch of its size."""
  return (
    decision.error is None and len(decision.steps) == 1 and decision.end == plan_lib.End.CONTINUE
  )


def _parse_all(payloads: list[str]) -> list[ledger_lib.Chunk]:
  """Every process's chunk, or the same ValueError on every host."""
  versions: dict[int, Any] = {}
  chunks = []
  for p, text in enumerate(payloads):
    try:
      chunks.append(ledger_lib.Chunk.from_json(text))
    except ledger_lib.ProtocolError as e:
      versions[p] = e.version
  if versions:
    shown = ", ".join(
      f"process {p}: {versions.get(p, ledger_lib.PROTOCOL_VERSION)!r}" for p in range(len(payloads))
    )
    raise ValueError(
      "the processes run different versions of the grain_jax_sync agreement"
      f" protocol ({shown}); every process must run the same version of the library"
    )
  return chunks


def _check_in_step(chunks: list[ledger_lib.Chunk]) -> None:
  """Under the collective exchange, every window must start at the same batch.

  A process that restarted its stream (`reset()`, `set_state()` or a new
  iterator) while its peers kept iterating has nothing to post its ending
  to: its next all-gather meets the peers' next window, and without this
  check the processes would pair different batches into one global array.
  Raises the same RuntimeError on every host. Different starts in every
  process's first window are `plan.decide`'s resume error.
  """
  starts = {c.report.process_index: c.start for c in chunks}
  if len(set(starts.values())) < 2:
    return
  fresh = [c.report.process_index for c in chunks if c.report.config is not None]
  if len(fresh) == len(chunks):
    return
  where = ", ".join(f"process {p} at batch {b}" for p, b in sorted(starts.items()))
  restarted = f"processes {fresh} restarted" if len(fresh) > 1 else f"process {fresh[0]} restarted"
  raise RuntimeError(
    f"the processes are at different batches of the stream ({where}):"
    f" {restarted} the stream (reset(), set_state() or a new iterator) while"
    " the others kept iterating. Without the key-value store (the collective"
    " exchange) every process must reset or restore at the same point"
    if fresh
    else f"the processes are at different batches of the stream ({where})"
  )
