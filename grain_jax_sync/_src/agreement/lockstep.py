"""The lockstep core (one process; the collective fallback): every process decides each window."""

from __future__ import annotations

import dataclasses
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import messages
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.agreement import common, core, endings
from grain_jax_sync._src.messages import ErrorKind, Outcome


class Lockstep(common.Agreement):
  """The lockstep core: reads a window, exchanges the reports, decides; no I/O of its own.

  A core as the streamed ones are, driven by `driver.Stepper`. On `Outcome.WAIT`
  every process reads one more batch (or its end), the undecided reads kept.
  A stop asked before the window rides in its report: every process stops before it.
  """

  def __init__(
    self,
    rules: plan_lib.Rules,
    who: common.Identity,
    *,
    process_count: int,
    window: int,
    position: int,
  ):
    super().__init__(rules, who)
    self._process_count = process_count
    self._window = window
    self._position = position
    self._signature: batches_lib.Signature | None = None
    self._end: core.End | None = None
    self._reads: list[core.Read] = []  # Undecided reads kept after a WAIT.
    run = core.Side(self._run())
    self.send, self.throw = run.send, run.throw

  def _run(self) -> core.Steps:
    for w in range(1 << 62):
      stop = None  # This host's stop, asked for: it rides in this window's report.
      if self._stop_at is not None:
        stop = endings.stopped_error(self._who.process, self._stop_at)
        if self._process_count == 1:
          self.stop_requested_by = stop.process_index
          return
      if self._end is None and stop is None:
        yield from self._read(max(self._window, len(self._reads) + 1))
      if self._signature is None and self._reads:
        self._signature = self._reads[0].batch.signature
      reads = self._reads
      decision = yield from self._decide(w, stop)
      self._rules = plan_lib.pin(self._rules, decision)
      self._position += sum(1 for s in decision.steps if s.action == messages.Action.YIELD)
      self._reads = reads[len(decision.steps) :] if decision.end == Outcome.WAIT else []
      if decision.steps:  # This host's read for each step (None past its end: a dummy).
        run = tuple((reads[i] if i < len(reads) else None, s) for i, s in enumerate(decision.steps))
        yield core.Deliver(common.Run(run, self._signature))
      reads, run = [], ()  # The build thread's alone once handed on.
      if self._agreed_end(decision.end, decision.error, self._end):
        return  # The stream's end or an agreed stop; an agreed error raised.

  def _read(self, need: int) -> core.Steps:
    """Reads until this host holds `need` batches, or its end."""
    count = need - len(self._reads)
    for item in (yield _READ_ONE if count == 1 else core.ReadWindow(count)):
      if isinstance(item, core.End):
        self._end = item
      else:
        self._reads.append(item)

  def _decide(self, w: int, stop: messages.ReportedError | None) -> core.Steps:
    """Reports the window (exchanged with several processes) and decides it; a stop ends it."""
    sig = None if self._signature is None else self._signature.to_json()
    report = common.make_report(self._who, self._reads, self._rules, self._end, sig, w == 0)
    if stop is not None:
      report = dataclasses.replace(report, error=stop)
    if self._process_count == 1:
      reports = [report]  # Nothing to exchange: skip the JSON round trip.
    else:
      chunk = messages.Chunk(start=self._position, ack=w, report=report)
      chunks = _parse_all((yield core.AllGather(w, chunk.to_json())))
      _check_in_step(chunks)
      reports = [c.report for c in chunks]
      if self._signature is None and (found := messages.signature_of(reports)) is not None:
        self._signature = batches_lib.Signature.from_json(found)
      stops = [
        r.error for r in reports if r.error is not None and r.error.kind == ErrorKind.STOPPED
      ]
      if stops:
        return plan_lib.Plan((), Outcome.RAISE, stops[0])
    return plan_lib.decide(reports, self._rules, position=self._position, groups=self._who.groups)


_READ_ONE = core.ReadWindow(1)  # The one action per batch alone: made once.


def _parse_all(payloads: list[str]) -> list[messages.Chunk]:
  """Every process's chunk, or the same ValueError on every host."""
  versions: dict[int, Any] = {}
  chunks = []
  for p, text in enumerate(payloads):
    try:
      chunks.append(messages.Chunk.from_json(text))
    except messages.ProtocolError as e:
      versions[p] = e.version
  if versions:
    raise ValueError(messages.version_error(versions, range(len(payloads))))
  return chunks


def _check_in_step(chunks: list[messages.Chunk]) -> None:
  """Raises the same RuntimeError on every host unless every window starts at the same batch.

  A process that restarted while its peers kept iterating would pair
  different batches into one global array (all in a first window: the resume error).
  """
  starts = {c.report.process_index: c.start for c in chunks}
  if len(set(starts.values())) < 2:
    return
  fresh = [c.report.process_index for c in chunks if c.report.config is not None]
  if len(fresh) == len(chunks):
    return
  where = ", ".join(f"process {p} at batch {b}" for p, b in sorted(starts.items()))
  raise RuntimeError(
    f"the processes are at different batches of the stream ({where}):"
    f" {plan_lib.processes(fresh)} restarted the stream (reset(), set_state() or a new"
    " iterator) while the others kept iterating. Without the key-value store (the"
    " collective exchange) every process must reset or restore at the same point"
    if fresh
    else f"the processes are at different batches of the stream ({where})"
  )
