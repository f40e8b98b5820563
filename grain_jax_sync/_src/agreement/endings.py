"""Every ending's error: the exception each host raises for an agreed ending, and the messages endings carry."""

from __future__ import annotations

import json
import logging

from grain_jax_sync._src import exchange as exchange_lib
from grain_jax_sync._src import plan as plan_lib
from grain_jax_sync._src import reader as reader_lib

logger = logging.getLogger(__name__)

ErrorKind = plan_lib.ErrorKind


def to_exception(
  error: plan_lib.ReportedError, process: int, own: reader_lib.End | None
) -> BaseException:
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

  A peer that closed in this stream could not post its ending (a stage
  thread of its was still blocked); one that closed in an earlier stream
  never started this one, which other processes restarted.
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


def closed_error(process: int, at_batch: int) -> plan_lib.ReportedError:
  """The ending of a process that closed its iterator after `at_batch` batches."""
  return plan_lib.ReportedError(
    ErrorKind.CLOSED,
    f"process {process} closed its iterator at batch {at_batch}",
    process,
    at_batch,
    "closed",
  )
