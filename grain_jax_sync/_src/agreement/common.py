"""What the agreement's forms share: the protocol's bounds, a process's identity, its reports, the decision, and this host's reads (`OwnReads`)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from grain_jax_sync._src import batches as batches_lib
from grain_jax_sync._src import messages, periods
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src.agreement import core, endings

# The read-ahead in bytes: a host holds at most this much of read batches its
# build thread has not handed on (at least a batch or two), on any host.
READ_AHEAD_BYTES = 64 << 20
# A process other than 0 waits this much longer than `sync_timeout_s` for a
# decision, so that process 0 names the slow peer first (one message everywhere).
FOLLOWER_GRACE_S = periods.DEAD_AFTER_S + 2.0


def read_ahead_limit(read: core.Read, lookahead: int | None, cap: int | None = None) -> int:
  """The most positions a host holds ahead of its build thread: the byte bound, `lookahead`, `cap`; >= 1."""
  bounds = [b for b in (lookahead, cap) if b is not None]
  return max(1, min([READ_AHEAD_BYTES // max(1, read.batch.nbytes), *bounds]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Identity:
  """What a process says about itself in its first report (`groups`: where processes share rows)."""

  process: int
  devices: int
  config: Any
  resume: int
  groups: tuple[tuple[int, ...], ...] = ()


def make_report(
  who: Identity,
  reads: Sequence[core.Read],
  rules: plan_lib.Rules,
  end: core.End | None,
  sig: Any,
  first: bool,
) -> messages.Report:
  """This host's report of `reads` (and its `end`, once read); digests and sizes where kept."""
  return messages.Report(
    process_index=who.process,
    rows=tuple(r.batch.rows for r in reads),
    exhausted=end is not None and end.exhausted,
    error=None if end is None else end.error,
    signature=sig,
    local_devices=who.devices,
    config=who.config if first else None,
    resume=who.resume if first else None,
    digests=tuple(r.digest for r in reads) if who.groups else (),
    sizes=() if rules.shapes is None else tuple(r.batch.sizes for r in reads),
  )


class Agreement:
  """What both forms share: the rules (the batch size pinned once decided) and the agreed stop."""

  def __init__(self, rules: plan_lib.Rules, who: Identity):
    self._rules = rules
    self._who = who
    self._stop_at: int | None = None  # `stop_asked`: the batches received then.
    self.stop_requested_by: int | None = None  # Set by an agreed stop.

  @property
  def batch_size(self) -> int | None:
    """The agreed full batch size (given, or derived from the first position); None until known."""
    return self._rules.batch_size

  def stop_asked(self, at_batch: int) -> None:
    """A stop was asked for here after batch `at_batch` (`JaxBatchIterator.request_stop`); no lock."""
    if self._stop_at is None:
      self._stop_at = at_batch

  def _agreed_end(
    self, end: messages.Outcome, error: messages.ReportedError | None, own: core.End | None
  ) -> bool:
    """Whether the stream ends here without an error (its end, an agreed stop); raises an agreed
    error (this host's own, `own`, with its traceback)."""
    if end != messages.Outcome.RAISE:
      return end == messages.Outcome.STOP
    assert error is not None
    if error.kind != messages.ErrorKind.STOPPED:
      raise endings.to_exception(error, self._who.process, own)
    self.stop_requested_by = error.process_index
    return True


# -- this host's reads, for the streamed form --------------------------------------


@dataclasses.dataclass(slots=True)  # Per batch: no frozen-init cost.
class Run:
  """Positions decided together, handed from the agreement to the builder."""

  steps: tuple[tuple[core.Read | None, messages.Step], ...]  # This host's read (None: a dummy).
  signature: batches_lib.Signature | None  # The agreed structure (None while no host has a batch).


