"""Every ending's error: the exception each host raises for an agreed ending, and the messages."""

from __future__ import annotations

import json
from collections.abc import Sequence

from grain_jax_sync._src import periods
from grain_jax_sync._src.agreement import core
from grain_jax_sync._src.messages import ErrorKind, ReportedError


class _PeerError(RuntimeError):
  def __init__(self, message: str, missing: Sequence[int] = ()):
    super().__init__(message)
    self.missing = tuple(missing)


class PeerTimeoutError(_PeerError):
  """A live peer did not report within `sync_timeout_s`.

  Attributes:
    missing: Indices of the processes that were waited for.
  """


class PeerLostError(_PeerError):
  """A peer stopped its liveness beat: it died.

  Attributes:
    missing: Indices of the lost processes.
  """


def _text(e: BaseException) -> str:
  """`str(e)`, or a stand-in where the exception's own `__str__` fails."""
  try:
    return str(e)
  except Exception as inner:  # noqa: BLE001 - the ending must still be posted.
    return f"<str() of the exception raised {type(inner).__qualname__}>"


def failed(
  process: int,
  position: int,
  batch_index: int,
  e: BaseException,
  doing: str,
  *,
  data: bool = False,
) -> core.End:
  """The `End` for exception `e`: with `data`, a ValueError every host raises; else this host's own."""
  if data and isinstance(e, ValueError):
    return core.End(position, ReportedError(ErrorKind.VALUE, _text(e), process, batch_index), e)
  name = type(e).__qualname__
  message = f"process {process} failed while {doing}: {name}: {_text(e)}"
  return core.End(position, ReportedError(ErrorKind.SOURCE, message, process, batch_index, name), e)


def to_exception(error: ReportedError, process: int, own: core.End | None) -> BaseException:
  """The exception this host raises for an agreed error."""
  if own is not None and own.exception is not None and own.error == error:
    return own.exception  # This host's own failure: its own exception.
  if error.kind == ErrorKind.VALUE:
    return ValueError(error.message)
  if error.kind == ErrorKind.TIMEOUT:
    return PeerTimeoutError(error.message, error.missing)
  if error.kind == ErrorKind.LOST:
    return PeerLostError(error.message, error.missing)
  if error.kind == ErrorKind.CLOSED:
    return RuntimeError(error.message)
  return RuntimeError(
    f"{error.message} (process {error.process_index} raised"
    f" {error.type_name}; every other process stops too, so that no host"
    " waits forever)"
  )


def closed_peer_message(note: str, namespace: str) -> str:
  """The error for a peer found closed (`key_value.register_close`) while waited for here."""
  try:
    stream, message = json.loads(note)
  except (TypeError, ValueError):
    stream, message = None, str(note)
  if stream == namespace:
    return str(message)
  return (
    f"{message}, without starting the stream that other processes restarted"
    " (reset(), set_state()): every process must restart it at the same point"
  )


def order_cause() -> str:
  """Why processes' iterators miss each other, and the fix: one wording wherever it may be the cause."""
  return (
    "the processes created or started their iterators in a different order"
    " (iterators are paired across processes by creation order unless given"
    " a `name=`, and an iterator's stream starts at its first next()): create"
    " the iterators in the same order on every process or pass the same"
    " `name=` to the iterators that belong together, and call next() on them"
    " in the same order on every process"
  )


def closed_error(process: int, at_batch: int, how: str = "closed its iterator") -> ReportedError:
  """The ending of a process that closed its iterator (or restarted its stream: `how`) after `at_batch` batches."""
  return ReportedError(
    ErrorKind.CLOSED, f"process {process} {how} at batch {at_batch}", process, at_batch, "closed"
  )


def lost(peer: int, at_batch: int, when: str, cause: str = "") -> ReportedError:
  """The ending of a peer whose liveness beat stopped `when`: dead, not slow (`liveness`)."""
  message = (
    f"process {peer} is lost: its liveness beat stopped for {periods.DEAD_AFTER_S:g}s {when};"
    f" {cause or 'it died (killed, out of memory, crashed) or froze'}"
  )
  return ReportedError(ErrorKind.LOST, message, peer, at_batch, "PeerLostError", (peer,))


def stopped_error(process: int, at_batch: int) -> ReportedError:
  """A stop that `process` asked for (`request_stop()`) after receiving `at_batch` batches."""
  message = f"process {process} requested a stop after batch {at_batch}"
  return ReportedError(ErrorKind.STOPPED, message, process, at_batch, "stop")


def not_at_end(waiting: list[int], yielded: int, timeout_s: float) -> ReportedError:
  """The ending of peers alive but not at the agreed end within `sync_timeout_s`."""
  message = (
    f"processes {waiting} did not reach the end of the stream ({yielded}"
    f" batches) within `sync_timeout_s`={timeout_s:g}s; they are alive"
    " (their liveness beats are recent) but stopped iterating before the end"
    " without closing the iterator"
  )
  return ReportedError(
    ErrorKind.TIMEOUT, message, waiting[0], yielded, "PeerTimeoutError", tuple(waiting)
  )


def crosswise(mine: tuple[int, str], theirs: tuple[int, str], at_batch: int) -> ReportedError:
  """Two processes, each waiting at the start of a stream the other never started: (process, stream) each."""
  (a, sa), (b, sb) = sorted([mine, theirs])
  message = (
    f"process {a} waits for the first batch of iterator {sa.rsplit('/', 1)[0]!r} and"
    f" process {b} for that of iterator {sb.rsplit('/', 1)[0]!r}, and neither has"
    f" started the other's: {order_cause()}"
  )
  peer = theirs[0]
  return ReportedError(ErrorKind.CLOSED, message, peer, at_batch, "RuntimeError", (peer,))
