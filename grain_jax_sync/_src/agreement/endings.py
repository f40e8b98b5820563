"""Every ending's error: the exception each host raises for an agreed ending, the messages, `post_end`."""

from __future__ import annotations

import json
import logging

from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import reader as reader_lib
from grain_jax_sync._src.messages import Chunk, Decision, ErrorKind, Outcome, Report, ReportedError

logger = logging.getLogger(__name__)


def to_exception(error: ReportedError, process: int, own: reader_lib.End | None) -> BaseException:
  """The exception this host raises for an agreed error."""
  if own is not None and own.exception is not None and own.error == error:
    return own.exception  # This host's own failure: its own exception.
  if error.kind == ErrorKind.VALUE:
    return ValueError(error.message)
  if error.kind == ErrorKind.TIMEOUT:
    return exchange_lib.PeerTimeoutError(error.message, error.missing)
  if error.kind == ErrorKind.LOST:
    return exchange_lib.PeerLostError(error.message, error.missing)
  if error.kind == ErrorKind.CLOSED:
    return RuntimeError(error.message)
  return RuntimeError(
    f"{error.message} (process {error.process_index} raised"
    f" {error.type_name}; every other process stops too, so that no host"
    " waits forever)"
  )


def closed_peer_message(note: str, namespace: str) -> str:
  """The error for a peer found closed (`exchange.register_close`) while waited for here.

  Closed in this stream, it could not post its ending (a stage thread was
  blocked); closed in an earlier one, it never started this restarted one.
  """
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


def lost(
  peer: int, dead_after_s: float, at_batch: int, when: str, cause: str = ""
) -> ReportedError:
  """The ending of a peer whose liveness beat stopped `when`: dead, not slow (`liveness`)."""
  return ReportedError(
    ErrorKind.LOST,
    f"process {peer} is lost: its liveness beat stopped for {dead_after_s:g}s {when};"
    f" {cause or 'it died (killed, out of memory, crashed) or froze'}",
    peer,
    at_batch,
    "PeerLostError",
    (peer,),
  )


def stopped_error(process: int, at_batch: int) -> ReportedError:
  """A stop that `process` asked for (`request_stop()`) after receiving `at_batch` batches.

  Every host ends its stream normally at the first position not decided yet.
  """
  return ReportedError(
    ErrorKind.STOPPED,
    f"process {process} requested a stop after batch {at_batch}",
    process,
    at_batch,
    "stop",
  )


def post_end(ex: exchange_lib.KeyValueExchange, at_batch: int, error: ReportedError | None) -> None:
  """Posts this host's ending (closed, or `error`) to a stream it never started.

  As the stream's first and final decision (process 0) or chunk (any other).
  """
  p = ex.process_index
  error = error or closed_error(p, at_batch)
  try:
    if p == 0:
      final = Decision(0, (), Outcome.RAISE, error)
      ex.post_decision(0, final.to_json(), final=True)
    else:
      report = Report(process_index=p, error=error, local_devices=1)
      ex.post_chunk(Chunk(start=0, ack=0, report=report).to_json(), final=True)
  finally:
    ex.end()