class OwnReads:
  """This host's undecided reads, and how far ahead of its consumer it lets positions be decided.

  No I/O: the reads come in from the driver (`core.Take`). The horizon
  (`limit`) is the positions the consumer took in the last `decide_ahead_s`
  seconds (`core.Pace`), within `read_ahead_limit`, and at least 1.

  Args:
    lookahead: `synchronize_lookahead`.
    read_ahead: At most this many positions held (None: `read_ahead_limit`).
    threaded: Whether a build thread runs (what it has not built counts).
    paced: Whether the horizon is measured (`core.Pace`).
    inline: Whether reads come in the consumer's own `next()`.
  """

  def __init__(
    self,
    *,
    lookahead: int | None,
    read_ahead: int | None = None,
    threaded: bool = False,
    paced: bool = True,
    inline: bool = True,
  ):
    self._cap = read_ahead
    self._threaded = threaded
    self._paced = paced
    self.inline = inline
    self.lookahead = lookahead
    self.batch_size: int | None = None  # The full batch size, once known (`Streamed._pin`).
    # Until the first read tells the bytes of a batch.
    self._base = min((b for b in (lookahead, read_ahead) if b is not None), default=2)
    self.limit = 1 if paced else self._base  # Nothing consumed yet.
    self.pending: collections.deque[core.Read] = collections.deque()
    self.count = 0  # Positions read.
    self.end: core.End | None = None
    self.signature: batches_lib.Signature | None = None
    self.stopped = False  # A stop was asked for here: read nothing more.
    self.now = core.Now(0.0)  # The driver's last word (`Streamed.send`).
    # Full: read again once half the read-ahead is free (`room`).
    self._refill = False
    self.asked = 0  # Reads asked of the reading thread (`core.Take.ask`) and not taken.

  def measure(self) -> core.Steps:
    """Sets `limit`, the consumer's last `decide_ahead_s` within the bounds: per read and decision."""
    pace = (yield core.PACE) if self._paced else self._base
    self.limit = max(1, min(self._base, pace))

  def _ahead(self) -> int:
    """Positions this host holds at most between its reads and its built batches.

    With a build thread, two horizons: a round's reads are posted, not decided
    yet, while the build thread works through the horizon decided before them.
    Only decisions are held to the horizon (`Decider._plan`). Inline, one horizon.
    """
    return min(self._base, 2 * self.limit) if self._threaded else self.limit

  def short(self, at: int = -1) -> bool:
    """Whether undecided read `at` may be short: decided once the next is known
    (`plan.Rules.wait_for_last`), which is then taken (`room`) and posted (`due`) at once."""
    p, full = self.pending, self.batch_size
    return len(p) >= -at and (full is None or p[at].batch.rows < full)

  def _free(self) -> int:
    """Reads this host may hold undecided now: at least 2 (the next is read while one is
    decided, inline too), less what its build thread holds; one more after a short one."""
    return max(2, self._ahead() - (self.held() or 0)) + self.short() - len(self.pending)

  def room(self) -> bool:
    """Whether to take another read: at most `_ahead()` positions, the unbuilt decided ones too;
    once full, again when half is free (reads, posts and decisions come in runs, not one a batch)."""
    if self.end is not None or self.stopped:
      return False
    free = self._free()
    if self._refill and free * 2 < self._ahead() and not self.short():
      return False
    self._refill = free <= 0
    return not self._refill

  def due(self, unposted: int) -> bool:
    """Whether `unposted` reads are to be posted (on process 0: decided) now.

    A round carries half the read-ahead, completing while the build thread
    works through the half before. Where the build thread (or the job, before
    its first batch) waits, each read goes at once, as does one after a short one.
    """
    if unposted == 0:
      return False
    if unposted * 2 >= self.limit or self.count == len(self.pending):  # Nothing decided yet.
      return True
    return self.held() == 0 or self.short(-2)

  def held(self) -> int | None:
    """Decided positions the build thread has not handed on yet; None without a build thread."""
    if not self._threaded:
      return None
    return self.count - len(self.pending) - self.now.done

  def waits_on_build(self) -> bool:
    """Whether the build thread holds decided positions, so that room comes as it takes them."""
    return (self.held() or 0) > 0

  def wait_for_build(self, *, until_room: bool = False) -> core.Steps:
    """Waits until the build thread hands a position on; with `until_room`, until `room()` (one wait)."""
    while self._threaded:
      beyond = self.now.done
      if until_room:
        ahead = self._ahead()
        need = -(-ahead // 2) if self._refill else 1
        beyond = max(beyond, min(self.count - ahead + need, self.count - len(self.pending)) - 1)
      yield core.WaitBuild(beyond)
      if not until_room or self.room() or not self.waits_on_build():
        return

  def ready(self) -> bool:
    """Whether a read can be taken at once (inline: always)."""
    return self.inline or self.now.ready

  def read(self, wait_s: float = 0.0) -> core.Steps:
    """This host's reads at hand, one step and one pace for a run; the first waited for up to `wait_s`."""
    want = max(1, self._free())
    ask = max(0, want - self.asked)  # Beyond those asked and not taken yet.
    items = yield core.Take(want, wait_s, ask)
    self.asked += ask - len(items)
    for item in items:
      if isinstance(item, core.End):
        self.end = item
        break
      if self.count == 0:
        self._base = read_ahead_limit(item, self.lookahead, self._cap)
        self.signature = item.batch.signature
      self.pending.append(item)
      self.count += 1
    if items:  # The horizon for what they bring, the end too.
      yield from self.measure()
    return items

  def take(self, start: int, n: int) -> core.Steps:
    """This host's reads for positions ``[start, start + n)`` (None past its end)."""
    yield from self.measure()
    return [self.pending.popleft() if start + i < self.count else None for i in range(n)]
